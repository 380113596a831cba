"""Per-rank workers that run the deep_ep adapters against the library's test double.

Each worker imports tests/ep/deep_ep_double/deep_ep as ``deep_ep`` (:func:`use_double`) (with the build it
stands for) and lets the adapters use it on the CPU, in place of the CUDA
library. The backends then run exactly the code they run on a cluster with
``implementation = "deep_ep"``; the double computes with arithmetic of its own.
"""

import importlib.machinery
import importlib.util
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from tests.ep.cases import _experts, _rank_slice, Case, global_inputs, make_style, run_backend
from torchtitan_ext.ep.backends import LIBRARY_VARIANTS

DOUBLE_DIR = Path(__file__).resolve().parent / "deep_ep_double"


def stand_in_cuda_home() -> Path:
    """A folder whose bin/nvcc is an executable that does nothing (the double checks that it is there)."""
    home = Path(tempfile.gettempdir()) / "deep_ep_double_cuda_home"
    nvcc = home / "bin" / "nvcc"
    if not nvcc.is_file():
        nvcc.parent.mkdir(parents=True, exist_ok=True)
        nvcc.write_text("#!/bin/sh\nexit 0\n")
        nvcc.chmod(0o755)
    return home


BUILD_CLASSES = {"main": ("ElasticBuffer", "Buffer"), "hybrid-ep": ("Buffer", "HybridEPBuffer"), "v2.5": ("EPBuffer",)}
"""The deep_ep classes each build of the library has: main the V2 and v1 APIs, the hybrid-ep branch v1 and
HybridEP, V2.5 its EPBuffer only."""
LIBRARY_BACKENDS = {build: tuple(variant for library_class in classes for variant in LIBRARY_VARIANTS[library_class])
                    for build, classes in BUILD_CLASSES.items()}
"""What each build of the library serves (backend variants)."""

DROPPING_FACTOR = 0.3
"""A non-blocking capacity factor at which the double's cases drop pairs."""


def use_double(build: str) -> None:
    """In this process, ``import deep_ep`` is the double of ``build``, and the adapters may use it on CPU.

    HybridEP compiles its kernels at the first dispatch: a stand-in ``$CUDA_HOME/bin/nvcc`` is provided."""
    os.environ["DEEP_EP_DOUBLE_BUILD"] = build
    if "deep_ep" not in sys.modules:  # the double, whatever else the machine has installed
        spec = importlib.machinery.PathFinder.find_spec("deep_ep", [str(DOUBLE_DIR)])
        sys.modules["deep_ep"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    os.environ["CUDA_HOME"] = str(stand_in_cuda_home())
    import torchtitan_ext.ep.kernels as kernels

    kernels.LIBRARY_DEVICE_TYPE = "cpu"


def adapters_worker(rank: int, ep: int, build: str, cases: tuple, ac_case: Case) -> dict:
    """Every backend the build serves, through the double (bf16, grouped GEMM experts) and through
    the reference (same dtype), per case; then checkpointed iterations, deterministic mode, and the
    dispatch modes active when the buffers were created."""
    use_double(build)
    from deep_ep import _double

    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    results = {}
    for case in cases:
        for backend in LIBRARY_BACKENDS[build]:
            for implementation in ("deep_ep", "reference"):
                results[case.name, backend, implementation] = run_backend(
                    rank, ep, case, backend, mesh, dtype=torch.bfloat16, grouped_mm=True,
                    implementation=implementation,
                )
        if build == "hybrid-ep":  # non-blocking with too few rows: the dropped count through the library
            for implementation in ("deep_ep", "reference"):
                results[case.name, "hybridep_drops", implementation] = run_backend(
                    rank, ep, case, "hybridep", mesh, dtype=torch.bfloat16, grouped_mm=True,
                    implementation=implementation, capacity_factor=DROPPING_FACTOR,
                )
    results["checkpointing"] = _checkpointed_runs(rank, ep, build, ac_case, mesh)
    torch.use_deterministic_algorithms(True)  # what torchtitan's debug.deterministic turns on
    try:
        results["deterministic"] = {
            backend: run_backend(rank, ep, ac_case, backend, mesh, dtype=torch.bfloat16, implementation="deep_ep")["out"]
            for backend in LIBRARY_BACKENDS[build]
        }
    finally:
        torch.use_deterministic_algorithms(False)
    results["creation_mode_stacks"] = list(_double.CREATION_MODE_STACKS)
    return results


def _checkpointed_runs(rank, ep, build, case, mesh) -> dict:
    """Forward + backward under per-op selective and full activation checkpointing (the buffer is
    created inside the checkpointed region, at the first dispatch)."""
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import _apply_full_ac, _apply_op_sac
    from torchtitan.models.deepseek_v3.infra.parallelize import _op_sac_save_list

    from tests.ep.cases import _CheckpointedExperts

    inputs = global_inputs(case)
    rows = _rank_slice(rank, case, ep)
    results = {}
    for backend in LIBRARY_BACKENDS[build]:
        for mode in ("selective_op", "full"):
            experts = _experts(case, inputs, grouped_mm=True).to(torch.bfloat16)
            style = make_style(backend, case, ep, implementation="deep_ep")
            parallelize_module(experts, mesh, style)
            module = _CheckpointedExperts(experts)
            ac = ActivationCheckpoint(mode="selective", selective_ac_option="op")
            if mode == "selective_op":
                module = _apply_op_sac(module, ac, op_sac_save_list=_op_sac_save_list | set(style.sac_save_ops()))
            else:
                module = _apply_full_ac(module, ac)
            x = inputs["x"][rows].to(torch.bfloat16).requires_grad_()
            scores = inputs["scores"][rows].clone().requires_grad_()
            out = module(x, scores, inputs["ids"][rows])
            out.backward(inputs["grad_out"][rows].to(torch.bfloat16))
            results[backend, mode] = {"out": out.detach().float(), "grad_x": x.grad.float(), "grad_scores": scores.grad}
    return results


def fp32_worker(rank: int, ep: int, build: str, case: Case) -> dict:
    """What each backend says when fp32 tokens reach the library."""
    use_double(build)
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    errors = {}
    for backend in LIBRARY_BACKENDS[build]:
        try:
            run_backend(rank, ep, case, backend, mesh, dtype=torch.float32, implementation="deep_ep")
            errors[backend] = None
        except (TypeError, RuntimeError) as e:
            errors[backend] = f"{type(e).__name__}: {e}"
    return errors


def waits_and_collectives(counter) -> dict[str, int]:
    """What a device-cost count saw that makes a GPU wait or communicate: host syncs, blocking host-to-device
    copies and collectives by kind."""
    events = Counter()
    for costs in counter.costs.values():
        events.update(kind.split(" at ")[0] for kind in costs.host_syncs.elements())
        events.update(kind.split(" at ")[0] for kind in costs.h2d_copies.elements() if kind.startswith("blocking"))
        events.update(kind for kind, *_ in costs.collectives)
    return dict(events)


def host_sync_worker(rank: int, ep: int, build: str, case: Case, inject: str | None = None) -> dict:
    """Per backend the build serves: one MoE layer's forward + backward counted by the device-cost ledger's
    counter (:class:`~torchtitan_ext.measuring.device_cost_counter.DeviceCostCounter`), with the host syncs the double
    reports the library making, and the backend's budget for the layer (forward and backward together).

    The experts are torchtitan's grouped GEMM, which reads nothing on the host.
    ``inject``: a backend whose dispatch op reads a device scalar inside its body (the counter's control).
    """
    from tests.ep.cases import Routing
    from torchtitan_ext.config import parse
    from torchtitan_ext.ep.backends import backend_variants, BACKENDS
    from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter

    use_double(build)
    from deep_ep import _double

    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    inputs = global_inputs(case)
    rows = _rank_slice(rank, case, ep)
    results = {}
    for backend in LIBRARY_BACKENDS[build]:
        experts = _experts(case, inputs, grouped_mm=True).to(torch.bfloat16)
        style = make_style(backend, case, ep, implementation="deep_ep")
        parallelize_module(experts, mesh, style)
        if inject == backend:
            import torchtitan_ext.ep.ops.hybridep as hybridep

            padded_rows = hybridep._padded_rows

            def padded_rows_reading_a_scalar(tensor, num_rows, _padded_rows=padded_rows):
                tensor.sum().item()
                return _padded_rows(tensor, num_rows)

            # called inside the dispatch op's body, and in combine's backward (a cached dispatch)
            hybridep._padded_rows = padded_rows_reading_a_scalar
        x = inputs["x"][rows].to(torch.bfloat16).requires_grad_()
        scores = inputs["scores"][rows].clone().requires_grad_()
        experts(x, Routing(scores, inputs["ids"][rows])).sum().backward()  # builds the buffer outside the count
        reported = []
        _double.LISTENERS.append(reported.append)
        with DeviceCostCounter() as counter:
            out = experts(x, Routing(scores, inputs["ids"][rows]))
            out.backward(inputs["grad_out"][rows].to(torch.bfloat16))
        _double.LISTENERS.remove(reported.append)
        args = backend_variants()[backend]
        budget = BACKENDS[args[1]].device_budget(parse(args))
        (costs,) = counter.costs.values()
        results[backend] = {"costs": costs, "double_syncs": reported.count("host_sync"),
                            "budget": budget.forward + budget.backward}
    return results


def _trained_steps(rank: int, ep: int, case: Case, backend: str, mesh, steps: int = 1):
    """One backend's experts module (kept by the caller, as a model keeps its layers) after ``steps``
    forward-backward passes through the library."""
    from tests.ep.cases import Routing

    inputs = global_inputs(case)
    experts = _experts(case, inputs, grouped_mm=True).to(torch.bfloat16)
    parallelize_module(experts, mesh, make_style(backend, case, ep, implementation="deep_ep"))
    rows = _rank_slice(rank, case, ep)
    for _ in range(steps):
        x = inputs["x"][rows].to(torch.bfloat16).requires_grad_()
        scores = inputs["scores"][rows].clone().requires_grad_()
        experts(x, Routing(scores, inputs["ids"][rows])).sum().backward()
    return experts


def lifetime_worker(rank: int, ep: int, build: str, case: Case) -> list[bool]:
    """Every backend the build serves, its layers alive to the end; each library buffer's explicitly_destroy
    flag. The harness then ends as a training run does (destroy_kernel_buffers, then the process group),
    which the double checks."""
    use_double(build)
    from deep_ep import _double

    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    _KEPT.extend(_trained_steps(rank, ep, case, backend, mesh) for backend in LIBRARY_BACKENDS[build])
    return [buffer.explicitly_destroy for buffer in _double._state().live]


_KEPT: list = []
"""The layers of :func:`lifetime_worker`, alive until its process ends (as a model's until training ends)."""


def unmeasurable_bandwidth_worker(rank: int, ep: int, case: Case) -> dict:
    """V2 with num_sms unset, where the library reads 0 GB/s for RDMA across two "nodes" of one rank each:
    one layer, two steps; the SM count it dispatched with, and the warnings about it."""
    import logging

    os.environ["DEEP_EP_DOUBLE_DETECTED_GBPS"] = "0"
    os.environ["DEEP_EP_DOUBLE_RANKS_PER_NODE"] = "1"
    use_double("main")
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    try:
        experts = _trained_steps(rank, ep, case, "deepep", init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)), 2)
    finally:
        logging.getLogger().removeHandler(handler)
    from torchtitan_ext.ep.base import _created_buffers

    sms = [buffer._buffer.value.num_sms for buffer in _created_buffers if buffer._buffer is not None]
    del experts  # kept alive until here: its style holds the shared buffer
    return {"num_sms": sms, "warnings": sum("could not estimate its SM count" in w for w in warnings)}


def fresh_group_worker(rank: int, ep: int) -> dict:
    """An ElasticBuffer through the adapter on a process group that has run no collective yet: whether it
    was destroyed, and the adapter's log lines."""
    import logging

    import torch.distributed as dist

    use_double("main")
    from torchtitan_ext.config import MoEShape
    from torchtitan_ext.ep.kernels.deep_ep import elastic_buffer

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    try:
        group = dist.new_group(ranks=list(range(ep)))
        buffer = elastic_buffer(group, MoEShape(hidden_dim=32, num_experts=8, top_k=2, max_tokens_per_rank=64))
    finally:
        logging.getLogger().removeHandler(handler)
    buffer.destroy()
    return {"destroyed": buffer.destroyed, "log": lines}


def lb_fetch_worker(rank: int, ep: int) -> dict:
    """One layer's replica weights out and their gradients home (``torchtitan_ext.ep.replication.experts``): by all-to-all,
    then through DeepEP V2.5's load-balancing kernels (the transport an ``EPBuffer`` registers), then by
    all-to-all again once that buffer is destroyed. bf16 experts of 16 elements (32 bytes, the kernels'
    row multiple); per run the fetched rows, the home gradient, the collectives and the LB calls."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_process_group_name

    use_double("v2.5")
    import deep_ep
    from torchtitan_ext.config import MoEShape
    from torchtitan_ext.ep.kernels.deep_ep import ep_buffer
    from torchtitan_ext.ep.kernels.deepep_apis import EPBufferAPI
    from torchtitan_ext.ep.replication.experts import (exchange_arguments, fetch_replicas, redundancy_mapping,
                                                       with_replicas)
    from torchtitan_ext.ep.replication.plan import ReplicaPlan
    from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter

    calls = []
    for name in ("lb_prefetch_weights", "lb_reduce_grads"):
        original = getattr(deep_ep.EPBuffer, name)
        setattr(deep_ep.EPBuffer, name, lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k))
    prefetch = deep_ep.EPBuffer.lb_prefetch_weights

    def prefetch_noting_its_landing(self, *args, **kwargs):
        event = prefetch(self, *args, **kwargs)
        wait = event.current_stream_wait
        event.current_stream_wait = lambda *a, **k: calls.append("landed") or wait(*a, **k)
        return event

    deep_ep.EPBuffer.lb_prefetch_weights = prefetch_noting_its_landing
    group = dist.group.WORLD
    plan = ReplicaPlan(4, ep, ((2, 3), (0, -1)))

    def run() -> dict:
        del calls[:]
        home = torch.arange(2 * 16, dtype=torch.bfloat16).view(2, 16).add(100 * rank).requires_grad_()
        scale = torch.tensor([[1.0], [10.0]], dtype=torch.bfloat16)
        tables = exchange_arguments(plan, rank), redundancy_mapping(plan)  # once per plan, as the experts do
        counter = DeviceCostCounter()
        with counter:
            in_flight = fetch_replicas([home], *tables, 2, _get_process_group_name(group))
            calls.append("fetch returned")
            (weights,) = with_replicas([home], *tables, 2, _get_process_group_name(group), in_flight)
            fetched = weights[2:]
            (fetched * scale).sum().backward()
        copies = sum(sum(costs.h2d_copies.values()) for costs in counter.costs.values())
        return {"fetched": fetched.detach().float(), "grad": home.grad.float(), "events": waits_and_collectives(counter),
                "host_to_device_copies": copies, "lb_calls": list(calls)}

    import logging

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    results = {"all_to_all": run()}
    shape = MoEShape(hidden_dim=32, num_experts=8, top_k=2, max_tokens_per_rank=64)
    buffer, transport = ep_buffer(group, shape, 2, (16,), torch.bfloat16)
    api = EPBufferAPI(buffer, None, transport)
    results["lb_kernels"] = run()
    results["lb_region_bytes"] = buffer.num_lb_bytes
    results["lb_sms"] = transport.num_sms
    api.destroy()
    results["after_destroy"] = run()

    def transport_for(parameter_elements: tuple[int, ...], **environment) -> dict:
        """Whether a new EPBuffer carries replicas of an expert whose parameters' rows hold ``parameter_elements``
        bf16 under ``environment``, its kernels' SMs, and what it logged."""
        del lines[:]
        deterministic = environment.pop("deterministic", False)
        saved = {key: os.environ.get(key) for key in environment}
        os.environ.update(environment)
        torch.use_deterministic_algorithms(deterministic)
        try:
            buffer, transport = ep_buffer(group, shape, 2, parameter_elements, torch.bfloat16)
        finally:
            torch.use_deterministic_algorithms(False)
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        buffer.destroy()
        return {"carries": transport is not None, "sms": transport.num_sms if transport else None, "log": list(lines)}

    # 224 bytes an expert (a multiple of 32), its parameters' rows 208 and 16: each goes to the kernels on its own
    results["unaligned"] = transport_for((104, 8))
    results["deterministic"] = transport_for((16,), deterministic=True)
    results["two_nodes"] = transport_for((16,), DEEP_EP_DOUBLE_RANKS_PER_NODE="1")
    results["unmeasured_nvlink"] = transport_for((16,), DEEP_EP_DOUBLE_DETECTED_GBPS="0")
    logging.getLogger().removeHandler(handler)
    return results


def lb_model_worker(rank: int, world_size: int, model: str, checkpointing: tuple[str, ...] = ()) -> dict:
    """A tiny ``model`` (the gradient matrix's) with 2 replica slots per rank, EP = 2, FSDP in bf16, over
    deepep: through DeepEP V2.5's double (replicas by its load-balancing kernels) and through the reference
    with the default API and with ``api = "ep"`` (replicas by all-to-all); ``checkpointing``: activation
    checkpointing overrides. Per run the loss and gradients, and the LB calls made."""
    os.chdir(Path(__file__).resolve().parents[2])
    use_double("v2.5")
    import deep_ep
    from tests.models.gradient_cases import Cell, run_cell
    from torchtitan_ext.ep.base import destroy_kernel_buffers
    from torchtitan_ext.training import prepare

    prepare()
    calls = []
    for name in ("lb_prefetch_weights", "lb_reduce_grads"):
        original = getattr(deep_ep.EPBuffer, name)
        setattr(deep_ep.EPBuffer, name, lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k))
    results = {}
    for implementation, api in (("deep_ep", "auto"), ("reference", "auto"), ("reference", "ep")):
        overrides = ("--parallelism.expert_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16",
                     "--deepep.implementation", implementation, "--deepep.api", api, *checkpointing)
        cell = Cell(f"v2_5_{implementation}_{api}", model, "deepep", world_size, overrides, bf16=True, replicas=2)
        del calls[:]
        results[implementation, api] = {**run_cell(rank, world_size, cell),
                                        "lb_calls": {name: calls.count(name) for name in sorted(set(calls))}}
        destroy_kernel_buffers()  # as a job ends: the EPBuffer goes, and its transport with it
    return results
