"""Measuring: what runs the harness's real code, on this machine, to count or time what a job pays.

Owns: the dry run of the parallelize plan on a fake process group (:mod:`.dry_run`), the device-cost ledger
(:mod:`.device_ledger`, its counter :mod:`.device_cost_counter` and what it counts :mod:`.device_costs`),
one rank's compute per step (:mod:`.compute`) with the collective recorder it replays collectives with
(:mod:`.collective_recorder`), and what the benchmarks share (:mod:`.timing`, the EP benchmarks' labels
:mod:`.ep_variants`). The planners price from what it measures; the benchmarks and ``python -m
torchtitan_ext.ledger`` run it.

May import: every tier below it, up to :mod:`torchtitan_ext.training` (see the tiers in :mod:`torchtitan_ext`).
"""
