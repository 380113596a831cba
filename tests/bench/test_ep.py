"""Smoke tests of the benchmark scripts: they run on one tiny shape (not how fast)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT


def test_bench_ep_runs(tmp_path):
    out, table = tmp_path / "ep.json", tmp_path / "bench.md"
    result = subprocess.run(
        [sys.executable, "scripts/bench_ep.py", "--nproc", "2", "--tokens", "32", "--hidden", "16",
         "--experts", "4", "--top-k", "2", "--warmup", "1", "--iters", "2", "--no-progress",
         "--json", str(out), "--markdown", str(table)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["nccl", "deepep", "hybridep", "hybridep_nb", "upstream"]
    for row in rows:
        assert 0 < row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert row["bare_median_ms"] > 0 and row["bytes_sent_per_rank"] > 0 and row["collectives"] > 0
    assert "| nccl | T=32 H=16 E=4 K=2 EP=2 |" in table.read_text()
    assert [(r["comm_backend"], r["dtype"], r["forward_only"]) for r in rows] == [
        ("nccl", "float32", False), ("deepep", "float32", False), ("hybridep", "float32", False),
        ("hybridep", "float32", False), (None, "float32", False)]
    # the file calibrates the layout advisor: each backend's rate on the link these 2 processes share
    advice = subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.plan", "--job.config_file", "train_configs/debug_model.toml",
         "--topology", "hgx_h100_ib", "--world-size", "2", "--calibrate-from", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert advice.returncode == 0, advice.stderr[-3000:]
    text = " ".join(advice.stdout.split())
    # the job's own settings: DeepEP V2 (its rows[1]), HybridEP blocking (rows[2]); and DeepEP v1, not timed
    for backend, row in (("nccl", 0), ("deepep", 1), ("hybridep", 2)):
        assert re.search(rf"{backend}: NVLink \(one node\): [0-9.]+ of nominal, measured \(ep\.json rows\[{row}\]: T=32 "
                         r"H=16 EP=2[^,]*, [0-9.e-]+ ms measured, [0-9.e-]+ ms at the nominal rate\)", text), text
    assert re.search(r"deepep legacy: NVLink \(one node\): dispatch 0\.67, combine 0\.69 of nominal \(1\.1\)", text), text


def test_bench_ep_local_work_runs_each_process_as_its_own_group(tmp_path):
    """--ep-degree 1: the backends' local work alone, as many processes sharing the machine."""
    out = tmp_path / "ep.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_ep.py", "--nproc", "2", "--ep-degree", "1", "--tokens", "32",
         "--hidden", "16", "--experts", "4", "--top-k", "2", "--warmup", "1", "--iters", "2", "--no-progress",
         "--backends", "nccl", "hybridep", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["ep"], r["processes"]) for r in rows] == [("nccl", 1, 2), ("hybridep", 1, 2)]
    for row in rows:
        assert 0 < row["bare_median_ms"] and 0 < row["median_ms"]
    assert "T=32 H=16 E=4 K=2 EP=1 x 2 groups" in result.stdout


def test_bench_ep_refuses_an_ep_degree_that_does_not_divide_the_processes(capsys):
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("bench_ep", REPO_ROOT / "scripts" / "bench_ep.py")
    bench_ep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_ep)
    with pytest.raises(SystemExit) as exit_info:
        bench_ep.main(["--nproc", "4", "--ep-degree", "3"])
    assert exit_info.value.code == 2
    assert "--ep-degree 3: use a divisor of --nproc 4" in capsys.readouterr().err


def test_bench_step_runs(tmp_path):
    out, table = tmp_path / "step.json", tmp_path / "bench.md"
    result = subprocess.run(
        [sys.executable, "scripts/bench_step.py", "--rounds", "1", "--steps", "2", "--warmup", "1",
         "--no-progress", "--json", str(out), "--markdown", str(table), "--",
         "--training.seq_len", "32", "--training.local_batch_size", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["times"]["upstream"]) == len(data["times"]["ours"]) == 1
    assert data["ratio"] > 0
    assert "Ratio ours / upstream" in table.read_text()


def test_bench_overlap_runs(tmp_path):
    table = tmp_path / "bench.md"
    result = subprocess.run(
        [sys.executable, "scripts/bench_overlap.py", "--nproc", "2", "--tokens", "32", "--hidden", "16",
         "--ffn", "8", "--experts", "4", "--top-k", "2", "--warmup", "1", "--iters", "2", "--no-progress",
         "--markdown", str(table)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in table.read_text().splitlines() if line.startswith("| ")][1:]
    assert [row[0].strip() for row in rows] == ["nccl", "deepep", "hybridep"]
    for _, overlapped, landed_first, ratio in rows:
        assert float(overlapped) > 0 and float(landed_first) > 0 and float(ratio) > 0


def test_check_cluster_without_cuda_lists_the_prerequisites_and_what_it_cannot_check():
    """scripts/check_cluster.sh is the first command on a cluster. Without CUDA it lists what deep_ep needs
    (one line each, with the fix where something is missing), says what only a GPU node can tell, and exits 0."""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has CUDA: the check would run for real")
    result = subprocess.run(["./scripts/check_cluster.sh"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CUDA_HOME": "", "NCCL_DIR": "/nonexistent"})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "check_cluster: what deep_ep needs on this machine"
    assert lines[-1].startswith("check_cluster: no CUDA device on this machine: the kernels, benchmarks and training")
    checks = lines[1:-1]
    assert [line.split(":")[0] for line in checks] == [
        "- CUDA toolkit (nvcc, for the kernels compiled at first use)",
        "- NCCL >= 2.30.4 (DeepEP main v2.1, V2's Gin backend)", "- NCCL >= 2.32.3 (DeepEP V2.5)",
        "- NVSHMEM >= 3.3.9 (DeepEP main v2.1's build, for the v1 API's internode kernels; V2.5 needs none)", "- writable kernel caches",
        "- multi-node HybridEP build (NIXL or DOCA)", "- pynvml (the hybrid-ep build's v1 Buffer checks NVLink pairs with it)",
        "- deep_ep importable", "- GPUs, NVLink, RDMA, the NCCL torch actually loads, the kernels",
    ]
    assert "- NCCL >= 2.30.4 (DeepEP main v2.1, V2's Gin backend): missing: NCCL_DIR=/nonexistent has no include/nccl.h" \
        in checks
    assert checks[-1].endswith(": not checkable here: no CUDA device: run this on a GPU node")


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_replication_reads_both_ranks_step_lines(capsys):
    """The step line as the launcher prints it with LOG_RANK=0,1; too few steps for a warm-up is refused."""
    bench = _script("bench_replication")
    lines = "\n".join(
        f"[rank{rank}]:09:14:1{step} step:  {step}  loss:  8.0{step}  grad_norm:  2.1352  step_time:  {step + rank}.5s"
        f"  recv max/mean: 1.{step}0"
        for rank in (0, 1) for step in range(1, 6)
    )
    found = bench.STEP.findall(lines)
    assert len(found) == 10 and found[-1] == ("1", "5", "8.05", "6.5", "1.50")
    times = {rank: {step: step + rank + 0.5 for step in range(1, 6)} for rank in (0, 1)}
    assert bench.slowest_median(times) == 6.0  # rank 1, steps 4 and 5: 5.5 and 6.5
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--steps", "4"])
    assert exit_info.value.code == 2
    assert "--steps 4: use more than 4 (the first 3 are warm-up)" in capsys.readouterr().err


def test_bench_replication_reads_the_all_layers_ratio_from_tensorboard(tmp_path):
    """torchtitan writes the metrics rank's scalars under dump_folder/tb/<time>/; other tags are left out."""
    from torch.utils.tensorboard import SummaryWriter

    bench = _script("bench_replication")
    writer = SummaryWriter(str(tmp_path / "tb" / "20261125-2300"))
    for step in range(1, 4):
        writer.add_scalar(bench.ALL_LAYERS, 1.0 + step / 10, step)
        writer.add_scalar("loss_metrics/global_avg_loss", 8.0, step)
    writer.close()
    assert bench.logged_scalars(tmp_path, bench.ALL_LAYERS) == pytest.approx({1: 1.1, 2: 1.2, 3: 1.3})
    assert bench.logged_scalars(tmp_path, "ep/absent") == {}


def test_bench_replica_split_runs():
    result = subprocess.run([sys.executable, "scripts/bench_replica_split.py", "--calls", "1"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()[2:]]
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [(2, 8, 2), (8, 64, 2), (64, 256, 1), (64, 256, 2)]
    assert all(int(r[4].replace(",", "")) > 0 for r in rows)


def test_bench_replica_transfer_runs():
    """The debug model's expert (w1, w2, w3: 3 x 256 x 256 floats, 0.75 MiB in fp32) is sent once per slot and
    direction, and each slot count gets its times."""
    result = subprocess.run([sys.executable, "scripts/bench_replica_transfer.py", "--iterations", "1", "--slots", "1"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("deepseek_v3 debugmodel: 8 experts of 0.750 MiB in fp32, 5 MoE layers, EP=2"), lines
    rows = [line.split("|")[1:-1] for line in lines[3:]]
    assert [(int(r[0]), float(r[1])) for r in rows] == [(1, 0.75)]
    assert all(float(cell) > 0 for row in rows for cell in row[2:])


def test_price_replicas_refuses_a_dump_too_short_to_price(capsys):
    price = _script("price_replicas")
    with pytest.raises(SystemExit) as exit_info:
        price.main(["--steps", "1"])
    assert exit_info.value.code == 2
    assert "--steps needs at least 2" in capsys.readouterr().err
