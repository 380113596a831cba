"""Inputs, ground truth and per-rank workers for the EP backend tests.

Every worker runs inside ``tests.helpers.run_distributed`` (one process per
rank) and returns plain tensors, which the tests compare with a single-process
dense MoE computed directly from the routing in fp32.
"""

import gc
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.models.moe.moe import GroupedExperts, MoE, MoEArgs

from torchtitan_ext import runtime
from torchtitan_ext.config import parse as parse_job_config
from torchtitan_ext.ep import BACKENDS as BACKEND_CLASSES
from torchtitan_ext.ep.backends import backend_variants, CPU_VARIANTS
from torchtitan_ext.ep import MoEShape
from torchtitan_ext.ep.base import Routing
from torchtitan_ext.ep.handle import DispatchHandle
from torchtitan_ext.ep.kernels.reference import ReferenceHybridEPBuffer
from torchtitan_ext.models.moe import ExpertParallelMoE, TensorParallelTokenSplit

@dataclass(frozen=True)
class Case:
    """One MoE problem, independent of the EP degree that solves it."""

    name: str
    num_experts: int
    top_k: int
    score_before_experts: bool
    total_tokens: int = 48
    hidden: int = 16
    ffn: int = 24
    seed: int = 0
    zero_scores: bool = False
    pad_multiple: int = 1
    routing: str = "random"
    """"random"; "contract_example": tokens 0-48 to expert 0, 49-95 to expert 1 (top-1);
    "all_to_one": every token picks experts 0 .. K-1 (the most skewed router)."""

    def local_experts(self, ep: int) -> int:
        return self.num_experts // ep

    def tokens_per_rank(self, ep: int) -> int:
        return self.total_tokens // ep


CASES = (
    Case("e4_top1", num_experts=4, top_k=1, score_before_experts=False, seed=1),
    Case("e4_top2_score_before", num_experts=4, top_k=2, score_before_experts=True, seed=2),
    Case("e4_top4_zero_scores", num_experts=4, top_k=4, score_before_experts=False, seed=3, zero_scores=True),
    Case("e8_top2", num_experts=8, top_k=2, score_before_experts=False, seed=4),
    Case("e12_top4_score_before", num_experts=12, top_k=4, score_before_experts=True, seed=5),
    Case("e8_top4_pad32", num_experts=8, top_k=4, score_before_experts=False, seed=6, pad_multiple=32),
)


def cases_for(ep: int) -> tuple[Case, ...]:
    return tuple(case for case in CASES if case.num_experts % ep == 0)


def global_inputs(case: Case) -> dict[str, torch.Tensor]:
    """Tokens, routing and expert weights for all ranks (fp32, from the case's seed).

    Routing leaves about a third of the experts without tokens and skews the
    rest, so ranks send and receive uneven numbers of rows.
    """
    generator = torch.Generator().manual_seed(case.seed)
    n, e, k = case.total_tokens, case.num_experts, case.top_k
    dead = torch.randperm(e, generator=generator)[: min(e - k, e // 3)]
    weights = torch.arange(1, e + 1, dtype=torch.float32) ** 2
    weights[dead] = 0.0
    ids = torch.multinomial(weights.expand(n, e), k, replacement=False, generator=generator)
    if case.routing == "contract_example":
        ids = (torch.arange(n) >= 49).long().unsqueeze(1)
    if case.routing == "all_to_one":
        ids = torch.arange(k).expand(n, k).clone()
    scores = torch.rand(n, k, generator=generator) + 0.05
    if case.zero_scores:
        scores[torch.rand(n, k, generator=generator) < 0.25] = 0.0
    return {
        "x": torch.randn(n, case.hidden, generator=generator),
        "scores": scores,
        "ids": ids,
        "grad_out": torch.randn(n, case.hidden, generator=generator),
        "w1": torch.randn(e, case.ffn, case.hidden, generator=generator) * 0.3,
        "w2": torch.randn(e, case.hidden, case.ffn, generator=generator) * 0.3,
        "w3": torch.randn(e, case.ffn, case.hidden, generator=generator) * 0.3,
    }


def dense_moe(inputs, score_before_experts: bool, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Ground truth: out[t] = sum_k expert_{id[t,k]}(x[t]) weighted by score[t,k], in fp32.

    ``keep`` [T, K] (bool) restricts the sum to the kept picks. Returns the
    output and the gradients of x, scores and expert weights for ``grad_out``.
    """
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("x", "scores", "w1", "w2", "w3")}
    x, scores = leaves["x"], leaves["scores"]
    out = torch.zeros_like(x)
    for slot in range(inputs["ids"].shape[1]):
        for expert in range(inputs["w1"].shape[0]):
            tokens = inputs["ids"][:, slot] == expert
            if keep is not None:
                tokens = tokens & keep[:, slot]
            if not tokens.any():
                continue
            score = scores[tokens, slot].unsqueeze(1)
            rows = x[tokens] * score if score_before_experts else x[tokens]
            hidden = F.silu(rows @ leaves["w1"][expert].t()) * (rows @ leaves["w3"][expert].t())
            result = hidden @ leaves["w2"][expert].t()
            out = out.index_add(0, tokens.nonzero().squeeze(1), result if score_before_experts else result * score)
    out.backward(inputs["grad_out"])
    return {"out": out.detach(), **{f"grad_{name}": leaf.grad for name, leaf in leaves.items()}}


def make_style(
    backend: str, case: Case, ep: int, capacity_factor: float | None = None,
    implementation: str = "reference", max_tokens_per_rank: int | None = None,
):
    """The backend's ExpertParallel for this case (a variant of :func:`backend_variants`), built the way training
    builds it: from a job config through the backend's ``layer_factory``."""
    args = backend_variants()[backend]
    name = args[1]
    if name != "nccl":
        args += [f"--{name}.implementation", implementation]
    if capacity_factor is not None:
        args += ["--hybridep.non_blocking_capacity_factor", str(capacity_factor)]
    shape = MoEShape(
        hidden_dim=case.hidden, num_experts=case.num_experts, top_k=case.top_k,
        max_tokens_per_rank=max_tokens_per_rank or case.tokens_per_rank(ep),
    )
    make_layer = BACKEND_CLASSES[name].layer_factory(parse_job_config(args), shape)
    return make_layer(score_before_experts=case.score_before_experts, pad_multiple=case.pad_multiple)


def _rank_slice(rank: int, case: Case, ep: int) -> slice:
    n = case.tokens_per_rank(ep)
    return slice(rank * n, (rank + 1) * n)


def _experts(case: Case, inputs, grouped_mm: bool = False) -> GroupedExperts:
    experts = GroupedExperts(case.hidden, case.ffn, case.num_experts, use_grouped_mm=grouped_mm)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(experts, name).copy_(inputs[name])
    return experts


def run_backend(
    rank: int, ep: int, case: Case, backend: str, mesh, *,
    device: str = "cpu", dtype: torch.dtype = torch.float32, grouped_mm: bool = False, **style_kwargs,
) -> dict:
    """Forward + backward of one backend on this rank's tokens; outputs and gradients (fp32, CPU).

    ``grouped_mm``: the experts run torchtitan's grouped GEMM, which reads the
    group sizes on the device (the loop path reads them on the host).
    """
    inputs = {k: v.to(device) for k, v in global_inputs(case).items()}
    experts = _experts(case, inputs, grouped_mm).to(device=device, dtype=dtype)
    style = make_style(backend, case, ep, **style_kwargs)
    parallelize_module(experts, mesh, style)
    rows = _rank_slice(rank, case, ep)
    x = inputs["x"][rows].to(dtype).clone().requires_grad_()
    scores = inputs["scores"][rows].clone().requires_grad_()
    out = experts(x, Routing(scores, inputs["ids"][rows]))
    out.backward(inputs["grad_out"][rows].to(dtype))
    local = slice(rank * case.local_experts(ep), (rank + 1) * case.local_experts(ep))
    result = {
        "out": out.detach().clone(),  # an op: waits for a combine still in flight
        "grad_x": x.grad,
        "grad_scores": scores.grad,
        "experts": local,
        "rows": rows,
        **{f"grad_{name}": getattr(experts, name).grad.to_local() for name in ("w1", "w2", "w3")},
    }
    result = {k: v.float().cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()}
    if style.stats.kept_pairs is not None:  # a backend that can drop counts the pairs it kept
        # what the metrics compute, for this rank's experts: the pairs routed to them from every rank
        # less the pairs they kept
        routed = int(((inputs["ids"] >= local.start) & (inputs["ids"] < local.stop)).sum())
        result["dropped_pairs"] = routed - int(style.stats.kept_pairs)
    return result


def conformance_worker(
    rank: int, ep: int, backends=CPU_VARIANTS, implementation: str = "reference",
    device: str = "cpu", dtype: torch.dtype = torch.float32,
) -> dict:
    mesh = init_device_mesh(device, (ep,), mesh_dim_names=("ep",))
    return {
        (case.name, backend): run_backend(
            rank, ep, case, backend, mesh, device=device, dtype=dtype, implementation=implementation
        )
        for case in cases_for(ep)
        for backend in backends
    }


# ---- HybridEP layout and drop rule (library-level calls) ----------------------------


def dense_routing(ids: torch.Tensor, scores: torch.Tensor, num_experts: int):
    routing_map = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool).scatter(1, ids, True)
    probs = torch.zeros(ids.shape[0], num_experts).scatter(1, ids, scores)
    return routing_map, probs


def hybridep_layout_worker(rank: int, ep: int, case: Case, capacity_factors: tuple) -> dict:
    """dispatch_with_permute / combine_with_unpermute of the reference buffer, blocking and
    non-blocking at each capacity factor."""
    import torch.distributed as dist

    inputs = global_inputs(case)
    rows = _rank_slice(rank, case, ep)
    routing_map, probs = dense_routing(inputs["ids"][rows], inputs["scores"][rows], case.num_experts)
    buffer = ReferenceHybridEPBuffer(
        dist.group.WORLD, case.hidden, case.tokens_per_rank(ep), case.local_experts(ep), dtype=torch.float32
    )
    results = {}
    for factor in (None, *capacity_factors):
        from torchtitan_ext.ep.hybridep import non_blocking_rows

        num_rows = None
        if factor is not None:
            num_rows = non_blocking_rows(
                case.tokens_per_rank(ep), ep, case.local_experts(ep), case.top_k, factor, case.pad_multiple
            )
        tokens, out_probs, _, tokens_per_expert, handle = buffer.dispatch_with_permute(
            hidden=inputs["x"][rows], routing_map=routing_map, probs=probs,
            num_of_experts_per_rank=case.local_experts(ep), num_permuted_tokens=num_rows,
            pad_multiple=case.pad_multiple, non_blocking=factor is not None,
        )
        # the expert "output" of a row is the row itself: combine sums each token's kept rows
        combined, combined_probs = buffer.combine_with_unpermute(hidden=tokens, probs=out_probs, handle=handle)
        results[factor] = {
            "tokens": tokens,
            "probs": out_probs,
            "tokens_per_expert": tokens_per_expert,
            "overflow_flag": int(handle.overflow_flag),
            "num_dropped": int(handle.num_dropped),
            "combined": combined,
            "combined_probs": combined_probs,
            "regrowths": buffer.regrowths,
        }
    return results


def contract_layout(case: Case, ep: int, rank: int, num_rows: int | None):
    """The contract's layout for one rank, computed by enumeration.

    Returns (rows as {row: (global token, local expert)}, padded counts
    truncated at M, M, kept pairs as a set of (global token, local expert)).
    """
    inputs = global_inputs(case)
    local = case.local_experts(ep)
    pad = case.pad_multiple
    layout, kept, offset, padded_counts = {}, set(), 0, []
    for expert in range(local):
        column = rank * local + expert
        tokens = [g for g in range(case.total_tokens) if column in inputs["ids"][g].tolist()]
        padded = -(-len(tokens) // pad) * pad
        for i, g in enumerate(tokens):
            layout[offset + i] = (g, expert)
        padded_counts.append(padded)
        offset += padded
    total = offset
    limit = total if num_rows is None else num_rows
    for row, pair in list(layout.items()):
        if row < limit:
            kept.add(pair)
        else:
            del layout[row]
    starts = [sum(padded_counts[:e]) for e in range(local)]
    truncated = [max(0, min(padded_counts[e], limit - starts[e])) for e in range(local)]
    return layout, truncated, limit, kept


# ---- handles and activation-checkpoint recompute ------------------------------------------


class _CheckpointedExperts(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, scores, ids):
        return self.experts(x, Routing(scores, ids))


_COLLECTIVES = ("all_to_all", "alltoall", "all_gather", "allgather", "all_reduce", "allreduce", "reduce_scatter")


class CollectiveCounter(TorchDispatchMode):
    """Counts communicating ops: c10d collectives and the backends' kernel ops
    (whose collectives run inside them, out of this mode's sight)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        # count_once only adds to the device counters (and not while recomputing)
        if (func.namespace == "torchtitan_ext" and "count_once" not in name) or (
            func.namespace in ("c10d", "_c10d_functional") and any(c in name for c in _COLLECTIVES)
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


_handles = weakref.WeakSet()


def _track_handles() -> None:
    """Record every DispatchHandle created from now on (weakly)."""
    original = DispatchHandle.__init__

    def tracked(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _handles.add(self)

    DispatchHandle.__init__ = tracked


def _live_handles() -> int:
    """Handles still referenced, without a garbage collection: a reference cycle counts as a leak."""
    return len(_handles)


def checkpoint_worker(rank: int, ep: int, case: Case, iterations: int) -> dict:
    """Collectives in backward and live handles after many checkpointed iterations.

    For each backend and AC mode (none, per-op selective with the backend's
    save list, full), run ``iterations`` forward+backward steps and count the
    collectives issued during backward (recomputation happens there).
    """
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import _apply_full_ac, _apply_op_sac
    from torchtitan.models.deepseek_v3.infra.parallelize import _op_sac_save_list

    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    inputs = global_inputs(case)
    rows = _rank_slice(rank, case, ep)
    _track_handles()
    gc.disable()  # as in torchtitan's training loop: leaks may not hide behind a collection
    results = {}
    for backend in CPU_VARIANTS:
        for mode in ("none", "selective_op", "full"):
            experts = _experts(case, inputs)
            style = make_style(backend, case, ep)
            parallelize_module(experts, mesh, style)
            module = _CheckpointedExperts(experts)
            ac = ActivationCheckpoint(mode="selective", selective_ac_option="op")
            if mode == "selective_op":
                module = _apply_op_sac(module, ac, op_sac_save_list=_op_sac_save_list | set(style.sac_save_ops()))
            elif mode == "full":
                module = _apply_full_ac(module, ac)
            backward_collectives, live_before_backward = [], []
            for _ in range(iterations):
                x = inputs["x"][rows].clone().requires_grad_()
                scores = inputs["scores"][rows].clone().requires_grad_()
                out = module(x, scores, inputs["ids"][rows])
                live_before_backward.append(_live_handles())
                counter = CollectiveCounter()
                with counter:
                    out.backward(inputs["grad_out"][rows])
                backward_collectives.append(counter.count)
                del out, x, scores
            results[(backend, mode)] = {
                "backward_collectives": backward_collectives,
                "live_before_backward": live_before_backward,
                "live_handles": _live_handles(),
                "pending_state": style._pending is not None,
                "unlanded_combines": torch._C._distributed_c10d._get_work_registry_size(),
            }
    return results


# ---- shared experts overlapping combine ----------------------------------------------------


def _moe_with_shared_experts(case: Case) -> MoE:
    """torchtitan's MoE (one shared expert), identical weights on every rank."""
    args = MoEArgs(
        num_experts=case.num_experts, num_shared_experts=1, top_k=case.top_k,
        score_before_experts=case.score_before_experts, use_grouped_mm=False,
    )
    torch.manual_seed(case.seed)
    moe = MoE(args, dim=case.hidden, hidden_dim=case.ffn)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(std=0.5)
    return moe


def overlap_worker(
    rank: int, ep: int, case: Case, backends: tuple, peer_wait_s: dict, borrowing_tp: bool = False
) -> dict:
    """Per backend: whether rank 0's shared experts start while its combine is in flight.

    Rank 1 holds its combine back until rank 0's shared experts have started,
    waiting at most ``peer_wait_s[backend]`` seconds. A combine that has landed
    when the experts return needs rank 1's rows first, so rank 0 can only get to
    its shared experts after rank 1 gave up waiting: rank 1 then reports False.
    Also returns each rank's MoE output and input gradient, and the same
    computed with every combine landed before the shared experts run.

    ``borrowing_tp``: EP borrows the TP ranks: every rank holds all tokens and
    dispatches its slice (the MoE's token split), as with
    tensor_parallel_degree = expert_parallel_degree and expert TP off.
    """
    runtime.configure()  # the router's torch.histc on int64 ids
    store = dist.distributed_c10d._get_default_store()
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    x_all = torch.randn(case.total_tokens, case.hidden, generator=torch.Generator().manual_seed(case.seed))
    x_rank = (x_all if borrowing_tp else x_all[_rank_slice(rank, case, ep)]).view(1, -1, case.hidden)
    results = {}
    for backend in backends:
        moe = _moe_with_shared_experts(case)
        key = f"shared experts started: {backend}"
        signalled = []
        if rank == 0:
            hook = moe.shared_experts.register_forward_pre_hook(lambda *_: store.set(key, "yes"))
        else:
            def hold_combine(*_):
                try:
                    store.wait([key], timedelta(seconds=peer_wait_s[backend]))
                    signalled.append(True)
                except RuntimeError:  # the wait timed out
                    signalled.append(False)

            hook = moe.experts.register_forward_hook(hold_combine)  # runs before the EP style's combine hook
        parallelize_module(moe.experts, mesh, make_style(backend, case, ep))
        split = TensorParallelTokenSplit(mesh) if borrowing_tp else None
        ExpertParallelMoE.adopt(moe, split)
        x = x_rank.clone().requires_grad_()
        out = moe(x)
        out.sum().backward()
        hook.remove()  # the sequential pass below holds nothing back

        x_sequential = x_rank.clone().requires_grad_()
        flat = x_sequential.view(-1, case.hidden)
        top_scores, expert_ids, _ = moe.router(flat, moe.expert_bias)
        if split is None:
            routed = moe.experts(flat, Routing(top_scores, expert_ids)).clone()  # an op: lands the combine first
        else:
            routing = Routing(split.split(top_scores), split.split(expert_ids))
            routed = split.unsplit(moe.experts(split.split(flat), routing).clone())
        sequential = (moe.shared_experts(flat) + routed).view_as(x_sequential)
        sequential.sum().backward()
        results[backend] = {
            "signalled": signalled[0] if signalled else None,
            "out": out.detach().clone(),
            "grad_x": x.grad,
            "sequential_out": sequential.detach().clone(),
            "sequential_grad_x": x_sequential.grad,
        }
    return results


def with_pad(case: Case, pad_multiple: int) -> Case:
    return replace(case, name=f"{case.name}_pad{pad_multiple}", pad_multiple=pad_multiple)

