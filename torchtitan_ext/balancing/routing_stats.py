"""Routing statistics: what the routers chose, per MoE layer, for planning and placement.

Off by default; ``[routing_stats] enable = true`` turns it on. A forward hook
on every MoE router accumulates on the device (no host sync):

- tokens per expert, per training step;
- the top-k co-activation matrix: how many tokens picked both expert a and b
  (the diagonal holds the tokens that picked a);
- the transition matrix from each MoE layer to the next MoE layer of the same
  model chunk: for each token, every pair (a picked at the layer, b picked at
  the next), so a token adds top_k x top_k counts.

Every ``save_every`` steps (and at the last step) the counts are summed over
all ranks (the routers of tensor-parallel ranks see the same tokens and count
once) and rank 0 writes ``<dump_folder>/<folder>/routing_step<STEP>.npz``:

=====================  ==================  ====================================================
key                    shape               meaning
=====================  ==================  ====================================================
``steps``              [S] int64           training steps covered by this file
``layers``             [L] int64           model layer ids of the MoE layers (all stages)
``tokens_per_expert``  [S, L, E] int64     (token, expert) picks per step, layer and expert
``coactivation``       [L, E, E] int64     tokens that picked both a and b, over the S steps
``transitions``        [L, E, E] int64     picks (a at layers[i], b at the next MoE layer), over
                                           the S steps; zero for the last layer of a chunk
``top_k``              [] int64            the router's top_k
``sampled_expert_ids`` [S, L, N, top_k]    the top-k expert ids of the first ``sample_tokens``
                       int16               tokens of every rank per step and layer (N = ranks x
                                           sample_tokens, rank-major; -1 where a rank had fewer)
=====================  ==================  ====================================================

Recomputation under activation checkpointing and validation passes are not counted.
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from torchtitan_ext.config import Range, register_section
from torchtitan_ext.ep.base import recomputing


@dataclass
class RoutingStats:
    enable: bool = False
    """
    Record routing statistics per MoE layer (tokens per expert per step,
    top-k co-activation, layer-to-layer transitions) and save them as .npz
    (schema in this module's docstring). Off by default: it costs two
    [E, E] matrix products per MoE layer and microbatch.
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
            if module.training:  # validation passes are not training's routing
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
        path = Path(folder) / f"routing_step{self.steps[-1]:06d}.npz"
        self.history, self.steps, self.sample_history = [], [], []
        self.coactivation.zero_()
        self.transitions.zero_()
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **arrays)
        return path


def load(path: Path | str) -> dict[str, np.ndarray]:
    """One saved file's arrays (see the module docstring for the schema)."""
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def load_folder(folder: Path | str) -> dict[str, np.ndarray]:
    """All files of a dump folder merged in step order: per-step arrays concatenated, matrices summed;
    ``file_steps`` [F] and ``file_coactivation`` [F, L, E, E] keep each file's steps and co-activation
    (for splitting a dump in time); ``sampled_expert_ids`` only when every file has it."""
    files = sorted(Path(folder).glob("routing_step*.npz"))
    if not files:
        raise FileNotFoundError(f"no routing_step*.npz files in {folder}: train with [routing_stats] enable = true")
    parts = [load(path) for path in files]
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
