"""Library fidelity: the adapters to deep_ep, run against a double faithful to the library's sources.

The real deep_ep cannot run here (CUDA, built from source). tests/ep/deep_ep_double
is a double of it whose signatures are the manifest's (read at pinned commits
of DeepEP main and of its hybrid-ep branch) and whose observable behaviour
follows the sources where an adapter can trip: pinned host memory in blocking
HybridEP, None on cached paths, an uninitialised overflow flag, bf16-only
kernels, rank-count and layout asserts, deterministic mode, import failures.
Every backend the library serves runs here through ``implementation =
"deep_ep"`` exactly as on a cluster, and must give the same numbers as the
reference implementation at the same dtype, bit for bit.
"""

import importlib
import inspect
import sys

import pytest
import torch

from tests.ep.deep_ep_double.manifest import HYBRID_EP_BUILD, MANIFEST, V2_5_BUILD, V2_5_REMOVED
from torchtitan_ext.ep.backends import KERNEL_LIBRARY_BACKENDS
from tests.ep.double_cases import (
    adapters_worker, DOUBLE_DIR, fp32_worker, fresh_group_worker, host_sync_worker, lb_fetch_worker, lb_model_worker,
    LIBRARY_BACKENDS, lifetime_worker, unmeasurable_bandwidth_worker,
)
from tests.ep.cases import Case
from tests.helpers import run_distributed

EP = 2
CASES = (
    Case("double_top2_after", num_experts=8, top_k=2, score_before_experts=False, seed=61, total_tokens=64, hidden=32),
    Case("double_top3_before_pad", num_experts=4, top_k=3, score_before_experts=True, seed=62, total_tokens=64,
         hidden=32, pad_multiple=16),
)
AC_CASE = CASES[0]


def _rendered(signature: inspect.Signature) -> str:
    """A signature as the manifest writes it: names, defaults and the keyword-only marker, no annotations."""
    parameters = [parameter.replace(annotation=inspect.Parameter.empty) for parameter in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


@pytest.fixture(params=["main", "hybrid-ep"])
def double_modules(request, installed_build):
    installed_build(request.param)
    return importlib.import_module("deep_ep._buffers"), importlib.import_module("deep_ep._hybrid")


def test_double_computes_without_the_project():
    """The double used to compute with torchtitan_ext's ReferenceBuffer, so "bit for bit equal to the
    reference" compared the reference with itself. It imports nothing from the project now."""
    import ast

    sources = sorted(DOUBLE_DIR.rglob("*.py"))
    assert len(sources) >= 5, sources
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(name.split(".")[0] in ("torchtitan_ext", "tests") for name in names), (source, names)


def test_guard_of_the_suites_double_it_has_the_manifests_signatures(double_modules):
    """A guard of the suite's own double, not of the product: the double keeps the signatures the manifest read at
    the library's pinned commits, so the adapters' calls, which run against it, bind as they would to deep_ep."""
    buffers, hybrid = double_modules
    manifest = MANIFEST | (HYBRID_EP_BUILD if buffers.BUILD == "hybrid-ep" else {})
    for qualified, (signature, _, repo, commit, path) in manifest.items():
        owner_name, _, member = qualified.partition(".")
        module = hybrid if owner_name in ("HybridEPBuffer", "indices_to_map") else buffers
        target = getattr(module, owner_name)
        if member:
            target = getattr(target, member)
        assert _rendered(inspect.signature(target)) == signature, (qualified, repo, commit, path)


def test_guard_of_the_suites_double_v2_5_has_the_manifests_signatures_and_no_v1(installed_build):
    """A guard of the suite's own double, not of the product: DeepEP V2.5 exports EPBuffer (V2's buffer split by
    job, with the load-balancing kernels) and no Buffer or ElasticBuffer, and the double of that build has exactly
    the manifest's signatures."""
    installed_build("v2.5")
    library = importlib.import_module("deep_ep")
    assert library.__version__ == "2.5.0"
    for qualified, (signature, _, repo, commit, path) in V2_5_BUILD.items():
        target = library
        for name in qualified.split("."):
            target = getattr(target, name)
        assert _rendered(inspect.signature(target)) == signature, (qualified, repo, commit, path)
    assert not [name for name in V2_5_REMOVED if hasattr(library, name)]


@pytest.fixture(scope="module", params=sorted(LIBRARY_BACKENDS))
def adapters(request):
    return request.param, run_distributed(EP, adapters_worker, request.param, CASES, AC_CASE)


@pytest.mark.slow
def test_every_backend_equals_the_reference_bitwise(adapters):
    """Forward and backward (outputs, tokens', scores' and experts' gradients): the adapters call
    the library as the reference is called, so results are identical at the same dtype. The
    experts read their group sizes on the device (grouped GEMM): a count left in pinned host
    memory would fail here."""
    build, results = adapters
    for rank_results in results:
        for case in CASES:
            for backend in LIBRARY_BACKENDS[build]:
                library = rank_results[case.name, backend, "deep_ep"]
                reference = rank_results[case.name, backend, "reference"]
                for key in ("out", "grad_x", "grad_scores", "grad_w1", "grad_w2", "grad_w3"):
                    assert torch.equal(library[key], reference[key]), (build, case.name, backend, key)
                if backend.startswith("hybridep"):
                    # routed less kept, kept read from the library's handle (its routing map is unwritten)
                    assert library["dropped_pairs"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("adapters", ["hybrid-ep"], indirect=True)  # the one build with HybridEP
def test_dropped_pairs_through_the_library_equal_the_reference(adapters):
    """Non-blocking HybridEP with too few rows: the same outputs and gradients, and the same dropped
    count per rank, read from the library's handle as from the reference's."""
    build, results = adapters
    total = 0
    for rank_results in results:
        for case in CASES:
            library = rank_results[case.name, "hybridep_drops", "deep_ep"]
            reference = rank_results[case.name, "hybridep_drops", "reference"]
            for key in ("out", "grad_x", "grad_scores", "grad_w1", "grad_w2", "grad_w3"):
                assert torch.equal(library[key], reference[key]), (case.name, key)
            assert library["dropped_pairs"] == reference["dropped_pairs"]
            total += library["dropped_pairs"]
    assert total > 0, "the cases must drop pairs at this factor"


@pytest.mark.slow
def test_checkpointed_backward_and_buffer_creation(adapters):
    """Per-op selective and full activation checkpointing run forward and backward through the
    library (the cached path of HybridEP's dispatch returns no tokens-per-expert), equal to each
    other; every buffer was created with no dispatch mode active, so selective checkpointing's
    cache never records the creation's collectives."""
    build, results = adapters
    for rank_results in results:
        runs = rank_results["checkpointing"]
        for backend in LIBRARY_BACKENDS[build]:
            selective, full = runs[backend, "selective_op"], runs[backend, "full"]
            for key in ("out", "grad_x", "grad_scores"):
                assert torch.equal(selective[key], full[key]), (backend, key)
        assert rank_results["creation_mode_stacks"] and set(rank_results["creation_mode_stacks"]) == {0}


@pytest.mark.slow
def test_deterministic_mode_runs(adapters):
    """torchtitan's debug.deterministic: DeepEP asserts against fill_uninitialized_memory; the adapters
    run its calls without it (deterministic algorithms stay on)."""
    build, results = adapters
    for rank_results in results:
        for backend in LIBRARY_BACKENDS[build]:
            assert torch.equal(
                rank_results["deterministic"][backend], rank_results[AC_CASE.name, backend, "deep_ep"]["out"]
            )


@pytest.mark.slow
def test_fp32_tokens_are_refused_before_the_library():
    """The library would misread fp32 (HybridEP) or raise "Unsupported type" (DeepEP's combine, after
    the dispatch communicated): the adapter refuses first, naming the dtype setting."""
    for build in sorted(LIBRARY_BACKENDS):
        errors = run_distributed(EP, fp32_worker, build, AC_CASE)[0]
        for backend, error in errors.items():
            assert error is not None and error.startswith("TypeError"), (build, backend, error)
            assert "take bf16 tokens only, not torch.float32" in error and "mixed_precision_param" in error


def _deep_ep_modules() -> list[str]:
    return [name for name in sys.modules if name == "deep_ep" or name.startswith("deep_ep.")]


@pytest.fixture
def installed_build(monkeypatch):
    """``use(build)``: in this process, ``import deep_ep`` is that build's double, on a CUDA machine. The double's
    modules leave with the test (monkeypatch restores what it removed, not what the test imported), so that a later
    test in this process does not find a deep_ep installed."""

    def use(build: str) -> None:
        monkeypatch.syspath_prepend(str(DOUBLE_DIR))
        monkeypatch.setenv("DEEP_EP_DOUBLE_BUILD", build)
        for name in _deep_ep_modules():
            monkeypatch.delitem(sys.modules, name)

    yield use
    for name in _deep_ep_modules():
        del sys.modules[name]


@pytest.mark.parametrize("build, api", [("main", "elastic"), ("hybrid-ep", "legacy"), ("v2.5", "ep")])
def test_deepep_default_api_follows_the_installed_build(installed_build, build, api):
    """[deepep] left at its defaults on CUDA: V2.5 where the build has EPBuffer, V2 where it has
    ElasticBuffer, v1 on the hybrid-ep branch (which has neither), and the job config validates on each."""
    from torchtitan_ext.ep.deepep import resolve_api
    from torchtitan_ext.training.specs import register_train_specs
    from torchtitan_ext.config import load_job_config

    register_train_specs()
    installed_build(build)
    job_config = load_job_config([
        "--job.config_file", "train_configs/debug_model.toml",
        "--parallelism.expert_parallel_comm_backend", "deepep", "--training.mixed_precision_param", "bfloat16",
    ], "cuda", 2)
    assert resolve_api(job_config.deepep.api, job_config.deepep.implementation, "cuda") == api


@pytest.mark.parametrize("build, refused", [("main", ()), ("hybrid-ep", (48, 96))])
def test_deepep_v1_rank_counts_follow_the_installed_build(installed_build, build, refused):
    """The v1 kernel configs differ between builds: EP 48 and 96 exist on DeepEP main only, and the
    hybrid-ep branch's Buffer would assert at the first dispatch. Validation asks the installed build."""
    from torchtitan_ext.config import ConfigError
    from torchtitan_ext.config import MoEShape
    from torchtitan_ext.ep.deepep import DeepEPExpertParallel
    from torchtitan_ext.config import parse

    installed_build(build)
    job_config = parse(["--job.config_file", "train_configs/debug_model.toml", "--deepep.api", "legacy",
                        "--training.mixed_precision_param", "bfloat16"])
    shape = MoEShape(hidden_dim=256, num_experts=192, top_k=8, max_tokens_per_rank=4096)
    for ep in (8, 16, 48, 64, 96, 128):
        job_config.parallelism.expert_parallel_degree = ep
        if ep in refused:
            with pytest.raises(ConfigError, match=(
                f"^parallelism.expert_parallel_degree = {ep}: the installed deep_ep's v1 Buffer has no kernel "
                f"config for it \\(Unsupported number of EP ranks: {ep}\\): .* deepep.api = 'elastic'$"
            )):
                DeepEPExpertParallel.validate_config(job_config, "cuda", shape)
        else:
            DeepEPExpertParallel.validate_config(job_config, "cuda", shape)


@pytest.mark.parametrize("failure, shown", [("nccl", "Invalid NCCL versions"), ("cuda_home", "cuda_home")])
def test_import_failure_is_a_clear_config_error(monkeypatch, installed_build, failure, shown):
    """DeepEP main's import checks (NCCL binary identity, CUDA home) raise AssertionError: it becomes
    a one-line error that says the import failed, not a traceback."""
    installed_build("main")
    monkeypatch.setenv("DEEP_EP_DOUBLE_IMPORT_FAILURE", failure)
    for backend in KERNEL_LIBRARY_BACKENDS:
        message = _library_job_error(monkeypatch, backend)
        assert "but import deep_ep failed: AssertionError" in message and shown in message
        assert f"{backend}.implementation = 'reference'" in message and "\n" not in message


@pytest.mark.parametrize("build, backend, missing, hint", [
    ("main", "hybridep", "HybridEPBuffer", "hybrid-ep branch"),
    ("hybrid-ep", "deepep", "ElasticBuffer", "DeepEP main"),
])
def test_a_build_without_the_backend_class_names_it(monkeypatch, installed_build, build, backend, missing, hint):
    """DeepEP main has no HybridEPBuffer and the hybrid-ep branch no ElasticBuffer: the error names the
    missing class and the build that has it."""
    installed_build(build)
    message = _library_job_error(monkeypatch, backend, *(["--deepep.api", "elastic"] if backend == "deepep" else []))
    assert f"but the installed deep_ep has no {missing}: " in message and hint in message
    assert f"{backend}.implementation = 'reference'" in message and "\n" not in message


def _library_job(monkeypatch, backend: str, *overrides: str):
    """A job that asks for the library, validated with this CPU standing in for CUDA."""
    import torchtitan_ext.ep.kernels as kernels
    from torchtitan_ext.config import load_job_config
    from torchtitan_ext.training.specs import register_train_specs

    register_train_specs()
    monkeypatch.setattr(kernels, "LIBRARY_DEVICE_TYPE", "cpu")
    return load_job_config([
        "--job.config_file", "train_configs/debug_model.toml",
        "--parallelism.expert_parallel_comm_backend", backend, f"--{backend}.implementation", "deep_ep",
        *overrides, "--training.mixed_precision_param", "bfloat16",
    ], "cpu", 2)


def _library_job_error(monkeypatch, backend: str, *overrides: str) -> str:
    """The ConfigError's message for a job that asks for the library (:func:`_library_job`)."""
    from torchtitan_ext.config import ConfigError

    with pytest.raises(ConfigError) as error:
        _library_job(monkeypatch, backend, *overrides)
    return str(error.value)


@pytest.fixture(scope="module")
def host_syncs():
    case = Case("host_sync", num_experts=8, top_k=2, score_before_experts=False, seed=31, total_tokens=64,
                hidden=32, pad_multiple=8)
    return {
        "control": run_distributed(EP, host_sync_worker, "hybrid-ep", case, "hybridep_non_blocking"),
        **{build: run_distributed(EP, host_sync_worker, build, case) for build in sorted(LIBRARY_BACKENDS)},
    }


@pytest.mark.slow
def test_the_real_adapters_pay_their_budget_and_declare_the_librarys_syncs(host_syncs):
    """One MoE layer's forward + backward through the adapters of the real library (the double), the custom ops'
    bodies included: within the backend's budget, no host sync of ours (the library's: one per blocking dispatch),
    no blocking host-to-device copy, and the syncs the adapters declare for the library's calls are the ones the
    double (from the pinned sources) reports it making."""
    for build in sorted(LIBRARY_BACKENDS):
        for rank_results in host_syncs[build]:
            for backend, got in rank_results.items():
                costs, budget = got["costs"], got["budget"]
                ours = {kind: count for kind, count in costs.host_syncs.items() if "(the library's)" not in kind}
                assert ours == {}, (build, backend, ours)
                assert costs.syncs == got["double_syncs"] <= budget.host_syncs, (build, backend, costs, got)
                assert costs.collective_count() <= budget.collectives, (build, backend, costs)
                assert all(kind.startswith("non-blocking") for kind in costs.h2d_copies), (build, backend, costs)
                assert sum(costs.h2d_copies.values()) <= budget.h2d_copies, (build, backend, costs)


@pytest.mark.slow
def test_counter_sees_into_custom_ops(host_syncs):
    """The control: a scalar read injected into a helper that non-blocking HybridEP's dispatch op
    and its combine's backward (a cached dispatch) call inside their bodies is counted, twice."""
    for rank_results in host_syncs["control"]:
        syncs = rank_results["hybridep_non_blocking"]["costs"].host_syncs
        assert sorted(kind.split(" at ")[0] for kind in syncs.elements()) == ["Tensor.item", "Tensor.item"], syncs


@pytest.mark.parametrize("build", ["main", "hybrid-ep"])
def test_deepep_v1_node_counts_follow_the_installed_build(installed_build, build):
    """EP = 24 (3 nodes of 8) passed validation on both builds, but the hybrid-ep branch has v1 internode
    kernels for 2, 4, 8, 16, 18 and 20 nodes only: its first dispatch failed with "Unsupported RDMA ranks"."""
    from torchtitan_ext.config import ConfigError, MoEShape, parse
    from torchtitan_ext.ep.deepep import DeepEPExpertParallel

    installed_build(build)
    job_config = parse(["--job.config_file", "train_configs/debug_model.toml", "--deepep.api", "legacy",
                        "--training.mixed_precision_param", "bfloat16", "--parallelism.expert_parallel_degree", "24"])
    shape = MoEShape(hidden_dim=256, num_experts=192, top_k=8, max_tokens_per_rank=4096)
    if build == "main":
        DeepEPExpertParallel.validate_config(job_config, "cuda", shape)
        return
    with pytest.raises(ConfigError, match=(
        r"^parallelism.expert_parallel_degree = 24: the installed deep_ep \(a build of the hybrid-ep branch\) has v1 "
        r"internode kernels for 2, 4, 8, 16, 18, 20 nodes of 8 ranks, not 3: pick one of those, or install DeepEP main"
    )):
        DeepEPExpertParallel.validate_config(job_config, "cuda", shape)


@pytest.mark.slow
@pytest.mark.parametrize("build", sorted(LIBRARY_BACKENDS))
def test_buffers_are_destroyed_before_the_process_group(build):
    """The buffers used to keep explicitly_destroy=False: their destructor ran a barrier and NCCL finalize
    after the process group was destroyed (or hung a failure exit in it). They are created with
    explicitly_destroy=True and destroyed first; the double fails a process group destroyed under a live
    one (the workers end as a training run does: destroy_kernel_buffers, then the group)."""
    created = run_distributed(EP, lifetime_worker, build, AC_CASE)
    for flags in created:
        assert flags and all(flags), created


@pytest.mark.slow
def test_an_unmeasurable_bandwidth_falls_back_to_20_sms():
    """V2 with deepep.num_sms unset: the library estimates SMs from the bandwidths ibstat and nvidia-smi
    report, and divides by them across nodes (elastic.py:809): 0 GB/s raised ZeroDivisionError at the first
    dispatch. The adapter asks for the estimate itself, falls back to 20 SMs and says so once."""
    results = run_distributed(EP, unmeasurable_bandwidth_worker, AC_CASE)
    for result in results:
        assert result["num_sms"] == [20] and result["warnings"] == 1, result


@pytest.mark.slow
def test_the_elastic_buffer_is_built_on_a_group_that_has_communicated():
    """ElasticBuffer borrows the group's NCCL communicator, which torch creates at the group's first
    collective: on a group that never communicated, the pointer is 0. The adapter runs a barrier first.
    Its size, which only the live communicator gives (the planner says n/a), is in the log: the double's
    default is the library's 2 MB alignment unit."""
    for result in run_distributed(EP, fresh_group_worker):
        assert result["destroyed"], result
        assert "DeepEP ElasticBuffer: 2 MiB per rank, sized by the library for 64 tokens per rank over 2 ranks" in (
            result["log"]), result


@pytest.mark.parametrize("setup, message", [
    (None, "HybridEP compiles its kernels at the first dispatch with $CUDA_HOME/bin/nvcc"),
    ("empty", "bin/nvcc is not an executable"),
    ("stand_in", None),
    ("cache_in_a_file", "is not a writable folder: set HYBRID_EP_CACHE_DIR to a writable folder"),
])
def test_hybridep_checks_its_kernel_compiler_before_the_job(monkeypatch, installed_build, tmp_path, setup, message):
    """HybridEP compiles its kernels with $CUDA_HOME/bin/nvcc at the first dispatch, on every rank; nothing
    checked CUDA_HOME before. Now the job's validation (the launcher's pre-flight) does."""
    from tests.ep.double_cases import stand_in_cuda_home

    installed_build("hybrid-ep")
    monkeypatch.setenv("HYBRID_EP_CACHE_DIR", str(tmp_path))
    if setup == "cache_in_a_file":
        (tmp_path / "a_file").write_text("")
        monkeypatch.setenv("HYBRID_EP_CACHE_DIR", str(tmp_path / "a_file"))
    if setup is None:
        monkeypatch.delenv("CUDA_HOME", raising=False)
    else:
        monkeypatch.setenv("CUDA_HOME", str(tmp_path if setup == "empty" else stand_in_cuda_home()))
    if message is None:
        _library_job(monkeypatch, "hybridep")
        return
    assert message in _library_job_error(monkeypatch, "hybridep")


@pytest.fixture(scope="module")
def lb_fetch():
    return run_distributed(EP, lb_fetch_worker)


@pytest.mark.slow
def test_replicas_move_through_deepep_v2_5_load_balancing_kernels(lb_fetch):
    """With an EPBuffer alive on the EP group, a layer's replica weights go out by lb_prefetch_weights and
    their gradients home by lb_reduce_grads (no all-to-all), with the same rows and sums as the all-to-all;
    the buffer reserved its LB region (weights bf16 and gradients fp32, each 2 MiB-aligned); once it is
    destroyed, replicas move by all-to-all again. The kernels' fetch lands when the experts wait for it, after the
    fetch has returned (the dispatch goes in between). On every transport the plan's tables are built once per
    plan: neither direction copies anything from host memory to the device."""
    results = lb_fetch
    all_to_all = "alltoall_base"
    for rank_results in results:
        by_all_to_all, by_kernels, after = (rank_results[k] for k in ("all_to_all", "lb_kernels", "after_destroy"))
        assert by_all_to_all["events"] == {all_to_all: 2} and by_all_to_all["lb_calls"] == ["fetch returned"]
        assert by_kernels["lb_calls"] == ["lb_prefetch_weights", "fetch returned", "landed", "lb_reduce_grads"]
        assert all_to_all not in by_kernels["events"]
        assert [r["host_to_device_copies"] for r in (by_all_to_all, by_kernels, after)] == [0, 0, 0]
        for key in ("fetched", "grad"):
            assert torch.equal(by_kernels[key], by_all_to_all[key]), key
            assert torch.equal(after[key], by_all_to_all[key]), key
        assert after["events"] == {all_to_all: 2} and after["lb_calls"] == ["fetch returned"]
        assert rank_results["lb_region_bytes"] == 2 * 2 * 1024 * 1024
    # rank 1's second slot is unused: 0, as the all-to-all leaves it
    assert torch.equal(results[1]["lb_kernels"]["fetched"][1], torch.zeros(16))


@pytest.mark.slow
def test_where_the_load_balancing_kernels_cannot_carry_replicas_the_log_says_why(lb_fetch):
    """Replicas move by all-to-all, said in one line, where the kernels cannot carry them: an expert that is
    not a multiple of 32 bytes, deterministic algorithms (their fp32 sums are in arrival order), an EP group
    over two NVLink domains. Where the library cannot estimate the kernels' SMs (NVLink read as 0 GB/s, an
    estimate of 0 its kernels refuse), 20 are used, with one warning."""
    for rank_results in lb_fetch:
        assert rank_results["lb_sms"] == 8  # the double's estimate at 400 GB/s
        prefix = "Expert replicas move by all-to-all, not DeepEP's load-balancing kernels: "
        for case, reason in (
            ("unaligned", "they move each expert parameter's row in a multiple of 32 bytes, and one of the routed "
                          "experts' is 208"),
            ("deterministic", "deterministic algorithms are on, and their gradient sums are in arrival order"),
            ("two_nodes", "they reach one NVLink domain, here 1 of the EP group's 2 ranks"),
        ):
            assert not rank_results[case]["carries"], case
            assert [line for line in rank_results[case]["log"] if line.startswith("Expert replicas")] == [prefix + reason]
        unmeasured = rank_results["unmeasured_nvlink"]
        assert unmeasured["carries"] and unmeasured["sms"] == 20
        assert sum("could not estimate its load-balancing kernels' SM count (20 used)" in line
                   for line in unmeasured["log"]) == 1


PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
       "--parallelism.pipeline_parallel_microbatch_size", "1")


@pytest.mark.slow
@pytest.mark.parametrize("model, checkpointing, world_size", [
    ("deepseek_v3", (), EP), ("llama4", (), EP), ("gpt_oss", (), EP),
    ("deepseek_v3", ("--activation_checkpoint.mode", "full"), EP),
    ("deepseek_v3", ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
     EP),
    ("deepseek_v3", PP2, 2 * EP),
    ("deepseek_v3", ("--parallelism.tensor_parallel_degree", "2"), 2 * EP),
])
def test_replication_through_deepep_v2_5_equals_the_reference(model, checkpointing, world_size):
    """A whole model step with 2 replica slots per rank (EP = 2, FSDP, bf16) over deepep on V2.5 (GPT-OSS: its
    experts' biases move with their weights), without and with activation checkpointing (full: the fetch is recomputed
    in backward; per op: it is saved), over 2 pipeline stages (each stage's EP group has its own buffer and kernels,
    two microbatches), and with EP borrowing the TP ranks (beside FSDP, through which torchtitan casts to bf16): the
    library's double (dispatch and combine through EPBuffer, replicas through its load-balancing kernels) gives the
    reference's loss and gradients (all-to-all replicas), bit for bit; so does the reference driven through the V2.5
    adapter (``api = "ep"``), which has no load-balancing kernels."""
    results = run_distributed(world_size, lb_model_worker, model, checkpointing)
    # replicas that computed no pair would make every run equal to the reference whatever they carry
    for run in (("deep_ep", "auto"), ("reference", "auto"), ("reference", "ep")):
        assert sum(rank_results[run]["replica_pairs"] for rank_results in results) > 0, run
    for rank_results in results:
        library = rank_results["deep_ep", "auto"]
        calls = library["lb_calls"]
        if checkpointing == PP2:
            # this stage's MoE layers, every microbatch; a stage's forwards also run without backward
            # (the schedule infers shapes), so fetches may outnumber returns
            assert calls["lb_prefetch_weights"] >= calls["lb_reduce_grads"] > 0, calls
        else:
            # out and home for every MoE layer; full checkpointing fetches again when it recomputes
            moe_layers = 3 if model == "deepseek_v3" else 2
            recomputed = "full" in checkpointing
            assert calls == {"lb_prefetch_weights": moe_layers * (1 + recomputed), "lb_reduce_grads": moe_layers}
        for api in ("auto", "ep"):
            reference = rank_results["reference", api]
            assert reference["lb_calls"] == {}
            assert library.get("loss") == reference.get("loss")  # a first pipeline stage has none
            assert library["grads"].keys() == reference["grads"].keys()
            for name, (shard, offset, shape) in library["grads"].items():
                reference_shard, reference_offset, reference_shape = reference["grads"][name]
                assert (offset, shape) == (reference_offset, reference_shape), (api, name)
                assert torch.equal(shard, reference_shard), (api, name)

