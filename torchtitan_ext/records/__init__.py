"""The files one tool writes and another reads, one module per format: ``metrics.jsonl``
(:mod:`.metrics`) and the EP benchmark's rows (:mod:`.ep_bench`).

May import: :mod:`torchtitan_ext.config` (see the tiers in :mod:`torchtitan_ext`).
"""
