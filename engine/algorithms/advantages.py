"""Advantage estimators, as pure functions of tensors and numbers (slime's `ppo_utils` semantics).

Per sample:  `grpo_advantages` — group-normalised reward (GRPO, GSPO, CISPO; mean-centred only for Dr.GRPO and
             as REINFORCE++-baseline's baseline).
Per token:   `reinforce_plus_plus_returns`, `reinforce_plus_plus_baseline_advantages`, `gae`, on [S, L] rows
             (zero right-padding is the terminal state: see engine.algorithms.packed).
Across the batch: `whiten_stats` + `masked_whiten` (--normalize-advantages; the caller sums the stats over DP
             ranks, so the result does not depend on the DP layout).
`compute_advantages` is the one place where `--advantage-estimator` is dispatched; it takes one packed
micro-batch plus the rewards of the *whole* rollout, so a group split over DP ranks is normalised the same way
on every rank.

Invariants (tests/test_advantages.py):
1. GRPO advantages of a group sum to 0; with std-normalisation their unbiased std is 1 − O(eps) (0 for a
   constant group).
2. A token's advantage depends only on its own sample and the rewards: packing and DP layout do not change it.
3. `gae` with λ = 1 equals discounted returns − values; with γ = λ = 1, V = 0 and no KL every response token of
   a sample gets the sample's reward.
4. `masked_whiten` with stats summed over parts equals whitening the concatenation.
"""
from __future__ import annotations

import warnings

import torch

from engine.algorithms.packed import from_rows, to_rows

ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


def grpo_advantages(rewards: torch.Tensor, n_samples_per_prompt: int, *, std_normalization: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r − group mean) / (group std + eps) per group of n consecutive samples.

    rewards: [N] one scalar per sample, groups contiguous. Returns [N]. Without std-normalisation this is
    Dr.GRPO's mean-centred reward. When N is not a multiple of n the whole batch is one group (warned).
    The std is the unbiased one (torch.std), as slime; with n = 1 it is undefined (0/0), so, as slime does, the
    std is not divided by and every advantage is r − r = 0.
    """
    n = n_samples_per_prompt
    if n == 1:
        std_normalization = False
    if rewards.numel() % n:
        warnings.warn(f"{rewards.numel()} rewards are not a multiple of n_samples_per_prompt={n}; "
                      "normalising over the whole batch as one group", stacklevel=2)
        n = rewards.numel()
    g = rewards.float().view(-1, n)  # [N/n, n]
    centred = g - g.mean(dim=1, keepdim=True)  # [N/n, n]
    if std_normalization:
        centred = centred / (g.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.view(-1)


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ·G_{t+1} along each row of [S, L] (G past the row's end is 0)."""
    out = torch.zeros_like(token_rewards)  # [S, L]
    running = torch.zeros_like(token_rewards[:, 0])  # [S]
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def _last_index(mask: torch.Tensor) -> torch.Tensor:
    """[S] column of each row's last nonzero entry of mask [S, L] (0 for an all-zero row)."""
    cols = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [S, L]
    return torch.where(mask > 0, cols, torch.zeros_like(cols)).max(dim=1).values


def reinforce_plus_plus_returns(rewards: torch.Tensor, kl: torch.Tensor, loss_mask: torch.Tensor, *,
                                kl_coef: float, gamma: float) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): discounted returns of the KL-shaped token rewards.

    rewards [S] per sample; kl, loss_mask [S, L]. Token reward r_t = −kl_coef·kl_t on trained tokens, plus the
    sample's reward on its last trained token (as slime). Returns G [S, L], used directly as the advantage.
    """
    token_rewards = -kl_coef * kl * loss_mask  # [S, L]
    last = _last_index(loss_mask)  # [S]
    has = loss_mask.sum(dim=1) > 0  # [S] a fully masked sample gets no reward
    token_rewards = token_rewards.index_put((torch.arange(rewards.numel()), last),
                                            rewards.to(token_rewards.dtype) * has, accumulate=True)
    return discounted_returns(token_rewards, gamma)


def reinforce_plus_plus_baseline_advantages(centred_rewards: torch.Tensor, kl: torch.Tensor, *,
                                            kl_coef: float) -> torch.Tensor:
    """REINFORCE++-baseline: the group-centred reward broadcast to tokens, minus kl_coef·KL.

    centred_rewards [S] (r − group mean), kl [S, L] → advantages [S, L]."""
    return centred_rewards[:, None].to(kl.dtype) - kl_coef * kl


def gae(rewards: torch.Tensor, values: torch.Tensor, *, gamma: float, lambd: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (PPO, arXiv 1506.02438) along each row of [S, L].

    δ_t = r_t + γ·V_{t+1} − V_t with V past the row's end = 0; A_t = δ_t + γλ·A_{t+1}; returns R_t = A_t + V_t
    (the critic's regression target). Returns (advantages [S, L], returns [S, L]).
    """
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # [S, L]
    deltas = rewards + gamma * next_values - values  # [S, L]
    adv = discounted_returns(deltas, gamma * lambd)  # A_t = Σ_k (γλ)^k δ_{t+k}
    return adv, adv + values


def whiten_stats(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[3] = (Σ m·x, Σ m·x², Σ m) in float64, to be summed over parts (DP ranks) before `masked_whiten`."""
    x, mask = x.double(), mask.double()
    return torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()])


def masked_whiten(x: torch.Tensor, stats: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean)·rsqrt(var + eps) with mean and unbiased var from summed `whiten_stats` (as slime)."""
    total, total_sq, count = stats.tolist()
    if count < 1:
        raise ValueError("cannot whiten advantages: no trained token in the whole batch")
    mean = total / count
    var = total_sq / count - mean * mean
    if count >= 2:
        var *= count / (count - 1)  # Bessel
    return ((x.double() - mean) / (max(var, 0.0) + eps) ** 0.5).to(x.dtype)


def compute_advantages(estimator: str, *, rewards: torch.Tensor, n_samples_per_prompt: int,
                       sample_ids: list[int], cu_seqlens: torch.Tensor, loss_mask: torch.Tensor,
                       kl: torch.Tensor, values: torch.Tensor | None = None, gamma: float = 1.0,
                       lambd: float = 1.0, kl_coef: float = 0.0, std_normalization: bool = True,
                       rewards_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns [T] of one packed micro-batch (0 where loss_mask is 0).

    rewards: [N] every sample of the rollout, indexed by Sample.index (groups of n contiguous);
    sample_ids: [S] the Sample.index of each sample in the micro-batch; loss_mask, kl, values: [T] flat,
    aligned with the tokens (entry t is about predicting token t; kl = kl(log π_old, log π_ref)).
    Returns equal advantages and returns except for PPO, whose returns are the critic's targets.
    rewards_normalized: the rewards come from --custom-reward-post-process-path, which replaces the group
    normalisation (slime's contract): GRPO-family and REINFORCE++-baseline take them as they are.
    """
    group = (lambda std: rewards.float()) if rewards_normalized else (
        lambda std: grpo_advantages(rewards, n_samples_per_prompt, std_normalization=std))
    ids = torch.as_tensor(sample_ids, dtype=torch.long)
    mask = to_rows(loss_mask, cu_seqlens)  # [S, L]
    kl_rows = to_rows(kl, cu_seqlens) * mask  # [S, L]
    if estimator in ("grpo", "gspo", "cispo"):
        score = group(std_normalization)[ids]  # [S]
        adv = score[:, None].expand_as(mask)  # [S, L]
        ret = adv
    elif estimator == "reinforce_plus_plus_baseline":
        centred = group(False)[ids]  # [S]
        adv = ret = reinforce_plus_plus_baseline_advantages(centred, kl_rows, kl_coef=kl_coef)
    elif estimator == "reinforce_plus_plus":
        adv = ret = reinforce_plus_plus_returns(rewards.float()[ids], kl_rows, mask, kl_coef=kl_coef, gamma=gamma)
    elif estimator == "ppo":
        if values is None:
            raise ValueError("the ppo estimator needs the critic's values")
        # token rewards −kl_coef·KL, plus the sample's reward on its last token (slime's PPO; the last token of
        # a packed sample is its last response token)
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
        token_rewards = (-kl_coef * kl_rows).index_put((torch.arange(ids.numel()), lens - 1),
                                                       rewards.float()[ids], accumulate=True)
        adv, ret = gae(token_rewards, to_rows(values, cu_seqlens), gamma=gamma, lambd=lambd)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}: one of {', '.join(ESTIMATORS)}")
    return from_rows(adv * mask, cu_seqlens), from_rows(ret * mask, cu_seqlens)
