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
     "rerun it with --num-tokens 8192 --hidden 7168"),
])
def test_a_test_log_that_cannot_calibrate_is_one_line(tmp_path, text, message):
    """Lines in the scripts' current formats (their f-strings, values made up): a missing combine, an internode run
    without its node count, a shape that is not the job's."""
    path = tmp_path / "test.log"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        calibration_rates([path], load_topology("hgx_h100_ib"), shape=MoEShape(7168, 256, 8, 8192))
    assert "\n" not in str(caught.value)
