"""Per-token RL losses and KL, elementwise over packed tokens; aggregation is `engine.algorithms.objective`'s.

All tensors are [T] flat token tensors of one packed micro-batch unless stated. ρ = exp(log πθ − log π_old).
Each loss returns (loss [T], clipped [T]) where clipped is a 0/1 float: 1 where the clip changed the token's
term (the clip fraction metric).
"""
from __future__ import annotations

import math

import torch

from engine.algorithms.packed import per_sample_mean, sample_sums, segment_ids


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str,
       importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise KL estimate of π‖π_ref from x = log π − log π_ref (Schulman's k1/k2/k3).

    k1 = x; k2 = x²/2; k3 (= low_var_kl) = e^(−x) − 1 + x, clamped to [−10, 10] (design.md; slime clamps only
    its low_var_kl spelling, here both spellings are the same estimator). importance_ratio (--use-unbiased-kl,
    DeepSeek-V3.2's correction, as slime): the estimate times π/π_old, so that on tokens sampled from π_old it
    estimates KL(π‖π_ref) of the current π; it multiplies before the clamp, and it carries its gradient.
    """
    x = log_probs.float() - ref_log_probs.float()  # [T]
    if kind == "k1":
        out = x
    elif kind == "k2":
        out = x.pow(2) / 2
    elif kind in ("k3", "low_var_kl"):
        out = torch.exp(-x) - 1 + x
    else:
        raise ValueError(f"unknown kl kind {kind!r}: one of k1, k2, k3, low_var_kl")
    if importance_ratio is not None:
        out = importance_ratio.float() * out
    return out.clamp(-10, 10) if kind in ("k3", "low_var_kl") else out


def _clip_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float | None,
                    eps_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    high = eps_clip if eps_clip_high is None else eps_clip_high
    loss1 = -ratio * advantages  # [T]
    loss2 = -ratio.clamp(1 - eps_clip, 1 + high) * advantages  # [T]
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1:
            raise ValueError(f"dual clip needs eps_clip_c > 1, got {eps_clip_c}")
        loss3 = -eps_clip_c * advantages  # [T] the dual-clip bound, only for A < 0
        dual = (advantages < 0) & (loss > loss3)
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
        clipped = torch.maximum(clipped, dual.float())
    return loss, clipped


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, *,
                eps_clip: float = 0.2, eps_clip_high: float | None = None,
                eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token: max(−ρA, −clip(ρ, 1−ε, 1+ε_high)·A).

    ε_high defaults to ε (asymmetric "clip-higher" when set). Dual clip (c > 1) bounds the loss of negative
    advantages by −c·A: L = min(L, −c·A) for A < 0.
    """
    ratio = torch.exp(log_probs - old_log_probs)  # [T]
    return _clip_surrogate(ratio, advantages, eps_clip, eps_clip_high, eps_clip_c)


def gspo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                     loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, *, eps_clip: float = 0.2,
                     eps_clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (arXiv 2507.18071): the clipped surrogate with one ratio per sequence.

    s_i = exp(mean over the sample's trained tokens of (log πθ − log π_old)), broadcast to its tokens; the
    gradient flows through the mean (every trained token of the sample gets 1/|y_i| of it), as slime.
    """
    seq_log_ratio = per_sample_mean(log_probs - old_log_probs, loss_mask, cu_seqlens)  # [S]
    ratio = torch.exp(seq_log_ratio)[segment_ids(cu_seqlens)]  # [T]
    return _clip_surrogate(ratio, advantages, eps_clip, eps_clip_high, None)


def cispo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, *,
                      eps_clip: float = 0.2, eps_clip_high: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): −sg(clip(ρ, 1−ε, 1+ε_high))·A·log πθ.

    The clipped ratio is a constant (stop-gradient), so ∂L/∂log πθ = −clip(ρ)·A: clipped tokens keep their
    gradient, only its weight is bounded. Canonical CISPO has no lower bound: pass eps_clip ≥ 1.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_probs - old_log_probs)  # [T]
    weight = ratio.clamp(1 - eps_clip, 1 + high)  # [T]
    return -weight.detach() * advantages * log_probs, (weight != ratio).float()


#: slime's MIS helper's SAFETY_BOUND: log-ratios are clamped to ±20 before exp (no inf weight, no inf × 0)
LOG_RATIO_BOUND = 20.0


def level_log_ratio(d: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None, level: str) -> torch.Tensor:
    """The log-ratio d [T] taken at `level`: each token its own ("token"), or over each sample's trained tokens
    (`mask`, samples by `cu_seqlens`) their sum ("sequence": the log-ratio of the sequences' probabilities) or
    their mean ("geometric": of the geometric mean), given to every token of the sample."""
    if level == "token":
        return d
    if level not in ("sequence", "geometric"):
        raise ValueError(f"level {level!r}: token, sequence or geometric")
    m = mask.float()
    per = per_sample_mean(d, m, cu_seqlens)  # [S]
    if level == "sequence":
        per = per * sample_sums(m, cu_seqlens)
    return per[segment_ids(cu_seqlens)]


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       cu_seqlens: torch.Tensor | None, *, tis: bool = True, mode: str = "clip",
                       level: str = "token", low: float = 0.0, high: float = 2.0, rs: bool = False,
                       rs_level: str = "token", rs_low: float = 0.5, rs_high: float = 2.0,
                       veto: float | None = None, scale: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance sampling and rejection sampling against the engine (slime's --use-tis and its MIS helper,
    examples/train_infer_mismatch_helper/mis.py), from d = log π_old,train − log π_rollout [T], a constant.

    tis: the weight w = exp(d at `level`) bounded by `mode` — "truncate": min(w, high); "clip": clamp(w, low,
    high); "mask": w kept where low ≤ w ≤ high, the token (a sample at the sequence / geometric level) rejected
    elsewhere — then divided by `scale` (--tis-batch-normalize's mean weight of the step; None without it).
    rs: a token (sample) whose ratio at `rs_level` lies outside [rs_low, rs_high] is rejected; `veto`: a sample with
    any trained token of ratio below it is rejected whole. A rejected token's policy loss is dropped; the caller
    keeps the per-sample denominators (slime). Returns (w [T], keep [T] 0/1, token sums of the trained tokens for
    metrics: tis_clipfrac (bounded or, mode "mask", rejected by the weight), rs_rejected, rs_vetoed, tis_norm)."""
    m = mask.float()
    d = old_log_probs.float() - rollout_log_probs.float()  # [T]
    w, keep = torch.ones_like(d), torch.ones_like(d)
    stats: dict[str, torch.Tensor] = {}
    lt = None
    if tis:
        lt = level_log_ratio(d, m, cu_seqlens, level)
        raw = torch.exp(lt.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if mode == "truncate":
            w = raw.clamp(max=high)
            bounded = raw > high
        elif mode == "clip":
            w = raw.clamp(low, high)
            bounded = w != raw
        elif mode == "mask":
            inside = (raw >= low) & (raw <= high)
            w, keep, bounded = raw, inside.float(), ~inside
        else:
            raise ValueError(f"mode {mode!r}: truncate, clip or mask")
        stats["tis_clipfrac"] = (bounded.float() * m).sum()
        if scale is not None:
            w = w / scale
            stats["tis_norm"] = scale * m.sum()
    if rs:
        lr = lt if lt is not None and rs_level == level else level_log_ratio(d, m, cu_seqlens, rs_level)
        rw = torch.exp(lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        rs_keep = ((rw >= rs_low) & (rw <= rs_high)).float()
        if veto is not None:  # one catastrophic token (ratio < veto) takes its whole sample out
            bad = sample_sums(((d < math.log(veto)) & (m > 0)).float(), cu_seqlens) > 0  # [S]
            vetoed = bad[segment_ids(cu_seqlens)].float()
            stats["rs_vetoed"] = (vetoed * m).sum()
            rs_keep = rs_keep * (1 - vetoed)
        stats["rs_rejected"] = ((1 - rs_keep) * m).sum()
        keep = keep * rs_keep
    return w, keep, stats


def tis_mean_parts(w: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, level: str) -> tuple[float, float]:
    """(Σ, count) of --tis-batch-normalize's mean over one micro-batch: the weights of the trained tokens (level
    token), or one weight per sample with a trained token (sequence, geometric: the same on all its tokens)."""
    m = mask.float()
    if level == "token":
        return float((w * m).sum()), float(m.sum())
    has = sample_sums(m, cu_seqlens) > 0  # [S]
    return float(per_sample_mean(w, m, cu_seqlens)[has].sum()), float(has.sum())


def mis_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, *, low: float = 0.5,
             high: float = 2.0) -> torch.Tensor:
    """Masked importance sampling (IcePop): 1 where low ≤ π_old,train / π_rollout ≤ high, else 0 — such a token's
    loss is dropped (not re-weighted), and it leaves the aggregation's token counts. Constants: no gradient."""
    w = torch.exp(old_log_probs.float() - rollout_log_probs.float())  # [T]
    return ((w >= low) & (w <= high)).to(old_log_probs.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
               value_clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss: max((V − R)², (V_old + clip(V − V_old, ±c) − R)²), as slime (no ½ factor)."""
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)  # [T]
    surr1 = (clipped_values - returns).pow(2)
    surr2 = (values - returns).pow(2)
    return torch.maximum(surr1, surr2), (surr1 > surr2).float()
