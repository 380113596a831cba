"""Reading the figures DeepEP's and HybridEP's own test scripts print, to calibrate the layout advisor on a cluster.

DeepEP (deepseek-ai/DeepEP main: ``tests/legacy/test_intranode.py`` and ``test_internode.py``, ``tests/`` before
its V2 reorganisation): rank 0 prints one ``[tuning] Best dispatch (BF16): SMs S, ...`` and one ``[tuning] Best
combine: SMs S, ...`` line, ending in ``X GB/s (NVL)`` (intranode) or ``X GB/s (RDMA), Y GB/s (NVL)``
(internode); each format the scripts have printed (with ``t: .. us``, ``avg_t``, ``transmit``/``notify``,
``notify + t us``, or no time) is read, for its GB/s and SMs. Bytes over time: NVL, the token rows rank 0
receives (its own included); RDMA, the (token, node) pairs it sends, its own node included. ``[config]
num_tokens=T, hidden=H, ... num_topk=K`` gives the shape where printed.

HybridEP (DeepEP's hybrid-ep branch, ``tests/test_hybrid_ep.py``): rank 0 prints, under ``=== Torch API Benchmark
(BF16, N ranks) ===``, ``dispatch (BF16): X GB/s (NVL), t: ...`` and ``combine: X GB/s (NVL), ...``, and with more
than one node the same with ``(RDMA)``; earlier versions ``[rank 0] HybridEP dispatch torch API (BF16): X GB/s
(NVL), ...`` and ``(IB)``. Lines under an FP8 section's header are skipped (its combine lines name no
dtype). The kernel-only lines (``dispatch kernel ...``) and the fused permute variants are
skipped: the Torch API's time is what a training step pays. The script prints no shape.

FP8 dispatch lines are skipped (the published figures the advisor prices are BF16). Neither script prints its node
count: a log whose figures cross RDMA needs a ``# nodes: N`` line, added by the one who ran it; ``# ranks_per_node:
N`` likewise where a DeepEP intranode run used other than its default 8 processes. This module reads those facts
and nothing else: what they say about a link is :mod:`.measured_rates`' business. Every malformed or ambiguous
part is a ConfigError naming its line.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan_ext.config import ConfigError

DEEPEP_BEST = re.compile(r"\[tuning\] Best (dispatch|combine)(?: \((BF16|FP8)\))?: SMs (\d+),")
DEEPEP_CONFIG = re.compile(r"\[config\] num_tokens=(\d+), hidden=(\d+)(?:,.*?\bnum_topk=(\d+))?")
HYBRIDEP_HEADER = re.compile(r"=== Torch API Benchmark \((BF16|FP8), (\d+) ranks\) ===")
HYBRIDEP_LINE = re.compile(
    r"^(?:\[rank 0\] HybridEP )?(dispatch|combine)(?: torch API)?(?: \((BF16|FP8)\))?:\s+([\d.]+) GB/s \((NVL|RDMA|IB)\)")
FIGURE = re.compile(r"([\d.]+) GB/s \((NVL|RDMA)\)")
ANNOTATION = re.compile(r"^#\s*(nodes|ranks_per_node):\s*(\S+)\s*$")
DEEPEP_DEFAULT_RANKS_PER_NODE = 8
"""The processes of DeepEP's intranode test by default (``--num-processes 8``), and its internode test's per node
(it asserts 8)."""


@dataclass(frozen=True)
class KernelTestLog:
    """What one test log says: the library, its dispatch and combine figures per link kind, and the run's size."""

    backend: str
    """This project's name of the library's backend: "deepep" or "hybridep"."""
    figures: dict[str, tuple[float, float]]
    """{"NVL" or "RDMA": (dispatch GB/s, combine GB/s)}, BF16, as printed."""
    lines: dict[str, tuple[int, int]]
    """{"NVL" or "RDMA": the lines of the dispatch and the combine figure}."""
    sms: int | None
    """The SMs of the best dispatch (DeepEP; None where the log does not print them)."""
    ranks_per_node: int | None
    """Ranks on one node's NVLink: ``# ranks_per_node``, else HybridEP's header's ranks over its nodes, else
    DeepEP's 8; None where unknown."""
    nodes: int | None
    """``# nodes``; None where not given."""
    shape: tuple[int, int, int | None] | None = field(default=None)
    """(tokens per rank, hidden, top-k or None where not printed) from DeepEP's ``[config]`` line; None where not
    printed."""


def read_kernel_test_log(path: Path, text: str) -> KernelTestLog | None:
    """The figures of a DeepEP or HybridEP test log ``text``; None when ``text`` is neither (another kind of log).
    ConfigError, naming the line, for a figure printed twice, a log with both libraries' lines, a missing dispatch
    or combine figure, or an annotation that is not a positive integer."""
    where = f"--calibrate-from {path}"
    found: dict[tuple[str, str], tuple[float, int]] = {}
    backends, sms, shape, header_ranks, notes = set(), None, None, None, {}
    section_dtype = None  # HybridEP's: the dtype of the Torch API section a line is in (its combine lines name none)

    def add(backend: str, kernel: str, fabric: str, figure: str, number: int) -> None:
        backends.add(backend)
        if (kernel, fabric) in found:
            raise ConfigError(f"{where}: line {number}: a second {kernel} figure over {fabric} (line "
                              f"{found[kernel, fabric][1]}): give the log of one run")
        found[kernel, fabric] = (float(figure), number)

    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if match := ANNOTATION.match(line):
            name, value = match.groups()
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{where}: line {number}: '# {name}: {value}': give a whole number >= 1")
            notes[name] = int(value)
        elif match := DEEPEP_CONFIG.search(line):
            tokens, hidden, top_k = match.groups()
            shape = (int(tokens), int(hidden), top_k and int(top_k))
        elif match := DEEPEP_BEST.search(line):
            kernel, dtype, best_sms = match.groups()
            if dtype == "FP8":
                continue
            sms = int(best_sms) if kernel == "dispatch" else sms
            for figure, fabric in FIGURE.findall(line[match.end():]):
                add("deepep", kernel, fabric, figure, number)
        elif match := HYBRIDEP_HEADER.search(line):
            section_dtype, header_ranks = match.group(1), int(match.group(2))
        elif line.startswith("==="):
            section_dtype = None  # another section (the kernel benchmark's)
        elif match := HYBRIDEP_LINE.match(line):
            kernel, dtype, figure, fabric = match.groups()
            if (dtype or section_dtype) != "FP8":
                add("hybridep", kernel, "RDMA" if fabric == "IB" else fabric, figure, number)
    if not backends:
        return None
    if len(backends) > 1:
        raise ConfigError(f"{where}: holds both DeepEP's and HybridEP's test lines: give each library's log in its "
                          "own file")
    (backend,) = backends
    fabrics = {fabric for _, fabric in found}
    for fabric in sorted(fabrics):
        missing = [kernel for kernel in ("dispatch", "combine") if (kernel, fabric) not in found]
        if missing:
            raise ConfigError(f"{where}: no BF16 {missing[0]} figure over {fabric}: give the whole log of the run")
    nodes = notes.get("nodes")
    ranks_per_node = notes.get("ranks_per_node")
    if ranks_per_node is None:
        if backend == "deepep":
            ranks_per_node = DEEPEP_DEFAULT_RANKS_PER_NODE
        elif header_ranks is not None and header_ranks % (nodes or 1) == 0:
            ranks_per_node = header_ranks // (nodes or 1)
    return KernelTestLog(
        backend,
        {fabric: (found["dispatch", fabric][0], found["combine", fabric][0]) for fabric in sorted(fabrics)},
        {fabric: (found["dispatch", fabric][1], found["combine", fabric][1]) for fabric in sorted(fabrics)},
        sms, ranks_per_node, nodes, shape,
    )
