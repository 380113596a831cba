"""The files one tool writes and another reads, one module per format: ``metrics.jsonl``
(:mod:`.metrics`), the EP benchmark's rows (:mod:`.ep_bench`), measurement campaigns (:mod:`.campaign`) and a
job's checkpoint folder (:mod:`.checkpoint_folder`).

May import: :mod:`torchtitan_ext.config` (see the tiers in :mod:`torchtitan_ext`).
"""
