"""Planning before launch: what a job costs in memory and communication, and which backend and layout to use.

Owns: the dry run on a fake process group (:mod:`.dry_run`), the per-rank memory and drop-risk plan
(:mod:`.memory_plan`), topology files (:mod:`.topology`), the seed paper's model (:mod:`.paper_model`) and
its application to a job (:mod:`.cost_model`, where tokens reach experts :mod:`.expert_reach`), the layout
advisor (:mod:`.layout_advisor`: the job's shape :mod:`.job_shape`, one priced :mod:`.layout`, the links and
rates it crosses :mod:`.layout_links`, the report :mod:`.advice_report`), the device-cost ledger
(:mod:`.device_ledger`, its counter :mod:`.device_cost_counter` and what it counts :mod:`.device_costs`), this
machine's calibration (:mod:`.calibrate`), measured compute
(:mod:`.measured_compute`) and the collective recorder it replays collectives with (:mod:`.collective_recorder`).
The command line is ``python -m torchtitan_ext.plan``.

May import: every tier below it, up to :mod:`torchtitan_ext.training` (see
the tiers in :mod:`torchtitan_ext`).
"""
