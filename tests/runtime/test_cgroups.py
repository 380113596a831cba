"""Control-group limits and out-of-memory counts, read from a stand-in /proc/self/cgroup and cgroup file system
laid out as the kernel lays out each version."""

import pytest

from torchtitan_ext.runtime import cgroups, memory

GiB = 1 << 30
UNSET_V1 = str((1 << 63) - 4096)  # LONG_MAX rounded down to a 4 KiB page


def _machine(tmp_path, monkeypatch, proc_cgroup: str, files: dict[str, str]) -> None:
    (tmp_path / "proc_cgroup").write_text(proc_cgroup)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    monkeypatch.setattr(cgroups, "PROC_CGROUP", tmp_path / "proc_cgroup")
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path / "fs")
    monkeypatch.setattr(cgroups, "VMSTAT", tmp_path / "vmstat")


@pytest.mark.parametrize("proc_cgroup, files, memory_limit, swap_limit", [
    # v2, a SLURM job's group under a lower parent: the lowest, not the nearest; "max" is no limit
    ("0::/slurm/job_7/step_0\n", {"cgroup.controllers": "memory", "slurm/memory.max": str(4 * GiB),
                                   "slurm/job_7/memory.max": str(8 * GiB), "slurm/job_7/step_0/memory.max": "max",
                                   "slurm/job_7/memory.swap.max": "0"}, 4 * GiB, 0),
    # v1: the memory controller's own hierarchy
    ("5:cpuset:/\n4:memory:/slurm/job_7\n", {"memory/slurm/memory.limit_in_bytes": str(6 * GiB),
                                             "memory/slurm/job_7/memory.limit_in_bytes": UNSET_V1}, 6 * GiB, None),
    # a container sees its own group as the root; /proc/self/cgroup names the host's path
    ("0::/system.slice/docker-abc.scope\n", {"cgroup.controllers": "memory", "memory.max": str(2 * GiB)}, 2 * GiB,
     None),
    # hybrid: v1's memory controller beside an empty v2 hierarchy (no cgroup.controllers at the root)
    ("4:memory:/job\n0::/job\n", {"memory/job/memory.limit_in_bytes": str(3 * GiB), "job/memory.max": str(GiB)},
     3 * GiB, None),
    # nothing set, and a line that is not one
    ("garbage\n4:memory:/\n", {"memory/memory.limit_in_bytes": UNSET_V1}, None, None),
], ids=["v2_lower_parent", "v1_parent", "container_root", "hybrid", "unset"])
def test_the_limits_are_the_lowest_over_the_process_control_groups(proc_cgroup, files, memory_limit, swap_limit,
                                                                   tmp_path, monkeypatch):
    _machine(tmp_path, monkeypatch, proc_cgroup, files)
    assert (cgroups.memory_limit(), cgroups.swap_limit()) == (memory_limit, swap_limit)


@pytest.mark.parametrize("limits, held", [
    ((None, None, None), 20 * GiB),           # the machine's 16 GiB and 4 GiB of swap
    ((8 * GiB, None, None), 12 * GiB),        # a memory limit, the machine's swap
    ((8 * GiB, 0, None), 8 * GiB),            # v2: no swap for the group
    ((8 * GiB, None, 10 * GiB), 10 * GiB),    # v1: memory and swap together
    ((32 * GiB, None, None), 20 * GiB),       # a limit above the machine's memory
], ids=["machine", "memory_limit", "no_swap", "v1_memory_and_swap", "limit_above_machine"])
def test_what_a_cpu_job_may_hold_is_its_memory_and_the_swap_it_may_use(limits, held, monkeypatch):
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda: 16 * GiB)
    monkeypatch.setattr(memory, "swap_bytes", lambda: 4 * GiB)
    for name, value in zip(("memory_limit", "swap_limit", "memory_and_swap_limit"), limits):
        monkeypatch.setattr(cgroups, name, lambda value=value: value)
    assert memory.host_memory_bytes() == held


@pytest.mark.parametrize("proc_cgroup, files, counted", [
    ("0::/job\n", {"cgroup.controllers": "memory", "job/memory.events": "low 0\nmax 3\noom 2\noom_kill 2"},
     ("memory.events", 2)),
    ("4:memory:/job\n", {"memory/job/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1"},
     ("memory.oom_control", 1)),
    ("", {}, ("vmstat", 7)),  # no control group: the machine's count
], ids=["v2", "v1", "machine"])
def test_out_of_memory_kills_are_counted_in_the_jobs_group_else_on_the_machine(proc_cgroup, files, counted,
                                                                              tmp_path, monkeypatch):
    _machine(tmp_path, monkeypatch, proc_cgroup, files)
    (tmp_path / "vmstat").write_text("pgfault 10\noom_kill 7\n")
    where, count = cgroups.oom_kills()
    assert where.endswith(f"{counted[0]})") and count == counted[1]
    (tmp_path / "vmstat").write_text("pgfault 10\n")
    assert (cgroups.oom_kills() is None) == (counted[0] == "vmstat")
