"""The choice's loops over copies, compiled for the host (numba): the rule of :mod:`.choice`, one layer at a time.

The choice is sequential by nature (each copy goes to the least-loaded rank
after the last copy's re-split), EP x S copies per layer: at DeepSeek-V3 671B's
shape (58 layers, EP=64, 2 slots) that is 7,424 small steps between two
training steps. As array operations over all layers at once they cost about
0.4 ms a round in interpreter overhead (128 rounds); compiled, each step is a
few hundred machine instructions. Compiled once per machine and cached
beside this file (:func:`warm` loads or compiles it ahead of the first choice).
"""

import numba
import numpy as np


@numba.njit(cache=True)
def water_fill(loads: np.ndarray, amount: int, quotas: np.ndarray) -> None:
    """Writes into ``quotas`` [C] the integer quotas summing to ``amount`` over copies with ``loads`` [C] that
    minimise max(loads + quotas): the lowest-loaded copies filled to a common level, the remainder one pair each
    to the lowest-loaded of them (ties: the earlier copy); the device's
    :func:`~torchtitan_ext.ep.replication.split.water_fill`, for one row."""
    order = np.argsort(loads, kind="mergesort")  # stable: ties keep copy order
    prefix = level = filled = filled_prefix = 0  # the first copy always fills: amount >= 0
    for i in range(loads.shape[0]):
        prefix += loads[order[i]]
        candidate = (amount + prefix) // (i + 1)
        if candidate < loads[order[i]]:
            break  # the next-lowest load lies above the level: the filled copies are a prefix of the order
        level, filled, filled_prefix = candidate, i + 1, prefix
    remainder = amount + filled_prefix - level * filled
    for i in range(loads.shape[0]):
        copy = order[i]
        quotas[copy] = max(level - loads[copy], 0) + (1 if i < remainder else 0)


@numba.njit(cache=True)
def choose(counts: np.ndarray, expert_parallel_degree: int, slots: int) -> np.ndarray:
    """[layers, EP, S] each rank's replica slots' home slots (-1: unused) for ``counts`` [layers, E] int64, by the
    rule of :mod:`.choice`: the home slot with the most pairs per copy (ties: the lower) gets a copy on the
    least-loaded rank with a free slot and no copy of it (ties: the lower rank), and its pairs are re-split by
    :func:`water_fill` over its copies (home first, then in the order they came); a slot that finds no such rank
    leaves for good; a layer ends when its slots are used or no expert with pairs can be copied. Each rank's copies
    are listed ascending, then its unused slots (:class:`~torchtitan_ext.ep.replication.plan.ReplicaPlan`'s order)."""
    layers, experts = counts.shape
    ep = expert_parallel_degree
    per_rank = experts // ep
    replicas = np.full((layers, ep, slots), -1, dtype=np.int64)
    copy_rank = np.empty((experts, ep), dtype=np.int64)
    shares = np.empty((experts, ep), dtype=np.int64)
    copies = np.empty(experts, dtype=np.int64)
    loads = np.empty(ep, dtype=np.int64)
    free_slots = np.empty(ep, dtype=np.int64)
    key = np.empty(experts, dtype=np.float64)
    has_copy = np.zeros(ep, dtype=np.bool_)
    others = np.empty(ep, dtype=np.int64)
    quotas = np.empty(ep, dtype=np.int64)
    for layer in range(layers):
        loads[:] = 0
        for home in range(experts):
            count = counts[layer, home]
            loads[home // per_rank] += count
            copy_rank[home, 0] = home // per_rank
            shares[home, 0] = count
            copies[home] = 1
            key[home] = count if count > 0 else -np.inf  # pairs per copy; -inf: never copied again
        free_slots[:] = slots
        for _ in range(ep * slots):  # every round but a stuck one uses a slot
            home = np.argmax(key)
            while key[home] != -np.inf:
                held = copies[home]
                has_copy[:] = False
                for copy in range(held):
                    has_copy[copy_rank[home, copy]] = True
                rank = -1
                for candidate in range(ep):
                    if free_slots[candidate] > 0 and not has_copy[candidate] and (
                            rank < 0 or loads[candidate] < loads[rank]):
                        rank = candidate
                if rank >= 0:
                    break
                key[home] = -np.inf  # free ranks only fill and copies only grow: stuck for good
                home = np.argmax(key)
            if key[home] == -np.inf:
                break
            free_slots[rank] -= 1
            replicas[layer, rank, slots - 1 - free_slots[rank]] = home
            copy_rank[home, held] = rank
            shares[home, held] = 0
            held += 1
            copies[home] = held
            for copy in range(held):
                others[copy] = loads[copy_rank[home, copy]] - shares[home, copy]
            water_fill(others[:held], counts[layer, home], quotas[:held])
            for copy in range(held):
                shares[home, copy] = quotas[copy]
                loads[copy_rank[home, copy]] = others[copy] + quotas[copy]
            key[home] = counts[layer, home] / held
        for rank in range(ep):  # a plan's order: each rank's copies ascending, then its unused slots
            replicas[layer, rank, :slots - free_slots[rank]].sort()
    return replicas


@numba.njit(cache=True)
def fill(counts: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """[layers, EP] each rank's pairs of ``counts`` [layers, E] int64 under ``replicas`` [layers, EP, S] (as
    :func:`choose` returns), the copies filled in one pass: each replicated expert, most pairs first (ties: the lower
    slot), re-splits its pairs by :func:`water_fill` over its copies, home first, then rank by rank."""
    layers, experts = counts.shape
    ep, slots = replicas.shape[1], replicas.shape[2]
    per_rank = experts // ep
    loads = np.zeros((layers, ep), dtype=np.int64)
    copy_rank = np.empty((experts, ep), dtype=np.int64)
    copies = np.empty(experts, dtype=np.int64)
    others = np.empty(ep, dtype=np.int64)
    quotas = np.empty(ep, dtype=np.int64)
    for layer in range(layers):
        for home in range(experts):
            loads[layer, home // per_rank] += counts[layer, home]
            copy_rank[home, 0] = home // per_rank
            copies[home] = 1
        for rank in range(ep):
            for slot in range(slots):
                home = replicas[layer, rank, slot]
                if home >= 0:
                    copy_rank[home, copies[home]] = rank
                    copies[home] += 1
        for home in np.argsort(-counts[layer], kind="mergesort"):
            held = copies[home]
            if held == 1:
                continue
            for copy in range(held):
                others[copy] = loads[layer, copy_rank[home, copy]] - (counts[layer, home] if copy == 0 else 0)
            water_fill(others[:held], counts[layer, home], quotas[:held])
            for copy in range(held):
                loads[layer, copy_rank[home, copy]] = others[copy] + quotas[copy]
    return loads


def warm() -> None:
    """Loads the compiled loops (or compiles them, once per machine: seconds), so that no step waits for it."""
    counts = np.ones((1, 2), dtype=np.int64)
    fill(counts, choose(counts, 2, 1))
