"""Routing statistics: what the routers chose, per MoE layer, for planning and placement.

Off by default (``[routing_stats] enable = true``). :class:`RoutingRecorder` hooks every MoE router and
counts on the device: tokens per expert per step, the top-k co-activation matrix, the transitions to
the next MoE layer, and sampled tokens' expert ids. Every ``save_every`` steps rank 0 writes the counts,
summed over all ranks, to ``<dump_folder>/<folder>/routing_step<FIRST>-<LAST>.npz``; :func:`load`
and :func:`load_folder` read them back. File schema: docs/metrics.md, "Routing statistics and
plots".
"""

import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError, Range, register_section
from torchtitan_ext.ep.recompute import recomputing


@dataclass
class RoutingStats:
    enable: bool = False
    """
    Record routing statistics per MoE layer (tokens per expert per step,
    top-k co-activation, layer-to-layer transitions) and save them as .npz
    (file schema: docs/metrics.md, "Routing statistics and
    plots"). Off by default: it costs two [E, E] matrix products per MoE
    layer and microbatch.
    """

    save_every: int = 10
    """Steps between saved files, an integer >= 1; the last training step always saves."""

    folder: str = "routing_stats"
    """Folder for the files, inside job.dump_folder."""

    sample_tokens: int = 256
    """
    Tokens per MoE layer, step and rank whose top-k expert ids are kept
    verbatim (the step's first ones), an integer >= 0; 0 keeps none. The
    placement tool measures distinct destination ranks per token on them,
    which the co-activation counts alone do not give for top-k > 2. A rank
    that routes fewer tokens in a step keeps what it has.
    """


register_section("routing_stats", RoutingStats, {
    "routing_stats.save_every": Range(1, meaning="steps"),
    "routing_stats.sample_tokens": Range(0, meaning="tokens per MoE layer, step and rank"),
})

_LAYER = re.compile(r"layers\.(\d+)\.")


class RoutingRecorder:
    """Device-side routing counts for every MoE layer of a rank's model chunks."""

    def __init__(
        self, num_layers: int, num_experts: int, top_k: int, device: torch.device, routing_copies: int = 1,
        sample_tokens: int = 0,
    ):
        self.num_experts = num_experts
        self.top_k = top_k
        self.routing_copies = routing_copies
        """Ranks whose routers see the same tokens (tensor parallelism): the sum is divided by it."""
        shape = (num_layers, num_experts)
        self.current = torch.zeros(shape, dtype=torch.int64, device=device)
        self.coactivation = torch.zeros((num_layers, num_experts, num_experts), dtype=torch.int64, device=device)
        self.transitions = torch.zeros_like(self.coactivation)
        self.history: list[torch.Tensor] = []
        self.sample = torch.full((num_layers, sample_tokens, top_k), -1, dtype=torch.int32, device=device)
        self.sampled = [0] * num_layers
        self.sample_history: list[torch.Tensor] = []
        self.steps: list[int] = []
        self.moe_layers: set[int] = set()
        self._next_layer: dict[int, int] = {}
        self._previous: tuple[int, torch.Tensor] | None = None
        self.saved = False
        """Whether this recorder has written a file (its first write sets earlier runs' later files aside)."""

    def attach(self, model_parts) -> None:
        """Hook every MoE router of ``model_parts``; a chunk's layers chain into transitions."""
        for part in model_parts:
            layers = sorted(
                (int(_LAYER.match(name).group(1)), module)
                for name, module in part.named_modules()
                if name.endswith("moe.router") and _LAYER.match(name)
            )
            for (layer, _), (following, _) in zip(layers, layers[1:]):
                self._next_layer[layer] = following
            for layer, router in layers:
                self.moe_layers.add(layer)
                router.register_forward_hook(self._router_hook(layer))

    def _router_hook(self, layer: int):
        def hook(module, inputs, outputs):
            if module.training:  # an eval-mode forward is not training's routing
                self.observe(layer, outputs[1])

        return hook

    def observe(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Count one router call: ``expert_ids`` [tokens, top_k]."""
        if recomputing():
            return
        with torch.no_grad():
            picks = torch.zeros(
                (expert_ids.shape[0], self.num_experts), dtype=torch.float32, device=expert_ids.device
            ).scatter_(1, expert_ids, 1.0)
            self.current[layer] += picks.sum(0).to(torch.int64)
            self.coactivation[layer] += (picks.t() @ picks).to(torch.int64)
            previous = self._previous
            if previous is not None and self._next_layer.get(previous[0]) == layer:
                self.transitions[previous[0]] += (previous[1].t() @ picks).to(torch.int64)
            self._previous = (layer, picks)
            taken = min(self.sample.shape[1] - self.sampled[layer], expert_ids.shape[0])
            self.sample[layer, self.sampled[layer]:self.sampled[layer] + taken] = expert_ids[:taken]
            self.sampled[layer] += taken

    def end_step(self, step: int) -> None:
        self.history.append(self.current.clone())
        self.steps.append(step)
        self.current.zero_()
        self._previous = None
        self.sample_history.append(self.sample.clone())
        self.sample.fill_(-1)
        self.sampled = [0] * len(self.sampled)

    def save(self, folder: Path | str) -> Path | None:
        """Sum over all ranks; rank 0 writes the window's file. Returns its path on rank 0."""
        if not self.steps:
            return None
        counts = torch.stack(self.history)
        layers = torch.zeros(counts.shape[1], dtype=torch.int64, device=counts.device)
        layers[sorted(self.moe_layers)] = 1
        for tensor in (counts, self.coactivation, self.transitions, layers):
            if dist.is_initialized():
                dist.all_reduce(tensor)
        moe = layers.nonzero().squeeze(1).tolist()
        sampled = torch.stack(self.sample_history)[:, moe]  # [S, L, sample_tokens, top_k]
        if dist.is_initialized():
            ranks = [torch.empty_like(sampled) for _ in range(dist.get_world_size())]
            dist.all_gather(ranks, sampled)
            sampled = torch.cat(ranks, dim=2)
        arrays = {
            "steps": np.array(self.steps, dtype=np.int64),
            "layers": np.array(moe, dtype=np.int64),
            "tokens_per_expert": (counts[:, moe] // self.routing_copies).cpu().numpy(),
            "coactivation": (self.coactivation[moe] // self.routing_copies).cpu().numpy(),
            "transitions": (self.transitions[moe] // self.routing_copies).cpu().numpy(),
            "top_k": np.array(self.top_k, dtype=np.int64),
            "sampled_expert_ids": sampled.to(torch.int16).cpu().numpy(),
        }
        first_step = self.steps[0]
        path = Path(folder) / f"routing_step{first_step:06d}-{self.steps[-1]:06d}.npz"
        self.history, self.steps, self.sample_history = [], [], []
        self.coactivation.zero_()
        self.transitions.zero_()
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self.saved:
            _set_aside_from(path.parent, first_step)
        self.saved = True
        # written whole or not at all: a kill during the write leaves only the hidden partial file
        partial = path.with_name(f".{path.name}.partial")
        with open(partial, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
        return path


def _set_aside_from(folder: Path, first_step: int) -> None:
    """Rename the files in ``folder`` that reach ``first_step`` or later to ``superseded_<name>``: another run
    recorded them (a job before this one in the same folder, or the run this one resumes, past its
    checkpoint), and a file's window cannot be split."""
    for path in sorted(folder.glob("routing_step*.npz")):
        match = FILE_NAME.fullmatch(path.name)
        if match is None or int(match.group(2)) >= first_step:
            target = path.with_name(f"superseded_{path.name}")
            os.replace(path, target)
            logger.warning(
                f"Routing statistics {path.name} reach step {first_step} or later, which this run records again: "
                f"set aside as {target.name}"
            )


FILE_NAME = re.compile(r"routing_step(\d+)-(\d+)\.npz")
"""A file's name: the first and last step it covers."""

REQUIRED = {"steps": 1, "layers": 1, "tokens_per_expert": 3, "coactivation": 3, "transitions": 3, "top_k": 0}
"""Every file's arrays and their number of dimensions (``sampled_expert_ids``, 4, is optional)."""


def load(path: Path | str) -> dict[str, np.ndarray]:
    """One saved file's arrays (see the module docstring for the schema); ConfigError naming the file and
    what is wrong with it (unreadable, a missing or ill-shaped array, negative counts, unordered steps)."""
    where = f"routing statistics file {path}"
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("a single array, not an .npz archive")
        with data:
            arrays = {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist: pass a routing_stats folder or one of its .npz files") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(
            f"{where} cannot be read ({type(e).__name__}: {e}): an interrupted write? remove it, or record again"
        ) from None
    _check_arrays(arrays, where)
    return arrays


def _check_arrays(arrays: dict[str, np.ndarray], where: str) -> None:
    for key, ndim in REQUIRED.items():
        if key not in arrays:
            raise ConfigError(f"{where} has no '{key}' array: it is not a routing-statistics file of this harness")
        if arrays[key].ndim != ndim or not np.issubdtype(arrays[key].dtype, np.integer):
            raise ConfigError(f"{where}: '{key}' is {arrays[key].dtype} with {arrays[key].ndim} dimensions, "
                              f"expected integers with {ndim}: record it again")
    steps, layers, counts = arrays["steps"], arrays["layers"], arrays["tokens_per_expert"]
    experts, top_k = counts.shape[-1] if counts.ndim == 3 else 0, int(arrays["top_k"])
    expected = {
        "tokens_per_expert": (len(steps), len(layers), experts),
        "coactivation": (len(layers), experts, experts),
        "transitions": (len(layers), experts, experts),
    }
    if "sampled_expert_ids" in arrays:
        sampled = arrays["sampled_expert_ids"]
        if sampled.ndim != 4:
            raise ConfigError(f"{where}: 'sampled_expert_ids' has {sampled.ndim} dimensions, expected 4 "
                              "(steps, layers, tokens, top_k): record it again")
        expected["sampled_expert_ids"] = (len(steps), len(layers), sampled.shape[2], top_k)
    for key, shape in expected.items():
        if arrays[key].shape != shape:
            raise ConfigError(f"{where}: '{key}' has shape {arrays[key].shape}, expected {shape} "
                              f"({len(steps)} steps, {len(layers)} layers, {experts} experts, top_k {top_k})")
    if not len(steps) or not len(layers) or experts < 1 or not 1 <= top_k <= experts:
        raise ConfigError(f"{where}: {len(steps)} steps, {len(layers)} layers, {experts} experts and top_k {top_k}: "
                          "an empty or inconsistent recording; record it again")
    if (np.diff(steps) <= 0).any() or steps[0] < 1:
        raise ConfigError(f"{where}: steps {steps.tolist()} are not increasing training steps >= 1")
    for key in ("tokens_per_expert", "coactivation", "transitions"):
        if (arrays[key] < 0).any():
            raise ConfigError(f"{where}: '{key}' has negative counts: the file is damaged; record it again")
    if counts.sum() == 0:
        raise ConfigError(f"{where}: every count is 0 (no token was routed): record a run that trains")
    if "sampled_expert_ids" in arrays and ((arrays["sampled_expert_ids"] < -1) | (arrays["sampled_expert_ids"] >= experts)).any():
        raise ConfigError(f"{where}: 'sampled_expert_ids' holds ids outside -1 .. {experts - 1}: record it again")


def load_folder(folder: Path | str) -> dict[str, np.ndarray]:
    """All files of a dump folder merged in step order: per-step arrays concatenated, matrices summed;
    ``file_steps`` [F] and ``file_coactivation`` [F, L, E, E] keep each file's steps and co-activation
    (for splitting a dump in time); ``sampled_expert_ids`` only when every file has it. ConfigError for
    a bad file, files of different models, or steps recorded twice (two runs in one folder, a resume
    that recorded them again)."""
    files = list(Path(folder).glob("routing_step*.npz"))
    if not files:
        raise ConfigError(f"no routing_step*.npz files in {folder}: train with [routing_stats] enable = true")
    parts = sorted(((load(path), path) for path in files), key=lambda item: int(item[0]["steps"][0]))
    first, first_path = parts[0]
    for (part, path), (previous, previous_path) in zip(parts[1:], parts):
        if not np.array_equal(part["layers"], first["layers"]) or part["tokens_per_expert"].shape[2] != first[
            "tokens_per_expert"].shape[2] or int(part["top_k"]) != int(first["top_k"]):
            raise ConfigError(f"routing statistics in {folder}: {path.name} and {first_path.name} record different "
                              "layers, experts or top_k: keep one model's files per folder")
        if part["steps"][0] <= previous["steps"][-1]:
            raise ConfigError(
                f"routing statistics in {folder}: {previous_path.name} (steps {previous['steps'][0]}-"
                f"{previous['steps'][-1]}) and {path.name} (steps {part['steps'][0]}-{part['steps'][-1]}) overlap: "
                "two runs recorded into one folder, or a resume recorded steps again; keep one run's files"
            )
    parts = [part for part, _ in parts]
    merged = {
        "steps": np.concatenate([p["steps"] for p in parts]),
        "layers": parts[0]["layers"],
        "tokens_per_expert": np.concatenate([p["tokens_per_expert"] for p in parts]),
        "coactivation": sum(p["coactivation"] for p in parts),
        "transitions": sum(p["transitions"] for p in parts),
        "top_k": parts[0]["top_k"],
        "file_steps": np.array([len(p["steps"]) for p in parts], dtype=np.int64),
        "file_coactivation": np.stack([p["coactivation"] for p in parts]),
    }
    if all("sampled_expert_ids" in p for p in parts):
        merged["sampled_expert_ids"] = np.concatenate([p["sampled_expert_ids"] for p in parts])
    return merged


def check_fits(stats: dict[str, np.ndarray], moe_layers: list[int], num_experts: int, where: str) -> None:
    """ConfigError unless the loaded dump ``stats`` records this model's MoE layers and experts."""
    experts = stats["tokens_per_expert"].shape[-1]
    if experts != num_experts or sorted(stats["layers"].tolist()) != sorted(moe_layers):
        raise ConfigError(
            f"{where} records {experts} experts on layers {stats['layers'].tolist()}, "
            f"but the job's model has {num_experts} on {sorted(moe_layers)}: use a dump of this model"
        )


def load_path(path: Path | str) -> dict[str, np.ndarray]:
    """A routing-statistics folder (:func:`load_folder`) or one of its files (:func:`load`)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"routing statistics {path} do not exist: pass <dump_folder>/routing_stats or one of its .npz files")
    return load(path) if path.is_file() else load_folder(path)


def recorder_for(job_config, model_parts, parallel_dims) -> "RoutingRecorder | None":
    """A recorder hooked into ``model_parts`` when ``[routing_stats] enable``, else None."""
    if not job_config.routing_stats.enable:
        return None
    args = model_parts[0].model_args
    recorder = RoutingRecorder(
        num_layers=args.n_layers,
        num_experts=args.moe_args.num_experts,
        top_k=args.moe_args.top_k,
        device=next(model_parts[0].parameters()).device,
        routing_copies=parallel_dims.tp,
        sample_tokens=job_config.routing_stats.sample_tokens,
    )
    recorder.attach(model_parts)
    return recorder


def output_folder(job_config) -> str:
    return os.path.join(job_config.job.dump_folder, job_config.routing_stats.folder)
