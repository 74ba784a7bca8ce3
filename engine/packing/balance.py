"""Karmarkar–Karp (largest differencing) k-way partitioning and sample-level rebalancing: --balance-data.

A *state* is k sets sorted by decreasing sum; its spread is max sum − min sum. Start with one state per item
(or, with equal_size, one state per run of k consecutive items in sorted order, one item per set), then merge
the two states of largest spread, pairing the heaviest set of one with the lightest of the other, until one
state is left: its k sets are the partition. With equal_size every set of every state holds the same number of
items, so the result has n/k items per part (what DP needs: every rank runs the same number of micro-batches).

Example (k = 2, not equal-size), weights 8 7 6 5 4: merge {8},{7} → (8 | 7), spread 1; merge {6},{5} →
(6 | 5), spread 1; merge {4} (spread 4) with (8 | 7): 4+7, 0+8 → (11 | 8), spread 3; merge (11 | 8) with (6 | 5):
11+5, 8+6 → (16 | 14): parts {7,4,5} and {8,6}. The optimum is 15 | 15: KK is a heuristic, not exact
(O(n·k·log k), O(n·log k) with equal_size).

rebalance() finishes the job at sample granularity. KK moves whole micro-batches, and with few per rank that is
coarse: 4,096 samples over DP 64 with a 65,536-token cap are 2 micro-batches per rank, and KK alone left the
slowest rank 7.9 % above the mean (bench case a); moving or swapping single samples from the heaviest rank,
without breaking the token cap or the micro-batch counts, brings it to 0.1 %.
"""
from __future__ import annotations

import heapq
from itertools import chain
from typing import Any

import numpy as np


def bin_sums(bins: list[list[int]], values) -> list[float]:
    """[K] Σ values[i] over each bin (one numpy bincount instead of K Python sums)."""
    sizes = [len(b) for b in bins]
    flat = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=sum(sizes))
    ids = np.repeat(np.arange(len(bins)), sizes)
    return np.bincount(ids, weights=np.asarray(values, dtype=np.float64)[flat], minlength=len(bins)).tolist()


def _flatten(tree: Any) -> list[int]:
    """Items of a set, stored as nested pairs so that merging two sets is O(1)."""
    out, stack = [], [tree]
    while stack:
        t = stack.pop()
        if t is None:
            continue
        if isinstance(t, tuple):
            stack += t
        else:
            out.append(t)
    return out


def karmarkar_karp(weights: list[float], k: int, equal_size: bool) -> list[list[int]]:
    """Partition indices 0..n-1 into k parts of near-equal weight sum (parts ordered by decreasing sum).

    equal_size: every part gets exactly n/k indices (n must be a multiple of k).
    """
    n = len(weights)
    if k < 1:
        raise ValueError(f"karmarkar_karp: k = {k}, need k ≥ 1")
    if equal_size and n % k:
        raise ValueError(f"karmarkar_karp: equal_size needs the item count to be a multiple of k; got {n} items, "
                         f"k = {k} ({n} = {n // k}·{k} + {n % k})")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    heap: list[tuple] = []  # (−spread, −max sum, tie, sums[k] decreasing, items[k] as trees)
    tie = 0

    def push(sums: list[float], items: list[Any]) -> None:
        nonlocal tie
        heapq.heappush(heap, (sums[-1] - sums[0], -sums[0], tie, sums, items))
        tie += 1

    if equal_size:
        for s in range(0, n, k):
            run = order[s:s + k][::-1]  # k items, heaviest first
            push([float(weights[i]) for i in run], list(run))
    else:
        for i in order:
            push([float(weights[i])] + [0.0] * (k - 1), [i] + [None] * (k - 1))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, _, sa, ia = heapq.heappop(heap)
        _, _, _, sb, ib = heapq.heappop(heap)
        # heaviest of A with lightest of B: the difference of the two states is what remains
        sums = [x + y for x, y in zip(sa, reversed(sb))]
        items = [(x, y) for x, y in zip(ia, reversed(ib))]
        rank = sorted(range(k), key=lambda j: -sums[j])
        push([sums[j] for j in rank], [items[j] for j in rank])
    _, _, _, _, items = heap[0]
    return [sorted(_flatten(t)) for t in items]


def rebalance(groups: list[list[list[int]]], lengths: list[int], flops: list[float], cap: int | None, *,
              moves: bool, tol: float = 1e-3, max_rounds: int | None = None) -> list[list[list[int]]]:
    """Lower the heaviest group's FLOPs by handing single samples to lighter groups, keeping every bin legal.

    groups[g][b] = sample indices of bin b of group g (a group is a DP rank, or a single micro-batch). A round
    takes the heaviest group h and one of the 4 lightest, l, with gap = F_h − F_l, and applies the move of one
    sample h → l (moves=True; never empties a bin) or the swap of s ∈ h with t ∈ l whose transfer δ lies in
    (0, gap), closest to gap/2: then max(F_h − δ, F_l + δ) < F_h, so the heaviest load only goes down. Bin token
    sums stay ≤ cap (cap None: no token limit, as in static mode) and the number of bins never changes. Stops
    when F_h ≤ (1 + tol)·mean, when no legal transfer helps the heaviest group, or after max_rounds.
    Samples already over the cap (alone in their bin) never move.
    """
    groups = [[list(b) for b in g] for g in groups]
    limit = float("inf") if cap is None else float(cap)
    lengths_np, flops_np = np.asarray(lengths, dtype=np.float64), np.asarray(flops, dtype=np.float64)
    F = bin_sums([list(chain.from_iterable(g)) for g in groups], flops)
    flat_T = iter(bin_sums([b for g in groups for b in g], lengths))
    T = [[next(flat_T) for _ in g] for g in groups]
    mean = sum(F) / len(F)
    hi = [(-f, g) for g, f in enumerate(F)]
    lo = [(f, g) for g, f in enumerate(F)]
    heapq.heapify(hi)
    heapq.heapify(lo)
    rounds = max_rounds if max_rounds is not None else 20 * len(groups) + 100
    for _ in range(rounds):
        while -hi[0][0] != F[hi[0][1]]:  # stale entries: the group's load changed since it was pushed
            heapq.heappop(hi)
        h = hi[0][1]
        if F[h] <= (1 + tol) * mean:
            break
        lightest: list[int] = []
        while lo and len(lightest) < 4:
            f, g = heapq.heappop(lo)
            if f == F[g] and g != h and g not in lightest:
                lightest.append(g)
        for g in lightest:
            heapq.heappush(lo, (F[g], g))
        best = None
        for l in lightest:
            best = _best_transfer(groups, T, h, l, F[h] - F[l], lengths_np, flops_np, limit, moves)
            if best is not None:
                break
        if best is None:
            break
        delta, (bh, s), (l, bl, t) = best
        groups[h][bh].remove(s)
        groups[l][bl].append(s)
        T[h][bh] -= lengths[s]
        T[l][bl] += lengths[s]
        if t is not None:
            groups[l][bl].remove(t)
            groups[h][bh].append(t)
            T[l][bl] -= lengths[t]
            T[h][bh] += lengths[t]
        F[h] -= delta
        F[l] += delta
        heapq.heappush(hi, (-F[h], h))
        heapq.heappush(hi, (-F[l], l))
        heapq.heappush(lo, (F[h], h))
        heapq.heappush(lo, (F[l], l))
    return groups


def _best_transfer(groups, T, h: int, l: int, gap: float, lengths: np.ndarray, flops: np.ndarray, limit: float,
                   moves: bool):
    """(δ, (bin in h, sample s), (l, bin in l, sample t or None)) with δ ∈ (0, gap) closest to gap/2, or None.

    Vectorised over the samples of h: a move s → l's roomiest bin has δ = f_s; a swap s ↔ t has δ = f_s − f_t,
    with t among the 4 samples of l whose f_t is nearest f_s − gap/2 (bisection on l's sorted FLOPs).
    """
    if gap <= 0 or not groups[l]:  # a group without micro-batches has nowhere to put a sample
        return None
    want = gap / 2
    # samples of h that may leave: not a lone oversize sample (bin over the cap)
    hb = [(s, bh) for bh, b in enumerate(groups[h]) if T[h][bh] <= limit for s in b]
    if not hb:
        return None
    s_idx, s_bin = np.array([x[0] for x in hb]), np.array([x[1] for x in hb])
    fs, Ls = flops[s_idx], lengths[s_idx]
    Th = np.asarray(T[h], dtype=np.float64)[s_bin]
    best, best_err = None, want  # only δ ∈ (0, gap) qualifies: |δ − gap/2| < gap/2
    if moves:
        room = limit - np.asarray(T[l], dtype=np.float64)
        w = int(np.argmax(room))
        size = np.array([len(b) for b in groups[h]])[s_bin]
        err = np.where((size > 1) & (Ls <= room[w]), np.abs(fs - want), np.inf)  # never empty a bin
        k = int(np.argmin(err))
        if err[k] < best_err:
            best, best_err = (float(fs[k]), (int(s_bin[k]), int(s_idx[k])), (l, w, None)), float(err[k])
    lb = [(t, bl) for bl, b in enumerate(groups[l]) if T[l][bl] <= limit for t in b]
    if lb:
        t_idx, t_bin = np.array([x[0] for x in lb]), np.array([x[1] for x in lb])
        order = np.argsort(flops[t_idx], kind="stable")
        t_idx, t_bin = t_idx[order], t_bin[order]
        ft, Lt = flops[t_idx], lengths[t_idx]
        Tl = np.asarray(T[l], dtype=np.float64)[t_bin]
        pos = np.searchsorted(ft, fs - want)
        for off in (-2, -1, 0, 1):
            k = np.clip(pos + off, 0, len(ft) - 1)
            d = fs - ft[k]
            legal = (Th - Ls + Lt[k] <= limit) & (Tl[k] - Lt[k] + Ls <= limit)
            err = np.where(legal, np.abs(d - want), np.inf)
            j = int(np.argmin(err))
            if err[j] < best_err:
                kk = int(k[j])
                best, best_err = (float(d[j]), (int(s_bin[j]), int(s_idx[j])),
                                  (l, int(t_bin[kk]), int(t_idx[kk]))), float(err[j])
    return best
