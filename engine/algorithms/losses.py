"""Policy loss and KL, elementwise over tokens; aggregation is the caller's (see `masked_mean`)."""
from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate of π‖π_ref from x = log π − log π_ref (Schulman's k1/k2/k3).

    k1 = x; k2 = x²/2; k3 (low_var_kl) = e^(−x) − 1 + x, clamped to [−10, 10].
    """
    x = log_probs - ref_log_probs  # [T]
    if kind == "k1":
        return x
    if kind == "k2":
        return x.pow(2) / 2
    if kind in ("k3", "low_var_kl"):
        return (torch.exp(-x) - 1 + x).clamp(-10, 10)
    raise ValueError(f"unknown kl kind {kind!r}: one of k1, k2, k3, low_var_kl")


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, *,
                eps_clip: float = 0.2, eps_clip_high: float | None = None,
                eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token: max(−ρA, −clip(ρ, 1−ε, 1+ε_high)·A), ρ = exp(logπθ − logπold).

    All inputs [T]. Dual clip (c > 1) bounds the loss of negative advantages by −c·A. Returns (loss [T],
    clipped [T] as 0/1 floats: 1 where the clipped branch was taken).
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_probs - old_log_probs)  # [T]
    loss1 = -ratio * advantages  # [T]
    loss2 = -ratio.clamp(1 - eps_clip, 1 + high) * advantages  # [T]
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    if eps_clip_c is not None:
        loss3 = -eps_clip_c * advantages
        dual = (advantages < 0) & (loss > loss3)
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
        clipped = torch.maximum(clipped, dual.float())
    return loss, clipped
