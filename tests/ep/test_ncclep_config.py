"""The ncclep backend's config checks: each limit NCCL EP documents (or asserts, aborting the process) refused in one
line that names the field and the fix, before anything is allocated; and what the section sets reaches the
library's group (checked on its double)."""

import pytest
import torch

from torchtitan_ext.config import ConfigError, MoEShape, parse
from torchtitan_ext.ep.kernels import KernelUnavailable, nccl_ep
from torchtitan_ext.ep.ncclep import NcclEPExpertParallel, receive_slots

NCCLEP = ["--parallelism.expert_parallel_comm_backend", "ncclep", "--parallelism.expert_parallel_degree", "2"]
SHAPE = dict(hidden_dim=256, num_experts=8, top_k=2, max_tokens_per_rank=1024)

LIMITS = {
    "low-latency mode": (["--ncclep.mode", "ll"], {}, "ncclep.mode = 'll'.* no backward pass"),
    "zero copy": (["--ncclep.zero_copy", "on"], {}, "ncclep.zero_copy = 'on' needs .* windows"),
    "NVLink domain": (["--ncclep.ranks_per_nvlink_domain", "3"], {}, "ranks_per_nvlink_domain = 3 does not divide"),
    "budget under the tokens a rank sends": (["--ncclep.max_recv_capacity_factor", "0.2"], {},
                                             "gives 848 receive slots per rank, fewer than the 1024 tokens"),
    "hidden size": ([], dict(hidden_dim=16392), "MAX_HIDDEN_DIM = 16384"),
    "token row bytes": (["--training.mixed_precision_param", "bfloat16"], dict(hidden_dim=100),
                        "a token row is 200 bytes .* multiple of 16"),
    "top_k": ([], dict(num_experts=64, top_k=33), "MAX_NUM_TOPK = 32"),
    "tokens per rank": ([], dict(max_tokens_per_rank=8200), "MAX_SUPPORTED_TOKENS_PER_RANK = 8192"),
    "experts per rank": ([], dict(num_experts=2 * 260), "kLocalPermuteMaxExpertsPerRank = 256"),
    "experts per NVLink team": ([], dict(num_experts=6), "3 local experts x 2 ranks .* multiple of 4"),
    "RDMA peers": (["--parallelism.expert_parallel_degree", "168"], dict(num_experts=168 * 4),
                   "spans 21 NVLink domains .* NUM_MAX_RDMA_PEERS = 20"),
}
"""Each limit: (overrides, the model shape's changes, what the refusal says), validated for a cluster (a dry run:
the device unknown, "auto" means the library)."""


@pytest.mark.parametrize("limit", LIMITS)
def test_each_limit_is_refused_in_one_line(limit):
    overrides, shape, message = LIMITS[limit]
    job_config = parse([*NCCLEP, *overrides])
    with pytest.raises(ConfigError, match=message) as refused:
        NcclEPExpertParallel.validate_config(job_config, None, MoEShape(**{**SHAPE, **shape}))
    assert "\n" not in str(refused.value)
    NcclEPExpertParallel.validate_config(parse(NCCLEP), None, MoEShape(**SHAPE))  # the same job within the limits


def test_the_double_takes_shapes_the_library_refuses_and_not_the_library_on_a_cpu():
    """On a CPU "auto" runs the double, which has none of the library's shape limits (the gradient matrix's model
    has 5 experts per rank); asking for the library there is refused."""
    NcclEPExpertParallel.validate_config(parse(NCCLEP), "cpu", MoEShape(**{**SHAPE, "num_experts": 10}))
    with pytest.raises(ConfigError, match="'nccl_ep' needs CUDA"):
        NcclEPExpertParallel.validate_config(parse([*NCCLEP, "--ncclep.implementation", "nccl_ep"]), "cpu",
                                             MoEShape(**SHAPE))


@pytest.mark.parametrize("cuda, extra", [("12.8", "cu12"), ("13.0", "cu13")])
def test_the_library_missing_on_cuda_says_how_to_install_it_for_torchs_cuda(monkeypatch, cuda, extra):
    def missing():
        raise KernelUnavailable("import nccl.ep failed: ModuleNotFoundError: No module named 'nccl'")

    monkeypatch.setattr(nccl_ep, "import_facade", missing)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    with pytest.raises(ConfigError) as refused:
        NcclEPExpertParallel.validate_config(parse([*NCCLEP, "--ncclep.implementation", "nccl_ep"]), "cuda",
                                             MoEShape(**SHAPE))
    command = f'pip install "nccl-extensions[{extra}]==0.1.0" on this CUDA machine'
    assert "No module named 'nccl'" in str(refused.value) and command in str(refused.value)


def test_the_static_budget_is_the_capacity_factors_rows():
    # N x R x min(L, K) x factor = 1024 x 2 x 2 x 0.5 pairs, and L x (P - 1) = 4 x 7 padding rows, to a multiple of 8
    assert receive_slots(MoEShape(**SHAPE), 2, 0.5, 8) == 2080
    assert receive_slots(MoEShape(**SHAPE), 2, None, 1) == 0
