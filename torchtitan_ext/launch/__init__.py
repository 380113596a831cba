"""Launching jobs: the launchers' pre-flight checks and the torchrun supervisor.

Owns: :mod:`.preflight` (``python -m torchtitan_ext.launch.preflight``, what
``run_train.sh`` and the SLURM script check before starting any process) and
:mod:`.supervisor` (``python -m torchtitan_ext.supervise``).

May import: every tier below it (see the tiers in :mod:`torchtitan_ext`); the
supervisor imports only modules that need nothing beyond the standard library
(:mod:`.processes`, the reader of ``metrics.jsonl``
:mod:`torchtitan_ext.records.metrics`, and the preemption signals
:mod:`torchtitan_ext.runtime.preemption`), so that it starts fast and survives what
the job does.
"""
