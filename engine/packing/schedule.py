"""DP schedule: which samples go to which DP rank and micro-batch, step by step.

Invariants (asserted on every schedule by the tests' helper):
1. every rank has the same number of micro-batches in a step;
2. a micro-batch holds at most max_tokens_per_gpu · cp_size tokens unless it is a single longer sample;
3. every sample appears exactly once in the schedule;
4. a trajectory (samples sharing a rollout id) never spans two steps.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Step:
    ranks: list[list[list[int]]]  # ranks[r][m] = sample indices of micro-batch m on DP rank r

    @property
    def samples(self) -> list[int]:
        return [i for rank in self.ranks for mb in rank for i in mb]


def _first_fit(indices: list[int], lengths: list[int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):  # first-fit decreasing
        for b, load in enumerate(loads):
            if load + lengths[i] <= cap:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _even_out(bins: list[list[int]], lengths: list[int], dp_size: int) -> list[list[int]]:
    """Split the largest multi-sample bins until the count is a multiple of dp_size (and ≥ dp_size)."""
    bins = [list(b) for b in bins]
    while len(bins) % dp_size or len(bins) < dp_size:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            raise ValueError(f"cannot make {len(bins)} micro-batches a multiple of DP={dp_size}: too few samples")
        big = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(big)
        half = len(big) // 2
        bins += [big[:half], big[half:]]
    return bins


def build_dp_schedule(lengths: list[int], *, dp_size: int, global_batch_size: int, cp_size: int = 1,
                      max_tokens_per_gpu: int | None = None, micro_batch_size: int | None = None,
                      balance_data: bool = False, balance_by_flops: bool = False, flops: list[float] | None = None,
                      rollout_ids: list[int] | None = None) -> list[Step]:
    """Steps of `global_batch_size` samples each, spread over `dp_size` ranks (strided assignment).

    Dynamic mode (max_tokens_per_gpu set): first-fit decreasing under the cap, then split bins to a multiple of
    DP. Static mode: micro_batch_size samples per micro-batch.
    """
    n = len(lengths)
    if n % global_batch_size:
        raise ValueError(f"{n} samples are not a multiple of global_batch_size={global_batch_size}")
    steps = []
    for s in range(0, n, global_batch_size):
        idx = list(range(s, s + global_batch_size))
        if max_tokens_per_gpu is not None:
            bins = _even_out(_first_fit(idx, lengths, max_tokens_per_gpu * cp_size), lengths, dp_size)
        else:
            mbs = micro_batch_size or 1
            bins = [idx[i:i + mbs] for i in range(0, len(idx), mbs)]
        ranks = [bins[r::dp_size] for r in range(dp_size)]
        steps.append(Step(ranks=ranks))
    return steps
