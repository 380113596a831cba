"""What the layout advice may tell the user: one layout ("pick"), or the layouts the model cannot tell apart
("measure"), from the advisor's measured error (:mod:`.advisor_error`).

A layout is picked only when every other runnable layout's predicted step is longer than the first's by more than
the gap band, the largest error of a predicted gap between two backends on the held-out published comparisons.
Otherwise every layout within the band is a candidate to time on the user's cluster, the first included. A layout
priced at a link's nominal rate (no published figure: a bound on its time) is a candidate whenever its bound falls
within the band, since it may be that fast. The headline figures are ranges, the predicted TFLOPS per GPU over the
largest and the smallest predicted / published figure measured.
"""

from dataclasses import dataclass

from torchtitan_ext.planning.advisor_error import ModelError
from torchtitan_ext.planning.layout import Layout

MEASURED_STEPS = 30
"""Steps each candidate trains when the user times it: enough after torchtitan's warm-up for a stable median."""


@dataclass(frozen=True)
class Decision:
    kind: str
    """"pick": the first layout is faster than every other by more than the band, and priced, not a bound;
    "measure": otherwise."""
    error: ModelError
    candidates: tuple[Layout, ...]
    """The first layout, then (for "measure") every other layout within the band, in the advice's order."""

    @property
    def first(self) -> Layout:
        return self.candidates[0]

    def tflops_range(self, layout: Layout) -> tuple[float, float]:
        return self.error.tflops_range(layout.tflops_per_gpu)


def decide(runnable: list[Layout], error: ModelError) -> Decision:
    """The decision over ``runnable`` (ranked, the advice's order: priced layouts first, nominal-rate bounds after)."""
    first = runnable[0]
    within = tuple(layout for layout in runnable[1:] if layout.step_s <= first.step_s * (1 + error.gap_band))
    # a layout priced at a nominal rate is a bound on its time, never a pick
    return Decision("measure" if within or first.nominal_links else "pick", error, (first, *within))


def measure_arguments(layout: Layout) -> list[str]:
    """What to add to the job's own launch to time ``layout`` on the cluster: its overrides, the steps, a log line
    per step (``metrics.jsonl`` then holds every step's ``time_metrics/end_to_end_slowest_rank(s)``)."""
    return [*layout.overrides(), "--training.steps", str(MEASURED_STEPS), "--metrics.log_freq", "1"]
