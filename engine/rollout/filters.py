"""Dynamic sampling filters (`--dynamic-sampling-filter-path`): keep or drop a whole group after its rewards.

A filter is slime's `fn(args, group: list[Sample])` (args: engine.rollout.hooks.HookArgs) or `fn(group)`, sync or
async, returning a bool or an object with a boolean `.keep` (slime's DynamicFilterOutput). One that raises fails the
rollout with a HookError naming it (not retried). The built-in one drops groups whose rewards all agree: with GRPO their
advantages are all 0, so they cost a train step and teach nothing.
"""
from __future__ import annotations

from typing import Any, Callable

from engine.samples import Sample, Status

BUILTIN_NONZERO_STD = "engine.rollout.filters:check_reward_nonzero_std"


def check_reward_nonzero_std(group: list[Sample]) -> bool:
    """Keep a group unless every live sample has the same reward (e.g. all 0 or all 1)."""
    rewards = [s.scalar_reward for s in group if s.status not in (Status.FAILED, Status.ABORTED)]
    return len(rewards) > 1 and max(rewards) > min(rewards)


def load_filter(path: str, args: Any = None) -> Callable[[list[Sample]], bool]:
    from engine.rewards import load_function
    from engine.rollout.hooks import call_hook, takes_args

    flag = "--dynamic-sampling-filter-path"
    fn = load_function(path, flag)
    lead = (args,) if takes_args(fn, 1) else ()

    def keep(group: list[Sample]) -> bool:
        out = call_hook(flag, path, fn, *lead, group)
        return bool(getattr(out, "keep", out))

    return keep
