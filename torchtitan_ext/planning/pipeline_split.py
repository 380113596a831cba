"""Which modules each pipeline rank runs, and its schedule's bubble, as torchtitan 0.2.2 splits a model.

The layout advisor prices a pipeline-parallel job by its busiest rank (the stage that sets the pipeline's pace) and
stretches that rank's work by the schedule's bubble. The split is torchtitan's own
(``generate_llm_fqn_per_model_part``, or the job's ``module_fqns_per_model_part``), with its stage-to-rank order
(looped, or V for ZBV and DualPipeV). See docs/planning.md, "Models, topologies, pipelines".
"""

import math
from dataclasses import dataclass

from torch.distributed.pipelining.schedules import (
    get_schedule_class, PipelineScheduleSingle, ScheduleDualPipeV, ScheduleZBVZeroBubble,
)
from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

from torchtitan_ext.config import ConfigError


@dataclass(frozen=True)
class PipelineSplit:
    """One job's pipeline: what each rank runs and how long it idles."""

    rank_modules: tuple[tuple[str, ...], ...]
    """Per pipeline rank, the model's top-level modules it runs ("tok_embeddings", "layers.3", "norm", "output"),
    over all its stages."""
    stages_per_rank: int
    """Virtual stages per rank (V): 1 for a single-stage schedule. >= 1."""
    microbatches: int
    """Microbatches per schedule step (m): the local batch over the microbatch size. >= 1."""

    @property
    def degree(self) -> int:
        return len(self.rank_modules)

    @property
    def bubble(self) -> float:
        """Idle time over busy time of a rank per schedule step: the warm-up and drain of 1F1B and its
        interleaved form (GPipe's is the same), (PP - 1) / (V x m); with fewer microbatches than ranks an
        interleaved rank also waits PP - m units between its V chunks, (PP - 1 + (V - 1)(PP - m)) / (V x m). A
        zero-bubble schedule is priced as interleaved, an upper bound where m >= 2 PP - 1 (ZBV pads its schedule
        to that many). 0 without pipeline parallelism."""
        pp, v, m = self.degree, self.stages_per_rank, self.microbatches
        return (pp - 1 + (v - 1) * max(0, pp - m)) / (v * m)


def _stages_per_rank(parallelism, n_layers: int) -> tuple[int, int]:
    """(virtual stages in all, per rank), as torchtitan's ``pipeline_llm`` derives and checks them: the checks of
    stages per rank where ``pipeline_parallel_layers_per_stage`` sets the count, then the stages that
    ``module_fqns_per_model_part`` lists where it is given."""
    pp = parallelism.pipeline_parallel_degree
    schedule = parallelism.pipeline_parallel_schedule
    try:
        single = issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
    except ValueError as e:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {schedule!r}: {e}") from None
    if parallelism.pipeline_parallel_layers_per_stage is not None:
        effective = (n_layers + parallelism.pipeline_parallel_first_stage_less_layers
                     + parallelism.pipeline_parallel_last_stage_less_layers)
        stages = math.ceil(effective / parallelism.pipeline_parallel_layers_per_stage)
        if stages % pp:
            raise ConfigError(
                f"{stages} pipeline stages do not divide over parallelism.pipeline_parallel_degree = {pp}: set "
                "parallelism.pipeline_parallel_layers_per_stage for a multiple of it"
            )
        if single and stages != pp:
            raise ConfigError(
                f"pipeline_parallel_schedule = {schedule!r} runs one stage per rank, and the split gives "
                f"{stages // pp}: raise parallelism.pipeline_parallel_layers_per_stage or use an interleaved schedule"
            )
        if not single and stages < 2 * pp:
            raise ConfigError(
                f"pipeline_parallel_schedule = {schedule!r} runs at least two stages per rank, and the split gives "
                "one: lower parallelism.pipeline_parallel_layers_per_stage or use a single-stage schedule"
            )
    else:
        stages = pp * (1 if single else 2)
    if parallelism.module_fqns_per_model_part is not None:
        stages = len(parallelism.module_fqns_per_model_part)
        if stages % pp:
            raise ConfigError(
                f"parallelism.module_fqns_per_model_part lists {stages} stages, which do not divide over "
                f"pipeline_parallel_degree = {pp}: list a multiple of it"
            )
    return stages, stages // pp


def pipeline_split(job_config, n_layers: int) -> PipelineSplit:
    """The job's split of a model of ``n_layers`` transformer layers; one rank running everything without
    pipeline parallelism."""
    p, training = job_config.parallelism, job_config.training
    pp = p.pipeline_parallel_degree
    if pp == 1:
        whole = ("tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output")
        return PipelineSplit((whole,), 1, 1)
    stages, per_rank = _stages_per_rank(p, n_layers)
    try:
        names = p.module_fqns_per_model_part or generate_llm_fqn_per_model_part(
            stages, n_layers, p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
        )
    except ValueError as e:
        raise ConfigError(f"parallelism.pipeline_parallel_layers_per_stage: torchtitan cannot split the model into "
                          f"{stages} stages ({e})") from None
    if get_schedule_class(p.pipeline_parallel_schedule) in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        if per_rank != 2:
            raise ConfigError(
                f"pipeline_parallel_schedule = {p.pipeline_parallel_schedule!r} runs two stages per rank, and the split "
                f"gives {per_rank}: set parallelism.pipeline_parallel_layers_per_stage for {2 * pp} stages"
            )
        stage_ids = [(rank, stages - 1 - rank) for rank in range(pp)]
    else:
        stage_ids = [tuple(rank + s * pp for s in range(per_rank)) for rank in range(pp)]
    rank_modules = tuple(tuple(module for stage in ids for module in names[stage]) for ids in stage_ids)
    microbatches = training.local_batch_size // p.pipeline_parallel_microbatch_size
    return PipelineSplit(rank_modules, per_rank, microbatches)
