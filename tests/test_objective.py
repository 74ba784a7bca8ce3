"""The step objective: aggregation closed forms and invariance over any split into micro-batches / DP ranks."""
from __future__ import annotations

import math

import pytest
import torch

from engine.algorithms import LossSpec, aggregate, policy_objective, value_objective


def test_aggregation_closed_forms():
    # two samples: losses [1, 3] (trained [1, 1]) and [10, 20, 30] (trained [1, 0, 1])
    x = torch.tensor([1.0, 3, 10, 20, 30])
    m = torch.tensor([1.0, 1, 1, 0, 1])
    cu = torch.tensor([0, 2, 5])
    # per-sample mean: (2 + 20) / G, with G = 4 samples in the whole step → 5.5
    loss, per_sample = aggregate(x, m, cu, per_token=False, denominator=4)
    assert float(loss) == pytest.approx(5.5)
    torch.testing.assert_close(per_sample, torch.tensor([2.0, 20.0]))
    # per token: (1 + 3 + 10 + 30) / N, N = 8 trained tokens in the step → 5.5 as well here; N = 11 → 4
    assert float(aggregate(x, m, cu, per_token=True, denominator=11)[0]) == pytest.approx(4.0)


def _batch(seed: int = 0, lens=(3, 5, 2, 4, 6, 1)):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()))
    return dict(
        lens=list(lens), cu=cu,
        lp=(-torch.rand(T, generator=g) * 2), old=(-torch.rand(T, generator=g) * 2),
        ref=(-torch.rand(T, generator=g) * 2), rollout=(-torch.rand(T, generator=g) * 2),
        ent=torch.rand(T, generator=g), adv=torch.randn(T, generator=g),
        mask=(torch.rand(T, generator=g) > 0.25).float())


def _slice(b, samples):
    """The tensors of a subset of consecutive samples as their own packed micro-batch."""
    a, z = int(b["cu"][samples[0]]), int(b["cu"][samples[-1] + 1])
    cu = b["cu"][samples[0]:samples[-1] + 2] - a
    return {k: (v[a:z] if isinstance(v, torch.Tensor) and v.numel() == int(b["cu"][-1]) else v)
            for k, v in b.items() if k not in ("cu", "lens")} | {"cu": cu}


SPECS = [
    LossSpec(),
    LossSpec(policy_loss="gspo", eps_clip=0.1),
    LossSpec(policy_loss="cispo", eps_clip=1.0, eps_clip_high=0.3, use_tis=True, tis_clip=1.5, tis_clip_low=0.2),
    LossSpec(eps_clip_high=0.28, eps_clip_c=3.0, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1,
             kl_loss_type="k2", per_token_loss=True),
    LossSpec(use_tis=True, tis_mode="mask", tis_clip_low=0.5, tis_clip=1.5, tis_level="geometric", use_rs=True,
             rs_level="geometric", rs_low=0.5, rs_high=2.0, rs_veto=0.25),  # (rejects 8 of 14 tokens, vetoes 5)
]


@pytest.mark.parametrize("spec", SPECS, ids=["ppo", "gspo", "cispo+tis", "per-token+kl+entropy", "mis+rs+veto"])
def test_loss_and_gradient_are_the_same_for_any_split(spec):
    b = _batch()
    G, N = 6, float(b["mask"].sum())
    denom = N if spec.per_token_loss else G

    def run(splits):
        lp = b["lp"].clone().requires_grad_()
        ent = b["ent"].clone().requires_grad_()
        total = 0.0
        for samples in splits:
            p = _slice(b | {"lp": lp, "ent": ent}, samples)
            loss, _, _ = policy_objective(spec, log_probs=p["lp"], entropy=p["ent"], old_log_probs=p["old"],
                                          ref_log_probs=p["ref"], rollout_log_probs=p["rollout"],
                                          advantages=p["adv"], loss_mask=p["mask"], cu_seqlens=p["cu"],
                                          denominator=denom)
            loss.backward()
            total += float(loss.detach())
        return total, lp.grad.clone(), ent.grad.clone()

    whole = run([[0, 1, 2, 3, 4, 5]])
    # as DP = 2 with two micro-batches each, and as DP = 3 with one sample per micro-batch
    for splits in ([[0, 1], [2], [3, 4], [5]], [[0], [1], [2], [3], [4], [5]]):
        part = run(splits)
        assert part[0] == pytest.approx(whole[0], rel=1e-6, abs=1e-7)
        torch.testing.assert_close(part[1], whole[1], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(part[2], whole[2], rtol=1e-6, atol=1e-7)
    assert whole[1].abs().sum() > 0  # the check is not vacuous


def test_policy_objective_closed_form_with_every_term():
    # one sample, two trained tokens, ratio 1 (lp = old), A = [1, −1]: pg = [−1, 1]
    # TIS weights exp(old − rollout) = [e^0.5 → clamp 1.5, e^−0.1 = 0.905]: pg·w = [−1.5, 0.905]
    # entropy [0.2, 0.4], coef 0.5 → −[0.1, 0.2]; k1 KL = lp − ref = [0.3, −0.1], coef 2 → [0.6, −0.2]
    # ℓ = [−1.5 − 0.1 + 0.6, 0.905 − 0.2 − 0.2] = [−1.0, 0.505]; per-sample mean / G(=2) = (−0.4952) / 2
    spec = LossSpec(entropy_coef=0.5, use_kl_loss=True, kl_loss_coef=2.0, kl_loss_type="k1", use_tis=True,
                    tis_clip=1.5)
    lp = torch.tensor([-1.0, -2.0])
    loss, stats, per_sample = policy_objective(
        spec, log_probs=lp, entropy=torch.tensor([0.2, 0.4]), old_log_probs=lp,
        ref_log_probs=lp - torch.tensor([0.3, -0.1]), rollout_log_probs=lp - torch.tensor([0.5, -0.1]),
        advantages=torch.tensor([1.0, -1.0]),
        loss_mask=torch.ones(2), cu_seqlens=torch.tensor([0, 2]), denominator=2)
    w1 = math.exp(-0.1)
    expected = ((-1.5 - 0.1 + 0.6) + (w1 - 0.2 - 0.2)) / 2
    assert float(per_sample[0]) == pytest.approx(expected, rel=1e-6)
    assert float(loss) == pytest.approx(expected / 2, rel=1e-6)
    assert float(stats["tis_clipfrac"]) == 1.0 and float(stats["ratio"]) == pytest.approx(2.0)
    assert float(stats["kl"]) == pytest.approx(0.2, rel=1e-6)  # Σ KL over trained tokens = 0.3 − 0.1


def test_unbiased_kl_weights_the_kl_loss_by_the_ratio_with_its_gradient():
    """--use-unbiased-kl (slime's, DeepSeek-V3.2): the KL term is ρ·KL with ρ = π/π_old, gradient through ρ too.
    k1, x = log π − log π_ref = [0.3, −0.1], ρ = [e^−0.2, e^0.3]: ℓ_t = ρ_t·x_t, ∂ℓ_t/∂log π_t = ρ_t·(x_t + 1)
    (without the flag: x_t and 1)."""
    from engine.config import RunConfig
    from engine.diagnosis import ConfigError

    x, shift = torch.tensor([0.3, -0.1]), torch.tensor([0.2, -0.3])
    rho = torch.exp(-shift)

    def run(unbiased: bool):
        lp = torch.tensor([-1.0, -2.0], requires_grad=True)
        spec = LossSpec(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1", unbiased_kl=unbiased)
        loss, stats, _ = policy_objective(
            spec, log_probs=lp, entropy=torch.zeros(2), old_log_probs=lp.detach() + shift,
            ref_log_probs=lp.detach() - x, rollout_log_probs=lp.detach(), advantages=torch.zeros(2),
            loss_mask=torch.ones(2), cu_seqlens=torch.tensor([0, 2]), denominator=1)
        loss.backward()
        return float(loss.detach()), float(stats["kl"]), lp.grad

    loss, kl_sum, grad = run(True)
    assert loss == pytest.approx(float((rho * x).mean()), rel=1e-6)  # one sample: its token mean
    assert kl_sum == pytest.approx(float((rho * x).sum()), rel=1e-6)
    torch.testing.assert_close(grad, rho * (x + 1) / 2)
    loss, kl_sum, grad = run(False)
    assert loss == pytest.approx(float(x.mean()), rel=1e-6) and kl_sum == pytest.approx(0.2, rel=1e-6)
    torch.testing.assert_close(grad, torch.full((2,), 0.5))
    assert LossSpec.of(RunConfig(use_kl_loss=True, use_unbiased_kl=True)).unbiased_kl
    with pytest.raises(ConfigError, match="--use-unbiased-kl corrects the KL loss, and --use-kl-loss is off"):
        RunConfig(use_unbiased_kl=True)


def test_opsm_leaves_drifted_samples_with_negative_advantages_out_of_the_policy_loss():
    """--use-opsm (slime's compute_opsm_mask): three samples of two tokens, ratio e^−d (log π = old − d):
    sample 0 drifted (d = 0.3 > δ) with A < 0 → masked; sample 1 drifted with A > 0 → kept; sample 2 A < 0 but
    d = 0 ≤ δ → kept. Only sample 0's tokens leave the loss (and its gradient), and 2 of 6 trained tokens count
    as masked."""
    from engine.config import RunConfig
    from engine.diagnosis import ConfigError

    old = torch.tensor([-1.0, -2.0, -1.5, -0.5, -1.0, -1.2])
    drift = torch.tensor([0.3, 0.3, 0.3, 0.3, 0.0, 0.0])
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    cu = torch.tensor([0, 2, 4, 6])

    def run(opsm: bool):
        lp = (old - drift).clone().requires_grad_(True)
        loss, stats, per_sample = policy_objective(
            LossSpec(use_opsm=opsm, opsm_delta=0.1), log_probs=lp, entropy=torch.zeros(6), old_log_probs=old,
            ref_log_probs=None, rollout_log_probs=old, advantages=adv, loss_mask=torch.ones(6), cu_seqlens=cu,
            denominator=3)
        loss.backward()
        return per_sample, stats, lp.grad

    plain, _, g_plain = run(False)
    masked, stats, g = run(True)
    assert float(masked[0]) == 0.0 and float(plain[0]) != 0.0
    torch.testing.assert_close(masked[1:], plain[1:])
    assert g[:2].abs().sum() == 0 and torch.equal(g[2:], g_plain[2:])
    assert float(stats["opsm_masked"]) == 2.0
    assert LossSpec.of(RunConfig(use_opsm=True, opsm_delta=0.5)).opsm_delta == 0.5
    with pytest.raises(ConfigError, match="--opsm-delta 0.5 without --use-opsm would do nothing"):
        RunConfig(opsm_delta=0.5)
    # policy_objective is the megatron backend's loss too (compared with torch's in tests/test_megatron_backend.py)
    assert LossSpec.of(RunConfig(use_opsm=True, train_backend="megatron")).use_opsm


def test_value_objective_is_split_invariant_too():
    b = _batch(seed=3)
    spec = LossSpec(value_clip=0.1)

    def run(splits):
        v = b["lp"].clone().requires_grad_()
        total = 0.0
        for samples in splits:
            p = _slice(b | {"lp": v}, samples)
            loss, _, _ = value_objective(spec, values=p["lp"], old_values=p["old"], returns=p["adv"],
                                         loss_mask=p["mask"], cu_seqlens=p["cu"], denominator=6)
            loss.backward()
            total += float(loss.detach())
        return total, v.grad.clone()

    whole, parts = run([[0, 1, 2, 3, 4, 5]]), run([[0, 1, 2], [3], [4, 5]])
    assert parts[0] == pytest.approx(whole[0], rel=1e-6)
    torch.testing.assert_close(parts[1], whole[1])


def _slime_vanilla_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """slime's vanilla_tis_function (slime/backends/megatron_utils/loss.py), as written there."""
    rollout_log_probs = torch.cat(rollout_log_probs, dim=0)
    old_log_probs = torch.cat(train_log_probs, dim=0)
    tis = torch.exp(old_log_probs - rollout_log_probs)
    tis_weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    metrics = {"tis": tis.clone().detach(), "tis_clipfrac": (tis_weights != tis).float().clone().detach()}
    return pg_loss * tis_weights, loss_masks, metrics


def _reject_long_ratio(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, response_lengths, **kw):
    """Rejection through the masks: every token of a sample's second half leaves the loss; weight 1 elsewhere."""
    masks = [m.clone() for m in loss_masks]
    for m, r in zip(masks, response_lengths):
        m[r // 2:] = 0
    return pg_loss, masks, {"kept": torch.cat(masks)}


def test_a_custom_tis_function_in_slimes_contract_sees_each_samples_response_tokens():
    """--custom-tis-function-path: slime's own vanilla TIS function through the hook gives --use-tis's loss and
    gradient exactly (the packed [T] tensors are cut into the samples' response spans and put back); a function
    that zeroes masks leaves those tokens out while the per-sample denominators stay; a bad return names the
    flag; and the flag is refused where it would do nothing."""
    from types import SimpleNamespace

    from engine.config import RunConfig
    from engine.diagnosis import ConfigError
    from engine.rollout.hooks import HookError

    b = _batch(seed=5)
    resp = [n - 1 for n in b["lens"]]  # every sample has a one-token prompt
    spec = LossSpec(use_tis=True, tis_clip=1.5, tis_clip_low=0.2)
    args = SimpleNamespace(tis_clip=1.5, tis_clip_low=0.2)

    def run(tis):
        lp = b["lp"].clone().requires_grad_(True)
        mask = b["mask"].clone()
        for a in b["cu"][:-1].tolist():
            mask[a] = 0  # the prompt token
        loss, stats, _ = policy_objective(spec, log_probs=lp, entropy=b["ent"], old_log_probs=b["old"],
                                          ref_log_probs=None, rollout_log_probs=b["rollout"], advantages=b["adv"],
                                          loss_mask=mask, cu_seqlens=b["cu"], denominator=6.0, tis=tis,
                                          response_lengths=resp)
        loss.backward()
        return loss.detach(), lp.grad, stats, mask

    built_in, g_built_in, s_built_in, mask = run(None)
    custom, g_custom, s_custom, _ = run((_slime_vanilla_tis, "tests/test_objective.py:_slime_vanilla_tis", args))
    torch.testing.assert_close(custom, built_in, rtol=0, atol=1e-7)
    torch.testing.assert_close(g_custom, g_built_in, rtol=0, atol=1e-7)
    assert float(s_custom["tis_clipfrac"]) == float(s_built_in["tis_clipfrac"]) > 0
    ratio = torch.exp(b["old"] - b["rollout"])
    assert float(s_custom["tis"]) == pytest.approx(float((ratio * mask).sum()), rel=1e-6)

    rejected, g_rej, s_rej, _ = run((_reject_long_ratio, "tests/test_objective.py:_reject_long_ratio", args))
    kept = torch.zeros_like(mask)
    for e, r in zip(b["cu"][1:].tolist(), resp):
        kept[e - r:e - r + r // 2] = 1
    assert g_rej[(kept == 0) & (mask > 0)].abs().sum() == 0 and g_rej[(kept > 0) & (mask > 0)].abs().sum() > 0
    assert float(s_rej["tis_kept"]) == float((kept * mask).sum())  # a key not starting with tis gets the prefix
    # the denominators are the original masks' (slime: rejected tokens zeroed, per-rollout totals kept)
    pg_only = LossSpec(use_tis=False)
    lp = b["lp"].clone().requires_grad_(True)
    ref_loss, _, _ = policy_objective(pg_only, log_probs=lp, entropy=b["ent"], old_log_probs=b["old"],
                                      ref_log_probs=None, rollout_log_probs=b["rollout"],
                                      advantages=b["adv"] * kept, loss_mask=mask, cu_seqlens=b["cu"], denominator=6.0)
    torch.testing.assert_close(rejected, ref_loss.detach(), rtol=0, atol=1e-7)

    with pytest.raises(HookError, match="--custom-tis-function-path"):
        run((lambda args, **kw: kw["pg_loss"], "m:f", args))
    with pytest.raises(HookError, match="must cover the"):
        run((lambda args, **kw: (kw["pg_loss"][:3], kw["loss_masks"], {}), "m:f", args))
    with pytest.raises(ConfigError, match="without --use-tis or --get-mismatch-metrics it would do nothing"):
        RunConfig(custom_tis_function_path="examples/hooks.py:icepop")
    assert RunConfig(use_tis=True, custom_tis_function_path="examples/hooks.py:icepop").custom_tis_function_path


def test_a_custom_pg_loss_reducer_aggregates_the_policy_term_alone_and_dr_grpo_is_length_unbiased():
    """--custom-pg-loss-reducer-function-path (slime's contract): examples/hooks.py's Dr.GRPO reducer gives
    (1/G) Σ_i Σ_t pg_it / C for the policy term while entropy and KL keep the per-sample mean; the step loss and
    its gradient are the same for any split into micro-batches; a reducer reproducing the default gives the
    default bit for bit; a broken one is a HookError naming the flag; other loss types refuse the flag."""
    from engine.algorithms import StepHooks, step_objective
    from engine.algorithms.losses import policy_loss
    from engine.algorithms.packed import per_sample_mean
    from engine.config import RunConfig
    from engine.diagnosis import ConfigError
    from engine.rollout.hooks import HookError
    from examples.hooks import DR_GRPO_DIVISOR, dr_grpo_reducer

    b = _batch(seed=9)
    resp = [n - 1 for n in b["lens"]]  # a one-token prompt each
    mask = b["mask"].clone()
    for a in b["cu"][:-1].tolist():
        mask[a] = 0
    spec = LossSpec(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    G = len(b["lens"])

    def run(reducer, samples=None, spec=spec, denom=float(G)):
        part = _slice(b, samples) if samples else {**b, "cu": b["cu"]}
        lens = [resp[i] for i in samples] if samples else resp
        lp = part["lp"].clone().requires_grad_(True)
        m = mask[int(b["cu"][samples[0]]):int(b["cu"][samples[-1] + 1])] if samples else mask
        loss, _, _ = step_objective(spec, hooks=StepHooks(pg_reducer=reducer), sample_ids=list(range(len(lens))),
                                    log_probs=lp, entropy=part["ent"], old_log_probs=part["old"],
                                    ref_log_probs=part["ref"], rollout_log_probs=part["rollout"],
                                    advantages=part["adv"], loss_mask=m, cu_seqlens=part["cu"], denominator=denom,
                                    response_lengths=lens)
        loss.backward()
        return loss.detach(), lp.grad

    dr = (dr_grpo_reducer, "examples/hooks.py:dr_grpo_reducer", None)
    whole, g_whole = run(dr)
    # closed form: the pg term summed per sample over C, the rest the default per-sample mean, all over G
    pg, _ = policy_loss(b["lp"], b["old"], b["adv"], eps_clip=0.2)
    default, _ = run(None)
    rest = default - float(per_sample_mean(pg, mask, b["cu"]).sum()) / G
    expected = float(torch.zeros(G).index_add(0, torch.repeat_interleave(torch.arange(G), torch.tensor(b["lens"])),
                                              pg * mask).sum()) / DR_GRPO_DIVISOR / G + rest
    # float32 sums in another order, and `rest` a difference of two such sums: ~1e-6 apart on some CPUs
    assert float(whole) == pytest.approx(float(expected), rel=1e-5)
    assert float(whole) != pytest.approx(float(default), rel=1e-3)  # it is not the default
    # any split into micro-batches sums to the whole, gradients included
    parts = [run(dr, s) for s in ([0, 1], [2], [3, 4, 5])]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), rel=1e-6)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), g_whole, rtol=1e-6, atol=1e-7)

    def same_as_default(total_lengths, response_lengths, loss_masks, per_token):
        assert total_lengths == b["lens"] and response_lengths == resp and per_token is False
        return lambda x: sum((xi * mi).sum() / mi.sum().clamp(min=1)
                             for xi, mi in zip(x.split(response_lengths), loss_masks))

    again, g_again = run((same_as_default, "t:f", None))
    _, g_default = run(None)
    torch.testing.assert_close(again, default, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_again, g_default, rtol=1e-6, atol=1e-8)

    with pytest.raises(HookError, match="--custom-pg-loss-reducer-function-path.*expected a reducer"):
        run((lambda *a: 3.0, "t:f", None))
    with pytest.raises(HookError, match="without a gradient"):
        run((lambda *a: (lambda x: torch.tensor(float(x.detach().sum()))), "t:f", None))
    with pytest.raises(HookError, match="expected a scalar tensor"):
        run((lambda *a: (lambda x: x), "t:f", None))
    with pytest.raises(ConfigError, match="--loss-type sft_loss does not compute"):
        RunConfig(loss_type="sft_loss", custom_pg_loss_reducer_function_path="examples/hooks.py:dr_grpo_reducer")
