"""Batch arithmetic with slime's semantics (design.md, "Batch arithmetic").

One rollout = B prompts × n samples. G (global_batch_size) counts *samples*, not prompts; k
(num_steps_per_rollout) sets G = B·n/k and must agree with an explicit G; train_iters = num_rollout·B·n/G sizes
the LR schedule. Every rank runs the same number of micro-batches per step, so:
  static mode   G is a multiple of micro_batch_size · DP (G/(mbs·DP) micro-batches per rank);
  dynamic mode  G is a multiple of DP (in the worst case every sample is its own micro-batch, and the count is
                made a multiple of DP by splitting: G samples must be able to fill that many micro-batches).
Every inconsistency is an RF06 ConfigError that shows the numbers and values that work (each suggested value
passes this function: tests/test_packing.py checks it).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from engine.diagnosis import ConfigError, Diagnosis


@dataclass(frozen=True)
class BatchPlan:
    samples_per_rollout: int  # B·n
    global_batch_size: int  # G, samples per optimizer step
    num_steps_per_rollout: int  # k = B·n / G
    train_iters: int  # num_rollout · k
    dp_size: int
    token_cap: int | None = None  # tokens per micro-batch in dynamic mode (max_tokens_per_gpu·CP); None: static

    def describe(self) -> str:
        return (f"samples per rollout B·n = {self.samples_per_rollout}, global batch G = {self.global_batch_size}, "
                f"steps per rollout k = {self.num_steps_per_rollout}, train_iters = {self.train_iters}, "
                f"DP = {self.dp_size}")


def micro_batch_cap(max_tokens_per_gpu: int | None, cp_size: int = 1) -> int | None:
    """Tokens one micro-batch may hold in dynamic mode: max_tokens_per_gpu per CP rank, so max_tokens_per_gpu·CP
    for the micro-batch the CP ranks share; None without a token budget (static micro-batches)."""
    return max_tokens_per_gpu * cp_size if max_tokens_per_gpu is not None else None


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def working_global_batch_sizes(samples_per_rollout: int, *, micro_batch_size: int, dp_size: int,
                               use_dynamic_batch_size: bool) -> list[int]:
    """Every G that works: a divisor of B·n and a multiple of DP (dynamic) or of micro_batch_size·DP (static)."""
    unit = dp_size if use_dynamic_batch_size else micro_batch_size * dp_size
    return [g for g in _divisors(samples_per_rollout) if g % unit == 0]


def batch_plan(*, rollout_batch_size: int, n_samples_per_prompt: int, num_rollout: int,
               global_batch_size: int | None, num_steps_per_rollout: int | None, micro_batch_size: int,
               dp_size: int, use_dynamic_batch_size: bool = False, max_tokens_per_gpu: int | None = None,
               cp_size: int = 1) -> BatchPlan:
    """Derive (G, k, train_iters) from the flags, or raise an RF06 ConfigError with the working values."""
    bn = rollout_batch_size * n_samples_per_prompt  # e.g. 32·8 = 256 samples per rollout
    dynamic, mbs = use_dynamic_batch_size, micro_batch_size
    unit = dp_size if dynamic else mbs * dp_size
    good = working_global_batch_sizes(bn, micro_batch_size=mbs, dp_size=dp_size, use_dynamic_batch_size=dynamic)
    facts = dict(rollout_batch_size=rollout_batch_size, n_samples_per_prompt=n_samples_per_prompt,
                 samples_per_rollout=bn, global_batch_size=global_batch_size,
                 num_steps_per_rollout=num_steps_per_rollout, micro_batch_size=mbs, dp_size=dp_size,
                 use_dynamic_batch_size=dynamic, working_global_batch_sizes=good)
    need = (f"a multiple of DP = {dp_size}" if dynamic else
            f"a multiple of micro_batch_size × DP = {mbs} × {dp_size} = {unit}")

    def rf06(what: str, *fixes: str) -> ConfigError:
        fixes = tuple(f for f in fixes if f)
        if not fixes:  # no G works with this B·n, mbs and DP: something else must change
            fixes = _other_fixes(bn, n_samples_per_prompt, mbs, dp_size, dynamic)
        return ConfigError(Diagnosis(code="RF06", severity="error", what=what, fix=", or ".join(fixes), facts=facts))

    ks = [bn // g for g in good]  # k = B·n/G for each working G, in the same order
    if num_steps_per_rollout is not None:
        if bn % num_steps_per_rollout:
            raise rf06(f"--num-steps-per-rollout {num_steps_per_rollout} does not divide the {bn} samples per "
                       f"rollout (B·n = {rollout_batch_size}·{n_samples_per_prompt})",
                       f"--num-steps-per-rollout one of {sorted(ks)}" if ks else "")
        g_from_k = bn // num_steps_per_rollout  # G = B·n/k
        if global_batch_size is not None and global_batch_size != g_from_k:
            raise rf06(f"--global-batch-size {global_batch_size} disagrees with --num-steps-per-rollout "
                       f"{num_steps_per_rollout}: G = B·n/k = {bn}/{num_steps_per_rollout} = {g_from_k} "
                       f"(global_batch_size counts samples, not prompts)",
                       f"--global-batch-size {g_from_k}, or drop one of the two flags" if g_from_k in good else
                       f"one pair of --global-batch-size {good} and --num-steps-per-rollout {ks}" if good else "")
        g = g_from_k
    elif global_batch_size is not None:
        if bn % global_batch_size:
            raise rf06(f"--global-batch-size {global_batch_size} does not divide the {bn} samples per rollout "
                       f"(B·n = {rollout_batch_size}·{n_samples_per_prompt}; G counts samples, not prompts)",
                       f"--global-batch-size one of {good} (G = {bn} trains once per rollout)" if good else "")
        g = global_batch_size
    else:
        g = bn  # one optimizer step per rollout
    if g % unit:
        why = ("every rank must run the same number of micro-batches, one sample each in the worst case"
               if dynamic else "every rank runs G / (micro_batch_size·DP) micro-batches of micro_batch_size samples")
        by_g = f"--global-batch-size one of {good} (that is --num-steps-per-rollout {ks})" if good else ""
        by_mbs = f"--micro-batch-size one of {_divisors(g // dp_size)}" if not dynamic and g % dp_size == 0 else ""
        by_dyn = "--use-dynamic-batch-size --max-tokens-per-gpu N" if not dynamic and g % dp_size == 0 else ""
        raise rf06(f"global batch G = {g} is not {need} ({why})",
                   by_g, by_mbs, by_dyn)
    k = bn // g
    return BatchPlan(samples_per_rollout=bn, global_batch_size=g, num_steps_per_rollout=k,
                     train_iters=num_rollout * k, dp_size=dp_size,
                     token_cap=micro_batch_cap(max_tokens_per_gpu, cp_size) if dynamic else None)


def _other_fixes(bn: int, n: int, mbs: int, dp: int, dynamic: bool) -> tuple[str, ...]:
    """When no global batch works: a micro-batch size, dynamic batching, or a rollout size that does."""
    if not dynamic and bn % dp == 0:  # G = B·n then works with any mbs dividing B·n/DP
        one_step = f"--global-batch-size {bn} (without --num-steps-per-rollout)"
        return (f"{one_step} with --micro-batch-size one of {_divisors(bn // dp)}",
                f"{one_step} with --use-dynamic-batch-size --max-tokens-per-gpu N")
    unit = dp if dynamic else mbs * dp
    b = unit // gcd(n, unit)  # smallest B with B·n a multiple of unit: n = 6, unit = 8 → B = 4, B·n = 24
    return (f"B·n = {bn} has no divisor that is a multiple of {unit}: --rollout-batch-size {b} (B·n = {b * n}) "
            f"or a multiple of it, with --global-batch-size a multiple of {unit} dividing B·n",)
