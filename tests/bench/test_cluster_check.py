"""The cluster check (python -m torchtitan_ext.bench cluster_check), the first command on a new machine: without CUDA it lists what
deep_ep needs (one line each, with the fix where something is missing), says what only a GPU node can tell, and
exits 0."""


import pytest
import torch

from torchtitan_ext.bench import cluster_check

FIRST_LINE = "check_cluster: what deep_ep needs on this machine"

without_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                  reason="this machine has CUDA: the check would run for real")


@without_cuda
def test_without_cuda_it_lists_the_prerequisites_and_what_it_cannot_check(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", "")
    monkeypatch.setenv("NCCL_DIR", "/nonexistent")
    assert cluster_check.main([]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == FIRST_LINE
    assert lines[-1].startswith("check_cluster: no CUDA device on this machine: the kernels, benchmarks and training")
    checks = lines[1:-1]
    assert [line.split(":")[0] for line in checks] == [
        "- CUDA toolkit (nvcc, for the kernels compiled at first use)",
        "- NCCL >= 2.30.4 (DeepEP main v2.1, V2's Gin backend)", "- NCCL >= 2.32.3 (DeepEP V2.5)",
        "- NVSHMEM >= 3.3.9 (DeepEP main v2.1's build, for the v1 API's internode kernels; V2.5 needs none)",
        "- writable kernel caches", "- multi-node HybridEP build (NIXL or DOCA)",
        "- pynvml (the hybrid-ep build's v1 Buffer checks NVLink pairs with it)",
        "- deep_ep importable", "- GPUs, NVLink, RDMA, the NCCL torch actually loads, the kernels",
    ]
    assert ("- NCCL >= 2.30.4 (DeepEP main v2.1, V2's Gin backend): missing: NCCL_DIR=/nonexistent has no "
            "include/nccl.h") in checks
    assert checks[-1].endswith(": not checkable here: no CUDA device: run this on a GPU node")


def test_every_deep_ep_class_it_looks_for_runs_a_backend_variant():
    from torchtitan_ext.measuring.ep_variants import labels

    assert all(variant + "_lib" in labels() for variant in cluster_check.LIBRARY_VARIANTS.values())
