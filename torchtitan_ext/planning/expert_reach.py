"""Where a token's experts land under uniform routing: the chance that none of its top-k is among a block of
experts (:func:`uniform_miss`), and the share of tokens that reach a block through torchtitan's group-limited gate
(DeepSeek-V3's; :func:`group_limited_reach`), drawn once per model."""

import functools
import math

import numpy as np


def uniform_miss(experts: int, top_k: int, held: int) -> float:
    """Probability that none of a token's top_k distinct experts (uniform) is among ``held`` experts."""
    if experts - held < top_k:
        return 0.0
    return math.comb(experts - held, top_k) / math.comb(experts, top_k)


GROUP_LIMITED_SAMPLES = 16384
"""Tokens drawn to estimate reach under group-limited routing (standard error below 0.4%)."""


def group_limited_choice(scores: np.ndarray, top_k: int, groups: int, limited: int) -> np.ndarray:
    """[tokens, top_k] experts the group-limited gate picks from ``scores`` [tokens, E] (in [0, 1)): each
    group scores the sum of its top 2, the ``limited`` best groups stay, the top_k of their experts win."""
    tokens, experts = scores.shape
    grouped = scores.reshape(tokens, groups, experts // groups).copy()
    group_scores = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
    dropped = np.argsort(group_scores, axis=1)[:, : groups - limited]
    np.put_along_axis(grouped, dropped[:, :, None].repeat(experts // groups, axis=2), -1.0, axis=1)
    return np.argpartition(-grouped.reshape(tokens, experts), top_k - 1, axis=1)[:, :top_k]


@functools.lru_cache(maxsize=64)
def group_limited_reach(experts: int, top_k: int, groups: int, limited: int, held: int) -> float:
    """The fraction of tokens with an expert among ``held`` consecutive experts (averaged over where they
    start, in steps of ``held``), under torchtitan's group-limited gate with independent, identically
    distributed scores: each group scores the sum of its top 2, a token keeps its ``limited`` best
    groups and picks its top_k experts among theirs. Drawn (fixed seed), not enumerated: the gate's
    choice of groups and of experts within them are not independent."""
    ids = _group_limited_draw(experts, top_k, groups, limited)
    blocks = experts // held  # the starts 0, held, ... that leave a whole block
    hit = np.zeros((ids.shape[0], blocks + 1), dtype=bool)  # the last column: experts past the whole blocks
    hit[np.arange(ids.shape[0])[:, None], np.minimum(ids // held, blocks)] = True
    return float(hit[:, :blocks].mean(axis=0).mean())


@functools.lru_cache(maxsize=8)
def _group_limited_draw(experts: int, top_k: int, groups: int, limited: int) -> np.ndarray:
    """[GROUP_LIMITED_SAMPLES, top_k] experts :func:`group_limited_choice` picks from a fixed-seed draw of scores
    (one draw serves every block size: read-only)."""
    scores = np.random.default_rng(0).random((GROUP_LIMITED_SAMPLES, experts))
    # a copy: the choice is a view of argpartition's [tokens, experts] result, which it would keep alive
    ids = np.ascontiguousarray(group_limited_choice(scores, top_k, groups, limited))
    ids.flags.writeable = False
    return ids
