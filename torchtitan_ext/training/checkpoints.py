"""Checkpoints that are complete on disk, or not counted: torchtitan's CheckpointManager, made safe.

A DCP checkpoint is complete once its ``.metadata`` exists (the coordinator
writes it last). Around torchtitan 0.2.2's manager this module

- sets torn folders aside at start: ``step-N`` without ``.metadata`` is renamed
  ``incomplete_step_N`` (a name torchtitan's ``step-(\\d+)`` pattern never
  matches), reported, and never loaded or counted; a last step exported as HF
  safetensors is set aside as ``hf_export_step_N``;
- refuses, in the launchers' pre-flight, a resume from a model-only step
  (torchtitan's last save by default), which torchtitan would load whole;
- counts only complete checkpoints for ``keep_latest_k``, so that the purge
  never deletes a complete checkpoint to make room for one still being
  written (async mode purges while the newest write is in flight);
- finishes a save before reporting it: :func:`save_now` waits for an async
  save and says whether ``.metadata`` is on disk; a trainer's close waits for
  one still in flight instead of dropping it;
- refuses ``keep_latest_k = 1`` (torchtitan raises on every rank) with the
  other config checks;
- says, where a job exports its last step as HF safetensors, that the export leaves out the MoE routing bias
  load balancing trains, where the model's HF format has no place for it.
"""

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torchtitan.tools.logging import logger

from torchtitan_ext.balancing.migration import read_record, record_problem, STATE_KEY as PLACEMENT_STATE_KEY
from torchtitan_ext.config import (
    ConfigError, data_parallel_degree, model_args_of, moe_layer_ids, register_check, routed_moe_args, shared_meta_model,
    unread_checkpoint_names, ValidationContext,
)
from torchtitan_ext.records.checkpoint_folder import checkpoint_steps, is_complete

SET_ASIDE_PREFIX = "incomplete_step_"
HF_EXPORT_INDEX = "model.safetensors.index.json"
"""What torchtitan writes last in a step saved as HF safetensors (``checkpoint.last_save_in_hf``), which it has no
``.metadata`` of."""
HF_EXPORT_PREFIX = "hf_export_step_"


def routing_bias_left_out_of_hf(job_config, sd_adapter) -> str | None:
    """The routing bias of the model's first MoE layer (``layers.<n>.moe.expert_bias``, which load balancing trains:
    every model's spec here balances) where the HF state-dict adapter's ``to_hf`` leaves it out, the model's HF
    format having no place for it (DeepSeek-V3's has ``e_score_correction_bias``); None where the adapter keeps it,
    or the model has none. Read from the model's arguments, whichever pipeline stage the caller holds."""
    moe_args = routed_moe_args(model_args_of(job_config))
    if moe_args is None or moe_args.load_balance_coeff is None:
        return None
    bias = f"layers.{moe_layer_ids(job_config)[0]}.moe.expert_bias"
    return None if sd_adapter.to_hf({bias: torch.zeros(moe_args.num_experts)}) else bias


def _is_hf_export(path: Path) -> bool:
    """Whether ``path`` holds a whole HF safetensors export: its index, written last, readable and naming files that
    are there (an index whose write was cut is no export)."""
    try:
        files = set(json.loads((path / HF_EXPORT_INDEX).read_text())["weight_map"].values())
        return bool(files) and all((path / name).is_file() for name in files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def set_aside_torn(folder: str | Path) -> list[Path]:
    """Rename every ``step-N`` in ``folder`` that a resume cannot load, a torn write (to ``incomplete_step_N``) or an
    HF safetensors export of a job's last step (to ``hf_export_step_N``; torchtitan would load it as its latest
    checkpoint and fail), ``_2``, ... where the name is taken, and log it; the new paths. Global rank 0 renames;
    every rank waits for it."""
    folder = Path(folder)
    moved = []
    if not dist.is_initialized() or dist.get_rank() == 0:
        complete, torn = checkpoint_steps(folder)
        resume = f"step {complete[-1]}" if complete else "the start (no complete checkpoint)"
        for step in torn:
            source = folder / f"step-{step}"
            export = _is_hf_export(source)
            prefix = HF_EXPORT_PREFIX if export else SET_ASIDE_PREFIX
            target = folder / f"{prefix}{step}"
            copy = 1
            while target.exists():
                copy += 1
                target = folder / f"{prefix}{step}_{copy}"
            os.rename(source, target)
            moved.append(target)
            what = ("an HF safetensors export (checkpoint.last_save_in_hf saves a job's last step so), which a resume "
                    "cannot load" if export else "incomplete (no .metadata: its write was interrupted)")
            logger.warning(f"Checkpoint {source} is {what}; set aside as {target}, never loaded or counted; "
                           f"training resumes from {resume}")
    if dist.is_initialized():
        dist.barrier()
    return moved


def purge_keeping_complete(checkpointer) -> None:
    """torchtitan's purge with ``keep_latest_k`` counted over complete checkpoints only (rank 0)."""
    if checkpointer.keep_latest_k <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
        return
    folder = Path(checkpointer.folder)
    complete, _ = checkpoint_steps(folder)
    for step in complete[: -checkpointer.keep_latest_k]:
        checkpointer.purge_queue.put(str(folder / f"step-{step}"))


def wait_for_saves(checkpointer) -> None:
    """Block until an asynchronous save in flight is on disk (a no-op without one)."""
    if checkpointer.enable:
        checkpointer.maybe_wait_for_staging()
        # torchtitan 0.2.2 has no public wait: _async_wait is what its own next save calls first
        checkpointer._async_wait()


def save_now(checkpointer, step: int) -> Path | None:
    """A full checkpoint of ``step`` (model, optimizer, schedulers, data loader, step) whatever the
    interval, waited for in async modes; its path once complete on disk, else None (checkpointing
    off or load-only, or a write that did not complete). Every rank calls it."""
    interval, checkpointer.interval = checkpointer.interval, 1
    try:
        checkpointer.save(step)
        wait_for_saves(checkpointer)
    finally:
        checkpointer.interval = interval
    if dist.is_initialized():
        dist.barrier()  # the coordinator writes .metadata last: every rank looks after it has finished
    path = Path(checkpointer.folder) / f"step-{step}"
    return path if checkpointer.enable and is_complete(path) else None


def checkpoint_to_load(job_config) -> Path | None:
    """The checkpoint a start of this job loads, as torchtitan chooses it: ``load_step``, else the latest
    complete one in the job's folder, else ``initial_load_path``; None when it loads none."""
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        return None
    folder = Path(job_config.job.dump_folder) / checkpoint.folder
    if checkpoint.load_step != -1:
        return folder / f"step-{checkpoint.load_step}"
    complete, _ = checkpoint_steps(folder)
    if complete:
        return folder / f"step-{complete[-1]}"
    return Path(checkpoint.initial_load_path) if checkpoint.initial_load_path else None


def check_start_checkpoint(job_config, world_size: int) -> None:
    """ConfigError where the checkpoint a job about to train starts from is not there: torchtitan's checkpointer
    finds out in every rank once they have started. ``checkpoint.load_step`` must name a complete checkpoint (where
    the job's checkpoint folder does not exist yet, torchtitan would start from scratch, or from
    ``initial_load_path``, without a word; where it does, fail); ``initial_load_path``, which torchtitan loads where
    that folder does not exist, must be a folder; a data loader's state must be loaded at the data-parallel degree
    it was saved at. For the launchers' pre-flight on a machine that trains the job (``world_size`` ranks):
    another machine may not see its files."""
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        return
    folder = Path(job_config.job.dump_folder) / checkpoint.folder
    if checkpoint.load_step != -1:
        complete, _ = checkpoint_steps(folder)
        if checkpoint.load_step not in complete:
            raise ConfigError(
                f"checkpoint.load_step = {checkpoint.load_step}, but {folder} holds no complete checkpoint of that step "
                f"(complete: {', '.join(map(str, complete)) or 'none'}): give one of them, or -1 for the latest"
            )
    starts_fresh = not folder.exists()
    if starts_fresh:
        _check_initial_checkpoint(job_config)  # first: a start it cannot read at all is named as such
    loaded = checkpoint_to_load(job_config)
    from_hf = loaded is not None and loaded.parent != folder and checkpoint.initial_load_in_hf
    if loaded is None or from_hf or not is_complete(loaded):
        return
    keys = _saved_keys(loaded)  # read once: each check below reads the same .metadata
    resumes = loaded.parent == folder and loaded.name != "step-0"  # torchtitan loads it whole
    if resumes:
        _check_loads_whole(job_config, loaded, folder, keys)
    if resumes or (starts_fresh and not checkpoint.initial_load_model_only):
        _check_data_loader_degree(job_config, loaded, keys, world_size)
    _check_model_shapes(job_config, loaded, keys)


FULL_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")
"""What a full checkpoint holds beside the model, and a model-only one lacks."""


SAVED_STATES = tuple(f"{state}." for state in (*FULL_STATE, PLACEMENT_STATE_KEY))
"""The prefixes of a checkpoint's keys that are no model weight (torchtitan's states; this harness's placement
record): the model's weights are saved under their own names."""


def _check_model_shapes(job_config, path: Path, keys) -> None:
    """ConfigError where the checkpoint a job loads was saved by another model: DCP fails in every rank on the first
    weight of another shape ("Size mismatch between saved ... and current"), and a rerun fails again."""
    if "model" in job_config.checkpoint.exclude_from_loading:
        return
    saved = {key: tuple(meta.size) for key, meta in keys.items()
             if not key.startswith(SAVED_STATES) and hasattr(meta, "size")}
    weights = {name: tuple(tensor.shape) for name, tensor in shared_meta_model(job_config).state_dict().items()}
    other = next((name for name in weights if name in saved and saved[name] != weights[name]), None)
    if other is None and (not saved or set(saved) & set(weights)):
        return
    model = f"model.name = '{job_config.model.name}', flavor '{job_config.model.flavor}'"
    what = (f"its {other} is {list(saved[other])}, which this job's model ({model}) makes {list(weights[other])}"
            if other is not None else f"none of its weights is one of this job's model ({model})")
    raise ConfigError(
        f"checkpoint {path} was saved by another model: {what}: run the model it was saved by, or give this job "
        "another checkpoint.folder"
    )


SAVED_DATA_LOADER = re.compile(r"dataloader\.dp_rank_\d+")
"""A checkpoint's key of one data-parallel rank's data loader state (torchtitan's ParallelAwareDataloader)."""


def _check_data_loader_degree(job_config, path: Path, keys, world_size: int) -> None:
    """ConfigError where a checkpoint's data loader state was saved by another number of data-parallel ranks than
    the job has: torchtitan's data loader asserts in every rank that the degree is unchanged ("dataloader resharding
    is not supported yet"), so a resume on another world size fails, and a rerun with it fails again."""
    if "dataloader" in job_config.checkpoint.exclude_from_loading:
        return
    degree = data_parallel_degree(job_config, world_size)
    saved = sum(1 for key in keys if SAVED_DATA_LOADER.fullmatch(key))
    if degree is None or not saved or saved == degree:
        return
    raise ConfigError(
        f"checkpoint {path} holds the data loader of {saved} data-parallel ranks, and this job has {degree} "
        "(data_parallel_replicate x data_parallel_shard): torchtitan's data loader cannot reshard its state; resume "
        f"at {saved} data-parallel ranks, or load the rest without it (--checkpoint.exclude_from_loading dataloader: "
        "the data starts over from the first batch)"
    )


def _check_initial_checkpoint(job_config) -> None:
    """ConfigError where the checkpoint a job without a checkpoint folder starts from cannot be loaded as the job
    says: torchtitan loads ``initial_load_path`` (with ``initial_load_in_hf``: the HF safetensors there, or in
    ``model.hf_assets_path`` where it is unset) and fails in every rank on a folder that holds no such checkpoint,
    with a missing key of the model's; it asserts, there, that an HF checkpoint is loaded as the model only, and
    that a quantized one is an HF one."""
    checkpoint = job_config.checkpoint
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_model_only:
        raise ConfigError("checkpoint.initial_load_in_hf loads the model only, but checkpoint.initial_load_model_only "
                          "is off: drop --checkpoint.no_initial_load_model_only")
    if checkpoint.initial_load_in_hf_quantized and not checkpoint.initial_load_in_hf:
        raise ConfigError("checkpoint.initial_load_in_hf_quantized reads a quantized HF checkpoint, but "
                          "checkpoint.initial_load_in_hf is off: add --checkpoint.initial_load_in_hf")
    if checkpoint.initial_load_path:
        field, path = "checkpoint.initial_load_path", checkpoint.initial_load_path
    elif checkpoint.initial_load_in_hf:
        field, path = "model.hf_assets_path", job_config.model.hf_assets_path
    else:
        return
    folder = Path(path)
    holds_hf = folder.is_dir() and any(folder.glob("*.safetensors"))
    if checkpoint.initial_load_in_hf:
        source = ("" if field == "checkpoint.initial_load_path"
                  else " (checkpoint.initial_load_in_hf loads from there where checkpoint.initial_load_path is unset)")
        if not holds_hf:
            state = "holds no .safetensors file" if folder.is_dir() else "is not a folder"
            raise ConfigError(
                f"{field} = '{path}' {state}, and the job starts from the HF checkpoint there{source}: set "
                "checkpoint.initial_load_path to the folder of the model's HF safetensors"
            )
    elif not folder.is_dir():
        raise ConfigError(
            f"checkpoint.initial_load_path = '{path}' is not a folder, and the job starts from it: give the folder "
            "of a checkpoint (a DCP step folder, or with checkpoint.initial_load_in_hf the HF safetensors' folder), "
            "or unset it"
        )
    elif not is_complete(folder):
        fix = ("it holds HF safetensors: add --checkpoint.initial_load_in_hf" if holds_hf
               else "give a complete DCP step folder (step-N with its .metadata)")
        raise ConfigError(
            f"checkpoint.initial_load_path = '{path}' holds no complete DCP checkpoint (no .metadata), and the job "
            f"starts from it: {fix}"
        )


def _saved_keys(path: Path):
    """The keys a complete checkpoint holds (its DCP metadata's); ConfigError where its ``.metadata`` cannot be read."""
    try:
        return FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # a damaged .metadata: whatever DCP raises, named in one line
        raise ConfigError(f"checkpoint {path}: its .metadata cannot be read ({type(e).__name__}: {e}): load another "
                          "checkpoint (checkpoint.load_step) or move this one away") from None


def _holds_model_only(keys) -> bool:
    """Whether a checkpoint of these keys holds the model alone, as torchtitan writes a job's last step under
    ``checkpoint.last_save_model_only`` (a full one also holds the optimizer, the data loader and the train state)."""
    return not any(key.startswith("train_state.") for key in keys)


def _check_loads_whole(job_config, path: Path, folder: Path, keys) -> None:
    """ConfigError where the checkpoint a job resumes from holds the model only: torchtitan loads every step but
    step 0 of the job's folder whole (less ``checkpoint.exclude_from_loading``), and fails in every rank on the
    missing optimizer and data loader (a finished job run again with more steps, its last step saved model-only)."""
    if set(FULL_STATE) <= set(job_config.checkpoint.exclude_from_loading):
        return
    if not _holds_model_only(keys):
        return
    complete, _ = checkpoint_steps(folder)
    full = next((step for step in reversed(complete) if f"step-{step}" != path.name and _holds_full(folder, step)), None)
    aside = folder / f"model_only_{path.name.replace('-', '_')}"
    resume = f"resume from the last full one, step {full}" if full is not None else "start over (no full one is left)"
    raise ConfigError(
        f"checkpoint {path} holds the model only (checkpoint.last_save_model_only saves a job's last step so), and "
        f"a job resuming in {folder} loads it whole: move it aside (mv {path} {aside}) to {resume}, or "
        f"start from its weights in a new folder (--checkpoint.folder NEW --checkpoint.initial_load_path {path}); "
        "--checkpoint.no_last_save_model_only saves a last step that resumes"
    )


def _holds_full(folder: Path, step: int) -> bool:
    """Whether ``step``'s complete checkpoint in ``folder`` holds the full state (False where it cannot be read)."""
    try:
        return not _holds_model_only(_saved_keys(folder / f"step-{step}"))
    except ConfigError:  # a damaged .metadata is no checkpoint to resume from
        return False


def check_checkpoint_options(job_config, context: ValidationContext) -> None:
    keep = job_config.checkpoint.keep_latest_k
    if keep == 1:  # torchtitan's manager refuses it whether or not checkpointing is on
        raise ConfigError(
            "checkpoint.keep_latest_k = 1: torchtitan keeps at least 2 (the newest may still be being written): "
            "set it to 0 (keep all) or 2 or more"
        )
    checkpoint = job_config.checkpoint
    if checkpoint.enable and checkpoint.export_dtype != "float32" and not checkpoint.last_save_model_only:
        # torchtitan converts only a model-only last save: the full one is written in the training dtype
        raise ConfigError(
            f"checkpoint.export_dtype = '{checkpoint.export_dtype}' converts the last save only where it holds the "
            "model alone, but checkpoint.last_save_model_only is off: drop --checkpoint.no_last_save_model_only, or "
            "the export dtype"
        )
    if checkpoint.enable and checkpoint.last_save_in_hf and not checkpoint.last_save_model_only:
        # torchtitan asserts it at the last step, once the whole run is spent
        raise ConfigError("checkpoint.last_save_in_hf saves the model alone, but checkpoint.last_save_model_only is "
                          "off: drop --checkpoint.no_last_save_model_only, or --checkpoint.last_save_in_hf")
    hf_fields = [f"checkpoint.{field}" for field in ("initial_load_in_hf", "last_save_in_hf")
                 if getattr(checkpoint, field)]
    # torchtitan loads and saves HF checkpoints through its model's state-dict adapter: for a family whose tensor
    # names it does not read, a load fails in every rank on a missing key, and a save writes names no loader reads
    unread_names = unread_checkpoint_names(job_config.model.flavor) if checkpoint.enable and hf_fields else ""
    if unread_names:
        raise ConfigError(f"{' and '.join(hf_fields)} with model.flavor = '{job_config.model.flavor}': {unread_names}: "
                          f"start from and save DCP checkpoints (unset {' and '.join(hf_fields)})")
    path = checkpoint_to_load(job_config)
    if context.device_type is None or path is None or context.moe_shape is None or not is_complete(path):
        return
    try:
        record = read_record(str(path))
    except Exception as e:  # a damaged .metadata or record: whatever DCP raises, named in one line
        raise ConfigError(f"checkpoint {path}: its expert placement record cannot be read ({type(e).__name__}: {e}): "
                          "load another checkpoint (checkpoint.load_step) or move this one away") from None
    if record is not None:
        problem = record_problem(*record, moe_layer_ids(job_config), context.moe_shape.num_experts)
        if problem:
            raise ConfigError(f"checkpoint {path}: the expert placement record {problem}")


register_check(check_checkpoint_options)
