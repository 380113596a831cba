"""The rows ``python -m torchtitan_ext.bench ep --json`` writes and ``python -m torchtitan_ext.plan
--calibrate-from`` reads: one :class:`EPBenchRow` per backend and shape, checked field by field on reading."""

import math
from dataclasses import dataclass, fields

from torchtitan_ext.config import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

MAX_PROCESSES = 65536
"""More processes than any bench runs: a larger count is not a bench_ep row."""

BENCH_COMMAND = "python -m torchtitan_ext.bench ep --json"


@dataclass(frozen=True)
class EPBenchRow:
    """One backend at one shape, as ``python -m torchtitan_ext.bench ep --json`` times it: one dispatch + combine
    (forward and backward, or forward only) with the experts as the identity, the slowest rank's times, and the
    same collectives timed alone ("bare")."""

    backend: str
    """The bench's name for what it timed: a backend variant, "upstream" (torchtitan's own), or a variant with
    "_lib" (the real deep_ep kernels)."""
    tokens: int
    """Tokens per rank."""
    hidden: int
    experts: int
    top_k: int
    ep: int
    """Ranks per EP group."""
    processes: int
    """Processes that ran at once (``ep`` divides it: the groups ran side by side)."""
    min_ms: float
    median_ms: float
    max_ms: float
    bare_min_ms: float
    bare_median_ms: float
    bare_max_ms: float
    ratio: float
    """``median_ms`` over ``bare_median_ms``."""
    overhead_us: float
    """``median_ms`` less ``bare_median_ms``, in microseconds."""
    bytes_sent_per_rank: int
    """Bytes the busiest rank's collectives sent per iteration."""
    gbps: float
    """``bytes_sent_per_rank`` over ``median_ms``, in GB/s."""
    collectives: int
    """Collectives one iteration issued."""
    comm_backend: str | None
    """``[parallelism] expert_parallel_comm_backend`` of the timed job; None for torchtitan's own."""
    job_args: list
    """The job-config overrides that select the timed backend and its settings."""
    dtype: str
    """The token rows' dtype: a key of :data:`DTYPE_BYTES`."""
    forward_only: bool
    local_bytes_per_rank: int
    """Bytes one iteration's operators outside the collectives and the library kernels read and write on the
    busiest rank (the permutes, gathers, padding and sums), as ``LocalTrafficCounter`` counts them."""
    copy_gbps: float
    """The device's copy bandwidth in the same run, bytes read plus written per second by a copy of 256 MiB (the
    slowest rank's): what the local passes are held against."""

    @property
    def local_gbps(self) -> float:
        """``local_bytes_per_rank`` over ``median_ms``: a lower bound of the local passes' bandwidth, since the
        median also holds the collectives and the launches."""
        return self.local_bytes_per_rank / self.median_ms / 1e6

    @classmethod
    def read(cls, row, where: str) -> "EPBenchRow":
        """The row of a JSON file; ConfigError, naming ``where`` and the field, for anything the bench does not write."""
        if not isinstance(row, dict):
            raise ConfigError(f"{where} = {row!r}: expected an object as {BENCH_COMMAND} writes")
        for field in fields(cls):
            if field.name not in row:
                raise ConfigError(f"{where}.{field.name} is missing: write the file with {BENCH_COMMAND} (this version)")
            value = row[field.name]
            kind = (int, float) if field.type is float else field.type
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ConfigError(f"{where}.{field.name} = {value!r}: not what {BENCH_COMMAND} writes")
        if row["dtype"] not in DTYPE_BYTES:
            raise ConfigError(f"{where}.dtype = {row['dtype']!r}: one of {', '.join(DTYPE_BYTES)}")
        if not (math.isfinite(row["median_ms"]) and row["median_ms"] > 0):
            raise ConfigError(f"{where}.median_ms = {row['median_ms']}: a measured time is finite and > 0")
        for field in ("tokens", "hidden", "experts", "top_k", "ep", "processes"):
            if not 1 <= row[field] <= (MAX_PROCESSES if field in ("ep", "processes") else 2**31):
                raise ConfigError(f"{where}.{field} = {row[field]}: not what {BENCH_COMMAND} writes")
        for field in ("processes", "experts"):
            if row[field] % row["ep"]:
                raise ConfigError(f"{where}.ep = {row['ep']} does not divide {field} = {row[field]}: not a bench_ep row")
        return cls(**{field.name: row[field.name] for field in fields(cls)})
