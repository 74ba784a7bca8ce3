"""Per-token losses: closed forms in comments, and the gradient paths that define each method."""
from __future__ import annotations

import math

import pytest
import torch

from engine.algorithms import cispo_policy_loss, gspo_policy_loss, kl, policy_loss, rollout_correction, value_loss

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
    w, keep, stats = rollout_correction(torch.tensor([0.0, -1.0, -3.0]), torch.tensor([-1.0, 0.0, 0.0]),
                                        torch.ones(3), None, low=0.1, high=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 1 / E, 0.1]))
    assert keep.tolist() == [1.0] * 3 and float(stats["tis_clipfrac"]) == 2.0


def test_tis_weights_at_the_sequence_and_geometric_levels():
    """slime's --tis-level: sample 0 (tokens 0–2, token 0 untrained) has log-ratios 0.3 and -0.1 on its trained
    tokens, sample 1 (tokens 3–4) 0.5 and 0.7. sequence: e^(0.2), e^(1.2) → clamped to 2.0; geometric: e^(0.1),
    e^(0.6); every token of a sample gets its sample's weight (also the untrained one, which no loss sees)."""
    old = torch.tensor([9.0, 0.3, -0.1, 0.5, 0.7])  # (token 0: 9, outside the mask, counts in no sum)
    rollout = torch.zeros(5)
    mask, cu = torch.tensor([0.0, 1, 1, 1, 1]), torch.tensor([0, 3, 5])
    w, _, stats = rollout_correction(old, rollout, mask, cu, low=0.0, high=2.0, level="sequence")
    torch.testing.assert_close(w, torch.tensor([math.exp(0.2)] * 3 + [2.0] * 2))
    assert float(stats["tis_clipfrac"]) == 2.0  # sample 1's two trained tokens
    w, _, _ = rollout_correction(old, rollout, mask, cu, low=0.0, high=2.0, level="geometric")
    torch.testing.assert_close(w, torch.tensor([math.exp(0.1)] * 3 + [math.exp(0.6)] * 2))
    w, _, _ = rollout_correction(old, rollout, mask, cu, low=0.0, high=2.0)  # token level: each its own, clamped
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


def _slime_mis(args, train, rollout, masks):
    """slime's examples/train_infer_mismatch_helper/mis.py `compute_mis_weights` (THUDM/slime, Apache-2.0), its
    weights and rejection masks transcribed sample by sample as it computes them (metrics left out): the oracle."""
    def level_ratio(d, m, level):
        if level == "token":
            return d
        s = (d * m).sum()
        return (s if level == "sequence" else s / m.sum().clamp(min=1)).expand_as(d)

    tis_low = args["tis_lower_bound"] if args["tis_lower_bound"] is not None else 1.0 / args["tis_upper_bound"]
    rs_low = args["rs_lower_bound"] if args["rs_lower_bound"] is not None else tis_low
    rs_high = args["rs_upper_bound"] if args["rs_upper_bound"] is not None else args["tis_upper_bound"]
    weights, out_masks = [], []
    for t, r, m in zip(train, rollout, masks):
        d, keep = t - r, m.clone()
        lt = level_ratio(d, m, args["tis_level"])
        w = torch.exp(lt.clamp(-20, 20))
        if args["tis_mode"] == "truncate":
            w = w.clamp(0, args["tis_upper_bound"]) * m
        elif args["tis_mode"] == "clip":
            w = w.clamp(tis_low, args["tis_upper_bound"]) * m
        else:
            keep = m * ((w >= tis_low) & (w <= args["tis_upper_bound"])).float()
            w = w * m
        if args["use_rs"]:
            lr = lt if args["rs_level"] == args["tis_level"] else level_ratio(d, m, args["rs_level"])
            rw = torch.exp(lr.clamp(-20, 20))
            keep = keep * ((rw >= rs_low) & (rw <= rs_high)).float()
            if args["rs_veto_threshold"] is not None:
                keep = keep * float(not ((d < math.log(args["rs_veto_threshold"])) & m.bool()).any())
        weights.append(w)
        out_masks.append(keep)
    if args["tis_batch_normalize"]:
        if args["tis_level"] == "token":
            mean = sum((w * m).sum() for w, m in zip(weights, masks)) / sum(m.sum() for m in masks)
        else:
            mean = sum((w * m).sum() / m.sum().clamp(min=1) for w, m in zip(weights, masks)) / len(weights)
        weights = [w / mean for w in weights]
    return weights, out_masks


@pytest.mark.parametrize("mode", ["truncate", "clip", "mask"])
@pytest.mark.parametrize("level,rs_level", [("token", "token"), ("sequence", "geometric"), ("geometric", "token")])
def test_rollout_correction_is_slimes_mis_helper(mode, level, rs_level):
    """--tis-mode / --tis-level / --use-rs / --rs-level / --rs-veto-threshold / --tis-batch-normalize against slime's
    MIS helper on 6 samples of random log-ratios (some tokens untrained): each token's multiplier of the policy loss
    (weight × kept) and the rejection mask are slime's. The batch-normalize mean is tis_mean_parts' (the trainer sums
    it over micro-batches and ranks); slime has no geometric-level mean, where rollflow takes the samples' as for
    sequence."""
    from engine.algorithms.losses import rollout_correction, tis_mean_parts

    g = torch.Generator().manual_seed(7)
    lens = [5, 3, 6, 2, 4, 7]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    T = sum(lens)
    old, rollout = -torch.rand(T, generator=g) * 2, -torch.rand(T, generator=g) * 2
    old[3] = rollout[3] - 12.0  # a catastrophic token (ratio e^-12) in sample 0
    mask = (torch.rand(T, generator=g) > 0.2).float()
    mask[3] = 1.0
    args = dict(tis_mode=mode, tis_level=level, tis_lower_bound=0.6, tis_upper_bound=1.8, use_rs=True,
                rs_level=rs_level, rs_lower_bound=None, rs_upper_bound=2.5, rs_veto_threshold=1e-4,
                tis_batch_normalize=level != "geometric")
    split = lambda x: [x[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]  # noqa: E731
    s_w, s_keep = _slime_mis(args, split(old), split(rollout), split(mask))
    kw = dict(mode=mode, level=level, low=0.6, high=1.8, rs=True, rs_level=rs_level, rs_low=0.6, rs_high=2.5,
              veto=1e-4)
    scale = None  # (without --tis-batch-normalize: no division, no train/tis_norm)
    if args["tis_batch_normalize"]:
        w0, _, _ = rollout_correction(old, rollout, mask, cu, **kw)
        total, count = tis_mean_parts(w0, mask, cu, level)
        scale = total / count
    w, keep, stats = rollout_correction(old, rollout, mask, cu, scale=scale, **kw)
    torch.testing.assert_close(w * keep * mask, torch.cat(s_w) * torch.cat(s_keep), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(keep * mask, torch.cat(s_keep))
    assert 0 < float(stats["rs_rejected"]) < float(mask.sum())  # some rejected, not all
    assert float(stats["rs_vetoed"]) == float(mask[:5].sum())  # sample 0, whole
    assert float(keep[:5].sum()) == 0.0
    assert ("tis_norm" in stats) == args["tis_batch_normalize"]
