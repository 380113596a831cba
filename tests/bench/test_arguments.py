"""Benchmarks refuse the arguments they cannot run with before they start anything."""

import pytest

from torchtitan_ext.bench import (ep, expert_loop, fresh_clone, price_replicas, replication, replication_cpu_time,
                                  replication_pair, step, suite_cpu)


@pytest.mark.parametrize("main, argv, message", [
    (step.main, ["--steps", "2", "--warmup", "2"], "--steps (2) must exceed --warmup (2)"),
    (price_replicas.main, ["--steps", "1"], "--steps needs at least 2"),
    (ep.main, ["--nproc", "4", "--ep-degree", "3"], "--ep-degree 3: use a divisor of --nproc 4"),
    (ep.main, ["--backends", "nccl", "hybridep_nb"], "argument --backends: invalid choice: 'hybridep_nb'"),
    (expert_loop.main, ["--experts", "4,0"], "argument --experts: 4,0: use expert counts >= 1, comma separated"),
    (expert_loop.main, ["--rounds", "2"], "--rounds: more than 2"),
    (replication.main, ["--steps", "4"], "--steps 4: use more than 4 (the first 3 are warm-up)"),
    (replication.main, ["--alphas", "0,x"], "--alphas 0,x --drift-every 3: use finite alphas >= 0, comma separated, "
                                            "and a drift of at least 1 step"),
    (replication_pair.main, ["--dtypes", "float16"], "--steps 12 --dtypes float16: use at least 2 steps and dtypes "
                                                     "of float32, float64, comma separated"),
    (fresh_clone.main, ["--campaign", "fresh-clone_cpu_2026-12-01.jsonl", "--against", "HEAD~1", "--rounds", "3"],
     "--rounds 3: use at least 1, and with --against an even number"),
    (fresh_clone.main, ["--campaign", "fresh-clone_cpu_2026-12-01.jsonl", "--env", "ATEN_CPU_CAPABILITY"],
     "--env ATEN_CPU_CAPABILITY: give NAME=VALUE, NAME a variable's name"),
    (suite_cpu.main, ["--campaign", "suite-cpu_cpu_2026-12-01.jsonl", "--top", "0"], "--top 0: print at least 1 file"),
    (replication_cpu_time.main, ["--steps", "3"], "--steps 3: use more than 3 (the first 3 are warm-up)"),
    (replication_cpu_time.main, ["--nproc", "1"], "use at least 2 ranks, 1 slot, 1 round and a drift of 1 step"),
    (replication_cpu_time.main, ["--alphas", "1,x"], "--alphas 1,x: use finite alphas >= 0, comma separated"),
    # a recomputed layer would time its segments twice
    (replication_cpu_time.main, ["--", "--activation_checkpoint.mode", "full"],
     "activation_checkpoint.mode 'full', parallelism.pipeline_parallel_degree 1: the CPU times are split per MoE "
     "layer on every rank: use 'none' and 1"),
])
def test_a_bad_argument_is_refused_before_any_run(capsys, main, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
