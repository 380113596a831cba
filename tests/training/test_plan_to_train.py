"""plan --hf-config ... --emit-config writes a job config that trains as written: the model named as
``hf:<config.json>``, read by training itself. For each family the emitted config dry-runs at full size on the world
size it was planned for, then trains a few steps on a CPU at its debug flavour (only the size, the data, the EP
degree, the suite's fp32 deterministic settings and what a CPU cannot do are overridden). In-process, as
run_train.sh's ranks load a job: the launcher's own path for a config file is the other configs' (tests/launch)."""

import tomllib

import pytest
import torch.distributed as dist

from tests.helpers import REPO_ROOT, run_distributed
from tests.training.cases import TINY, train_worker
from torchtitan_ext import plan
from torchtitan_ext.config import load_job_config
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.measuring.dry_run import dry_run

pytestmark = pytest.mark.slow  # the planner's advice over every layout, twice: about 25 s

FAMILIES = {
    # family: (HF config, the job planned, its world size, topology, debug flavour)
    "qwen3": ("docs/hf_configs/qwen3-30b-a3b.json", "train_configs/qwen3_30b_a3b.toml", 8, "hgx_h100_ib",
              "debugmodel_moe_small"),
    "gpt_oss": ("docs/hf_configs/gpt-oss-120b.json", "train_configs/gpt_oss_120b_gb200.toml", 64, "gb200_nvl72",
                "debugmodel_small"),
}
STEPS = 2
DEBUG_EP = 2
AT_DEBUG_SIZE = (
    "--model.hf_assets_path", "./assets/embedded", "--training.dataset", "stdlib_code",
    "--parallelism.expert_parallel_degree", str(DEBUG_EP), "--compile.no-enable", "--model.converters", "",
    "--checkpoint.no-enable", "--training.steps", str(STEPS), "--metrics.log_freq", "1", *TINY,
)


@pytest.fixture(scope="module")
def emitted(tmp_path_factory, monkeypatch_module):
    """{family: the emitted config's path}: plan run as its CLI, from the repository root."""
    monkeypatch_module.chdir(REPO_ROOT)
    folder = tmp_path_factory.mktemp("emitted")
    written = {}
    for family, (hf_config, job, world_size, topology, _) in FAMILIES.items():
        written[family] = folder / f"{family}.toml"
        plan.main(["--hf-config", hf_config, "--job.config_file", job, "--world-size", str(world_size),
                   "--topology", topology, "--emit-config", str(written[family])])
    return written


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("family", FAMILIES)
def test_emitted_config_names_the_model_and_dry_runs_at_full_size(family, emitted):
    hf_config, _, world_size, _, _ = FAMILIES[family]
    written = tomllib.loads(emitted[family].read_text())
    assert written["model"]["name"] == family and written["model"]["flavor"] == f"hf:{hf_config}"
    # the planned job's description named its own layout: the emitted one names the layout it holds
    backend, ep = (written["parallelism"][key] for key in ("expert_parallel_comm_backend", "expert_parallel_degree"))
    assert written["job"]["description"].startswith(f"{family} hf:{hf_config}, {backend} EP={ep}, {world_size} ranks")
    try:
        report = dry_run(load_job_config(["--job.config_file", str(emitted[family])], device_type=None,
                                         world_size=world_size), world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert report.model == f"{family} hf:{hf_config}"
    assert report.parameter_devices == {"meta"}


def _nvlink_domain_at_debug_size(config_file) -> list[str]:
    """The emitted backend's EP ranks per NVLink domain at the debug run's EP degree, where the config names one."""
    written = tomllib.loads(config_file.read_text())
    section = BACKENDS[written["parallelism"]["expert_parallel_comm_backend"]].config_section
    if "ranks_per_nvlink_domain" not in written.get(section, {}):
        return []
    return [f"--{section}.ranks_per_nvlink_domain", str(DEBUG_EP)]


def test_emitted_configs_train_at_debug_size(emitted, tmp_path):
    runs = [(family, ["--job.config_file", str(emitted[family]), "--model.flavor", FAMILIES[family][4],
                      "--job.dump_folder", str(tmp_path / family), *AT_DEBUG_SIZE,
                      *_nvlink_domain_at_debug_size(emitted[family])]) for family in FAMILIES]
    losses = run_distributed(2, train_worker, runs)[0]
    for family in FAMILIES:
        assert list(losses[family]) == list(range(1, STEPS + 1)), (family, losses[family])
