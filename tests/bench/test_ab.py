"""bench ab's comparison row: the medians of the interleaved runs' step times, the job as the advisor prices it,
written in the comparisons format and read back through plan's checks (the runs themselves are the one launcher's,
tested with it)."""

import pytest
import torch

from torchtitan_ext.bench import ab
from torchtitan_ext.config import ConfigError
from torchtitan_ext.planning.published_comparisons import load_comparisons

JOB = ["--job.config_file", "train_configs/debug_model.toml", "--training.local_batch_size", "2"]


@pytest.fixture(autouse=True)
def a_cpu_machine(monkeypatch):
    """The runs as the launcher places them here: two processes on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("NGPU", "2")
    monkeypatch.delenv("CONFIG_FILE", raising=False)


def test_the_row_holds_each_backends_median_and_reads_back_as_a_priced_comparison(tmp_path, monkeypatch):
    runs = iter([([3.0, 5.0, 4.0], "float32"), ([2.0, 2.5, 9.0], "float32"),
                 ([6.0, 1.0, 4.5], "float32"), ([2.2, 2.4, 2.6], "float32")])
    monkeypatch.setattr(ab, "timed_run", lambda backend, args, world_size, folder: next(runs))
    out = tmp_path / "ab.toml"
    assert ab.main(["--backends", "nccl", "deepep", "--topology", "hgx_h100_ib", "--comparison", str(out),
                    "--steps", "4", "--warmup", "1", "--rounds", "2", "--role", "held_out", "--", *JOB]) == 0
    [row] = load_comparisons(out)
    # round 1 nccl then deepep, round 2 deepep then nccl: nccl ran 1st and 4th (3, 5, 4, 2.2, 2.4, 2.6: median 2.8),
    # deepep 2nd and 3rd (2, 2.5, 9, 6, 1, 4.5: median 3.5)
    assert row.measured == {"nccl": pytest.approx(2.8), "deepep": pytest.approx(3.5)}
    assert (row.role, row.metric, row.faster(row.measured)) == ("held_out", "s/step", "nccl")
    assert row.priced.train_args == ["--job.config_file", "train_configs/debug_model.toml",
                                     "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32"]
    assert (row.priced.topology, row.priced.world_size, row.priced.ep, row.priced.precision, row.priced.device) == (
        "hgx_h100_ib", 2, 2, "fp32", "cpu")


def test_a_written_file_is_never_overwritten_and_a_bad_job_is_refused_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(ab, "timed_run", lambda *args: pytest.fail("a run started"))
    taken = tmp_path / "ab.toml"
    taken.write_text("")
    with pytest.raises(ConfigError, match="give a new file in an existing folder"):
        ab.main(["--backends", "nccl", "deepep", "--topology", "hgx_h100_ib", "--comparison", str(taken), "--", *JOB])
    with pytest.raises(ConfigError, match="expert_parallel_degree"):
        ab.main(["--backends", "nccl", "hybridep", "--topology", "hgx_h100_ib", "--comparison",
                 str(tmp_path / "new.toml"), "--", *JOB, "--parallelism.expert_parallel_degree", "1"])
