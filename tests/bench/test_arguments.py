"""Benchmarks refuse the arguments they cannot run with before they start anything."""

import pytest

from torchtitan_ext.bench import price_replicas, step


@pytest.mark.parametrize("main, argv, message", [
    (step.main, ["--steps", "2", "--warmup", "2"], "--steps (2) must exceed --warmup (2)"),
    (price_replicas.main, ["--steps", "1"], "--steps needs at least 2"),
])
def test_a_run_without_a_measured_step_is_refused(capsys, main, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
