"""Batch arithmetic with slime's semantics (design.md, "Batch arithmetic").

One rollout = B prompts × n samples. G (global_batch_size) counts *samples*; k (num_steps_per_rollout) sets
G = B·n/k; train_iters = num_rollout·B·n/G sizes the LR schedule. Static micro-batching needs G divisible by
micro_batch_size · dp_size. Every inconsistency is an RF06 ConfigError that shows the numbers and values that work.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.doctor.diagnosis import ConfigError, Diagnosis


@dataclass(frozen=True)
class BatchPlan:
    samples_per_rollout: int  # B·n
    global_batch_size: int  # G, samples per optimizer step
    num_steps_per_rollout: int  # k = B·n / G
    train_iters: int  # num_rollout · k
    dp_size: int

    def describe(self) -> str:
        return (f"samples per rollout B·n = {self.samples_per_rollout}, global batch G = {self.global_batch_size}, "
                f"steps per rollout k = {self.num_steps_per_rollout}, train_iters = {self.train_iters}, "
                f"DP = {self.dp_size}")


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def _rf06(what: str, fix: str, **facts) -> ConfigError:
    return ConfigError(Diagnosis(code="RF06", severity="error", what=what, fix=fix, facts=facts))


def batch_plan(*, rollout_batch_size: int, n_samples_per_prompt: int, num_rollout: int,
               global_batch_size: int | None, num_steps_per_rollout: int | None, micro_batch_size: int,
               dp_size: int, use_dynamic_batch_size: bool = False) -> BatchPlan:
    """Derive (G, k, train_iters) from the flags, or raise an RF06 ConfigError with the working values."""
    bn = rollout_batch_size * n_samples_per_prompt  # e.g. 32·8 = 256 samples per rollout
    facts = dict(rollout_batch_size=rollout_batch_size, n_samples_per_prompt=n_samples_per_prompt,
                 samples_per_rollout=bn, global_batch_size=global_batch_size,
                 num_steps_per_rollout=num_steps_per_rollout, micro_batch_size=micro_batch_size, dp_size=dp_size)
    if num_steps_per_rollout is not None:
        if bn % num_steps_per_rollout:
            ks = [d for d in _divisors(bn) if d <= 64]
            raise _rf06(f"num_steps_per_rollout k = {num_steps_per_rollout} does not divide the {bn} samples per "
                        f"rollout (B·n = {rollout_batch_size}·{n_samples_per_prompt})",
                        f"--num-steps-per-rollout one of {ks}", **facts)
        g_from_k = bn // num_steps_per_rollout
        if global_batch_size is not None and global_batch_size != g_from_k:
            raise _rf06(f"--global-batch-size {global_batch_size} disagrees with --num-steps-per-rollout "
                        f"{num_steps_per_rollout}: G = B·n/k = {bn}/{num_steps_per_rollout} = {g_from_k} "
                        f"(global_batch_size counts samples, not prompts)",
                        f"--global-batch-size {g_from_k}, or drop one of the two flags", **facts)
        g = g_from_k
    elif global_batch_size is not None:
        if bn % global_batch_size:
            gs = [d for d in _divisors(bn) if d >= min(bn, micro_batch_size * dp_size)]
            raise _rf06(f"--global-batch-size {global_batch_size} does not divide the {bn} samples per rollout "
                        f"(B·n = {rollout_batch_size}·{n_samples_per_prompt}; G counts samples, not prompts)",
                        f"--global-batch-size one of {gs} (G = {bn} trains once per rollout)", **facts)
        g = global_batch_size
    else:
        g = bn  # one optimizer step per rollout
    if not use_dynamic_batch_size and g % (micro_batch_size * dp_size):
        per = micro_batch_size * dp_size
        good_mbs = [m for m in _divisors(g // dp_size) if g % dp_size == 0] if g % dp_size == 0 else []
        raise _rf06(f"global batch G = {g} is not divisible by micro_batch_size × DP = {micro_batch_size} × "
                    f"{dp_size} = {per}",
                    (f"--micro-batch-size one of {good_mbs}" if good_mbs else
                     f"a global batch that is a multiple of {per}") + ", or --use-dynamic-batch-size", **facts)
    k = bn // g
    return BatchPlan(samples_per_rollout=bn, global_batch_size=g, num_steps_per_rollout=k,
                     train_iters=num_rollout * k, dp_size=dp_size)
