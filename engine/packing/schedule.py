"""DP schedule: which samples go to which DP rank and micro-batch, step by step (slime's dp_schedule semantics).

Pack first, distribute second. For each optimizer step (global_batch_size trajectories):
  1. pack the step's samples into micro-batches (bins):
       dynamic (max_tokens_per_gpu set): best-fit decreasing on tokens under cap = max_tokens_per_gpu·cp_size,
                 a sample longer than the cap alone in its bin; with balance_by_flops as many bins as best fit
                 needs are filled by FLOPs instead (longest sample first into the bin of least FLOPs that still
                 has room under the cap; a new bin only when none has room);
       static:   micro_batch_size samples per bin, in order; with balance_by_flops the bins are drawn by
                 Karmarkar–Karp on FLOPs with equal part sizes (still micro_batch_size samples each);
  2. make the bin count a multiple of dp_size (and ≥ dp_size) by splitting the largest multi-sample bins in two;
  3. give each rank count/dp_size bins: with balance_data Karmarkar–Karp on bin FLOPs (equal count per rank),
     then single-sample transfers from the heaviest rank (engine.packing.balance.rebalance; dynamic mode moves
     and swaps under the cap, static mode swaps only); otherwise strided (bin j → rank j mod dp_size).

Invariants of every schedule (tests/test_packing.py asserts them all with one helper, on every test):
  I1. every rank has the same number of micro-batches in a step;
  I2. a micro-batch holds at most max_tokens_per_gpu·cp_size tokens unless it is a single sample longer than that
      (static mode: at most micro_batch_size samples);
  I3. every sample appears exactly once in the schedule;
  I4. a trajectory (samples sharing a rollout id) never spans two steps; each step holds global_batch_size of them.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass
from itertools import chain

from engine.packing.arithmetic import micro_batch_cap
from engine.packing.balance import bin_sums, karmarkar_karp, rebalance


@dataclass
class Step:
    ranks: list[list[list[int]]]  # ranks[r][m] = sample indices of micro-batch m on DP rank r

    @property
    def samples(self) -> list[int]:
        return [i for rank in self.ranks for mb in rank for i in mb]

    @property
    def micro_batches(self) -> list[list[int]]:
        return [mb for rank in self.ranks for mb in rank]


# ---- 1. packing ------------------------------------------------------------------------------------------------
def best_fit_decreasing(idx: list[int], lengths: list[int], cap: int) -> list[list[int]]:
    """Bins of total length ≤ cap, longest sample first into the fullest bin it fits; a sample > cap sits alone.

    Open bins are one sorted list of room·M + bin id (M > any bin id), so the best fit is one bisect.
    """
    bins: list[list[int]] = []
    M = len(lengths) + 1
    room: list[int] = []  # sorted room·M + bin; full bins leave the list
    for i in sorted(idx, key=lengths.__getitem__, reverse=True):  # stable: equal lengths keep index order
        L = lengths[i]
        pos = bisect_left(room, L * M)
        if pos < len(room):
            left, b = divmod(room[pos], M)
            bins[b].append(i)
            if left > L:  # the bin's room shrinks: it moves left, to q ≤ pos; shift only room[q:pos]
                v = (left - L) * M + b
                q = bisect_left(room, v, 0, pos)
                room[q + 1:pos + 1] = room[q:pos]
                room[q] = v
            else:
                del room[pos]
        else:
            bins.append([i])
            if L < cap:
                insort(room, (cap - L) * M + len(bins) - 1)
    return bins


def least_loaded_fit(idx: list[int], lengths: list[int], cost: list[float], cap: int,
                     num_bins: int) -> list[list[int]]:
    """LPT under the token cap: longest sample first into the bin of least cost that has room for it.

    Starts from num_bins empty bins; a sample that fits nowhere opens a new bin (alone when longer than cap).
    With FLOPs from sequence_flops (increasing in length) longest-first is costliest-first, as LPT wants.
    Bins without room for the current sample wait in a heap by room: lengths only decrease, so a bin comes back
    once the samples get short enough, and every bin is set aside at most once per sample it receives.
    """
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    room = [cap] * num_bins
    ready = [(0.0, b) for b in range(num_bins)]  # (cost load, bin): room ≥ the current sample's length
    waiting: list[tuple[int, float, int]] = []  # (−room, cost load, bin)
    for i in sorted(idx, key=lengths.__getitem__, reverse=True):
        L = lengths[i]
        while waiting and -waiting[0][0] >= L:
            _, load, b = heapq.heappop(waiting)
            heapq.heappush(ready, (load, b))
        while ready and room[ready[0][1]] < L:
            load, b = heapq.heappop(ready)
            heapq.heappush(waiting, (-room[b], load, b))
        if ready:
            load, b = heapq.heappop(ready)
        else:
            load, b = 0.0, len(bins)
            bins.append([])
            room.append(cap)
        bins[b].append(i)
        room[b] -= L
        if room[b] > 0:
            heapq.heappush(ready, (load + cost[i], b))
    return [b for b in bins if b]


def balanced_chunks(idx: list[int], cost: list[float], size: int) -> list[list[int]]:
    """⌈S/size⌉ bins of at most `size` samples each, balanced by cost: Karmarkar–Karp with equal part sizes.

    S is padded with zero-cost dummies to a multiple of the bin count and the dummies dropped: fewer than `size`
    dummies exist, so every bin keeps at least one real sample. E.g. S = 10, size 4 → 3 bins, 2 dummies.
    """
    k = -(-len(idx) // size)
    padded = [cost[i] for i in idx] + [0.0] * (k * size - len(idx))
    return [[idx[j] for j in part if j < len(idx)] for part in karmarkar_karp(padded, k, equal_size=True)]


# ---- 2. a multiple of DP ---------------------------------------------------------------------------------------
def _halve(b: list[int], cost: list[float]) -> tuple[list[int], list[int]]:
    """Two halves of a bin balanced by cost (costliest first into the lighter half); both non-empty."""
    halves: tuple[list[int], list[int]] = ([], [])
    sums = [0.0, 0.0]
    for i in sorted(b, key=lambda i: (-cost[i], i)):
        h = 0 if sums[0] <= sums[1] else 1
        halves[h].append(i)
        sums[h] += cost[i]
    return halves


def split_to_multiple(bins: list[list[int]], cost: list[float], dp_size: int) -> list[list[int]]:
    """Split the costliest multi-sample bins until the count is a multiple of dp_size and ≥ dp_size.

    A half of a bin holds a subset of its samples, so the cap (I2) still holds after any split.
    """
    bins = [list(b) for b in bins]
    target = max(dp_size, -(-len(bins) // dp_size) * dp_size)  # ⌈K / DP⌉·DP, e.g. 13 bins, DP 4 → 16
    heap = [(-c, j) for j, (b, c) in enumerate(zip(bins, bin_sums(bins, cost))) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target:
        if not heap:
            n = sum(len(b) for b in bins)
            raise ValueError(f"a step of {n} samples cannot fill {target} micro-batches (a multiple of DP = "
                             f"{dp_size}) with at least one sample each: every rank needs the same number of "
                             f"micro-batches; use a global batch whose steps hold a multiple of {dp_size} samples")
        _, j = heapq.heappop(heap)
        a, b = _halve(bins[j], cost)
        bins[j] = a
        bins.append(b)
        for k, half in ((j, a), (len(bins) - 1, b)):
            if len(half) > 1:
                heapq.heappush(heap, (-sum(map(cost.__getitem__, half)), k))
    return bins


# ---- the schedule ----------------------------------------------------------------------------------------------
def _steps_of_trajectories(n: int, global_batch_size: int, rollout_ids: list[int] | None) -> list[list[int]]:
    """Sample indices of each step: global_batch_size trajectories per step, in order of first appearance."""
    if rollout_ids is None:  # every sample its own trajectory: steps are consecutive runs of G samples
        trajectories: list[list[int]] | range = range(n)
    else:
        groups: dict[int, list[int]] = {}
        for i, rid in enumerate(rollout_ids):
            groups.setdefault(rid, []).append(i)
        trajectories = list(groups.values())
    if len(trajectories) % global_batch_size:
        raise ValueError(f"{len(trajectories)} trajectories ({n} samples) are not a multiple of global_batch_size = "
                         f"{global_batch_size}: a step holds global_batch_size whole trajectories")
    if rollout_ids is None:
        return [list(range(s, s + global_batch_size)) for s in range(0, n, global_batch_size)]
    return [[i for t in trajectories[s:s + global_batch_size] for i in t]
            for s in range(0, len(trajectories), global_batch_size)]


def build_dp_schedule(lengths: list[int], *, dp_size: int, global_batch_size: int, cp_size: int = 1,
                      max_tokens_per_gpu: int | None = None, micro_batch_size: int | None = None,
                      balance_data: bool = False, balance_by_flops: bool = False, flops: list[float] | None = None,
                      rollout_ids: list[int] | None = None) -> list[Step]:
    """Steps of global_batch_size trajectories, each spread over dp_size ranks as micro-batches (see module doc).

    lengths[i]: sample i's total tokens; flops[i]: its estimated cost (needed by balance_data / balance_by_flops;
    engine.packing.flops.flops_per_sample); rollout_ids[i]: its trajectory (default: every sample its own).
    Dynamic mode iff max_tokens_per_gpu is given, else static with micro_batch_size.
    """
    n = len(lengths)
    if dp_size < 1 or cp_size < 1 or global_batch_size < 1:
        raise ValueError(f"dp_size = {dp_size}, cp_size = {cp_size}, global_batch_size = {global_batch_size}: "
                         "all must be ≥ 1")
    if max_tokens_per_gpu is None and micro_batch_size is None:
        raise ValueError("give max_tokens_per_gpu (dynamic mode) or micro_batch_size (static mode)")
    if (balance_data or balance_by_flops) and flops is None:
        raise ValueError("balance_data / balance_by_flops need flops[i] per sample: "
                         "engine.packing.flops.flops_per_sample(lengths, ModelShape.from_hf_config(...))")
    for name, xs in (("flops", flops), ("rollout_ids", rollout_ids)):
        if xs is not None and len(xs) != n:
            raise ValueError(f"{name} has {len(xs)} entries for {n} samples")
    weight = list(flops) if flops is not None else [float(x) for x in lengths]
    cost = weight if balance_by_flops else [float(x) for x in lengths]  # what packing and splitting balance
    cap = micro_batch_cap(max_tokens_per_gpu, cp_size)
    steps = []
    for idx in _steps_of_trajectories(n, global_batch_size, rollout_ids):
        if cap is not None:
            bins = best_fit_decreasing(idx, lengths, cap)
            if balance_by_flops:  # as many bins as tokens need, filled by FLOPs
                fitting = sum(1 for t in bin_sums(bins, lengths) if t <= cap)
                bins = least_loaded_fit(idx, lengths, weight, cap, fitting)
        elif balance_by_flops:
            bins = balanced_chunks(idx, weight, micro_batch_size)
        else:
            bins = [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
        bins = split_to_multiple(bins, cost, dp_size)
        if balance_data:
            parts = karmarkar_karp(bin_sums(bins, weight), dp_size, equal_size=True)
            ranks = [[bins[j] for j in part] for part in parts]
            # KK places whole micro-batches; with few per rank single-sample transfers finish the job
            ranks = rebalance(ranks, lengths, weight, cap, moves=max_tokens_per_gpu is not None)
        else:
            ranks = [bins[r::dp_size] for r in range(dp_size)]
        steps.append(Step(ranks=ranks))
    return steps


def schedule_stats(steps: list[Step], lengths: list[int], flops: list[float], cap: int | None) -> dict[str, float]:
    """What pack logs per rollout: packing efficiency, DP imbalance, micro-batches per rank.

    efficiency = real tokens / (micro-batches × cap); without a cap (static mode) the largest micro-batch stands
    for the cap (what a fixed memory budget must hold); above 1 when samples longer than the cap sit alone.
    dp_imbalance = Σ_steps max_r F / Σ_steps mean_r F, F = a rank's FLOPs in the step: how much longer the
    slowest rank computes than the average one (1.0 = no rank waits).
    """
    mbs = [mb for s in steps for mb in s.micro_batches]
    tokens = bin_sums(mbs, lengths)
    dp = len(steps[0].ranks)
    slowest = mean = 0.0
    for s in steps:
        per_rank = bin_sums([list(chain.from_iterable(rank)) for rank in s.ranks], flops)
        slowest += max(per_rank)
        mean += sum(per_rank) / dp
    budget = cap if cap is not None else max(tokens)
    return {"micro_batches": float(len(mbs)), "micro_batches_per_rank": len(mbs) / dp,
            "tokens": float(sum(tokens)), "efficiency": sum(tokens) / (len(mbs) * budget),
            "dp_imbalance": slowest / mean if mean else 1.0, "max_micro_batch_tokens": float(max(tokens)),
            "oversize_samples": float(sum(1 for L in lengths if cap is not None and L > cap))}
