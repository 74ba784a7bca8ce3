"""Advantage estimators."""
from __future__ import annotations

import warnings

import torch


def grpo_advantages(rewards: torch.Tensor, n_samples_per_prompt: int, *, std_normalization: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r − group mean) / (group std + eps) per group of n consecutive samples.

    rewards: [N] one scalar per sample, groups contiguous. Returns [N]. Without std-normalisation this is
    Dr.GRPO's mean-centred reward. When N is not a multiple of n the whole batch is one group (warned).
    """
    n = n_samples_per_prompt
    if rewards.numel() % n:
        warnings.warn(f"{rewards.numel()} rewards are not a multiple of n_samples_per_prompt={n}; "
                      "normalising over the whole batch as one group", stacklevel=2)
        n = rewards.numel()
    g = rewards.float().view(-1, n)  # [N/n, n]
    centred = g - g.mean(dim=1, keepdim=True)
    if std_normalization:
        centred = centred / (g.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.view(-1)
