"""How wrong the layout advisor is, measured on the published comparisons it did not fit, and what the advice
may therefore claim.

``python -m torchtitan_ext.plan --validate --error-output FILE`` prices every held-out comparison as shipped and
under the fit, and writes two numbers per pricing (as shipped, or the fit file's name) to ``FILE``
(``docs/advisor_error.toml`` ships):

- the **gap band**: the largest error, over the held-out rows, of the predicted speed ratio between two backends
  against the published one, as ``exp(|ln(predicted ratio / published ratio)|) - 1`` (whichever backend a row
  lists first). Two layouts whose predicted steps are closer than the band cannot be told apart: the advice says
  "measure both";
- the **figure ratios**: the smallest and largest predicted over published throughput (TFLOPS per GPU, or a step
  time's inverse) over the held-out rows' backends. The advice's headline TFLOPS per GPU is the predicted one
  divided by each: the range that error spans.

The advice reads the shipped file (:data:`SHIPPED`), the entry of its own pricing; a pricing the file does not hold
is refused in one line, since an unmeasured model has no band to state.
"""

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from torchtitan_ext.config import ConfigError
from torchtitan_ext.planning.published_comparisons import HIGHER_IS_FASTER

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "advisor_error.toml"
AS_SHIPPED = "as shipped"
"""The pricing name of the advisor with no fit applied."""


def pricing_name(fit: Path | None) -> str:
    """The pricing of the advice under the fit file ``fit`` (None: as shipped): the file's path from the
    repository's root where it lies inside it, else the path as given."""
    if fit is None:
        return AS_SHIPPED
    resolved = fit.resolve()
    return resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(fit)


@dataclass(frozen=True)
class ModelError:
    """The advisor's error under one pricing, on the held-out published comparisons."""

    pricing: str
    """:data:`AS_SHIPPED`, or the fit file the predictions were made under (:func:`pricing_name`)."""
    gap_band: float
    """The largest |predicted gap - published gap| over the held-out rows, as a fraction (0.10: 10 points)."""
    figure_ratio_low: float
    """The smallest predicted / published figure over the held-out rows' backends (> 0)."""
    figure_ratio_high: float
    """The largest predicted / published figure (>= ``figure_ratio_low``)."""
    rows: tuple[str, ...]
    """The held-out comparisons measured."""
    file: str = ""
    """The error file it was read from (:func:`load_error`), from the repository's root where it lies inside it."""

    def tflops_range(self, predicted: float) -> tuple[float, float]:
        """The range of TFLOPS per GPU that ``predicted`` stands for, given the measured figure ratios."""
        return predicted / self.figure_ratio_high, predicted / self.figure_ratio_low


def measured_error(pricing: str, comparisons, predictions) -> ModelError:
    """The error of ``predictions`` (comparison id -> its prediction) on the held-out rows of ``comparisons``."""
    rows = [c for c in comparisons if c.role == "held_out" and c.id in predictions]
    if not rows:
        raise ConfigError("no held-out comparison is priced: the advisor's error cannot be measured; add a priced "
                          "row with role = \"held_out\" to the comparisons file")
    # the speed ratio of the two backends either way round: ln of it flips sign with the order, its error does not
    errors = [abs(math.log((1 + c.gap(predictions[c.id].figures)) / (1 + c.gap(c.measured)))) for c in rows]
    # predicted over published throughput: a step time's ratio is inverted
    ratios = [(predictions[c.id].figure(backend) / figure) ** (1 if HIGHER_IS_FASTER[c.metric] else -1)
              for c in rows for backend, figure in c.measured.items()]
    return ModelError(pricing, math.exp(max(errors)) - 1, min(ratios), max(ratios), tuple(c.id for c in rows))


def write_error(errors: list[ModelError], path: Path, command: str) -> None:
    """``errors`` as TOML at ``path``, written whole (a temporary file renamed)."""
    header = (f"# Written by {command}:\n# the layout advisor's error on the held-out published comparisons "
              "(torchtitan_ext/planning/advisor_error.py says what each number means).\n")
    document = {"pricing": [{"name": e.pricing, "gap_band": e.gap_band, "figure_ratio_low": e.figure_ratio_low,
                             "figure_ratio_high": e.figure_ratio_high, "rows": list(e.rows)} for e in errors]}
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(header + tomli_w.dumps(document), encoding="utf-8")
        partial.replace(path)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"--error-output {path}: could not write it ({e.strerror}): choose a path in a folder you "
                          "can write") from None


def load_error(path: Path, pricing: str) -> ModelError:
    """The entry of ``pricing`` in the error file at ``path``, checked field by field."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the advisor's error ({e}): rerun python -m torchtitan_ext.plan "
                          f"--validate --error-output {path}") from None
    entries = {entry.get("name"): entry for entry in document.get("pricing", [])}
    if pricing not in entries:
        raise ConfigError(f"{path}: no measured error for pricing '{pricing}' (it holds: "
                          f"{', '.join(map(str, entries)) or 'none'}): run python -m torchtitan_ext.plan --validate "
                          f"--fit-from FILE --error-output {path} for that fit")
    entry = entries[pricing]
    where = f"{path}: pricing '{pricing}'"
    values = {}
    for field in ("gap_band", "figure_ratio_low", "figure_ratio_high"):
        value = entry.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ConfigError(f"{where}: {field} = {value!r}: a finite number >= 0 is required")
        values[field] = float(value)
    if not 0 < values["figure_ratio_low"] <= values["figure_ratio_high"]:
        raise ConfigError(f"{where}: figure_ratio_low must be > 0 and at most figure_ratio_high")
    rows = entry.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(row, str) for row in rows):
        raise ConfigError(f"{where}: rows must list the held-out comparisons measured")
    return ModelError(pricing, values["gap_band"], values["figure_ratio_low"], values["figure_ratio_high"], tuple(rows),
                      pricing_name(path))
