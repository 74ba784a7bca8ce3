"""Dynamic sampling filters (`--dynamic-sampling-filter-path`): keep or drop a whole group after its rewards.

A filter is `fn(group: list[Sample]) -> bool` (or an object with a boolean `.keep`, as slime's
DynamicFilterOutput), sync or async. The built-in one drops groups whose rewards all agree: with GRPO their
advantages are all 0, so they cost a train step and teach nothing.
"""
from __future__ import annotations

from typing import Callable

from engine.samples import Sample, Status

BUILTIN_NONZERO_STD = "engine.rollout.filters:check_reward_nonzero_std"


def check_reward_nonzero_std(group: list[Sample]) -> bool:
    """Keep a group unless every live sample has the same reward (e.g. all 0 or all 1)."""
    rewards = [s.scalar_reward for s in group if s.status not in (Status.FAILED, Status.ABORTED)]
    return len(rewards) > 1 and max(rewards) > min(rewards)


def load_filter(path: str) -> Callable[[list[Sample]], bool]:
    from engine.rewards import call_maybe_async, load_function

    fn = load_function(path, "--dynamic-sampling-filter-path")

    def keep(group: list[Sample]) -> bool:
        out = call_maybe_async(fn, group)
        return bool(getattr(out, "keep", out))

    return keep
