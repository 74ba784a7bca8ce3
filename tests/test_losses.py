"""Per-token losses: closed forms in comments, and the gradient paths that define each method."""
from __future__ import annotations

import math

import pytest
import torch

from engine.algorithms import cispo_policy_loss, gspo_policy_loss, kl, policy_loss, tis_weights, value_loss

E = math.e


def test_kl_estimators_closed_forms():
    # x = log π − log π_ref = [1, −1, 0]
    lp, ref = torch.tensor([0.0, -2.0, -1.0]), torch.tensor([-1.0, -1.0, -1.0])
    torch.testing.assert_close(kl(lp, ref, "k1"), torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(kl(lp, ref, "k2"), torch.tensor([0.5, 0.5, 0.0]))
    # k3 = e^(−x) − 1 + x: x = 1 → 1/e; x = −1 → e − 2; x = 0 → 0
    k3 = torch.tensor([1 / E, E - 2, 0.0])
    torch.testing.assert_close(kl(lp, ref, "k3"), k3)
    torch.testing.assert_close(kl(lp, ref, "low_var_kl"), k3)
    # clamp: x = −20 → e^20 − 21 ≈ 4.9e8 → 10
    assert float(kl(torch.tensor([-20.0]), torch.tensor([0.0]), "low_var_kl")) == 10.0
    with pytest.raises(ValueError, match="unknown kl kind"):
        kl(lp, ref, "k4")


def test_ppo_clip_closed_forms():
    # ratio e, A = 1: max(−e, −1.2) = −1.2 (clipped)
    # ratio e⁻¹ = 0.368, A = 1: max(−0.368, −0.8) = −0.368 (not clipped: the pessimistic branch is unclipped)
    # ratio e⁻¹, A = −1: max(0.368, 0.8) = 0.8 (clipped)
    # ratio 1, A = 2: −2
    lp = torch.tensor([1.0, -1.0, -1.0, 0.0])
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0])
    loss, clipped = policy_loss(lp, torch.zeros(4), adv, eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -1 / E, 0.8, -2.0]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_clip_high_is_asymmetric():
    # ratio e, A = 1, ε_high = 0.28: −1.28 instead of −1.2; the low side keeps ε = 0.2
    loss, _ = policy_loss(torch.tensor([1.0, -1.0]), torch.zeros(2), torch.tensor([1.0, -1.0]), eps_clip=0.2,
                          eps_clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-1.28, 0.8]))


def test_dual_clip_bounds_negative_advantages():
    # ratio e² = 7.39, A = −1: PPO gives max(7.39, 1.2) = 7.39; dual clip c = 3 → min(7.39, 3) = 3
    # ratio e², A = +1: untouched by dual clip → max(−7.39, −1.2) = −1.2
    loss, clipped = policy_loss(torch.tensor([2.0, 2.0]), torch.zeros(2), torch.tensor([-1.0, 1.0]), eps_clip=0.2,
                                eps_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([3.0, -1.2]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 1.0]))


def test_ppo_gradient_is_zero_on_clipped_tokens():
    # token 0: ratio e, A = 1 → clipped, no gradient; token 1: ratio 1, A = 2 → ∂(−ρA)/∂logπ = −ρA = −2
    lp = torch.tensor([1.0, 0.0], requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(2), torch.tensor([1.0, 2.0]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -2.0]))


def test_gspo_uses_the_sequence_mean_log_ratio():
    # sample 0 = tokens 0..2, trained [1, 1, 0], log-ratio [0.3, −0.1, 5] → mean over trained = 0.1 → s = e^0.1
    # sample 1 = tokens 3..4, log-ratio [0.4, 0.4] → s = e^0.4 > 1.2 → clipped for A > 0
    lp = torch.tensor([0.3, -0.1, 5.0, 0.4, 0.4], requires_grad=True)
    mask = torch.tensor([1.0, 1, 0, 1, 1])
    cu = torch.tensor([0, 3, 5])
    adv = torch.tensor([1.0, 1, 1, 1, 1])
    loss, clipped = gspo_policy_loss(lp, torch.zeros(5), adv, mask, cu, eps_clip=0.2)
    s0 = math.exp(0.1)
    torch.testing.assert_close(loss, torch.tensor([-s0, -s0, -s0, -1.2, -1.2]))
    torch.testing.assert_close(clipped, torch.tensor([0.0, 0, 0, 1, 1]))
    # gradient of sample 0's per-token mean loss through the mean log-ratio: each trained token gets −s0/2,
    # the untrained token 0; sample 1 is clipped → 0
    (loss * mask).sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-s0, -s0, 0.0, 0.0, 0.0]))


def test_cispo_stops_the_gradient_of_the_clipped_ratio():
    # ratio e (A = 1) is clipped to 1.2; loss = −1.2·A·logπ = −1.2·1·1; ∂/∂logπ = −1.2 (not 0 as in PPO)
    # ratio 1 (A = −0.5): loss = −1·(−0.5)·0 = 0; ∂/∂logπ = −1·(−0.5) = 0.5 (no ratio-derivative term)
    lp = torch.tensor([1.0, 0.0], requires_grad=True)
    loss, clipped = cispo_policy_loss(lp, torch.zeros(2), torch.tensor([1.0, -0.5]), eps_clip=0.2)
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, 0.0]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-1.2, 0.5]))


def test_cispo_gradient_ignores_old_log_prob_path():
    # the clipped weight is a constant: no gradient reaches old_log_probs either
    old = torch.tensor([0.5], requires_grad=True)
    lp = torch.tensor([0.2], requires_grad=True)
    loss, _ = cispo_policy_loss(lp, old, torch.tensor([1.0]), eps_clip=1.0, eps_clip_high=5.0)
    loss.sum().backward()
    assert old.grad is None or float(old.grad.abs().sum()) == 0.0
    torch.testing.assert_close(lp.grad, -torch.exp(torch.tensor([-0.3])))  # −ρ·A with ρ = e^(0.2 − 0.5)


def test_tis_weights_are_clamped_ratios():
    # exp(old − rollout): e^1 = 2.718 → 2.0 (clipped); e^−1 = 0.368; e^−3 = 0.0498 → low 0.1 (clipped)
    w, clipped = tis_weights(torch.tensor([0.0, -1.0, -3.0]), torch.tensor([-1.0, 0.0, 0.0]), low=0.1, high=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 1 / E, 0.1]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 1.0]))


def test_tis_weights_at_the_sequence_and_geometric_levels():
    """slime's --tis-level: sample 0 (tokens 0–2, token 0 untrained) has log-ratios 0.3 and -0.1 on its trained
    tokens, sample 1 (tokens 3–4) 0.5 and 0.7. sequence: e^(0.2), e^(1.2) → clamped to 2.0; geometric: e^(0.1),
    e^(0.6); every token of a sample gets its sample's weight (also the untrained one, which no loss sees)."""
    old = torch.tensor([9.0, 0.3, -0.1, 0.5, 0.7])  # (token 0: 9, outside the mask, counts in no sum)
    rollout = torch.zeros(5)
    mask, cu = torch.tensor([0.0, 1, 1, 1, 1]), torch.tensor([0, 3, 5])
    w, clipped = tis_weights(old, rollout, low=0.0, high=2.0, level="sequence", mask=mask, cu_seqlens=cu)
    torch.testing.assert_close(w, torch.tensor([math.exp(0.2)] * 3 + [2.0] * 2))
    torch.testing.assert_close(clipped, torch.tensor([0.0, 0, 0, 1, 1]))
    w, _ = tis_weights(old, rollout, low=0.0, high=2.0, level="geometric", mask=mask, cu_seqlens=cu)
    torch.testing.assert_close(w, torch.tensor([math.exp(0.1)] * 3 + [math.exp(0.6)] * 2))
    w, _ = tis_weights(old, rollout, low=0.0, high=2.0)  # token level: each its own, clamped
    torch.testing.assert_close(w, torch.tensor([2.0, math.exp(0.3), math.exp(-0.1), math.exp(0.5), 2.0]))


def test_value_loss_clipping():
    # V_old = 0, R = 1, c = 0.2
    # V = 0.5: clipped V = 0.2 → (0.2 − 1)² = 0.64 vs (0.5 − 1)² = 0.25 → max 0.64 (clipped branch)
    # V = 0.1: inside the clip range → (0.1 − 1)² = 0.81 both
    # V = −0.5: clipped V = −0.2 → 1.44 vs 2.25 → 2.25 (unclipped: clipping never lowers the loss)
    v = torch.tensor([0.5, 0.1, -0.5], requires_grad=True)
    loss, clipped = value_loss(v, torch.zeros(3), torch.ones(3), value_clip=0.2)
    torch.testing.assert_close(loss.detach(), torch.tensor([0.64, 0.81, 2.25]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 0.0]))
    loss.sum().backward()
    # the clipped branch has no gradient in V; others 2(V − R): [0, −1.8, −3]
    torch.testing.assert_close(v.grad, torch.tensor([0.0, -1.8, -3.0]))
