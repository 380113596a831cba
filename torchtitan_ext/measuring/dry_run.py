"""Validate a job on one CPU process, without allocating model weights.

``COMM_MODE=fake_backend NGPU=<world size> ./run_train.sh`` (or
``python -m torchtitan_ext.measuring.dry_run [--world-size N] -- --job.config_file X [overrides]``; the
world size as every tool takes it: the flag, else NGPU, else the config's degrees)
parses and validates the config, builds the device mesh over a fake process
group of the job's world size, builds the model on the meta device, applies the
same parallelize plan (and pipeline split) that training applies, and reports
the mesh, the parameters one rank holds, and the EP backend with its settings.
Nothing touches a GPU or a network; kernel libraries are not needed (the
kernels are chosen at the first dispatch, which a dry run never reaches).
"""

import argparse
import sys
from dataclasses import dataclass

from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.entry import imports_without_collection, run_and_exit

with imports_without_collection():
    import torch
    import torch.distributed as dist
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools import utils
    from torchtitan.tools.logging import logger

    from torchtitan_ext.config import (
        comm_backend, ConfigError, job_world_size, load_job_config, max_tokens_per_rank, model_class_and_args, MoEShape,
        parse, routed_moe_args,
    )
    from torchtitan_ext.ep import backend_class
    from torchtitan_ext.models.converters import RECIPES
    from torchtitan_ext.runtime.console import init_logger
    from torchtitan_ext.training import prepare


@dataclass(frozen=True)
class DryRunReport:
    model: str
    world_size: int
    mesh: dict[str, int]
    total_parameters: int
    rank_parameters: int
    rank_parameter_bytes: int
    parameter_dtype: str
    ep_settings: dict[str, str]
    rank_expert_parameters: int
    rank_expert_parameter_bytes: int
    rank_layers: tuple[int, ...]
    """Model layer ids rank 0 holds, in order."""
    rank_moe_layers: tuple[int, ...]
    """Those of them that are MoE layers."""
    pipeline_stages: int
    converters: tuple[str, ...]
    parameter_devices: frozenset[str]
    """Devices of rank 0's parameters: {"meta"}, nothing was allocated."""

    def lines(self) -> list[str]:
        mesh = " ".join(f"{name}={size}" for name, size in self.mesh.items())
        lines = [
            f"dry run: {self.model} on {self.world_size} ranks (fake process group, meta device)",
            f"mesh: {mesh}",
            f"parameters: {self.total_parameters:,} in the model; rank 0 holds "
            f"{self.rank_parameters:,} ({self.rank_parameter_bytes / 1e9:.2f} GB in {self.parameter_dtype})",
        ]
        if self.pipeline_stages > 1:
            lines.append(f"pipeline: rank 0 runs {self.pipeline_stages} stage(s) of the split model")
        if self.converters:
            described = [f"{name} (needs {RECIPES[name].gpus})" if name in RECIPES else name for name in self.converters]
            lines.append(f"model converters (checked on the job's GPUs, not applied in a dry run): {', '.join(described)}")
        lines += [f"ep {key}: {value}" for key, value in self.ep_settings.items()]
        return lines


def dry_run(job_config, world_size: int) -> DryRunReport:
    """Apply the job's parallelisms to a meta-device model over a fake process group (its own, released before
    it returns, unless one is already initialized)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        return _dry_run(job_config, world_size)
    finally:
        if created:
            dist.destroy_process_group()


def _dry_run(job_config, world_size: int) -> DryRunReport:
    p = job_config.parallelism
    parallel_dims = ParallelDims(
        dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world_size,
    )
    parallel_dims.build_mesh()
    spec = get_train_spec(job_config.model.name)
    model_cls, model_args = model_class_and_args(job_config)
    dtype = TORCH_DTYPE_MAP[job_config.training.dtype]
    with torch.device("meta"), utils.set_default_dtype(dtype):
        model = model_cls(model_args)
    total = sum(param.numel() for param in model.parameters())

    if parallel_dims.pp_enabled:
        loss_fn = spec.build_loss_fn(job_config, parallel_dims=parallel_dims)
        _, model_parts, _, _ = spec.pipelining_fn(
            model, parallel_dims, job_config, torch.device("cpu"), model_args, spec.parallelize_fn, loss_fn
        )
    else:
        model_parts = [spec.parallelize_fn(model, parallel_dims, job_config)]

    named = [
        (name, param.to_local() if hasattr(param, "to_local") else param)
        for part in model_parts
        for name, param in part.named_parameters()
    ]
    local = [tensor for _, tensor in named]
    experts = [tensor for name, tensor in named if ".moe.experts." in name]
    layers = [
        (int(layer_id), block) for part in model_parts for layer_id, block in part.layers.items()
    ]
    ep_settings = {"backend": "none (no MoE layers)"}
    moe_args = routed_moe_args(model_args)
    if moe_args is not None:
        shape = MoEShape(model_args.dim, moe_args.num_experts, moe_args.top_k, max_tokens_per_rank(job_config))
        ep_settings = (
            {"name": comm_backend(job_config), **backend_class(job_config).describe(job_config, shape)}
            if parallel_dims.ep_enabled
            else {"backend": "none (expert_parallel_degree = 1)"}
        )
    return DryRunReport(
        model=f"{job_config.model.name} {job_config.model.flavor}",
        world_size=world_size,
        mesh={name: mesh.size() for name, mesh in parallel_dims.get_all_one_dimensional_meshes().items()},
        total_parameters=total,
        rank_parameters=sum(t.numel() for t in local),
        rank_parameter_bytes=sum(t.numel() * t.element_size() for t in local),
        rank_expert_parameters=sum(t.numel() for t in experts),
        rank_expert_parameter_bytes=sum(t.numel() * t.element_size() for t in experts),
        rank_layers=tuple(layer_id for layer_id, _ in layers),
        rank_moe_layers=tuple(layer_id for layer_id, block in layers if getattr(block, "moe_enabled", False)),
        parameter_dtype=str(dtype).removeprefix("torch."),
        ep_settings=ep_settings,
        pipeline_stages=len(model_parts),
        converters=tuple(job_config.model.converters),
        parameter_devices=frozenset(t.device.type for t in local),
    )


def main(argv: list[str] | None = None) -> None:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--world-size", type=int, help="world size to validate for (default: NGPU, else the config's degrees)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    init_logger()
    prepare()
    try:
        world_size = job_world_size(parse(train_args), args.world_size)
        job_config = load_job_config(train_args, device_type=None, world_size=world_size)
        report = dry_run(job_config, world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for line in report.lines():
        logger.info(line)


if __name__ == "__main__":
    run_and_exit(main)
