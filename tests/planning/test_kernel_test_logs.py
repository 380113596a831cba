"""DeepEP's and HybridEP's own test logs calibrate the advisor: read as the library's published figures are.

The fixtures are real logs, verbatim from public threads (each file's header names its source)."""

import pytest

from tests.helpers import REPO_ROOT
from torchtitan_ext.config import ConfigError, MoEShape
from torchtitan_ext.planning.kernel_test_log import read_kernel_test_log
from torchtitan_ext.planning.measured_rates import calibration_rates
from torchtitan_ext.planning.topology import load_topology

DATA = REPO_ROOT / "tests/planning/data"
DEEPEP = DATA / "deepep_internode_h200_2nodes.log"
HYBRIDEP = DATA / "hybridep_4ranks.log"


def test_deepeps_internode_log_calibrates_the_rdma_link_from_its_bf16_best_lines():
    """By hand from the file: BF16 dispatch 40.89 GB/s, combine 44.37 GB/s over RDMA, 24 SMs, 2 nodes (FP8 skipped).
    Each counts the own node's pairs: half of them leave over 2 nodes, so 40.89 / 2 / 50 and 44.37 / 2 / 50 of
    the 50 GB/s NIC, their harmonic mean 0.4256."""
    log = read_kernel_test_log(DEEPEP, DEEPEP.read_text())
    assert (log.backend, log.figures, log.sms, log.nodes) == ("deepep", {"RDMA": (40.89, 44.37), "NVL": (133.78, 145.16)}, 24, 2)
    rates = calibration_rates([DEEPEP], load_topology("hgx_h100_ib"))
    assert list(rates) == [("deepep", ("legacy",), 1)]
    dispatch, combine = 40.89 / 2 / 50, 44.37 / 2 / 50
    assert rates["deepep", ("legacy",), 1].fraction == pytest.approx(2 / (1 / dispatch + 1 / combine))


def test_hybrideps_log_calibrates_the_nvlink_of_both_modes_from_rank_0s_torch_api_lines():
    """Rank 0's dispatch (544.91) and combine (387.94 GB/s) over 4 ranks; rank 1's and the permute variant's lines
    are not read. 3 of every 4 rows leave the rank: x 0.75 / 900 on GB200's NVLink."""
    rates = calibration_rates([HYBRIDEP], load_topology("gb200_nvl72"))
    dispatch, combine = 544.91 * 0.75 / 900, 387.94 * 0.75 / 900
    assert {key: rate.fraction for key, rate in rates.items()} == pytest.approx({
        ("hybridep", ("blocking",), 0): 2 / (1 / dispatch + 1 / combine),
        ("hybridep", ("non-blocking",), 0): 2 / (1 / dispatch + 1 / combine)})


@pytest.mark.parametrize("text, message", [
    ("[tuning] Best dispatch (BF16): SMs 24, NVL chunk 8: 153.00 GB/s (NVL), t: 312.50 us\n",
     "no BF16 combine figure over NVL"),
    ("[tuning] Best dispatch (BF16): SMs 24, NVL chunk 28, RDMA chunk 16: 40.89 GB/s (RDMA), 133.78 GB/s (NVL)\n"
     "[tuning] Best combine: SMs 24, NVL chunk 2, RDMA chunk 20, 1.50 + 345.00 us, 44.37 GB/s (RDMA), 145.16 GB/s (NVL)\n",
     "add a line '# nodes: N'"),
    ("[config] num_tokens=4096, hidden=7168, num_topk=8\n# ranks_per_node: 8\n"
     "[tuning] Best dispatch (BF16): SMs 24, NVL chunk 8, 153.00 GB/s (NVL), t: 312.50 us\n"
     "[tuning] Best combine: SMs 24, NVL chunk 4: 158.00 GB/s (NVL), t: 300.00 us\n",
     "rerun it with --num-tokens 8192 --hidden 7168 --num-topk 8"),
    ("[config] num_tokens=8192, hidden=7168, num_topk_groups=4, num_topk=6\n# ranks_per_node: 8\n"
     "[tuning] Best dispatch (BF16): SMs 24, NVL chunk 8, 153.00 GB/s (NVL), t: 312.50 us\n"
     "[tuning] Best combine: SMs 24, NVL chunk 4: 158.00 GB/s (NVL), t: 300.00 us\n",
     "ran 8192 tokens per rank at hidden 7168, top-k 6; .* rerun it with --num-tokens 8192 --hidden 7168 --num-topk 8"),
])
def test_a_test_log_that_cannot_calibrate_is_one_line(tmp_path, text, message):
    """Lines in the scripts' formats (their f-strings, values made up): a missing combine, an internode run
    without its node count, a shape that is not the job's (its tokens; its top-k)."""
    path = tmp_path / "test.log"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        calibration_rates([path], load_topology("hgx_h100_ib"), shape=MoEShape(7168, 256, 8, 8192))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("config", ["num_tokens=8192, hidden=7168, num_topk=8", "num_tokens=8192, hidden=7168"])
def test_a_test_log_at_the_jobs_shape_calibrates(tmp_path, config):
    """The job's tokens, hidden and top-k; a script that prints no top-k is held to its tokens and hidden."""
    path = tmp_path / "test.log"
    path.write_text(f"[config] {config}\n[tuning] Best dispatch (BF16): SMs 24, NVL chunk 8, 153.00 GB/s (NVL)\n"
                    "[tuning] Best combine: SMs 24, NVL chunk 4: 158.00 GB/s (NVL)\n")
    rates = calibration_rates([path], load_topology("hgx_h100_ib"), shape=MoEShape(7168, 256, 8, 8192))
    assert list(rates) == [("deepep", ("legacy",), 0)]


HYBRIDEP_CURRENT = """=== Kernel Benchmark (BF16, 8 ranks) ===
dispatch kernel (BF16)(NVL):                     149.24 GB/s, avg_t=2638.9 us [min=2609.0, max=2671.0]
combine kernel(NVL):                             135.98 GB/s, avg_t=2896.4 us [min=2862.0, max=3111.0]
=== Torch API Benchmark (BF16, 8 ranks) ===
dispatch (BF16):                                 400.00 GB/s (NVL), t: 100.0 us [min=99.0, max=101.0], nvl_recv_bytes: 40.00 MB
combine:                                         300.00 GB/s (NVL), t: 133.3 us [min=130.0, max=140.0], combine_send_bytes: 40.00 MB
dispatch+permute (BF16):                         350.00 GB/s (NVL), t: 114.3 us [min=110.0, max=120.0], nvl_recv_bytes: 40.00 MB
=== Torch API Benchmark (FP8, 8 ranks) ===
dispatch (FP8):                                  500.00 GB/s (NVL), t: 80.0 us [min=79.0, max=81.0], nvl_recv_bytes: 20.00 MB
combine:                                         310.00 GB/s (NVL), t: 129.0 us [min=128.0, max=130.0], combine_send_bytes: 40.00 MB
"""


@pytest.mark.parametrize("text, backend, figures, ranks_per_node", [
    (HYBRIDEP_CURRENT, "hybridep", {"NVL": (400.0, 300.0)}, 8),
    ("# nodes: 2\n[rank 0] HybridEP dispatch torch API (BF16): 40.00 GB/s (IB), t: 900.00 us, rdma_send_bytes: 9.00 MB\n"
     "[rank 0] HybridEP combine torch API: 42.00 GB/s (IB), t: 850.00 us, rdma_recv_bytes: 9.00 MB\n",
     "hybridep", {"RDMA": (40.0, 42.0)}, None),
    ("[tuning] Best dispatch (BF16): SMs 24, NVL chunk 8, 153.00 GB/s (NVL), t: 312.50 us\n"
     "[tuning] Best combine: SMs 24, NVL chunk 4: 158.00 GB/s (NVL), t: 300.00 us\n", "deepep", {"NVL": (153.0, 158.0)}, 8),
])
def test_each_format_the_scripts_print_is_read_to_its_bf16_torch_api_figures(tmp_path, text, backend, figures,
                                                                              ranks_per_node):
    """Lines in the scripts' formats (their f-strings, values made up): HybridEP's current one with its kernel-only,
    permute and FP8 sections skipped (its FP8 combine line names no dtype), its earlier one over IB, and DeepEP's
    intranode best lines (8 ranks, the test's default)."""
    log = read_kernel_test_log(tmp_path / "test.log", text)
    assert (log.backend, log.figures, log.ranks_per_node) == (backend, figures, ranks_per_node)
