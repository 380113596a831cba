"""A SLURM job's nodes in rack order, one host name a line: the node ranks multinode_trainer.slurm gives torchrun.

``python -m torchtitan_ext.launch.rack_order`` (inside an allocation) reads the job's nodes
(``scontrol show hostnames $SLURM_JOB_NODELIST``) and the cluster's blocks (``scontrol show topology``: with SLURM's
topology/block plugin, one block per NVLink domain, an NVL72 rack's 18 trays) and prints the nodes grouped by block,
blocks in the order SLURM lists them, nodes in the job's order within a block. Ranks are numbered node by node in
that order, so each run of consecutive ranks (an EP group: 64 ranks = 16 trays of 4 GPUs) lies in one rack when the
allocation gave whole racks' worth of trays (``sbatch --segment=16``). Without a block topology the job's node order
is kept, and says so on stderr.
"""

import os
import sys
from collections.abc import Callable

from torchtitan_ext.runtime.jobs import JobFailed, run_job

SCONTROL_TIMEOUT_S = 60


def blocks_of(topology: str, expand: Callable[[str], list[str]]) -> list[list[str]]:
    """The host names of each block that ``scontrol show topology`` lists (``BlockName=... Nodes=EXPR``), lowest
    level first: a block that contains another listed block (an aggregate of racks) is left out."""
    blocks = []
    for line in topology.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "BlockName" in fields and fields.get("Nodes"):
            blocks.append(expand(fields["Nodes"]))
    sets = [set(block) for block in blocks]
    return [block for block, hosts in zip(blocks, sets) if not any(other < hosts for other in sets)]


def rack_order(job_hosts: list[str], blocks: list[list[str]]) -> list[str]:
    """``job_hosts`` grouped by the block each belongs to, blocks in listed order, the job's order within a block;
    hosts in no block last, in the job's order."""
    block_of = {host: index for index, block in enumerate(blocks) for host in block}
    position = {host: index for index, host in enumerate(job_hosts)}
    return sorted(job_hosts, key=lambda host: (block_of.get(host, len(blocks)), position[host]))


def _scontrol(*args: str) -> str:
    return run_job(["scontrol", *args], timeout_s=SCONTROL_TIMEOUT_S).output


def _hostnames(expression: str) -> list[str]:
    return _scontrol("show", "hostnames", expression).split()


def main() -> None:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        print("error: SLURM_JOB_NODELIST is not set: run inside a SLURM allocation", file=sys.stderr)
        sys.exit(2)
    job_hosts = _hostnames(nodelist)
    try:
        topology = _scontrol("show", "topology")
    except JobFailed:  # no topology plugin that shows one
        topology = ""
    blocks = blocks_of(topology, _hostnames)
    if not blocks:
        print("[rack_order] no block topology (SLURM's topology/block plugin): ranks follow the job's node order",
              file=sys.stderr)
    print("\n".join(rack_order(job_hosts, blocks)))


if __name__ == "__main__":
    main()
