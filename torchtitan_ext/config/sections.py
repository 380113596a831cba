"""The shared section that no feature owns: ``[parallelism]``'s EP backend field, widened to our backends."""

from dataclasses import dataclass

from torchtitan_ext.config.registry import register_section

BACKEND_ALIASES = {"standard": "nccl"}
"""torchtitan's backend names that mean one of ours."""


@dataclass
class Parallelism:
    expert_parallel_comm_backend: str = "standard"
    """
    Expert-parallel communication backend, used when expert_parallel_degree > 1.

    - "nccl": all-to-all over torch.distributed (NCCL on GPU, gloo on CPU).
      "standard", torchtitan's name for it, is accepted as an alias.
    - "deepep": DeepEP's kernels; knobs in [deepep].
    - "hybridep": DeepEP's HybridEP kernels (fused permute, optional
      non-blocking mode); knobs in [hybridep].
    - "ncclep": NCCL EP, NVIDIA's EP library (eager or a static receive
      budget); knobs in [ncclep].

    No effect for models without MoE layers or when expert_parallel_degree = 1.
    """


register_section("parallelism", Parallelism)


def comm_backend(job_config) -> str:
    """The EP backend's canonical name (aliases resolved)."""
    name = job_config.parallelism.expert_parallel_comm_backend
    return BACKEND_ALIASES.get(name, name)


def job_summary(job_config, ranks: int) -> str:
    """What the job is, from the resolved config: model, flavour, EP backend and degree, and its ``ranks``
    ("deepseek_v3 debugmodel, nccl EP=2, 2 ranks"); the job's banner and a config the planner writes say it."""
    ep = job_config.parallelism.expert_parallel_degree
    parallel = f"{comm_backend(job_config)} EP={ep}" if ep > 1 else "no EP"
    return f"{job_config.model.name} {job_config.model.flavor}, {parallel}, {ranks} rank{'s' * (ranks != 1)}"


def overlaps_expert_parallel(parallelism) -> bool:
    """Whether the job runs one microbatch's EP communication beside another's compute: torchtitan 0.2.2 does so
    under DualPipeV with ``pipeline_parallel_expert_parallel_overlap`` (its only schedule that overlaps EP)."""
    return (
        parallelism.pipeline_parallel_degree > 1
        and parallelism.pipeline_parallel_expert_parallel_overlap
        and parallelism.pipeline_parallel_schedule.lower() == "dualpipev"
    )
