"""Expert load balancing: routing statistics, expert placement and moving experts while training.

Owns: the routing recorder and its files with the ``[routing_stats]`` section
(:mod:`.routing_stats`), the placement and its file with the
``[expert_placement]`` section and check (:mod:`.placement`), the offline
placement search (:mod:`.placement_search`; its command line is
``python -m torchtitan_ext.placement``), moving expert weights and optimizer
state to a placement in training (:mod:`.migration`), the benchmarks' routing
skew with the ``[routing_skew]`` section and check (:mod:`.routing_skew`) and
the routing report's plots (:mod:`.routing_report`, which needs matplotlib and
is imported only by its command line). Importing it registers its sections
and checks.

May import: :mod:`torchtitan_ext.config`, :mod:`~torchtitan_ext.runtime`,
:mod:`~torchtitan_ext.ep`, :mod:`~torchtitan_ext.models` (see the tiers in
:mod:`torchtitan_ext`).
"""

from torchtitan_ext.balancing import placement, routing_skew, routing_stats  # noqa: F401  (register their sections)
