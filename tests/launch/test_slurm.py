"""multinode_trainer.slurm builds the right torchrun command (fake srun/scontrol)."""

import os
import stat

import pytest

from tests.helpers import launcher_env, REPO_ROOT, run_job

pytestmark = pytest.mark.slow


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.txt"
    scripts = {
        "srun": f"""#!/bin/bash
{{ printf '%s\\n' "$@"; echo "ENV NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=${{NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN:-unset}}"; echo "ENV USE_MNNVL=${{USE_MNNVL:-unset}}"; }} > {record}
""",
        # the job's two trays in node-list order, rack 2's first; SLURM's block topology lists rack 1 first
        "scontrol": """#!/bin/bash
case "$*" in
    "show hostnames gb-r[1-2]-t01") printf 'gb-r2-t01\\ngb-r1-t01\\n' ;;
    "show hostnames gb-r1-t[01-18]") printf 'gb-r1-t%02d\\n' $(seq 1 18) ;;
    "show hostnames gb-r2-t[01-18]") printf 'gb-r2-t%02d\\n' $(seq 1 18) ;;
    "show topology") printf 'BlockName=rack1 BlockIndex=0 Nodes=gb-r1-t[01-18] BlockSize=18\\nBlockName=rack2 BlockIndex=1 Nodes=gb-r2-t[01-18] BlockSize=18\\n' ;;
    *) exit 1 ;;
esac
""",
    }
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir, record


def _run(fake_slurm, tmp_path, config, nodes, gpus, *overrides):
    bin_dir, record = fake_slurm
    env = launcher_env(
        SLURM_JOB_NUM_NODES=str(nodes), SLURM_GPUS_ON_NODE=str(gpus), SLURM_JOB_NODELIST="gb-r[1-2]-t01",
        SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO_ROOT), CONFIG_FILE=config, LOG_DIR=str(tmp_path / "logs"),
        DEVICE_TYPE="cuda",  # the batch host of a GPU job has GPUs; this one has none
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env.pop("NGPU")  # processes per node come from SLURM
    result = run_job(["bash", "multinode_trainer.slurm", *overrides], cwd=REPO_ROOT, env=env, timeout_s=300,
                     check=False)
    return result, (record.read_text().splitlines() if record.exists() else [])


def test_gb200_command_and_environment(fake_slurm, tmp_path):
    config = "train_configs/deepseek_v3_671b_gb200.toml"
    result, argv = _run(
        fake_slurm, tmp_path, config, 64, 4, "--training.steps", "7",
        # deep_ep is not installed here; on the cluster the library kernels are used
        "--hybridep.implementation", "reference",
    )
    assert result.returncode == 0, result.output[-3000:]
    command = " ".join(argv)
    # one task per node, node i on line i of the host file (the racks in order), torchrun's node rank its task's
    assert argv[:8] == ["--kill-on-bad-exit=1", "--ntasks=64", "--ntasks-per-node=1", "--distribution=arbitrary",
                        "bash", "-c", 'PET_NODE_RANK="${SLURM_PROCID}" exec "$@"', "node_rank"]
    assert (tmp_path / "logs" / "nodes_in_rack_order.txt").read_text().split() == ["gb-r1-t01", "gb-r2-t01"]
    assert argv[8:17] == [
        "python", "-m", "torchtitan_ext.supervise", "--checkpoint-folder",
        "./outputs/checkpoint", "--dump-folder", "./outputs", "--", "torchrun",
    ]
    assert "--nnodes 64 --nproc_per_node 4" in command
    # a signal that reaches torchrun itself (scancel) goes to the ranks, which get time to save
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 600" in command
    assert "--rdzv_id 4242 --rdzv_backend static --rdzv_endpoint gb-r1-t01:29500" in command
    assert f"--log-dir {tmp_path / 'logs'} --redirects 3" in command
    assert f"-m torchtitan_ext.train --job.config_file {config} --training.steps 7" in command
    # derived from [hybridep] in the config, exported to every rank
    assert "ENV NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=64" in argv
    assert "ENV USE_MNNVL=1" in argv
    assert (tmp_path / "logs").is_dir()


def test_no_library_environment_for_nccl(fake_slurm, tmp_path):
    result, argv = _run(fake_slurm, tmp_path, "train_configs/debug_model.toml", 2, 1)
    assert result.returncode == 0, result.output[-3000:]
    assert "ENV NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=unset" in argv
    assert "ENV USE_MNNVL=unset" in argv


def test_world_size_mismatch_fails_before_srun(fake_slurm, tmp_path):
    result, argv = _run(fake_slurm, tmp_path, "train_configs/deepseek_v3_671b_gb200.toml", 8, 4)
    assert result.returncode == 2
    assert argv == []
    assert "expert_parallel_degree = 64 (x expert TP 1) must divide dp_shard x cp x tp = 32" in result.output
