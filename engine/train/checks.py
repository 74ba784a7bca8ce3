"""Runtime checks of the train stage, as pure functions of numbers → Diagnosis (or None).

RF01  first step of a fresh run: the policy and the reference are the same weights, so log π_old = log π_ref
      (KL = 0) and the first update's ratio is 1. A difference means a checkpoint was not loaded as intended.
RF09  grad-norm spike: a step's grad norm above SPIKE_FACTOR × the median of the previous steps.
RF13  NaN/Inf loss or gradients (the report names the samples whose own loss is not finite).
RF14  train–inference mismatch: the engine's log-probs of tokens differ from the trainer's on the same weights by
      more than bf16/fp32 kernel noise — the engine serves other weights (wrong mapping, partial or stale sync).
"""
from __future__ import annotations

import statistics

from engine.diagnosis import Diagnosis

#: max |Δ log-prob| (fp32) allowed between two forwards of the same weights: the same code on the same inputs
#: is bit-identical on CPU; 1e-4 leaves room for kernel choice on GPU and is ~1000× below what a wrong or
#: half-loaded checkpoint gives (O(0.1–10)).
FIRST_STEP_TOL = 1e-4
SPIKE_FACTOR = 10.0
SPIKE_WINDOW = 50  # previous steps in the running median
SPIKE_MIN_HISTORY = 5  # steps seen before spikes are judged


def first_step_check(*, ref_logp_maxdiff: float | None = None, ratio_maxdev: float | None = None,
                     ref_source: str = "", policy_source: str = "", tol: float = FIRST_STEP_TOL
                     ) -> Diagnosis | None:
    """RF01 at runtime: max |log π_old − log π_ref| (before the first update) and max |ρ − 1| (the first update)
    over trained tokens; None = not measured. A NaN counts as a failure."""
    bad_ref = ref_logp_maxdiff is not None and not ref_logp_maxdiff <= tol
    bad_ratio = ratio_maxdev is not None and not ratio_maxdev <= tol
    if not (bad_ref or bad_ratio):
        return None
    parts = []
    if bad_ref:
        parts.append(f"the policy ({policy_source}) and the reference ({ref_source}) disagree on the first step: "
                     f"max |log π − log π_ref| = {ref_logp_maxdiff:.3g} > {tol:g} (KL should be 0)")
    if bad_ratio:
        parts.append(f"the first update's ratio π/π_old is not 1: max |ρ − 1| = {ratio_maxdev:.3g} > {tol:g} "
                     "(the training forward differs from the log-prob forward on the same weights)")
    return Diagnosis(code="RF01", severity="error", what="; ".join(parts),
                     fix=("make --ref-load name the same weights the policy starts from (drop --ref-load to use "
                          f"--hf-checkpoint {policy_source}); check that the checkpoint loaded completely"
                          if bad_ref else "report this as a bug: the train forward must be deterministic "
                                          "(dropout off, same kernels) on unchanged weights"),
                     facts={"ref_logp_maxdiff": ref_logp_maxdiff, "ratio_maxdev": ratio_maxdev, "tol": tol})


def grad_norm_spike(history: list[float], grad_norm: float, *, factor: float = SPIKE_FACTOR,
                    window: int = SPIKE_WINDOW, min_history: int = SPIKE_MIN_HISTORY) -> float | None:
    """The running median the norm spiked above (grad_norm > factor × median of the last `window` finite norms),
    else None. [1, 1, 1, 1, 1] then 12 → 12 > 10 × 1 → spike (returns 1.0)."""
    prev = [g for g in history[-window:] if g == g and g != float("inf")]
    if len(prev) < min_history:
        return None
    median = statistics.median(prev)
    return median if grad_norm > factor * median else None


def spike_diagnosis(*, step: int, rollout_id: int, grad_norm: float, median: float, sample_ids: list[int]
                    ) -> Diagnosis:
    return Diagnosis(code="RF09", severity="warning",
                     what=f"grad norm {grad_norm:.4g} at optimizer step {step} (rollout {rollout_id}) is "
                          f"{grad_norm / median:.1f}× the running median {median:.4g}; samples of the step: "
                          f"{sample_ids[:32]}{' …' if len(sample_ids) > 32 else ''}",
                     fix="inspect these samples: a prompt already chat-templated with another template (check "
                         "--apply-chat-template against your data), a reward outlier, or a too-high --lr",
                     facts={"step": step, "rollout_id": rollout_id, "grad_norm": grad_norm, "median": median,
                            "sample_ids": sample_ids})


def nan_diagnosis(*, step: int, rank_losses: float, grad_norm: float, bad_sample_ids: list[int] | None,
                  step_sample_ids: list[int]) -> Diagnosis:
    """bad_sample_ids: the samples whose own loss is not finite; None when the backend does not know them."""
    if bad_sample_ids is None:
        culprits = f"samples of the step: {step_sample_ids[:32]}"
    elif bad_sample_ids:
        culprits = f"samples with a non-finite loss: {bad_sample_ids[:32]}"
    else:
        culprits = f"every sample's loss is finite, the gradients are not; samples of the step: {step_sample_ids[:32]}"
    return Diagnosis(code="RF13", severity="error",
                     what=f"NaN/Inf at optimizer step {step}: loss {rank_losses:.4g}, grad norm {grad_norm:.4g}; "
                          f"{culprits}",
                     fix="check these samples (rewards, token ids) and the learning rate (--lr); "
                         "--no-check-for-nan-in-loss-and-grad skips such steps instead, without fixing the cause",
                     facts={"step": step, "grad_norm": grad_norm, "bad_sample_ids": bad_sample_ids or [],
                            "sample_ids": step_sample_ids})


def mismatch_diagnosis(*, where: str, mean: float, worst: float, tokens: float, threshold: float,
                       engine_dtype: str, train_dtype: str) -> Diagnosis | None:
    """RF14 when the mean |log π_engine − log π_trainer| over `tokens` tokens is above `threshold` (NaN too).
    `where`: "rollout 3" (the rollout's trained tokens) or "the weight sync to version 4" (fixed probe prompts)."""
    if mean <= threshold:
        return None
    return Diagnosis(
        code="RF14", severity="error",
        what=f"train/inference mismatch at {where}: the engine's log-probs differ from the trainer's by {mean:.4g} on "
             f"average over {tokens:.0f} tokens (max {worst:.4g}; limit {threshold:g}, engine {engine_dtype}, trainer "
             f"{train_dtype}). The engine is not serving the trainer's weights; training on these samples would "
             "optimise the wrong policy",
        fix="likely causes, in order: the trainer → engine weight mapping (names or layout of --train-backend's HF "
            "export), a dtype the engine rounds differently (--rollout-dtype vs --bf16), a stale or partial weight "
            "sync (compare sync/weight_version), a chat template that differs between the data and the model. For "
            "a known, small mismatch (e.g. bf16 kernels) correct it with --use-tis and raise "
            "--logprob-mismatch-threshold",
        facts={"mean": mean, "max": worst, "tokens": tokens, "threshold": threshold, "engine_dtype": engine_dtype,
               "train_dtype": train_dtype, "where": where})
