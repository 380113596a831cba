"""Each backend's published kernel figures: quoted from docs/published_ep_figures.md, converted to the
fraction of a link's nominal rate that bytes leaving the rank reach, chosen by the configured SMs, and used
by the advisor's all-to-all price."""

import re

import pytest

from tests.helpers import REPO_ROOT
from torchtitan_ext.config import load_job_config
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.ep import deepep, hybridep, nccl
from torchtitan_ext.ep.published_rates import FABRICS, nearest_sms, PublishedRate
from torchtitan_ext.planning import cost_model as cm
from torchtitan_ext.planning.layout_advisor import kernel_rate_fractions
from torchtitan_ext.planning.topology import Level, Topology

FIGURES = (REPO_ROOT / "docs" / "published_ep_figures.md").read_text(encoding="utf-8")
ALL_RATES = [*nccl.NcclExpertParallel.PUBLISHED_RATES, *hybridep.PUBLISHED_RATES,
             *(rate for rates in deepep.PUBLISHED_RATES.values() for rate in rates)]
DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]


def _figure(value: float) -> str:
    """How the document prints a figure: 485.50 and 485.5, 46 and 46.0 are the same number."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return rf"(?<![\d.]){re.escape(text)}(?:\.0+|0+)?(?![\d])"


@pytest.mark.parametrize("rate", ALL_RATES, ids=lambda rate: f"{rate.fabric}-{rate.sms}-{rate.dispatch_GBps}")
def test_every_figure_is_quoted_in_the_document_at_its_row(rate):
    """The row the source names holds both figures (the section's table line that starts with the row's id,
    or for a whole section, some line of it); the fabric is one the topology may name."""
    assert rate.fabric in FABRICS
    row = re.match(r"docs/published_ep_figures\.md (\S+):", rate.source)[1]
    if re.fullmatch(r"\d+\.\d+|4d\.\d+", row):
        lines = [line for line in FIGURES.splitlines() if line.startswith(f"| {row} |")]
    else:  # a section such as 4b or 4c: one of its table lines holds the SM count and both figures
        section = FIGURES.split(f"### {row}.")[1].split("###")[0]
        lines = [line for line in section.splitlines() if re.search(rf"\| {rate.sms} \|", line)]
    assert any(re.search(_figure(rate.dispatch_GBps), line) and re.search(_figure(rate.combine_GBps), line)
               for line in lines), (rate.source, lines)


def test_a_figure_becomes_the_share_of_the_nominal_rate_that_leaves_the_rank():
    """HybridEP on GB200, 32 ranks, 16 SMs: 485.50 GB/s dispatch counts the rank's own 1/32 of the bytes."""
    rate = next(r for r in hybridep.PUBLISHED_RATES if r.fabric == "mnnvl" and r.sms == 16)
    assert rate.dispatch_fraction == pytest.approx(485.50 * 31 / 32 / 900)
    assert rate.combine_fraction == pytest.approx(423.19 * 31 / 32 / 900)
    bus = PublishedRate("rdma", 46.0, 40.0, 50.0, None, None, "a bus bandwidth")
    assert (bus.dispatch_fraction, bus.combine_fraction) == (pytest.approx(0.92), pytest.approx(0.8))


def test_the_configured_sms_pick_the_figure():
    rates = hybridep.PUBLISHED_RATES
    assert {r.fabric: r.sms for r in nearest_sms(rates, 16)} == {"mnnvl": 16, "nvlink": 16, "rdma": 8}
    assert {r.fabric: r.sms for r in nearest_sms(rates, 32)} == {"mnnvl": 32, "nvlink": 16, "rdma": 8}
    assert {r.fabric: r.sms for r in nearest_sms(rates, 3)} == {"mnnvl": 16, "nvlink": 4, "rdma": 2}
    assert {r.fabric: r.sms for r in nearest_sms(rates, None)} == {"mnnvl": 16, "nvlink": 4, "rdma": 2}

    def chosen(*overrides):
        job_config = load_job_config([*DEBUG_JOB, *overrides], device_type=None, world_size=2)
        backend = overrides[1]
        return {rate.fabric: rate for rate in BACKENDS[backend].published_rates(job_config)}

    # v1 unset uses the library's 20 SMs: on NVLink 5 the 16- and 24-SM figures are as near, and ties go to the
    # fewer SMs; elsewhere only 24-SM figures are published
    legacy = chosen("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.api", "legacy")
    assert (legacy["mnnvl"].sms, legacy["nvlink"].sms, legacy["rdma"].sms) == (16, 24, 24)
    elastic = chosen("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.api", "elastic", "--deepep.num_sms", "48")
    assert (elastic["nvlink"].sms, elastic["rdma"].sms) == (64, 6)
    split = chosen("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.num_sms_dispatch", "32",
                   "--hybridep.num_sms_combine", "16")["mnnvl"]
    assert (split.dispatch_GBps, split.combine_GBps) == (484.22, 423.19)
    assert set(chosen("--parallelism.expert_parallel_comm_backend", "nccl")) == {"rdma"}


def test_the_all_to_all_takes_the_backends_share_of_each_link():
    """Without start-up latency an all-to-all's time is its bytes over the link's rate times the backend's
    fraction (dispatch and combine, one each way: their harmonic mean); a link without a figure stays nominal."""
    level = Level("node", 4, 100.0, 0.0, 100.0, 100.0, "nvlink")
    outer = Level("network", None, 10.0, 0.0, 10.0, 10.0, None)
    topology = Topology("t", 1.0, True, (level, outer))
    job_config = load_job_config([*DEBUG_JOB, "--parallelism.expert_parallel_comm_backend", "hybridep",
                                  "--parallelism.expert_parallel_degree", "4"], device_type=None, world_size=8)
    fractions = kernel_rate_fractions(BACKENDS["hybridep"], job_config, topology)
    rate = next(r for r in hybridep.PUBLISHED_RATES if r.fabric == "nvlink" and r.sms == 16)
    assert fractions == {0: pytest.approx(2 / (1 / rate.dispatch_fraction + 1 / rate.combine_fraction))}
    work = cm.MoEWorkload(tokens=1024, hidden=256, top_k=2, experts=8, expert_parameters=1000, activation_bytes=2,
                          gather_bytes=2, reduce_bytes=4, pre_expert_flops=1e9, regather_in_backward=True)
    nominal = cm.layer_costs(work, topology, 8, 4, 2, True)
    priced = cm.layer_costs(work, topology, 8, 4, 2, True, token_rate_fractions=fractions)
    assert priced.a2a == pytest.approx(nominal.a2a / fractions[0])
    assert (priced.all_gather, priced.token_copies) == (nominal.all_gather, nominal.token_copies)
    across = cm.layer_costs(work, topology, 8, 8, 1, True, token_rate_fractions=fractions)
    assert across.a2a == cm.layer_costs(work, topology, 8, 8, 1, True).a2a  # the network's bytes set it, nominal
