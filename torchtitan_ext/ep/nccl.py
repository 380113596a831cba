"""The ``nccl`` backend: all-to-all over torch.distributed (NCCL on GPU, gloo on CPU).

torchtitan's "standard" backend, as torchtitan lays it out: each rank sorts its (token, expert) pairs by expert
id (destination rank, then local expert), gathers their rows once and sends them in one all-to-all; the receiver
permutes them (source-major) into its expert groups, padded to the grouped-GEMM alignment (at least 8 rows; 16
for FP8 and 32 for MXFP8 grouped GEMMs), with one gather computed on the device. Combine permutes back, sends
in one all-to-all, and one ``index_add`` sums every token's top-k rows (weighted by their scores for
DeepSeek-V3-style routing). Per MoE layer and step: one all-to-all of the counts (none under expert replication,
whose split knows every rank's counts) and one host sync for the split sizes in forward (all-to-all split sizes
live on the host, as in torchtitan), one all-to-all of rows per pass (dispatch and combine, forward and
backward): :meth:`NcclExpertParallel.device_budget`.

The row all-to-alls are custom ops (:mod:`torchtitan_ext.ep.ops.nccl`), on the selective activation-checkpointing
save list; combine's is asynchronous and its sum runs at the first use of its output (``in_flight``), so the MoE's
shared experts overlap it.
"""

from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.tensor import distribute_tensor, DTensor, Partial, Replicate, Shard

from torchtitan_ext.config import MoEShape
from torchtitan_ext.ep.base import RoutedExpertParallel, Routing, scale_rows, token_group_alignment, Variant
from torchtitan_ext.ep.budget import Budget, DeviceBudget
from torchtitan_ext.ep.in_flight import in_flight
from torchtitan_ext.ep.layout import expert_major_rows, round_up
from torchtitan_ext.ep.planning_profile import PlanningProfile
from torchtitan_ext.ep.published_rates import PublishedRate


@dataclass(frozen=True)
class _NcclDispatchState:
    token_of_row: torch.Tensor
    """Source token of every sent row (rows in send order: by destination rank, then local expert)."""
    row_scores: torch.Tensor | None
    """Scores of the sent rows, when they multiply the expert outputs."""
    destinations: torch.Tensor
    """Group row of every received row."""
    group_sources: torch.Tensor
    """Received row of every group row (row 0 for a pad row)."""
    pad_rows: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class NcclExpertParallel(RoutedExpertParallel):
    """EP over all-to-all collectives (NCCL on GPU, gloo on CPU).

    Applied on a 1-D "ep" mesh it is plain EP; on an ["ep", "etp"] mesh it also
    shards each expert's hidden dimension over "etp" (expert tensor parallelism,
    the only backend that supports it).
    """

    shared_experts_overlap = "yes: the combine all-to-alls are asynchronous, summed at first use"
    min_pad_multiple = 8
    supports_expert_tensor_parallel = True
    needs_expert_parallelism = False
    variants = {"nccl": Variant()}

    ops_module = "torchtitan_ext.ep.ops.nccl"
    saved_ops = ("_c10d_functional::all_to_all_single", "torchtitan_ext::nccl_dispatch", "torchtitan_ext::nccl_combine")

    @classmethod
    def layer_factory(cls, job_config, shape: MoEShape):
        return partial(cls, pad_multiple=token_group_alignment(job_config))

    @classmethod
    def device_budget(cls, job_config) -> DeviceBudget:
        return DeviceBudget(
            forward=Budget(host_syncs=1, collectives=3), backward=Budget(collectives=2),
            why="forward: the counts' all-to-all (unless the routing carries them) and one host read of the split "
                "sizes, then the rows' all-to-all in dispatch and in combine; backward: the rows' all-to-all of each",
            counts_exchange=Budget(collectives=1),
        )

    def _partition_fn(self, name, mod, device_mesh):
        if device_mesh.ndim == 1:
            return super()._partition_fn(name, mod, device_mesh)
        # expert TP on an [ep, etp] mesh: experts over "ep", w1/w3 column-wise and w2 row-wise over "etp"
        for param_name, hidden_dim in (("w1", 1), ("w2", 2), ("w3", 1)):
            param = getattr(mod, param_name)
            sharded = distribute_tensor(param, device_mesh, [Shard(0), Shard(hidden_dim)])
            mod.register_parameter(param_name, torch.nn.Parameter(sharded))

    def _token_dispatch(self, mod, inputs, device_mesh):
        if device_mesh.ndim == 1:
            return super()._token_dispatch(mod, inputs, device_mesh)
        # every expert-TP rank computes a partial result from the same tokens and scores,
        # so their gradients are partial sums over "etp"
        x, routing = inputs
        x, scores = (
            DTensor.from_local(t, device_mesh["etp"], (Replicate(),)).to_local(grad_placements=(Partial(),))
            for t in (x, routing.scores)
        )
        routing = Routing(scores, routing.expert_ids, routing.logical_ids, routing.sent_counts)
        return super()._token_dispatch(mod, (x, routing), device_mesh["ep"])

    def _token_combine(self, mod, routed_output, device_mesh):
        if device_mesh.ndim == 1:
            return super()._token_combine(mod, routed_output, device_mesh)
        return super()._token_combine(mod, routed_output, device_mesh["ep"])

    def dispatch(self, x, scores, expert_ids, num_experts, group, sent_counts=None):
        from torchtitan_ext.ep.ops.nccl import nccl_dispatch

        ep_degree = group.size()
        local_experts = num_experts // ep_degree
        num_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        # expert id d * L + e: sorted, the pairs go by destination rank d, then local expert e
        pair_order = torch.argsort(flat_ids, stable=True)
        with torch.no_grad():
            send_counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
            send_counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
            # recv_counts[s * L + e]: rows from source s for this rank's expert e; exchanged unless the routing
            # knows every rank's counts already (expert replication's split)
            if sent_counts is None:
                recv_counts = all_to_all_single(send_counts, None, None, group=group.group_name)
            else:
                first = group.rank() * local_experts
                recv_counts = sent_counts[:, first:first + local_experts].reshape(-1)
            received = recv_counts.view(ep_degree, local_experts)
            rows_per_expert = round_up(received.sum(0), self.pad_multiple)
            # split sizes must be on the host: one device-to-host sync, as in torchtitan
            host = torch.cat([send_counts.view(ep_degree, local_experts).sum(1), received.sum(1),
                              rows_per_expert.sum().view(1)]).cpu().tolist()
        send_splits, recv_splits, total_padded = host[:ep_degree], host[ep_degree:-1], host[-1]
        destinations, pad_rows = expert_major_rows(
            received, self.pad_multiple, sum(recv_splits), total_padded - sum(recv_splits)
        )
        # received row of every group row, pads at row 0 (zeroed after): groups are gathered, each row written once
        group_sources = torch.zeros(total_padded, dtype=torch.int64, device=x.device).index_copy_(
            0, destinations, torch.arange(destinations.shape[0], device=x.device)
        )
        token_of_row = pair_order // top_k
        rows = x.index_select(0, token_of_row)
        row_scores = scores.reshape(-1).index_select(0, pair_order)
        if self.score_before_experts:
            rows = scale_rows(rows, row_scores)
        routed = nccl_dispatch(rows, destinations, group_sources, pad_rows, send_splits, recv_splits, group.group_name)
        self._pending = _NcclDispatchState(
            token_of_row=token_of_row,
            row_scores=None if self.score_before_experts else row_scores,
            destinations=destinations,
            group_sources=group_sources,
            pad_rows=pad_rows,
            send_splits=send_splits,
            recv_splits=recv_splits,
            num_tokens=num_tokens,
        )
        return routed, rows_per_expert

    def combine(self, routed_output, group):
        from torchtitan_ext.ep.ops.nccl import nccl_combine

        state = self._take_pending()
        combined, _, _ = nccl_combine(
            routed_output, state.destinations, state.group_sources, state.pad_rows, state.token_of_row, state.row_scores,
            state.num_tokens, state.send_splits, state.recv_splits, group.group_name, self.collective_name("combine"),
        )
        return in_flight(combined)


PUBLISHED_RATES = (
    # NVIDIA publishes no large-message all-to-all bandwidth for multi-node NVLink (NVL72), and a figure of
    # one node's NVSwitch is not taken to carry over to it: there it is priced at nominal
    PublishedRate("nvlink", 370.0, 370.0, 450.0, None, None,
                  "docs/published_ep_figures.md 5.8: NCCL's effective NVLink rate for collectives other than "
                  "all-reduce, seen as busBw, 8 x H100 (the NCCL maintainer, nccl-tests issue #212)"),
    PublishedRate("rdma", 46.0, 46.0, 50.0, None, None,
                  "docs/published_ep_figures.md 5.6: nccl-tests alltoall busbw, 2 x DGX-H100, 400 Gbit/s NIC, "
                  "NVLink disabled (a user's report, DeepEP issue #3)"),
)
"""NCCL's all-to-all per kind of link, as NVIDIA and its users publish it."""


class NcclPlanningProfile(PlanningProfile):
    """The nccl backend as the planner prices it: torch.distributed's all-to-all, each (token, expert) pair its own
    row, timed by nccl-tests' alltoall_perf."""

    moves_tokens_with_collective_all_to_all = True

    @classmethod
    def communication_sms(cls, job_config) -> float | None:
        """None: NCCL picks the CTAs (one SM each) of every all-to-all at run time, up to its communicator's
        ``maxCTAs``; what they take from the GEMMs beside them is not priced."""
        return None

    @classmethod
    def published_rates(cls, job_config) -> tuple[PublishedRate, ...]:
        return PUBLISHED_RATES
