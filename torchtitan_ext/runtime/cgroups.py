"""What the kernel's control groups allow this process and count of it: memory and swap limits, out-of-memory kills.

A SLURM job's ``--mem``, a container's memory limit and a memory-limited systemd unit are control groups, v2 (one
hierarchy, ``0::/path`` in ``/proc/self/cgroup``) or v1 (a ``memory`` controller of its own). Imports no torch: the
supervisor reads the out-of-memory count.
"""

from pathlib import Path, PurePosixPath

PROC_CGROUP = Path("/proc/self/cgroup")
"""This process's control groups, a line per hierarchy: ``ID:controllers:path``."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the control-group file systems are mounted: cgroup v2's at the root, v1's memory controller under
``memory/``."""
VMSTAT = Path("/proc/vmstat")
"""The kernel's event counters, machine-wide: its ``oom_kill`` line counts the processes its out-of-memory killer
ended since boot."""
UNSET_FROM = 1 << 62
"""A limit from this value up is unset: v1 writes LONG_MAX rounded down to a page (9223372036854771712 with 4 KiB
pages), v2 writes "max"."""


def _memory_groups() -> list[tuple[Path, str]]:
    """(the folder of this process's memory control group, its version: "v2" or "v1"), then its ancestors' up to
    the hierarchy's root; empty where there are no control groups. A container sees its own group as the root, so
    groups of the path that are not there are left out."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return []
    groups = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "" and (CGROUP_ROOT / "cgroup.controllers").is_file():
            root, version = CGROUP_ROOT, "v2"
        elif "memory" in controllers.split(","):
            root, version = CGROUP_ROOT / "memory", "v1"
        else:
            continue
        folder = PurePosixPath(path)
        for group in (folder, *folder.parents):
            if group.is_absolute() and (root / group.relative_to("/")).is_dir():
                groups.append((root / group.relative_to("/"), version))
    return groups


def _lowest(v2_file: str | None, v1_file: str | None) -> int | None:
    """The lowest limit set in ``v2_file`` or ``v1_file`` over this process's memory groups; None where none is."""
    limits = []
    for folder, version in _memory_groups():
        name = v2_file if version == "v2" else v1_file
        try:
            value = (folder / name).read_text().strip() if name else ""
        except OSError:
            continue
        if value.isdigit() and int(value) < UNSET_FROM:
            limits.append(int(value))
    return min(limits, default=None)


def memory_limit() -> int | None:
    """The lowest memory limit, bytes, over this process's control group and its ancestors; None where none is set."""
    return _lowest("memory.max", "memory.limit_in_bytes")


def swap_limit() -> int | None:
    """The lowest swap limit of cgroup v2 (``memory.swap.max``, bytes of swap alone); None where none is set."""
    return _lowest("memory.swap.max", None)


def memory_and_swap_limit() -> int | None:
    """The lowest limit of cgroup v1 on memory and swap together (``memory.memsw.limit_in_bytes``); None where none
    is set."""
    return _lowest(None, "memory.memsw.limit_in_bytes")


def oom_kills() -> tuple[str, int] | None:
    """(where, how many): the processes the kernel's out-of-memory killer has ended in this process's control group
    (v2 ``memory.events``, its descendants included; v1 ``memory.oom_control``), else, without one, on the whole
    machine (:data:`VMSTAT`); None where the kernel does not count them (not Linux, or older than 4.13)."""
    for folder, version in _memory_groups()[:1]:
        path = folder / ("memory.events" if version == "v2" else "memory.oom_control")
        found = _counter(path, "oom_kill")
        if found is not None:
            return f"in this job's control group (oom_kill in {path})", found
    found = _counter(VMSTAT, "oom_kill")
    return None if found is None else (f"on this machine (oom_kill in {VMSTAT})", found)


def _counter(path: Path, name: str) -> int | None:
    """The value of the ``name value`` line of a kernel counter file; None where the file or the line is missing."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return None
