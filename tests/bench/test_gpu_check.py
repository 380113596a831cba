"""The one-GPU check on a CPU: what it would run (its dry run), its refusal to run, and the table it prints."""

import json
import sys

import pytest

from torchtitan_ext.bench import gpu_check


def test_the_dry_run_prints_every_stage_and_captures_only_sync_free_backends(capsys, tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [stage.name for stage in gpu_check.stages(tmp_path)]
    assert [line.split(" (at most")[0] for line in lines[:-1]] == names
    assert "cuda graph capture" in names and "16B step ours vs upstream" in names
    # nccl reads its split sizes on the host and blocking hybridep reads its token count: neither fits a graph
    assert lines[-1] == "cuda graph capture covers: hybridep_non_blocking, ncclep_static"


def test_without_a_gpu_it_refuses_in_one_line(capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "--dry-run" in captured.err
    assert not (tmp_path / "gpu_check.json").exists()


def test_the_table_has_each_stage_with_its_result_or_what_failed():
    report = {
        "environment": {"status": 0, "seconds": 2.0, "result": {"torch": "2.13.0", "cuda": "13.0",
                                                                   "device": "NVIDIA H100", "date": "2026-11-26"}},
        "gpu tests": {"status": 0, "seconds": 80.5, "output": "noise\n5 passed, 5 skipped in 82.36s\nwarning\n"},
        "ledger cuda vs cpu": {"status": 0, "seconds": 20.0, "result": {
            "nccl": {"cuda": {"forward": {"host_syncs": 1}}, "cpu": {"forward": {"host_syncs": 1}}, "agree": True},
            "hybridep": {"cuda": {"error": "Traceback\n  frame\nRuntimeError: sync\n"}, "cpu": {}, "agree": False}}},
        "bench ep": {"status": 1, "seconds": 30.1, "output": "Traceback\nRuntimeError: No backend\n  return f()\n"},
        "inductor compile, debug model": {"status": "skipped: 337 s spent of 300"},
    }
    table = gpu_check.stage_table(report).splitlines()
    assert len(table) == 2 + len(report)
    assert table[-4] == "| gpu tests | 0 | 80.5 | 5 passed, 5 skipped in 82.36s |"
    assert table[-3] == ("| ledger cuda vs cpu | 0 | 20.0 | nccl: agree=True; hybridep: agree=False; "
                         "hybridep cuda: RuntimeError: sync |")
    assert table[-2] == "| bench ep | 1 | 30.1 | RuntimeError: No backend |"
    assert table[-1] == "| inductor compile, debug model | skipped: 337 s spent of 300 |  |  |"


def test_stages_picks_what_runs_and_refuses_an_unknown_name(capsys, tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--stages", "bench ep"]) == 0
    assert [line.split(" (at most")[0] for line in capsys.readouterr().out.splitlines()[:-1]] == [
        "environment", "bench ep"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--stages", "bench_ep"])
    assert "--stages: no stage 'bench_ep'; the stages: 'environment', " in capsys.readouterr().err


def test_a_failed_stage_shows_the_line_that_says_what_failed_not_its_last_step():
    output = "step:  1  loss:  8.1\n[rank0]: Traceback\n[rank0]: torch._dynamo.exc.BackendCompilerFailed: boom\n"
    assert gpu_check.summary({"status": 1, "output": output}) == "[rank0]: torch._dynamo.exc.BackendCompilerFailed: boom"
    assert gpu_check.summary({"status": 0, "output": output.split("[rank0]")[0] + "warning\n"}) == "step:  1  loss:  8.1"


@pytest.mark.slow
def test_a_stage_stopped_at_its_limit_reports_what_both_streams_held():
    code = "import sys, time; print('step 3 of 16', flush=True); print('loading', file=sys.stderr, flush=True); " \
           "time.sleep(60)"
    report = gpu_check._run(gpu_check.Stage("slow", [sys.executable, "-c", code], timeout_s=3))
    assert report["status"] == "timeout"
    assert report["output"] == "step 3 of 16\nloading\n"


@pytest.mark.slow
def test_a_failed_stage_fails_the_check_and_each_stage_is_on_disk_before_the_next_starts(monkeypatch, tmp_path):
    """Three stages in 3 s: the second reads the report the first left on disk and fails; the third would sleep
    past the budget and is stopped there (not a failure of its own); the check exits 1, naming the failed one."""
    import torch

    report_path = tmp_path / "gpu_check.json"
    read_report = f"import json, sys; print(sorted(json.load(open({str(report_path)!r})))); sys.exit(3)"
    monkeypatch.setattr(gpu_check, "stages", lambda out: [
        gpu_check.Stage("environment", [sys.executable, "-c", "print('ok')"], 60),
        gpu_check.Stage("reads the report", [sys.executable, "-c", read_report], 60),
        gpu_check.Stage("past the budget", [sys.executable, "-c", "import time; time.sleep(60)"], 60),
    ])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_check.main(["--out", str(tmp_path), "--budget-s", "3"]) == 1
    report = json.loads(report_path.read_text())
    assert report["environment"]["status"] == 0
    assert (report["reads the report"]["status"], report["reads the report"]["output"]) == (3, "['environment']\n")
    assert report["past the budget"]["status"] == "stopped at the budget: 3 s spent"
