"""Published same-setup comparisons of EP backends, and how the layout advisor's predictions stand against them.

    python -m torchtitan_ext.plan --validate [--comparisons FILE]

The comparisons are data (``docs/published_comparisons.toml``, its header gives the fields): one job measured
under two backends, each row with its source and a role, ``fit`` or ``held_out``, chosen before any fit. A row
the advisor can price names its job (config, overrides, topology, world size, EP degree); the others say why not.
For each priced row the report gives the advisor's figure per backend beside the published one, the gap between
the two backends either way, and whether the faster backend is the same.
"""

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from torchtitan_ext.config import ConfigError, load_job_config, register_hf_model
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.planning.layout import Layout
from torchtitan_ext.planning.layout_advisor import advise
from torchtitan_ext.planning.topology import load_topology

SHIPPED = Path(__file__).resolve().parents[2] / "docs" / "published_comparisons.toml"
ROLES = ("fit", "held_out")
HIGHER_IS_FASTER = {"TFLOPS/GPU": True, "tokens/s": True, "s/step": False}
"""The metrics a row may report, and whether a larger figure is the faster backend."""
PREDICTED_METRICS = ("TFLOPS/GPU", "s/step")
"""The metrics the advisor predicts (a priced row must report one of them)."""
MXFP8_CONVERTERS = ("quantize.linear.mx", "quantize.grouped_mm.mx")
PRICED_PRECISIONS = {"bf16": (), "fp32": (), "mxfp8": MXFP8_CONVERTERS}
"""The precisions a priced row may state -> the MXFP8 converters its job runs: none in bf16 or fp32 (a CPU job's,
as ``bench ab`` measures it; its overrides give the parameter dtype); in mxfp8 every linear layer (but the output
layer, torchtitan's default filter) and the routed experts' grouped GEMMs, as Megatron's MXFP8 recipe quantizes
them."""
TEXT_FIELDS = ("id", "url", "source", "date", "hardware", "model", "parallelism", "batch", "precision",
               "activation_checkpointing", "compared", "metric", "role")


@dataclass(frozen=True)
class PricedJob:
    """How the advisor prices a comparison's job."""

    config: str
    """A train config (repository path)."""
    overrides: tuple[str, ...]
    """CLI overrides that make the config the published job (batch, checkpointing, precision)."""
    topology: str
    """A topology file or shipped name."""
    world_size: int
    ep: int
    """The published EP degree: each backend's layout at this degree, with the job's own settings, is the
    prediction."""
    hf_config: str = ""
    """A Hugging Face config.json (repository path) whose model takes the place of the config's, or ""."""
    precision: str = "bf16"
    """The row's precision, one of :data:`PRICED_PRECISIONS`: it sets the job's MXFP8 converters."""
    device: str = "cuda"
    """Where the job ran: "cuda" (the kernel libraries' real kernels), or "cpu" (``bench ab`` on a CPU: DeepEP and
    HybridEP on their reference kernels, which take fp32), which the job's config checks resolve for."""
    a2a_overlap: bool | None = None
    """Whether the published run overlapped its all-to-alls with another microbatch's compute (Megatron's
    ``overlap_moe_expert_parallel_comm``, "moe_a2a_overlap"), where torchtitan's config cannot say it (it overlaps
    them only under DualPipeV); None: as the job's config runs them."""

    @property
    def device_type(self) -> str | None:
        """``load_job_config``'s device type for the job's checks: None (the generic GPU job) on "cuda"."""
        return None if self.device == "cuda" else self.device

    @property
    def train_args(self) -> list[str]:
        """The job as the advisor reads it: the config, the overrides, and the model of ``hf_config``."""
        model = register_hf_model(Path(self.hf_config)) if self.hf_config else []
        return ["--job.config_file", self.config, *self.overrides, *model]


@dataclass(frozen=True)
class Comparison:
    id: str
    url: str
    source: str
    role: str
    metric: str
    measured: dict[str, float]
    """Backend (this project's name) -> figure, in the order published."""
    priced: PricedJob | None
    unpriced: str
    """Why the advisor cannot price the job yet ("" when ``priced``). The row's other fields (hardware, model,
    parallelism, batch, ...) are checked on load and left in the file for its readers."""

    def faster(self, figures: dict[str, float]) -> str:
        """Which backend ``figures`` (backend -> figure in this row's metric) call faster."""
        pick = max if HIGHER_IS_FASTER[self.metric] else min
        return pick(figures, key=figures.get)

    def gap(self, figures: dict[str, float]) -> float:
        """How much faster the second backend is than the first, as a fraction (negative: slower)."""
        first, second = (figures[name] for name in self.measured)
        return second / first - 1 if HIGHER_IS_FASTER[self.metric] else first / second - 1


HELD_OUT_GOALS = (0.03, 2.0, 0.25)
"""What a prediction of a held-out row should meet: the faster backend right wherever the published gap between
them is larger than 3%, the predicted gap within a factor of 2 of the published one (and of its sign), and each
predicted figure within 25% of the published one."""


def held_out_goals(comparisons: list[Comparison], predictions: dict[str, "Prediction"]) -> str:
    """How many of the priced held-out rows' gaps and figures meet :data:`HELD_OUT_GOALS` under ``predictions``."""
    sign_gap, factor, tolerance = HELD_OUT_GOALS
    rows = [comparison for comparison in comparisons if comparison.role == "held_out" and comparison.id in predictions]
    signed = [row for row in rows if abs(row.gap(row.measured)) > sign_gap]
    right = [row for row in signed if predictions[row.id].ranking_agrees]
    within_factor = [row for row in rows if row.gap(row.measured) != 0
                     and 1 / factor <= row.gap(predictions[row.id].figures) / row.gap(row.measured) <= factor]
    figures = [(row, backend) for row in rows for backend in row.measured]
    close = [(row, backend) for row, backend in figures
             if abs(predictions[row.id].figure(backend) / row.measured[backend] - 1) <= tolerance]
    return (f"the faster backend right on {len(right)} of {len(signed)} gaps over {sign_gap:.0%}, the gap within a "
            f"factor of {factor:g} on {len(within_factor)} of {len(rows)}, the figure within {tolerance:.0%} on "
            f"{len(close)} of {len(figures)}")


def _refuse(where: str, problem: str) -> None:
    raise ConfigError(f"{where}: {problem}")


def _comparison(row: dict, where: str) -> Comparison:
    for field in TEXT_FIELDS:
        if not isinstance(row.get(field), str) or (field not in ("activation_checkpointing",) and not row[field]):
            _refuse(where, f"'{field}' is missing or not a non-empty string: add it (the header lists the fields)")
    if not isinstance(row.get("seq_len"), int) or isinstance(row["seq_len"], bool) or row["seq_len"] < 0:
        _refuse(where, "'seq_len' must be an integer >= 0 (0: not stated)")
    if row["role"] not in ROLES:
        _refuse(where, f"role '{row['role']}': use one of {', '.join(ROLES)}")
    if row["metric"] not in HIGHER_IS_FASTER:
        _refuse(where, f"metric '{row['metric']}': use one of {', '.join(HIGHER_IS_FASTER)}")
    measured = row.get("measured")
    if not isinstance(measured, dict) or len(measured) != 2:
        _refuse(where, "'measured' must give the figures of exactly two backends, e.g. { nccl = 269.11, hybridep = 352.18 }")
    for backend, figure in measured.items():
        if backend not in BACKENDS:
            _refuse(where, f"measured backend '{backend}': use this project's names ({', '.join(BACKENDS)})")
        if isinstance(figure, bool) or not isinstance(figure, (int, float)) or not 0 < figure < math.inf:
            _refuse(where, f"measured {backend} = {figure!r}: use the published figure, a finite number > 0")
    if ("priced" in row) == ("unpriced" in row):
        _refuse(where, "give exactly one of 'priced' (how the advisor prices the job) and 'unpriced' (why it cannot)")
    priced = None
    if "priced" in row:
        job = row["priced"]
        if row["metric"] not in PREDICTED_METRICS:
            _refuse(where, f"metric '{row['metric']}' of a priced row: the advisor predicts {', '.join(PREDICTED_METRICS)}")
        if not isinstance(job, dict) or not isinstance(job.get("config"), str) or not isinstance(job.get("topology"), str):
            _refuse(where, "'priced' needs config and topology (strings), overrides, world_size and ep")
        unknown = sorted(set(job) - {"config", "overrides", "topology", "world_size", "ep", "hf_config", "device",
                                "a2a_overlap"})
        if unknown:
            _refuse(where, f"priced has no field {', '.join(unknown)}: its fields are config, overrides, topology, "
                           "world_size, ep, hf_config, device and a2a_overlap")
        if job.get("device", "cuda") not in ("cuda", "cpu"):
            _refuse(where, f"priced.device = {job['device']!r}: use \"cuda\" or \"cpu\" (where the job ran)")
        if not isinstance(job.get("a2a_overlap", False), bool):
            _refuse(where, f"priced.a2a_overlap = {job['a2a_overlap']!r}: use true or false (whether the run "
                           "overlapped its all-to-alls with another microbatch's compute)")
        if not isinstance(job.get("hf_config", ""), str):
            _refuse(where, "priced.hf_config must be the path of a Hugging Face config.json")
        overrides = job.get("overrides", [])
        if not isinstance(overrides, list) or not all(isinstance(item, str) for item in overrides):
            _refuse(where, "priced.overrides must be a list of strings (CLI overrides)")
        for field in ("world_size", "ep"):
            if not isinstance(job.get(field), int) or isinstance(job[field], bool) or job[field] < 1:
                _refuse(where, f"priced.{field} must be an integer >= 1")
        if row["precision"] not in PRICED_PRECISIONS:
            _refuse(where, f"precision '{row['precision']}' of a priced row: the advisor prices "
                           f"{', '.join(PRICED_PRECISIONS)} (or give 'unpriced' instead)")
        priced = PricedJob(job["config"], tuple(overrides), job["topology"], job["world_size"], job["ep"],
                           job.get("hf_config", ""), row["precision"], job.get("device", "cuda"),
                           job.get("a2a_overlap"))
        if priced.hf_config:
            register_hf_model(Path(priced.hf_config), f"{where}: priced.hf_config {priced.hf_config}")
    elif not isinstance(row["unpriced"], str) or not row["unpriced"]:
        _refuse(where, "'unpriced' must say why the advisor cannot price the job")
    return Comparison(row["id"], row["url"], row["source"], row["role"], row["metric"],
                      {backend: float(figure) for backend, figure in measured.items()}, priced,
                      row.get("unpriced", ""))


def load_comparisons(path: Path = SHIPPED) -> list[Comparison]:
    """The comparisons in ``path``; a bad row or field is refused in one line naming it."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--comparisons {path}: no such file: give the comparisons file "
                          "(docs/published_comparisons.toml)") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--comparisons {path}: not a readable UTF-8 TOML file ({type(e).__name__}: {e})") from None
    rows = data.get("comparison")
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        raise ConfigError(f"--comparisons {path}: no [[comparison]] tables: add them (docs/published_comparisons.toml)")
    comparisons = [_comparison(row, f"--comparisons {path}, comparison {index + 1} "
                                    f"('{row.get('id', '?')}')") for index, row in enumerate(rows)]
    ids = [comparison.id for comparison in comparisons]
    repeated = sorted({name for name in ids if ids.count(name) > 1})
    if repeated:
        raise ConfigError(f"--comparisons {path}: id {', '.join(repeated)} used twice: give each row its own id")
    return comparisons


@dataclass(frozen=True)
class Prediction:
    comparison: Comparison
    layouts: dict[str, Layout]
    """Backend -> the advisor's layout of it as the row's job ran it: at its EP degree, with its own settings and
    replica slots."""

    def figure(self, backend: str) -> float:
        layout = self.layouts[backend]
        return layout.tflops_per_gpu if self.comparison.metric == "TFLOPS/GPU" else layout.step_s

    @property
    def figures(self) -> dict[str, float]:
        return {backend: self.figure(backend) for backend in self.comparison.measured}

    @property
    def bounds(self) -> list[str]:
        """The backends priced at a nominal link rate (a bound, not a prediction)."""
        return [backend for backend, layout in self.layouts.items() if layout.nominal_links]

    @property
    def ranking_agrees(self) -> bool:
        return self.comparison.faster(self.figures) == self.comparison.faster(self.comparison.measured)


def job_of(comparison: Comparison):
    """The comparison's job config, as the advisor reads it (for :func:`predict` to price many times), with the MXFP8
    converters of the row's precision (:data:`PRICED_PRECISIONS`)."""
    job = comparison.priced
    job_config = load_job_config(job.train_args, device_type=job.device_type, world_size=job.world_size)
    kept = [name for name in job_config.model.converters if name not in MXFP8_CONVERTERS]
    job_config.model.converters = kept + list(PRICED_PRECISIONS[job.precision])
    job_config.quantize.grouped_mm.mx.fqns = ["experts"]
    return job_config


def predict(comparison: Comparison, fitted=None, job_config=None) -> Prediction:
    """The advisor's prediction for a priced comparison (ConfigError where its job does not price), as shipped or
    under ``fitted`` parameters (:class:`~torchtitan_ext.planning.advisor_fit.FittedParameters`); ``job_config``:
    :func:`job_of` the comparison, when the caller has it."""
    job = comparison.priced
    if job_config is None:
        job_config = job_of(comparison)
    train_args = job.train_args
    topology, rates = load_topology(job.topology), None
    if fitted is not None:  # by the topology's own name, before its ranks are placed (the levels keep their order)
        topology, rates = fitted.applied(topology)
    topology = topology.placed_for(job.world_size, None)
    layouts, _ = advise(train_args, job.world_size, topology, measured_rates=rates, job_config=job_config,
                        ep_degrees={job.ep}, device_type=job.device_type, a2a_overlap=job.a2a_overlap)
    # the layout the published job ran: its own settings (the advisor's variants of them are other jobs)
    as_run = {layout.backend: layout for layout in layouts
              if layout.refused is None and layout.ep == job.ep and layout.backend in comparison.measured
              and not layout.settings and layout.replica_slots == layout.job_replica_slots}
    missing = [backend for backend in comparison.measured if backend not in as_run]
    if missing:
        refusals = {layout.backend: layout.refused for layout in layouts if layout.refused and layout.ep == job.ep}
        raise ConfigError(f"comparison '{comparison.id}': the advisor prices no {', '.join(missing)} layout at "
                          f"EP={job.ep} ({'; '.join(f'{b}: {refusals[b]}' for b in missing if b in refusals) or 'none considered'})")
    return Prediction(comparison, as_run)


def _figures(comparison: Comparison, figures: dict[str, float], bounds: list[str] = ()) -> str:
    shown = ", ".join(f"{backend} {figure:,.2f}{' (nominal rate: a bound)' if backend in bounds else ''}"
                      for backend, figure in figures.items())
    second = list(comparison.measured)[1]
    return f"{shown} {comparison.metric} ({second} {comparison.gap(figures):+.1%})"


def _predicted(prediction: Prediction) -> str:
    comparison = prediction.comparison
    errors = ", ".join(f"{backend} {prediction.figure(backend) / figure - 1:+.1%}"
                       for backend, figure in comparison.measured.items())
    verdict = "agrees" if prediction.ranking_agrees else "disagrees"
    return (f"{_figures(comparison, prediction.figures, prediction.bounds)}; off the published by {errors}; "
            f"the faster backend {verdict}")


def format_validation(comparisons: list[Comparison], shipped: dict[str, Prediction],
                      fitted: dict[str, Prediction] | None = None, fit_source: str = "") -> list[str]:
    """One paragraph per comparison (published; predicted as shipped and under the fit, or why not priced), then a
    summary line and the held-out goals met (:func:`held_out_goals`) as shipped and under the fit."""
    lines = []
    for comparison in comparisons:
        lines.append(f"{comparison.id} ({comparison.role}): published {_figures(comparison, comparison.measured)}")
        if comparison.id not in shipped:
            lines.append(f"  not priced: {comparison.unpriced}")
            continue
        lines.append(f"  as shipped: {_predicted(shipped[comparison.id])}")
        if fitted is not None:
            lines.append(f"  with the fit: {_predicted(fitted[comparison.id])}")
    priced = [c for c in comparisons if c.id in shipped]
    held_out = [c for c in comparisons if c.role == "held_out"]
    priced_held_out = [c for c in priced if c.role == "held_out"]

    def agreeing(predictions: dict[str, Prediction]) -> str:
        agree = [c for c in priced if predictions[c.id].ranking_agrees]
        return (f"{len(agree)} of {len(priced)} priced ({sum(c.role == 'held_out' for c in agree)} of "
                f"{len(priced_held_out)} held out)")

    summary = (f"summary: {len(comparisons)} comparisons ({len(comparisons) - len(held_out)} fit, {len(held_out)} held "
               f"out), {len(priced)} priced; the faster backend agrees as shipped on {agreeing(shipped)}")
    goals = [f"held-out goals as shipped: {held_out_goals(comparisons, shipped)}"]
    if fitted is not None:
        summary += f", with the fit ({fit_source}) on {agreeing(fitted)}"
        goals.append(f"held-out goals with the fit: {held_out_goals(comparisons, fitted)}")
    return lines + [summary, *goals]


def validate(path: Path = SHIPPED, fitted=None):
    """(every comparison in ``path``, the priced ones' predictions as shipped, and under ``fitted`` parameters or
    None), by comparison id."""
    comparisons = load_comparisons(path)
    priced = [comparison for comparison in comparisons if comparison.priced]
    shipped = {comparison.id: predict(comparison) for comparison in priced}
    under_fit = None if fitted is None else {comparison.id: predict(comparison, fitted) for comparison in priced}
    return comparisons, shipped, under_fit


def validation_report(path: Path = SHIPPED, fitted=None, fit_source: str = "") -> list[str]:
    """``format_validation`` of :func:`validate`: the priced comparisons predicted as shipped and, given ``fitted``
    parameters (read from ``fit_source``), under them."""
    return format_validation(*validate(path, fitted), fit_source)
