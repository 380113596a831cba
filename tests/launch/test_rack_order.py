"""The SLURM job's nodes in rack order, from `scontrol show topology` (topology/block plugin)."""

from torchtitan_ext.launch.rack_order import blocks_of, rack_order

# two NVL72 racks of 18 trays, and the aggregate block SLURM lists above them
TOPOLOGY = """BlockName=rack1 BlockIndex=0 Nodes=r1-t[01-18] BlockSize=18
BlockName=rack2 BlockIndex=1 Nodes=r2-t[01-18] BlockSize=18
BlockName=rack1-2 BlockIndex=2 Nodes=r1-t[01-18],r2-t[01-18] BlockSize=36
"""


def _expand(expression: str) -> list[str]:
    hosts = []
    for rack in (1, 2):
        if f"r{rack}-t[01-18]" in expression:
            hosts += [f"r{rack}-t{tray:02d}" for tray in range(1, 19)]
    return hosts


def test_the_lowest_blocks_are_the_racks():
    blocks = blocks_of(TOPOLOGY, _expand)
    assert [block[0] for block in blocks] == ["r1-t01", "r2-t01"] and all(len(block) == 18 for block in blocks)


def test_trays_interleaved_by_the_scheduler_are_grouped_by_rack():
    # 16 trays of each rack, the node list alternating between them
    job = [f"r{rack}-t{tray:02d}" for tray in range(1, 17) for rack in (2, 1)]
    ordered = rack_order(job, blocks_of(TOPOLOGY, _expand))
    assert ordered == [f"r1-t{tray:02d}" for tray in range(1, 17)] + [f"r2-t{tray:02d}" for tray in range(1, 17)]


def test_without_a_block_topology_the_node_list_order_is_kept():
    job = ["b", "a", "c"]
    assert blocks_of("SwitchName=s0 Level=0 LinkSpeed=1 Nodes=a,b,c", _expand) == []
    assert rack_order(job, []) == job
