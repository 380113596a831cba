"""What every EP backend shares: the ``ExpertParallel`` contract and its inputs.

A backend is an ``ExpertParallel`` (a ``ParallelStyle``) applied to the routed
experts. It shards their weights on dim 0 over the EP mesh (torchtitan's
``_partition_fn``), and wraps the experts' forward:

- ``_token_dispatch``: (tokens [N, H], top-k scores [N, K], top-k expert ids
  [N, K]) -> (expert-major rows [M, H], padded rows per local expert [L]);
- ``_token_combine``: expert output rows [M, H] -> [N, H], each token's
  top-k results summed, back on its source rank in its source order.

Scores multiply the rows before the experts (``score_before_experts``, Llama4)
or the expert outputs before combine (DeepSeek-V3); either way in fp32,
rounded to the activation dtype.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torchtitan.components.quantization import FP8_GROUP_ALIGNMENT_SIZE, MXFP8_GROUP_ALIGNMENT_SIZE
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed.expert_parallel import ExpertParallel

from torchtitan_ext.ep.handle import KernelBuffer


@dataclass(frozen=True)
class MoEShape:
    """The MoE layers a backend serves, as fixed by the job config."""

    hidden_dim: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    """Tokens one rank brings to one dispatch (a microbatch's tokens on this rank)."""


def token_group_alignment(job_config) -> int:
    """Row multiple the expert GEMMs need: 32 for MXFP8, 16 for FP8 grouped GEMMs, else 1."""
    converters = job_config.model.converters
    if "quantize.grouped_mm.mx" in converters:
        return MXFP8_GROUP_ALIGNMENT_SIZE
    if "quantize.grouped_mm.float8" in converters:
        return FP8_GROUP_ALIGNMENT_SIZE
    return 1


def max_tokens_per_rank(job_config) -> int:
    """Tokens one rank dispatches per MoE call: a microbatch, split by CP and by TP when EP borrows it."""
    parallelism = job_config.parallelism
    batch = job_config.training.local_batch_size
    if parallelism.pipeline_parallel_degree > 1:
        batch = parallelism.pipeline_parallel_microbatch_size
    tokens = batch * job_config.training.seq_len // parallelism.context_parallel_degree
    if parallelism.tensor_parallel_degree > 1 and parallelism.expert_tensor_parallel_degree == 1:
        tokens //= parallelism.tensor_parallel_degree
    return tokens


def recomputing() -> bool:
    """True while activation checkpointing recomputes a forward inside backward.

    Counters updated in forward skip recomputation, so that checkpointed layers
    count each dispatch once (and selective checkpointing, which replays the
    forward's ops, sees no extra op).
    """
    return torch._C._current_graph_task_id() != -1


def scale_rows(rows: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """rows * scores per row, in fp32, rounded to the rows' dtype."""
    return (rows.float() * scores.float().unsqueeze(-1)).to(rows.dtype)


class SharedKernelBuffer:
    """One kernel buffer for every MoE layer of a job, created at the first dispatch.

    Its size comes from the config (``MoEShape``), not from the call, so it is
    allocated once; creating it lazily keeps dry runs and meta-device model
    construction free of communication buffers.
    """

    def __init__(self, create: Callable[[Any, torch.Tensor], Any]):
        self._create = create
        self._buffer: KernelBuffer | None = None

    def get(self, group, example: torch.Tensor) -> KernelBuffer:
        """The buffer; ``example`` (the first dispatched tokens) gives device and dtype."""
        if self._buffer is None:
            self._buffer = KernelBuffer(self._create(group, example))
        return self._buffer


class RoutedExpertParallel(ExpertParallel, ABC):
    """Base of the EP backends: experts take (tokens, scores, expert ids)."""

    sac_save_ops: ClassVar[tuple] = ()
    """Ops whose outputs selective activation checkpointing must save, so that
    recomputation never repeats a collective."""

    min_pad_multiple: ClassVar[int] = 1
    """Smallest row multiple this backend pads expert groups to."""

    def __init__(
        self, *, score_before_experts: bool, pad_multiple: int = 1, token_split_mesh: DeviceMesh | None = None
    ):
        super().__init__()
        self.score_before_experts = score_before_experts
        self.pad_multiple = max(pad_multiple, self.min_pad_multiple)
        self.token_split_mesh = token_split_mesh
        """TP mesh that EP borrows (expert TP off): each of its ranks dispatches a
        1/TP slice of the (TP-replicated) tokens; outputs are Partial over it."""
        self._pending = None

    @classmethod
    @abstractmethod
    def layer_factory(cls, job_config, shape: MoEShape) -> Callable[..., "RoutedExpertParallel"]:
        """Per-layer constructor (keywords: score_before_experts, token_split_mesh);
        the layers it makes share whatever the backend shares (its buffer)."""

    @classmethod
    def library_environment(cls, job_config) -> dict[str, str]:
        """Environment variables the backend's kernel library reads (exported by launchers)."""
        return {}

    @classmethod
    def describe(cls, job_config, shape: MoEShape) -> dict[str, str]:
        """The backend's settings for this job, for reports (dry run, planner, logs)."""
        pad = max(token_group_alignment(job_config), cls.min_pad_multiple)
        return {"backend": cls.__name__, "expert group padding": f"multiples of {pad} rows"}

    @abstractmethod
    def dispatch(
        self, x: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor,
        num_experts: int, group,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert-major rows, padded rows per local expert); remembers what combine needs."""

    @abstractmethod
    def combine(self, routed_output: torch.Tensor, group) -> torch.Tensor:
        """Expert outputs back to [N, H] on their source ranks."""

    def _token_dispatch(self, mod, inputs, device_mesh):
        x, scores, expert_ids = (self._split_tokens(t) for t in inputs)
        return self.dispatch(x, scores, expert_ids, mod.num_experts, device_mesh.get_group())

    def _token_combine(self, mod, routed_output, device_mesh):
        return self._unsplit_tokens(self.combine(routed_output, device_mesh.get_group()))

    def _split_tokens(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.token_split_mesh is None:
            return tensor
        parts = self.token_split_mesh.size()
        if tensor.shape[0] % parts:
            raise ValueError(
                f"{tensor.shape[0]} tokens do not split evenly over tensor parallel degree {parts}: "
                "make local_batch_size x seq_len divisible by it"
            )
        return tensor.chunk(parts)[self.token_split_mesh.get_local_rank()]

    def _unsplit_tokens(self, output: torch.Tensor) -> torch.Tensor:
        """This rank's slice in place, zeros elsewhere: the TP ranks' outputs sum to the whole."""
        if self.token_split_mesh is None:
            return output
        parts, rank = self.token_split_mesh.size(), self.token_split_mesh.get_local_rank()
        rows = output.shape[0]
        return torch.nn.functional.pad(output, (0, 0, rank * rows, (parts - rank - 1) * rows))

    def _take_pending(self):
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError(f"{type(self).__name__}: combine called without a dispatch")
        return pending
