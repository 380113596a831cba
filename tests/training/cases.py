"""Training runs inside test worker processes: torchtitan's Trainer, losses recorded per step."""

import logging
import os
import time
import types
from unittest import mock

from tests.helpers import REPO_ROOT

TINY = [
    "--training.local_batch_size", "2",
    "--training.seq_len", "64",
    "--training.mixed_precision_param", "float32",
    "--debug.deterministic",
    "--metrics.disable_color_printing",
]
"""A small, deterministic fp32 debug job: bf16 rounding differs between backends
(the combine sums in a different order), and training amplifies that."""


def train_worker(
    rank: int, world_size: int, runs: list[tuple[str, list[str]]], setup=None, after_step=None,
) -> dict[str, dict[int, float]]:
    """Train each (name, args) job in turn; {name: {step: global loss}} (-1 on non-loss PP ranks).

    ``setup(trainer)`` runs before training, ``after_step(trainer)`` after each step.
    """
    os.environ["LOCAL_RANK"] = str(rank)
    os.chdir(REPO_ROOT)
    import torchtitan.train

    from torchtitan_ext.config import load_job_config
    from torchtitan_ext.data import prepare_embedded_assets
    from torchtitan_ext.training import prepare
    from torchtitan_ext.training.trainer import Trainer

    prepare()
    # torchtitan's trainer sleeps 2 s on rank 0 after the last step "for other ranks to complete": here each
    # job's successor (or the worker's end) waits for every rank anyway, and each job would idle 2 s
    without_final_sleep = types.SimpleNamespace(**{**vars(time), "sleep": lambda seconds: None})
    results = {}
    for name, args in runs:
        job_config = load_job_config(args, "cpu", world_size)
        prepare_embedded_assets(job_config)
        trainer = Trainer(job_config)
        losses = {}
        log = trainer.metrics_processor.log

        def record(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None, _log=log, _losses=losses):
            _losses[step] = float(global_avg_loss)
            _log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

        trainer.metrics_processor.log = record
        if setup is not None:
            setup(trainer)
        if after_step is not None:
            train_step = trainer.train_step

            def stepped(data_iterator, _train_step=train_step, _trainer=trainer):
                _train_step(data_iterator)
                after_step(_trainer)

            trainer.train_step = stepped
        try:
            with mock.patch.object(torchtitan.train, "time", without_final_sleep):
                trainer.train()
        finally:
            trainer.close()
        results[name] = losses
    return results


def console_of_a_run(rank: int, world_size: int, args: list[str]) -> list[str]:
    """Train ``args`` as ``python -m torchtitan_ext.train`` does (its console set up first); the lines this
    rank's console showed, as torchrun relays them (``[rank0]:`` first)."""
    from torchtitan_ext.runtime.console import init_logger

    init_logger()
    root = logging.getLogger()
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.setFormatter(root.handlers[0].formatter)
    handler.emit = lambda record: lines.append(f"[rank{rank}]:{handler.format(record)}")
    root.addHandler(handler)
    try:
        train_worker(rank, world_size, [("run", args)])
    finally:
        root.removeHandler(handler)
    return lines
