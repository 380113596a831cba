"""The search for an expert placement (:mod:`.placement`) from recorded routing.

``python -m torchtitan_ext.placement`` runs it (:func:`search`). Per MoE layer, on the dump's first steps
(the fit steps), it minimises the largest per-rank token load summed over them, then, within ``--load-tolerance`` of it,
keeps co-activated experts on one rank or NVLink domain; it is never worse than the identity there.
It reports before and after on the held-out later steps. ``--first-step`` leaves out earlier files.
See docs/balancing.md, "Placement from recorded routing" and "Where the seed papers' algorithms fail,
and what is taken".
"""

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from torchtitan_ext.balancing.placement import Placement
from torchtitan_ext.balancing.routing_stats import check_fits, load_folder
from torchtitan_ext.config import ConfigError, moe_layer_ids, moe_shape
from torchtitan_ext.ep import PLANNING_PROFILES, planning_profile


# --- the placement of one layer -----------------------------------------------------------------


def balance_loads(loads: np.ndarray, ranks: int) -> np.ndarray:
    """Rank of each expert, equal expert counts, minimising the largest rank load.

    Longest-processing-time first over the ranks that still have a free slot,
    then swaps between the most loaded rank and another while one lowers the
    larger of the two: each swap lowers the most loaded rank's load or leaves
    fewer ranks at it, so the loop ends (bounded at experts^2 swaps besides: a tie at float precision
    must not make it spin). ``loads`` must be finite and >= 0.
    """
    if not np.isfinite(loads).all() or (loads < 0).any():
        raise ValueError(f"expert loads must be finite and >= 0, got {loads}")
    experts = len(loads)
    per_rank = experts // ranks
    rank_of = np.empty(experts, dtype=np.int64)
    rank_load = np.zeros(ranks, dtype=np.float64)
    free = np.full(ranks, per_rank)
    for expert in np.argsort(-loads, kind="stable"):
        open_ranks = np.flatnonzero(free)
        rank = open_ranks[np.argmin(rank_load[open_ranks])]
        rank_of[expert] = rank
        rank_load[rank] += loads[expert]
        free[rank] -= 1
    for _ in range(experts * experts):
        hot = int(np.argmax(rank_load))
        mine = np.flatnonzero(rank_of == hot)
        others = np.flatnonzero(rank_of != hot)
        # swapping a (hot) with b (rank j): the pair's larger load after the swap must drop below hot's
        delta = loads[mine][:, None] - loads[others][None, :]
        after = np.maximum(rank_load[hot] - delta, rank_load[rank_of[others]][None, :] + delta)
        best = np.unravel_index(np.argmin(after), after.shape)
        if after[best] >= rank_load[hot] - 1e-9:
            return rank_of
        a, b = mine[best[0]], others[best[1]]
        rank_load[hot] -= delta[best]
        rank_load[rank_of[b]] += delta[best]
        rank_of[a], rank_of[b] = rank_of[b], hot
    return rank_of


def group_by_affinity(
    rank_of: np.ndarray, loads: np.ndarray, coactivation: np.ndarray, ranks_per_domain: int, load_cap: float,
    max_rounds: int,
) -> np.ndarray:
    """Swap experts between ranks to raise the co-activation kept within a rank (and a domain).

    Each round scores every swap in the round's state and walks the best
    ``4 x ranks`` of positive gain in that order. Each is scored again against
    the swaps made before it in the round (its exact gain, in O(1)) and made
    only if it still strictly raises the integer score and keeps both ranks'
    loads at or under ``load_cap``. The score rises with every swap, so the
    rounds end; at most ``max_rounds``.
    """
    rank_of = rank_of.copy()
    experts = len(rank_of)
    ranks = int(rank_of.max()) + 1
    pair = coactivation.astype(np.float64)
    np.fill_diagonal(pair, 0.0)
    rank_load = np.bincount(rank_of, weights=loads, minlength=ranks)
    by_rank = pair @ np.eye(ranks)[rank_of]                     # [E, R]: each expert's affinity to each rank
    by_domain = by_rank.reshape(experts, ranks // ranks_per_domain, ranks_per_domain).sum(axis=2)
    domain_of_rank = np.arange(ranks) // ranks_per_domain
    rows = np.arange(experts)
    candidates = 4 * ranks
    for _ in range(max_rounds):
        domain_of = domain_of_rank[rank_of]
        # moving a to rank r (domain d) gains by_rank[a, r] - own + by_domain[a, d] - own domain;
        # a swap adds both experts' moves and takes back the pair's own co-activation, counted in each
        move = (by_rank - by_rank[rows, rank_of][:, None]
                + (by_domain - by_domain[rows, domain_of][:, None])[:, domain_of_rank])[:, rank_of]
        gain = move + move.T - 2 * pair * (1 + (domain_of[:, None] != domain_of[None, :]))
        load_after = rank_load[rank_of][:, None] - (loads[:, None] - loads[None, :])
        gain[(load_after > load_cap) | (load_after.T > load_cap) | (rank_of[:, None] == rank_of[None, :])] = 0.0
        flat = np.triu(gain, 1).ravel()  # a swap and its mirror are one
        # scores are integer token counts: a gain under 1 is none
        best = np.flatnonzero(flat > 0.5)
        if len(best) > candidates:
            best = best[np.argpartition(flat[best], -candidates)[-candidates:]]
        made = 0
        for index in best[np.argsort(-flat[best])]:
            a, b = divmod(int(index), experts)
            i, j = rank_of[a], rank_of[b]
            di, dj = domain_of_rank[i], domain_of_rank[j]
            shift = loads[a] - loads[b]
            if i == j or rank_load[i] - shift > load_cap or rank_load[j] + shift > load_cap:
                continue
            exact = by_rank[a, j] + by_rank[b, i] - by_rank[a, i] - by_rank[b, j] - 2 * pair[a, b]
            if di != dj:
                exact += by_domain[a, dj] + by_domain[b, di] - by_domain[a, di] - by_domain[b, dj] - 2 * pair[a, b]
            if exact <= 0.5:
                continue
            rank_load[i] -= shift
            rank_load[j] += shift
            moved = pair[:, b] - pair[:, a]
            by_rank[:, i] += moved
            by_rank[:, j] -= moved
            by_domain[:, di] += moved
            by_domain[:, dj] -= moved
            rank_of[a], rank_of[b] = j, i
            made += 1
        if not made:
            break
    return rank_of


def slots_from_ranks(rank_of: np.ndarray) -> tuple[int, ...]:
    """Logical expert per physical slot: each rank's experts in its slots, by expert id."""
    return tuple(int(e) for e in np.lexsort((np.arange(len(rank_of)), rank_of)))


def ranks_from_slots(slots, ranks: int) -> np.ndarray:
    """EP rank of each logical expert under ``slots`` (logical expert per physical slot)."""
    per_rank = len(slots) // ranks
    rank_of = np.empty(len(slots), dtype=np.int64)
    rank_of[list(slots)] = np.arange(len(slots)) // per_rank
    return rank_of


# --- measures ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measures:
    """How a placement does on some steps of recorded routing."""

    load_max_over_mean: float
    """Per step: the most loaded EP rank's (token, expert) pairs over the mean; averaged over the steps."""
    distinct_ranks: float
    """Distinct EP ranks among a token's top-k experts, averaged over the sampled tokens."""
    distinct_domains: float
    """The same for NVLink domains (groups of ``ranks_per_domain`` consecutive EP ranks)."""


def measure(rank_of: np.ndarray, tokens_per_expert: np.ndarray, sampled: np.ndarray, ranks_per_domain: int) -> Measures:
    """``tokens_per_expert`` [steps, E]; ``sampled`` [tokens, top_k] expert ids (rows with -1 dropped)."""
    ranks = int(rank_of.max()) + 1
    per_rank = np.stack([np.bincount(rank_of, weights=step, minlength=ranks) for step in tokens_per_expert])
    mean = per_rank.mean(axis=1)
    ratio = float(np.mean(per_rank.max(axis=1)[mean > 0] / mean[mean > 0]))
    token_ranks = rank_of[sampled]
    return Measures(ratio, _distinct_per_row(token_ranks), _distinct_per_row(token_ranks // ranks_per_domain))


def _distinct_per_row(values: np.ndarray) -> float:
    ordered = np.sort(values, axis=1)
    return float(np.mean(1 + (np.diff(ordered, axis=1) != 0).sum(axis=1)))


def dispatch_copies(measures: Measures, top_k: int) -> dict[str, float]:
    """Copies of a token each backend's dispatch sends: k, or one per distinct rank."""
    return {
        name: measures.distinct_ranks if profile.sends_each_token_once_per_rank else float(top_k)
        for name, profile in PLANNING_PROFILES.items()
    }


# --- the tool ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerResult:
    layer: int
    slots: tuple[int, ...]
    fit_before: Measures
    fit_after: Measures
    held_out_before: Measures
    held_out_after: Measures
    kept_identity: bool


def from_step(stats: dict, first_step: int) -> dict:
    """The dump without its files that cover steps before ``first_step``."""
    ends = np.cumsum(stats["file_steps"])
    starts = ends - stats["file_steps"]
    kept = [i for i, start in enumerate(starts) if stats["steps"][start] >= first_step]
    rows = np.concatenate([np.arange(starts[i], ends[i]) for i in kept]) if kept else np.zeros(0, dtype=np.int64)
    per_step = ("steps", "tokens_per_expert", "sampled_expert_ids")
    return {
        **stats,
        **{key: stats[key][rows] for key in per_step},
        "file_steps": stats["file_steps"][kept],
        "file_coactivation": stats["file_coactivation"][kept],
    }


def split_steps(stats: dict, holdout: float) -> tuple[int, int]:
    """(files to fit on, first held-out step index): the dump's files split in time order."""
    files = len(stats["file_steps"])
    if files < 2:
        raise ConfigError(
            f"--routing-stats has {files} file: fitting and held-out evaluation need at least 2 "
            "(train with a routing_stats.save_every that splits the run into several files)"
        )
    fit_files = min(files - 1, max(1, round(files * (1 - holdout))))
    return fit_files, int(sum(stats["file_steps"][:fit_files]))


def place(stats: dict, ranks: int, ranks_per_domain: int, holdout: float, load_tolerance: float, progress=True):
    """One :class:`LayerResult` per MoE layer of a dump loaded by :func:`load_dump`."""
    fit_files, first_held_out = split_steps(stats, holdout)
    top_k = int(stats["top_k"])
    experts = stats["tokens_per_expert"].shape[-1]
    results = []
    layers = list(enumerate(stats["layers"].tolist()))
    for index, layer in tqdm(layers, desc="placing layers", unit="layer", disable=not progress):
        counts = stats["tokens_per_expert"][:, index].astype(np.float64)
        sampled = stats["sampled_expert_ids"][:, index]
        fit = (counts[:first_held_out], _rows(sampled[:first_held_out], top_k))
        held_out = (counts[first_held_out:], _rows(sampled[first_held_out:], top_k))
        loads = fit[0].sum(axis=0)
        coactivation = sum(part[index] for part in stats["file_coactivation"][:fit_files])
        identity = np.arange(experts) // (experts // ranks)
        balanced = balance_loads(loads, ranks)
        cap = np.bincount(balanced, weights=loads, minlength=ranks).max() * (1 + load_tolerance)
        max_rounds = 4 * experts
        before = measure(identity, *fit, ranks_per_domain)
        grouped = group_by_affinity(balanced, loads, coactivation, ranks_per_domain, cap, max_rounds)
        measured = [(identity, before), (grouped, measure(grouped, *fit, ranks_per_domain))]
        # grouping from the identity keeps every rank under the identity's largest load: worth a try
        # only where that load is within the tolerance of the first grouping's (it may then group better)
        if before.load_max_over_mean <= measured[1][1].load_max_over_mean * (1 + load_tolerance):
            from_identity = group_by_affinity(identity, loads, coactivation, ranks_per_domain,
                                              np.bincount(identity, weights=loads, minlength=ranks).max(), max_rounds)
            measured.append((from_identity, measure(from_identity, *fit, ranks_per_domain)))
        # lexicographic, never behind the identity: no higher load; then, within the load tolerance
        # of the best load, the fewest distinct ranks per token
        eligible = [(c, m) for c, m in measured if m.load_max_over_mean <= before.load_max_over_mean + 1e-12]
        best_load = min(m.load_max_over_mean for _, m in eligible)
        chosen, chosen_measures = min(
            ((c, m) for c, m in eligible if m.load_max_over_mean <= best_load * (1 + load_tolerance)),
            key=lambda item: (item[1].distinct_ranks, item[1].load_max_over_mean),
        )
        results.append(LayerResult(
            layer=layer,
            slots=slots_from_ranks(chosen),
            fit_before=before,
            fit_after=chosen_measures,
            held_out_before=measure(identity, *held_out, ranks_per_domain),
            held_out_after=measure(chosen, *held_out, ranks_per_domain),
            kept_identity=chosen is identity,
        ))
    return results


def _rows(sampled: np.ndarray, top_k: int) -> np.ndarray:
    rows = sampled.reshape(-1, top_k)
    return rows[(rows >= 0).all(axis=1)]


def load_dump(folder: str) -> dict:
    """A routing-statistics folder with the per-file co-activation kept apart (for the fit/held-out split)."""
    stats = load_folder(folder)
    if "sampled_expert_ids" not in stats or stats["sampled_expert_ids"].shape[2] == 0:
        raise ConfigError(
            f"--routing-stats {folder} has no sampled routing (sampled_expert_ids): record it again with this "
            "version ([routing_stats] enable = true, sample_tokens > 0)"
        )
    return stats


def format_results(results: list[LayerResult], top_k: int, tokens_per_step: float, token_bytes: int) -> list[str]:
    def row(name: str, m: Measures) -> str:
        copies = dispatch_copies(m, top_k)
        megabytes = " ".join(f"{name}={copies[name] * tokens_per_step * token_bytes / 1e6:.2f}" for name in copies)
        return (f"  {name:<22} load max/mean {m.load_max_over_mean:.3f}  ranks/token {m.distinct_ranks:.3f}  "
                f"domains/token {m.distinct_domains:.3f}  dispatch MB/step {megabytes}")

    lines = []
    for r in results:
        note = " (identity kept: no candidate was better on the fit steps)" if r.kept_identity else ""
        lines.append(f"MoE layer {r.layer}{note}")
        lines += [row("fit, identity", r.fit_before), row("fit, placed", r.fit_after),
                  row("held-out, identity", r.held_out_before), row("held-out, placed", r.held_out_after)]
    def mean(measure_of, field):
        return np.mean([getattr(measure_of(r), field) for r in results])

    before, after = (lambda r: r.held_out_before), (lambda r: r.held_out_after)
    worse = [r.layer for r in results if r.held_out_after.load_max_over_mean > r.held_out_before.load_max_over_mean]
    if worse:
        lines.append(
            f"warning: on the held-out steps the placement's load max/mean is above the identity's on MoE layers "
            f"{worse}: their routing changed between the fit and held-out steps; record a later or longer window "
            "(--first-step), or keep those layers' identity"
        )
    lines.append(
        f"All {len(results)} MoE layers, held-out steps: load max/mean {mean(before, 'load_max_over_mean'):.3f} -> "
        f"{mean(after, 'load_max_over_mean'):.3f}, distinct ranks per token {mean(before, 'distinct_ranks'):.3f} -> "
        f"{mean(after, 'distinct_ranks'):.3f}, distinct domains per token {mean(before, 'distinct_domains'):.3f} -> "
        f"{mean(after, 'distinct_domains'):.3f}"
    )
    return lines


def check_search_options(holdout: float, load_tolerance: float, first_step: int, ranks_per_domain: int | None) -> None:
    """ConfigError for a search flag out of its range (NaN is out of every range)."""
    if not 0 < holdout < 1:
        raise ConfigError(f"--holdout {holdout}: use a fraction between 0 and 1, e.g. 0.5")
    if not 0 <= load_tolerance < math.inf:
        raise ConfigError(f"--load-tolerance {load_tolerance}: use a finite fraction >= 0, e.g. 0.02")
    if first_step < 1:
        raise ConfigError(f"--first-step {first_step}: use a training step >= 1")
    if ranks_per_domain is not None and ranks_per_domain < 1:
        raise ConfigError(f"--ranks-per-domain {ranks_per_domain}: use a rank count >= 1, or leave it out")


def search(
    job_config, routing_stats: str, output: str, *, world_size: int, ranks_per_domain: int | None,
    first_step: int, holdout: float, load_tolerance: float,
) -> list[str]:
    """Place every MoE layer of a validated job from the dump in ``routing_stats``, write the placement
    file ``output``; the report's lines. ConfigError for a dump or setting that does not fit the job
    (``holdout`` and ``load_tolerance`` are checked by :func:`check_search_options` first)."""
    shape = moe_shape(job_config)
    if shape is None:
        raise ConfigError(f"model {job_config.model.name} {job_config.model.flavor} has no MoE layers: nothing to place")
    ep = job_config.parallelism.expert_parallel_degree
    if ep == 1:
        raise ConfigError("parallelism.expert_parallel_degree = 1: placement needs expert parallelism, set it > 1")
    stats = from_step(load_dump(routing_stats), first_step)
    experts = stats["tokens_per_expert"].shape[-1]
    moe_layers = moe_layer_ids(job_config)
    check_fits(stats, moe_layers, shape.num_experts, f"--routing-stats {routing_stats}")
    # a domain at least as large as the EP group holds all of it
    domain = min(ranks_per_domain or planning_profile(job_config).nvlink_domain_ranks(job_config) or ep, ep)
    if domain < 1 or ep % domain:
        raise ConfigError(f"--ranks-per-domain {domain} does not divide expert_parallel_degree = {ep}: pick a divisor")
    began = time.perf_counter()
    results = place(stats, ep, domain, holdout, load_tolerance)
    elapsed = time.perf_counter() - began
    placement = Placement(experts, ep, {r.layer: r.slots for r in results})
    Path(output).write_text(placement.to_json() + "\n")
    tokens_per_step = stats["tokens_per_expert"].sum() / len(stats["steps"]) / len(moe_layers) / int(stats["top_k"])
    token_bytes = shape.hidden_dim * 2
    lines = [
        f"Placement for {len(results)} MoE layers, {experts} experts on EP={ep} ({domain} ranks per domain), "
        f"world size {world_size}; dump: {len(stats['steps'])} steps in {len(stats['file_steps'])} files, "
        f"fit on the first {split_steps(stats, holdout)[1]} steps; {elapsed:.2f} s",
        f"(dispatch MB per step and MoE layer: {tokens_per_step:.0f} tokens x copies x {token_bytes} bytes, bf16 rows)",
        *format_results(results, int(stats["top_k"]), tokens_per_step, token_bytes),
        what_to_do(results, output),
    ]
    return lines


def what_to_do(results: list[LayerResult], output: str) -> str:
    """The report's last line: train with the file, unless every layer kept the identity, which changes nothing."""
    if all(r.kept_identity for r in results):
        return (f"Wrote {output}, the identity in every MoE layer: training with it changes nothing. No placement "
                "did better on the fit steps; where the hot experts move from step to step, replication follows "
                "them (--expert_replication.slots_per_rank, docs/balancing.md)")
    return f"Wrote {output}: train with --expert_placement.file {output}"

