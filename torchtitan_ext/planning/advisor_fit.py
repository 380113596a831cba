"""The layout advisor's free parameters, fitted on the published comparisons whose role is ``fit``.

    python -m torchtitan_ext.plan --fit [--comparisons FILE] [--fit-output FILE]

At most three parameters, each with a meaning, in two kinds:

- ``compute_scale`` (one per topology): the achieved compute rate of the fitted jobs over the topology's
  ``compute_tflops``. Fitted first, on the figures of the backends whose all-to-all the advisor prices from
  published kernel figures, whose step is then compute plus a communication it already prices.
- ``link_fraction`` (one per backend and fabric): the share of the link's nominal rate a backend's all-to-all
  reaches on a fabric it publishes no figure for (nccl on NVL72's MNNVL), fitted next, on that backend's figures,
  with the compute scale fixed. It takes the place of the nominal rate, as a measured rate does
  (``plan --calibrate-from``).

A fixed cost per EP call (launches, host syncs) would be a third kind; the fit rows here cannot tell it from
these two, so it is not fitted. Each parameter is the root of its figures' mean log error (bisected), so with
one figure per parameter the fit rows' residuals are 0 by construction: the held-out rows are the check.
"""

import json
import math
import tomllib
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path

from torchtitan_ext.config import ConfigError, parse
from torchtitan_ext.ep import BACKENDS, PLANNING_PROFILES
from torchtitan_ext.planning.measured_rates import MeasuredRate
from torchtitan_ext.planning.published_comparisons import HIGHER_IS_FASTER, job_of, predict
from torchtitan_ext.planning.topology import load_topology, Topology

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "advisor_fit.toml"
MAX_PARAMETERS = 3
def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string (JSON's escapes are TOML's; raw UTF-8 avoids surrogate escapes)."""
    return json.dumps(text, ensure_ascii=False)


ROOT_TOLERANCE = 1e-3
"""How far (mean log of predicted over published) the fit rows' figures may stay off at a fitted parameter."""
SCALE_RANGE = (0.05, 4.0)
"""Where ``compute_scale`` is searched."""
FRACTION_RANGE = (0.005, 1.0)
"""Where a ``link_fraction`` is searched: a share of the nominal rate."""


@dataclass(frozen=True)
class LinkFraction:
    backend: str
    settings: tuple
    """The backend's rate settings in the fitted layout (:meth:`~torchtitan_ext.ep.planning_profile.PlanningProfile.rate_settings`)."""
    fabric: str
    fraction: float


@dataclass(frozen=True)
class FittedParameters:
    compute_scale: dict[str, float]
    """Topology name -> achieved compute over its ``compute_tflops``."""
    link_fractions: tuple[LinkFraction, ...]
    fitted_on: tuple[str, ...]
    """The comparisons' ids."""
    residuals: dict[str, float] = field(default_factory=dict)
    """"<comparison id> <backend>" -> predicted over published figure, minus 1, under these parameters."""

    @property
    def count(self) -> int:
        return len(self.compute_scale) + len(self.link_fractions)

    def link_shares(self) -> dict[tuple[str, tuple, str], float]:
        """{(backend, rate settings, fabric): fitted share of the nominal rate}: the other end of the range of a
        layout priced at a nominal rate (the layout advisor's ``fitted_fractions``)."""
        return {(link.backend, link.settings, link.fabric): link.fraction for link in self.link_fractions}

    def applied(self, topology: Topology) -> tuple[Topology, dict[tuple[str, tuple, int], MeasuredRate]]:
        """``topology`` with its compute scaled, and the fitted link fractions as the advisor's measured rates."""
        scale = self.compute_scale.get(topology.name)
        if scale is not None:
            topology = topology.scaled(scale, f"{scale:.3f} of the topology's, fitted on {', '.join(self.fitted_on)}")
        rates = {}
        for link in self.link_fractions:
            for level, spec in enumerate(topology.levels):
                if spec.fabric == link.fabric:
                    rates[link.backend, link.settings, level] = MeasuredRate(
                        link.backend, link.settings, level, link.fraction,
                        f"on {', '.join(self.fitted_on)}", includes_local_work=False, fitted=True)
        return topology, rates


def _root(error, low: float, high: float, what: str, iterations: int = 20) -> float:
    """The x in [low, high] (bisected in log space, to a millionth of its log range) where ``error``, which grows
    with x, is 0."""
    at_low, at_high = error(low), error(high)
    if at_low > 0 or at_high < 0:
        raise ConfigError(f"{what}: no value in [{low:g}, {high:g}] matches the fit rows' figures (predicted "
                          f"{'faster' if at_low > 0 else 'slower'} across it): check the rows' figures and jobs")
    a, b = math.log(low), math.log(high)
    for _ in range(iterations):
        middle = (a + b) / 2
        a, b = (a, middle) if error(math.exp(middle)) > 0 else (middle, b)
    root = math.exp((a + b) / 2)
    if abs(error(root)) > ROOT_TOLERANCE:  # the error jumps there (a layout's ranking changed): no root
        raise ConfigError(f"{what}: the fit rows' figures are {error(root):+.3f} (mean log) off at the best value, "
                          f"{root:.4g}: no value matches them; check the rows' figures and jobs")
    return root


def fit(comparisons: list) -> FittedParameters:
    """Fit the parameters on the priced comparisons whose role is ``fit`` (ConfigError if there is none, or if they
    would need more than :data:`MAX_PARAMETERS`)."""
    rows = [comparison for comparison in comparisons if comparison.role == "fit" and comparison.priced]
    if not rows:
        raise ConfigError("no priced comparison has role 'fit': mark one or more (docs/published_comparisons.toml)")
    jobs = {row.id: job_of(row) for row in rows}  # read once: each parameter prices the rows many times
    shipped = {row.id: predict(row, job_config=jobs[row.id]) for row in rows}
    topologies = {row.id: load_topology(row.priced.topology) for row in rows}
    nominal, priced = [], []  # (row, backend): figures priced at a nominal link rate, and the others
    for row in rows:
        for backend in row.measured:
            (nominal if shipped[row.id].layouts[backend].nominal_links else priced).append((row, backend))
    scales_needed = sorted({topologies[row.id].name for row, _ in priced})
    links_needed = {}
    for row, backend in nominal:
        layout = shipped[row.id].layouts[backend]
        settings = PLANNING_PROFILES[backend].rate_settings(parse(["--job.config_file", row.priced.config, *row.priced.overrides,
                                                          *layout.overrides()]))
        for fabric in dict.fromkeys(layout.nominal_fabrics):
            links_needed.setdefault((backend, settings, fabric), []).append((row, backend))
    if len(scales_needed) + len(links_needed) > MAX_PARAMETERS:
        raise ConfigError(f"the fit rows would need {len(scales_needed) + len(links_needed)} parameters (compute "
                          f"scale of {', '.join(scales_needed)}; link fractions of {len(links_needed)} backend and "
                          f"fabric pairs): fit on fewer topologies or backends (at most {MAX_PARAMETERS})")
    fitted_on = tuple(row.id for row in rows)

    def log_error(parameters: FittedParameters, figures: list) -> float:
        """How much faster than published the figures are predicted, the mean of their logs (0 where they agree);
        it grows with the compute scale and with a link fraction."""
        errors = []
        for row, backend in figures:
            predicted = predict(row, parameters, jobs[row.id]).figure(backend)
            errors.append(math.log(predicted / row.measured[backend]) * (1 if HIGHER_IS_FASTER[row.metric] else -1))
        return sum(errors) / len(errors)

    scales = {}
    for name in scales_needed:
        figures = [(row, backend) for row, backend in priced if topologies[row.id].name == name]
        scales[name] = _root(lambda scale: log_error(FittedParameters({**scales, name: scale}, (), fitted_on), figures),
                             *SCALE_RANGE, f"compute_scale of {name}")
    fractions = []
    for (backend, settings, fabric), figures in links_needed.items():
        fraction = _root(lambda value: log_error(FittedParameters(
            scales, (*fractions, LinkFraction(backend, settings, fabric, value)), fitted_on), figures), *FRACTION_RANGE,
            f"link_fraction of {backend} on {fabric}")
        fractions.append(LinkFraction(backend, settings, fabric, fraction))
    parameters = FittedParameters(scales, tuple(fractions), fitted_on)
    residuals = {f"{row.id} {backend}": predict(row, parameters, jobs[row.id]).figure(backend) / figure - 1
                 for row in rows for backend, figure in row.measured.items()}
    return replace(parameters, residuals=residuals)


def write_fit(parameters: FittedParameters, path: Path, comparisons_path: Path) -> None:
    """The parameters as TOML with their provenance: the command, the comparisons file, the rows and the date."""
    resolved = comparisons_path.resolve()
    shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else comparisons_path
    lines = [
        f"# Written by python -m torchtitan_ext.plan --fit --comparisons {shown} on {date.today()}:",
        "# the layout advisor's free parameters (torchtitan_ext/planning/advisor_fit.py says what each means).",
        f"fitted_on = [{', '.join(_toml_string(name) for name in parameters.fitted_on)}]",
        "",
    ]
    for name, scale in parameters.compute_scale.items():
        lines += ["[[compute_scale]]", f"topology = {_toml_string(name)}", f"scale = {scale!r}", ""]
    for link in parameters.link_fractions:
        settings = ", ".join(_toml_string(str(value)) for value in link.settings)
        lines += ["[[link_fraction]]", f"backend = {_toml_string(link.backend)}", f"settings = [{settings}]",
                  f"fabric = {_toml_string(link.fabric)}", f"fraction = {link.fraction!r}", ""]
    lines += ["[residuals]", *(f"{_toml_string(key)} = {value!r}" for key, value in parameters.residuals.items())]
    written = path.with_name(f".{path.name}.partial")
    try:
        written.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written.replace(path)
    except OSError as e:
        written.unlink(missing_ok=True)
        raise ConfigError(f"--fit-output {path}: could not write it ({e.strerror}): choose a path in a folder you "
                          "can write") from None


def load_fit(path: Path) -> FittedParameters:
    """Parameters :func:`write_fit` wrote; a bad file or field refused in one line naming it."""
    again = "write the file again with python -m torchtitan_ext.plan --fit"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--fit-from {path}: no such file: write it with python -m torchtitan_ext.plan --fit") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--fit-from {path}: not a readable UTF-8 TOML file ({type(e).__name__}: {e}): {again}") from None

    def refuse(where: str, problem: str):
        raise ConfigError(f"--fit-from {path}: {where} {problem}: {again}")

    def text(entry: dict, field: str, where: str) -> str:
        if not isinstance(entry.get(field), str) or not entry[field]:
            refuse(f"{where}.{field}", "must be a non-empty string")
        return entry[field]

    def number(entry: dict, field: str, where: str, bounds: tuple[float, float]) -> float:
        value = entry.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not bounds[0] <= value <= bounds[1]:
            refuse(f"{where}.{field}", f"must be a number in [{bounds[0]:g}, {bounds[1]:g}]")
        return float(value)

    def tables(key: str) -> list[dict]:
        entries = data.get(key, [])
        if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
            refuse(key, "must be [[" + key + "]] tables")
        return entries

    fitted_on = data.get("fitted_on")
    if not isinstance(fitted_on, list) or not fitted_on or not all(isinstance(name, str) and name for name in fitted_on):
        refuse("fitted_on", "must list the comparisons' ids")
    scales = {text(entry, "topology", "compute_scale"): number(entry, "scale", "compute_scale", SCALE_RANGE)
              for entry in tables("compute_scale")}
    links = []
    for entry in tables("link_fraction"):
        settings = entry.get("settings")
        if not isinstance(settings, list) or not all(isinstance(value, str) for value in settings):
            refuse("link_fraction.settings", "must be a list of strings")
        links.append(LinkFraction(text(entry, "backend", "link_fraction"), tuple(settings),
                                  text(entry, "fabric", "link_fraction"),
                                  number(entry, "fraction", "link_fraction", FRACTION_RANGE)))
    if any(link.backend not in BACKENDS for link in links):
        refuse("link_fraction.backend", f"must be one of {', '.join(BACKENDS)}")
    residuals = data.get("residuals", {})
    if not isinstance(residuals, dict) or any(isinstance(value, bool) or not isinstance(value, (int, float))
                                              for value in residuals.values()):
        refuse("residuals", "must map each fit figure to a number")
    return FittedParameters(scales, tuple(links), tuple(fitted_on), dict(residuals))


def format_fit(parameters: FittedParameters) -> list[str]:
    """Each parameter and each fit figure's residual, one line each."""
    lines = [f"compute_scale {name}: {scale:.4f} (achieved compute over the topology's compute_tflops)"
             for name, scale in parameters.compute_scale.items()]
    lines += [f"link_fraction {link.backend} {'/'.join(map(str, link.settings)) or ''} on {link.fabric}: "
              f"{link.fraction:.4f} of the nominal rate".replace("  ", " ") for link in parameters.link_fractions]
    lines += [f"residual {key}: {value:+.2%}" for key, value in parameters.residuals.items()]
    return lines
