"""``<dump_folder>/metrics.jsonl``: a job's logged steps as a file, written by the trainer and read by every tool;
``validation.jsonl`` beside it, its validations.

One JSON object per logged step (validation), ``{"step": N, ...}`` with every metric under the name TensorBoard
shows it by (docs/metrics.md). Imports only the standard library: the supervisor reads it too.
"""

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
"""Name of the metrics file in a job's dump folder."""

VALIDATION_FILE = "validation.jsonl"
"""Name of the validations' file in a job's dump folder (``validation.enable``)."""


class MetricsFile:
    """``<dump_folder>/<name>`` (metrics.jsonl, validation.jsonl): one JSON object per logged step, ``{"step": N, ...}`` with every metric
    under the name TensorBoard logs it by, appended as each step is logged (written by the rank that logs them,
    torchtitan's metrics rank).

    A run that starts at step S (a fresh run at 1, a resumed one later) first drops the file's lines of steps S
    and beyond, left by an earlier attempt, so that the file is the history of the steps that led to this one.
    """

    def __init__(self, folder: Path, name: str = METRICS_FILE):
        self.path = folder / name
        self._opened = False

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self._opened:
            self._opened = True
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = [row for row in read_metrics(self.path.parent, self.path.name) if row["step"] < step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


def read_metrics(dump_folder: Path | str, name: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The logged steps (``name`` = :data:`VALIDATION_FILE`: validations) of the run in ``dump_folder``, in order
    (:class:`MetricsFile`); empty if none was logged.

    A last line without its newline is a write that a killed process left unfinished: it is not a step."""
    path = Path(dump_folder) / name
    if not path.exists():
        return []
    *lines, _ = path.read_text().split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not a JSON object ({e.msg}): delete the file or that line") from None
    return rows


def logged_losses(dump_folder: Path | str) -> dict[int, float]:
    """{step: global average loss} of the run in ``dump_folder``."""
    return {row["step"]: row["loss_metrics/global_avg_loss"] for row in read_metrics(dump_folder)}
