"""NCCL EP's double (torchtitan_ext/ep/kernels/nccl_ep_double.py) against the pinned facade and the library's rules.

The signatures, dataclass fields and enum values the adapter relies on equal those of the nccl-extensions 0.1.0
wheel (:data:`FACADE`, read from its ``nccl/ep`` sources); the expert-major layout, drop rule and counters equal an
oracle written here from ``nccl_ep.h`` and ``scan_kernel.cuh``'s ``em_populate_cnt_tensors``; each rule the library
asserts is refused with its own words. Everything here runs in a group of this process alone: the conformance
cases (tests/ep/test_conformance.py) run the double at EP 1, 2 and 4.
"""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from torchtitan_ext.ep.kernels import nccl_ep_double as ep

WHEEL = "nccl-extensions 0.1.0 (nccl/ep/group.py, handle.py, tensor.py, enums.py, interop/torch.py)"
FACADE = {
    "Group.create": "(comm, config)",
    "Group.create_handle": "(self, layout, topk_idx, *, layout_info=None, config=None, stream)",
    "Group.destroy": "(self)",
    "Handle.update": "(self, topk_idx, *, layout_info=None, stream)",
    "Handle.dispatch": "(self, inputs, outputs, *, layout_info=None, config=None, stream)",
    "Handle.combine": "(self, inputs, outputs, *, config=None, stream)",
    "Handle.complete": "(self, *, config=0, stream)",
    "Handle.destroy": "(self)",
    "Tensor.__init__": "(self, buffer, *, dtype=None, shape=None, window=None, window_offset=None)",
    "get_nccl_comm_from_group": "(group=None)",
}
"""The calls the adapter makes, as the wheel defines them (annotations left out)."""
FIELDS = {
    "GroupConfig": ("algorithm", "num_experts", "max_dispatch_tokens_per_rank", "max_recv_tokens_per_rank",
                    "max_token_bytes", "rdma_buffer_size", "num_qp_per_rank", "num_channels", "max_num_sms", "alloc",
                    "enable_mask", "timeout_ns", "zero_copy", "overflow_policy", "num_topk"),
    "HandleConfig": ("dispatch_output_per_expert_alignment",),
    "DispatchConfig": ("send_only", "round_scales", "pass_direction", "quantization_recipe"),
    "CombineConfig": ("send_only", "pass_direction", "quantization_recipe"),
    "LayoutInfo": ("expert_counters", "src_rank_counters", "expert_offsets", "recv_total_counter", "recv_topk_idx_kind"),
    "DispatchInputs": ("tokens", "topk_weights", "scales"),
    "DispatchOutputs": ("tokens", "topk_weights", "scales", "topk_idx"),
    "CombineInputs": ("tokens", "topk_weights", "scales"),
    "CombineOutputs": ("tokens", "topk_weights"),
}
ENUMS = {
    "Algorithm": {"LOW_LATENCY": 0, "HIGH_THROUGHPUT": 1},
    "Layout": {"UNSET": 0, "EXPERT_MAJOR": 1, "RANK_MAJOR": 2, "FLAT": 3},
    "PassDir": {"FWD": 0, "BWD": 1},
    "OverflowPolicy": {"AUTO": 0, "TRAP": 1, "DROP": 2},
    "ZeroCopyMode": {"AUTO": 0, "OFF": 1, "ON": 2},
    "DispatchQuantizationRecipe": {"NONE": 0, "FWD": 1, "DS_FP8E3M4": 2},
    "CombineQuantizationRecipe": {"NONE": 0, "NVFP4": 1},
}


def _signature(function) -> str:
    parameters = [parameter.replace(annotation=inspect.Parameter.empty)
                  for parameter in inspect.signature(function).parameters.values()]
    return str(inspect.Signature(parameters))


def test_the_double_has_the_facades_calls_fields_and_enums():
    for name, expected in FACADE.items():
        owner, _, attribute = name.rpartition(".")
        function = getattr(getattr(ep, owner), attribute) if owner else getattr(ep, attribute)
        assert _signature(function) == expected, (name, WHEEL)
    for name, fields in FIELDS.items():
        assert tuple(field.name for field in dataclasses.fields(getattr(ep, name))) == fields, name
    for name, members in ENUMS.items():
        assert {member.name: member.value for member in getattr(ep, name)} == members, name
    assert (ep.LIBRARY_VERSION, ep.API_VERSION, ep.FACADE_VERSION) == ("0.2.0", 2, "0.1.0")


def test_the_double_imports_nothing_of_the_project():
    tree = ast.parse(Path(ep.__file__).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(module.startswith("torchtitan_ext") for module in modules)


def _group(world, **overrides):
    config = dict(algorithm=ep.Algorithm.HIGH_THROUGHPUT, num_experts=4, max_dispatch_tokens_per_rank=6,
                  max_token_bytes=16 * 4, num_topk=2)
    return ep.Group.create(ep.get_nccl_comm_from_group(world), ep.GroupConfig(**{**config, **overrides}))


def _layout(handle_group, ids, alignment):
    counters, offsets, total = (torch.full((4,), -1, dtype=torch.int64), torch.full((4,), -1, dtype=torch.int64),
                                torch.zeros(1, dtype=torch.int64))
    info = ep.LayoutInfo(expert_counters=ep.Tensor(counters), expert_offsets=ep.Tensor(offsets),
                         recv_total_counter=ep.Tensor(total))
    handle = handle_group.create_handle(ep.Layout.EXPERT_MAJOR, ep.Tensor(ids), layout_info=info,
                                        config=ep.HandleConfig(alignment), stream=0)
    return handle, counters, offsets, int(total)


IDS = torch.tensor([[2, 0], [0, 3], [2, 0], [3, 2], [0, 2]])
"""Expert 0: tokens 0, 1, 2, 4; expert 1: none; expert 2: tokens 0, 2, 3, 4; expert 3: tokens 1, 3."""


def _oracle(alignment: int, budget: int | None):
    """Zones from nccl_ep.h and em_populate_cnt_tensors: (padded counts, zone starts, true total, {slot: (token,
    pick)}) with slots at or above the budget dropped, and the reported counts and offsets clamped to it."""
    pairs = {e: [(t, k) for t in range(IDS.shape[0]) for k in range(2) if IDS[t, k] == e] for e in range(4)}
    padded = [-(-len(p) // alignment) * alignment for p in pairs.values()]
    starts = [sum(padded[:e]) for e in range(4)]
    total = sum(padded)
    capacity = total if budget is None else budget
    slots = {starts[e] + i: pair for e, p in pairs.items() for i, pair in enumerate(p) if starts[e] + i < capacity}
    reported = [min(padded[e], max(capacity - starts[e], 0)) for e in range(4)]
    return reported, [min(s, capacity) for s in starts], total, slots, capacity


@pytest.mark.parametrize("alignment, budget", [(1, None), (4, None), (1, 7), (4, 9)])
def test_expert_major_layout_drop_rule_and_counters(world_of_one, alignment, budget):
    group = _group(world_of_one, max_recv_tokens_per_rank=budget or 0,
                   overflow_policy=ep.OverflowPolicy.DROP if budget else ep.OverflowPolicy.AUTO)
    handle, counters, offsets, total = _layout(group, IDS, alignment)
    reported, starts, true_total, slots, capacity = _oracle(alignment, budget)
    assert (counters.tolist(), offsets.tolist(), total) == (reported, starts, true_total)
    tokens = torch.arange(1.0, 6.0).repeat_interleave(16).view(5, 16)
    weights = torch.tensor([[0.5, 0.25], [0.125, 0.75], [1.5, 2.5], [3.0, 4.0], [5.0, 6.0]])
    out = torch.full((capacity, 16), float("nan"))
    out_weights = torch.full((capacity,), float("nan"))
    handle.dispatch(ep.DispatchInputs(tokens=ep.Tensor(tokens), topk_weights=ep.Tensor(weights)),
                    ep.DispatchOutputs(tokens=ep.Tensor(out), topk_weights=ep.Tensor(out_weights)), stream=0)
    for slot in range(capacity):
        if slot in slots:
            token, pick = slots[slot]
            assert out[slot].eq(token + 1).all() and out_weights[slot] == weights[token, pick]
        elif slot < sum(reported):  # a padding slot: its token row and weight zeroed (ht_ep.cuh's local permute)
            assert out[slot].eq(0).all() and out_weights[slot] == 0
    combined = torch.empty(5, 16)
    rows = torch.nan_to_num(out, nan=0.0)
    grad_weights = torch.arange(capacity, dtype=torch.float32)
    combined_weights = torch.empty(5, 2)
    handle.combine(ep.CombineInputs(tokens=ep.Tensor(rows), topk_weights=ep.Tensor(grad_weights)),
                   ep.CombineOutputs(tokens=ep.Tensor(combined), topk_weights=ep.Tensor(combined_weights)),
                   config=ep.CombineConfig(pass_direction=ep.PassDir.BWD), stream=0)
    kept = {pair: slot for slot, pair in slots.items()}
    for token in range(5):
        kept_picks = [k for k in range(2) if (token, k) in kept]
        assert combined[token].eq((token + 1) * len(kept_picks)).all()
        assert combined_weights[token].tolist() == [float(kept[token, k]) if (token, k) in kept else 0.0 for k in range(2)]


def test_the_librarys_rules_in_its_words(world_of_one):
    refusals = (
        (dict(max_token_bytes=24), "must be a multiple of 16 bytes"),
        (dict(max_recv_tokens_per_rank=4), "requires max_recv_tokens_per_rank >= max_dispatch_tokens_per_rank"),
        (dict(overflow_policy=ep.OverflowPolicy.DROP), "eager mode .* does not support NCCL_EP_OVERFLOW_DROP"),
    )
    for overrides, message in refusals:
        with pytest.raises(AssertionError, match=message):
            _group(world_of_one, **overrides)
    group = _group(world_of_one)
    with pytest.raises(AssertionError, match="must be a power of two"):
        _layout(group, IDS, 3)
    with pytest.raises(AssertionError, match="Token count exceeds HT buffer capacity"):
        _layout(group, torch.zeros(7, 2, dtype=torch.int64), 1)
    handle, *_ = _layout(group, IDS, 1)
    tokens, out = torch.ones(5, 16), torch.empty(8, 16)
    with pytest.raises(AssertionError, match="topk_weights_in != nullptr"):  # forward needs the weights
        handle.dispatch(ep.DispatchInputs(tokens=ep.Tensor(tokens)), ep.DispatchOutputs(tokens=ep.Tensor(out)), stream=0)
    with pytest.raises(AssertionError, match="topk_weights_in == nullptr"):  # backward forbids them
        handle.dispatch(ep.DispatchInputs(tokens=ep.Tensor(tokens), topk_weights=ep.Tensor(torch.ones(5, 2))),
                        ep.DispatchOutputs(tokens=ep.Tensor(out)),
                        config=ep.DispatchConfig(pass_direction=ep.PassDir.BWD), stream=0)
    with pytest.raises(AssertionError, match="16B aligned for TMA"):
        handle.dispatch(ep.DispatchInputs(tokens=ep.Tensor(torch.ones(5, 3))), ep.DispatchOutputs(tokens=ep.Tensor(out)),
                        config=ep.DispatchConfig(pass_direction=ep.PassDir.BWD), stream=0)
    trapping = _group(world_of_one, max_recv_tokens_per_rank=6, overflow_policy=ep.OverflowPolicy.TRAP)
    with pytest.raises(AssertionError, match="padded EM slots 10 > max_recv_tokens_per_rank 6"):
        _layout(trapping, IDS, 1)


def _ncclep_layer(factor=None, tokens=5):
    """The ncclep backend's style (4 experts, top-2, hidden 16, ``tokens`` per rank), built from a job config as
    training builds it, with its experts."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.models.moe.moe import GroupedExperts

    from torchtitan_ext.config import MoEShape, parse
    from torchtitan_ext.ep.ncclep import NcclEPExpertParallel

    args = ["--parallelism.expert_parallel_comm_backend", "ncclep", "--ncclep.implementation", "reference"]
    if factor is not None:
        args += ["--ncclep.max_recv_capacity_factor", str(factor)]
    shape = MoEShape(hidden_dim=16, num_experts=4, top_k=2, max_tokens_per_rank=tokens)
    style = NcclEPExpertParallel.layer_factory(parse(args), shape)(score_before_experts=False)
    experts = parallelize_module(GroupedExperts(16, 8, 4, use_grouped_mm=False), DeviceMesh("cpu", [0]), style)
    return experts, style


def test_one_handle_serves_every_step_and_the_budget_counts_its_drops(world_of_one, monkeypatch):
    """The group is created once and its handle rebound each step, not created again. 40 tokens each to experts 0
    and 2 under a budget of 72 slots (factor 0.5: 40 x min(4, 2) x 0.5 = 40 pairs, and 4 x 7 padding rows, to a
    multiple of 8): expert 0's zone holds slots 0-39, expert 2's starts at 40 and keeps 32 of its 40 pairs, so the
    metrics read 72 kept pairs per step."""
    from torchtitan_ext.ep.base import Routing

    calls = {"create_handle": 0, "update": 0}
    for owner, name in ((ep.Group, "create_handle"), (ep.Handle, "update")):
        original = getattr(owner, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    experts, style = _ncclep_layer(factor=0.5, tokens=40)
    ids = torch.tensor([[0, 2]]).expand(40, 2)
    for step in range(3):
        tokens = torch.randn(40, 16, requires_grad=True)
        experts(tokens, Routing(torch.rand(40, 2), ids)).sum().backward()
    assert calls == {"create_handle": 1, "update": 3}  # the double's create_handle binds the first routing by update
    assert int(style.stats.kept_pairs) == 3 * 72
