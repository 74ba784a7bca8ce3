"""Advantage estimators: hand-computed values, the module's invariants, one dispatch per estimator."""
from __future__ import annotations

import math

import pytest
import torch

from engine.algorithms import (compute_advantages, discounted_returns, gae, grpo_advantages, masked_whiten,
                               reinforce_plus_plus_baseline_advantages, reinforce_plus_plus_returns, whiten_stats)
from engine.algorithms.packed import from_rows, per_sample_mean, to_rows


def test_grpo_group_normalisation_closed_form():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4·0.25/3) = 0.57735 → ±0.5/0.57735 = ±0.866025
    # group [1, 1, 1, 1]: constant → 0 (no signal, not a division by zero)
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1]), 4)
    s = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([s, -s, -s, s, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    assert abs(float(adv[:4].sum())) < 1e-6  # invariant 1: a group's advantages sum to 0


def test_dr_grpo_only_centres():
    # Dr.GRPO: r − mean, [3, 1] → [1, −1]; [2, 2] → [0, 0]
    adv = grpo_advantages(torch.tensor([3.0, 1, 2, 2]), 2, std_normalization=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1, 0, 0]))


def test_grpo_with_one_sample_per_prompt_is_zero_not_nan():
    # n = 1: the group mean is the reward itself and the std of one sample is 0/0 (NaN); slime turns the
    # std-normalisation off for n = 1, so A = r − r = 0 (the step trains nothing, and says so with grad norm 0)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5]), 1)
    assert torch.equal(adv, torch.zeros(3))
    adv, _ = compute_advantages("grpo", rewards=torch.tensor([1.0, 0.0]), n_samples_per_prompt=1, sample_ids=[0, 1],
                                cu_seqlens=torch.tensor([0, 3, 6]), loss_mask=torch.tensor([0., 1, 1, 0, 1, 1]),
                                kl=torch.zeros(6))
    assert torch.isfinite(adv).all() and float(adv.abs().sum()) == 0.0


def test_grpo_non_multiple_of_n_is_one_group_with_a_warning():
    with pytest.warns(UserWarning, match="not a multiple"):
        adv = grpo_advantages(torch.tensor([0.0, 1, 2]), 2, std_normalization=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0, 1]))  # mean of all three = 1


def test_discounted_returns():
    # γ = 0.5: r = [1, 0, 2] → G2 = 2, G1 = 0 + 0.5·2 = 1, G0 = 1 + 0.5·1 = 1.5
    torch.testing.assert_close(discounted_returns(torch.tensor([[1.0, 0, 2]]), 0.5), torch.tensor([[1.5, 1, 2]]))


def test_reinforce_plus_plus_returns_put_reward_on_last_trained_token():
    # row: mask [1, 1, 0], kl [0.2, 0.4, 9] (the masked token's KL is ignored), reward 1, kl_coef 0.5, γ = 1:
    # token rewards = [−0.1, −0.2 + 1, 0] → returns [0.7, 0.8, 0]
    out = reinforce_plus_plus_returns(torch.tensor([1.0]), torch.tensor([[0.2, 0.4, 9.0]]),
                                      torch.tensor([[1.0, 1, 0]]), kl_coef=0.5, gamma=1.0)
    torch.testing.assert_close(out, torch.tensor([[0.7, 0.8, 0.0]]))


def test_reinforce_plus_plus_baseline_subtracts_kl():
    # centred reward 0.5, kl [0.2, 0.0], kl_coef 0.5 → [0.4, 0.5]
    out = reinforce_plus_plus_baseline_advantages(torch.tensor([0.5]), torch.tensor([[0.2, 0.0]]), kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.4, 0.5]]))


def test_gae_closed_form():
    # r = [0, 1], V = [0.5, 0.2], γ = 0.9, λ = 0.8, V past the end = 0:
    # δ1 = 1 + 0 − 0.2 = 0.8;  δ0 = 0 + 0.9·0.2 − 0.5 = −0.32
    # A1 = 0.8;  A0 = δ0 + γλ·A1 = −0.32 + 0.72·0.8 = 0.256;  R = A + V = [0.756, 1.0]
    adv, ret = gae(torch.tensor([[0.0, 1]]), torch.tensor([[0.5, 0.2]]), gamma=0.9, lambd=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.256, 0.8]]))
    torch.testing.assert_close(ret, torch.tensor([[0.756, 1.0]]))


def test_gae_lambda_one_is_monte_carlo_minus_value():
    # invariant 3: λ = 1 → A_t = Σ γ^k r_{t+k} − V_t exactly
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    adv, ret = gae(r, v, gamma=0.95, lambd=1.0)
    torch.testing.assert_close(adv, discounted_returns(r, 0.95) - v)
    torch.testing.assert_close(ret, discounted_returns(r, 0.95))


def test_zero_padding_is_terminal():
    # a row padded with zeros gives the same advantages on its real tokens as the unpadded row
    r, v = torch.tensor([[0.0, 0, 1]]), torch.tensor([[0.3, 0.1, 0.4]])
    a_short, _ = gae(r, v, gamma=0.9, lambd=0.7)
    a_pad, _ = gae(torch.cat([r, torch.zeros(1, 4)], 1), torch.cat([v, torch.zeros(1, 4)], 1), gamma=0.9, lambd=0.7)
    torch.testing.assert_close(a_pad[:, :3], a_short)


def test_whiten_stats_summed_over_parts_equal_the_whole():
    # invariant 4: two "ranks" whitening with summed stats == whitening the concatenation
    g = torch.Generator().manual_seed(1)
    x, m = torch.randn(10, generator=g), (torch.rand(10, generator=g) > 0.3).float()
    whole = masked_whiten(x, whiten_stats(x, m))
    stats = whiten_stats(x[:4], m[:4]) + whiten_stats(x[4:], m[4:])
    torch.testing.assert_close(torch.cat([masked_whiten(x[:4], stats), masked_whiten(x[4:], stats)]), whole)
    sel = whole[m > 0]
    # on the masked tokens: mean 0, unbiased std 1 (up to eps)
    assert abs(float(sel.mean())) < 1e-5 and abs(float(sel.std()) - 1) < 1e-4


def test_rows_round_trip():
    cu = torch.tensor([0, 3, 4, 6])
    x = torch.arange(6.0)
    rows = to_rows(x, cu)
    torch.testing.assert_close(rows, torch.tensor([[0.0, 1, 2], [3, 0, 0], [4, 5, 0]]))
    torch.testing.assert_close(from_rows(rows, cu), x)
    # per-sample masked mean: sample 0 tokens [0, 1, 2] mask [0, 1, 1] → 1.5; sample 1 has no trained token → 0
    torch.testing.assert_close(per_sample_mean(x, torch.tensor([0.0, 1, 1, 0, 1, 1]), cu),
                               torch.tensor([1.5, 0.0, 4.5]))


# ---- compute_advantages: the one dispatch ---------------------------------------------------------------------
def _batch():
    """Two samples packed: sample 0 = 2 prompt + 3 response tokens, sample 1 = 1 prompt + 2 response."""
    cu = torch.tensor([0, 5, 8])
    mask = torch.tensor([0.0, 0, 1, 1, 1, 0, 1, 1])
    kl = torch.tensor([0.0, 0, 0.1, 0.2, 0.3, 0, 0.4, 0.5])
    return cu, mask, kl


def test_grpo_family_broadcasts_the_group_normalised_reward():
    cu, mask, kl = _batch()
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])  # one group of 4; the micro-batch holds samples 0 and 3
    # mean 0.25, unbiased std = sqrt((0.5625 + 3·0.0625)/3) = 0.5 → sample 0: 0.75/0.5 = 1.5, sample 3: −0.5
    for est in ("grpo", "gspo", "cispo"):
        adv, ret = compute_advantages(est, rewards=rewards, n_samples_per_prompt=4, sample_ids=[0, 3],
                                      cu_seqlens=cu, loss_mask=mask, kl=kl)
        exp = torch.tensor([0.0, 0, 1.5, 1.5, 1.5, 0, -0.5, -0.5])
        torch.testing.assert_close(adv, exp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ret, adv)


def test_ppo_with_zero_values_and_gamma_one_gives_the_reward_minus_future_kl():
    cu, mask, kl = _batch()
    # γ = λ = 1, V = 0, kl_coef = 1: A_t = Σ_{k ≥ t} r_k, r = −KL on trained tokens, +reward on the sample's last
    # sample 0 (reward 1): trained KL [0.1, 0.2, 0.3] → A = [1 − 0.6, 1 − 0.5, 1 − 0.3] = [0.4, 0.5, 0.7]
    # sample 1 (reward 0): KL [0.4, 0.5] → A = [−0.9, −0.5]
    adv, ret = compute_advantages("ppo", rewards=torch.tensor([1.0, 0.0]), n_samples_per_prompt=2, sample_ids=[0, 1],
                                  cu_seqlens=cu, loss_mask=mask, kl=kl, values=torch.zeros(8), kl_coef=1.0)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0, 0.4, 0.5, 0.7, 0, -0.9, -0.5]))
    torch.testing.assert_close(ret, adv)  # V = 0 → returns = advantages


def test_ppo_values_change_advantages_not_returns_at_lambda_one():
    cu, mask, kl = _batch()
    v = torch.tensor([0.0, 0.3, 0.2, 0.1, 0.4, 0.0, 0.5, 0.6])
    kw = dict(rewards=torch.tensor([1.0, 0.0]), n_samples_per_prompt=2, sample_ids=[0, 1], cu_seqlens=cu,
              loss_mask=mask, kl=kl)
    a0, r0 = compute_advantages("ppo", values=torch.zeros(8), **kw)
    a1, r1 = compute_advantages("ppo", values=v, **kw)
    torch.testing.assert_close(r1, r0)  # λ = 1: returns are Monte-Carlo, independent of V
    torch.testing.assert_close(a1, a0 - v * mask)


def test_reinforce_plus_plus_baseline_uses_the_group_mean():
    cu, mask, kl = _batch()
    # rewards [1, 0] → centred [0.5, −0.5]; kl_coef 0.5: sample 0 → 0.5 − 0.5·[0.1, 0.2, 0.3]
    adv, _ = compute_advantages("reinforce_plus_plus_baseline", rewards=torch.tensor([1.0, 0.0]),
                                n_samples_per_prompt=2, sample_ids=[0, 1], cu_seqlens=cu, loss_mask=mask, kl=kl,
                                kl_coef=0.5)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0, 0.45, 0.4, 0.35, 0, -0.7, -0.75]))


def test_a_tokens_advantage_does_not_depend_on_the_packing():
    # invariant 2: sample 1 alone or packed after sample 0 gets the same advantages, for every estimator
    cu, mask, kl = _batch()
    v = torch.linspace(0, 0.7, 8)
    rewards = torch.tensor([1.0, 0.0])
    for est in ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"):
        kw = dict(rewards=rewards, n_samples_per_prompt=2, gamma=0.9, lambd=0.95, kl_coef=0.3)
        both, _ = compute_advantages(est, sample_ids=[0, 1], cu_seqlens=cu, loss_mask=mask, kl=kl, values=v, **kw)
        alone, _ = compute_advantages(est, sample_ids=[1], cu_seqlens=torch.tensor([0, 3]), loss_mask=mask[5:],
                                      kl=kl[5:], values=v[5:], **kw)
        torch.testing.assert_close(both[5:], alone, msg=est)


def test_unknown_estimator_and_ppo_without_values_are_errors():
    cu, mask, kl = _batch()
    kw = dict(rewards=torch.tensor([1.0, 0.0]), n_samples_per_prompt=2, sample_ids=[0, 1], cu_seqlens=cu,
              loss_mask=mask, kl=kl)
    with pytest.raises(ValueError, match="unknown advantage estimator 'rloo'"):
        compute_advantages("rloo", **kw)
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("ppo", **kw)
