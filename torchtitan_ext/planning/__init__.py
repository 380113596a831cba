"""Planning before launch: what a job costs in memory and communication, and which backend and layout to use.

Owns: the per-rank memory and drop-risk plan (:mod:`.memory_plan`), topology files (:mod:`.topology`), the seed
paper's model (:mod:`.paper_model`) and its application to a job (:mod:`.cost_model`, where tokens reach experts
:mod:`.expert_reach`, the bytes a backend's local work moves :mod:`.local_traffic`), the layout advisor
(:mod:`.layout_advisor`: the job's shape :mod:`.job_shape`, one priced :mod:`.layout`, the links and rates it
crosses :mod:`.layout_links`, replicas :mod:`.replica_cost`, the report :mod:`.advice_report`), its inputs
measured elsewhere (:mod:`.measured_compute`, :mod:`.measured_rates`, :mod:`.nccl_tests_log`), this machine's
calibration (:mod:`.calibrate`) and the fit on published comparisons (:mod:`.published_comparisons`,
:mod:`.advisor_fit`). What runs the real code to measure is :mod:`torchtitan_ext.measuring`. The command line
is ``python -m torchtitan_ext.plan``.

May import: :mod:`torchtitan_ext.config`, :mod:`~torchtitan_ext.runtime`, :mod:`~torchtitan_ext.records`,
:mod:`~torchtitan_ext.ep`, :mod:`~torchtitan_ext.models` (see the tiers in :mod:`torchtitan_ext`).
"""
