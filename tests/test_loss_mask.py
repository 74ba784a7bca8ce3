"""The per-token loss mask of multi-turn samples (engine/rollout/hooks.py): tokens that came from a tool or the
environment carry no loss and get no gradient; a multi-turn sample packed with others gives the same loss as
alone; per-token and per-sample aggregation count only the model's tokens. On the torch backend's packed forward
of the bundled model; the Megatron backend calls the same `policy_objective` with the same `loss_mask` (GPU only)."""
from __future__ import annotations

import pytest
import torch

from engine.algorithms.objective import LossSpec, policy_objective
from engine.packing.microbatch import make_micro_batch
from engine.samples import Sample, Status
from engine.train.forward import packed_forward


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model).float()


def sample(index: int, prompt: list[int], turns: list[tuple[list[int], int]]) -> Sample:
    """turns: (tokens, mask) in order — mask 1 for the model's turns, 0 for a tool's output."""
    resp = [t for toks, _ in turns for t in toks]
    mask = [m for toks, m in turns for _ in toks]
    g = torch.Generator().manual_seed(index)
    return Sample(index=index, group_index=0, rollout_id=0, prompt="p", tokens=prompt + resp,
                  response_length=len(resp), loss_mask=mask,
                  rollout_log_probs=(-torch.rand(len(resp), generator=g)).tolist(), status=Status.COMPLETED)


MULTI = sample(0, [60, 51, 43, 52, 61], [([60, 99, 97], 1), ([62, 55, 60, 47, 62], 0), ([55, 258], 1)])
OTHERS = [sample(1, [49, 43, 49, 61], [([50, 258], 1)]), sample(2, [57, 43, 57, 61, 32], [([49, 56, 258], 1)])]
SPECS = [LossSpec(), LossSpec(policy_loss="gspo"), LossSpec(policy_loss="cispo"),
         LossSpec(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, use_tis=True, tis_clip=2.0),
         LossSpec(per_token_loss=True)]


def objective(model, samples, advantages, spec, denominator, *, perturb=False):
    mb = make_micro_batch(samples, advantages)
    lp, ent = packed_forward(model, mb)
    lp.retain_grad()
    with torch.no_grad():
        old = lp.detach() + 0.05 * torch.sin(mb.position_ids.float())  # ratio ≠ 1, by position in the sample
        ref = lp.detach() - 0.1
    rollout_lp, adv = mb.rollout_log_probs.clone(), mb.advantages.clone()
    if perturb:  # garbage where the mask is 0: must change nothing
        off = mb.loss_mask == 0
        rollout_lp[off], adv[off], old[off], ref[off] = 7.0, -13.0, 3.0, -9.0
    loss, _, per_sample = policy_objective(spec, log_probs=lp, entropy=ent, old_log_probs=old, ref_log_probs=ref,
                                           rollout_log_probs=rollout_lp, advantages=adv, loss_mask=mb.loss_mask,
                                           cu_seqlens=mb.cu_seqlens, denominator=denominator)
    return mb, lp, loss, per_sample


@pytest.mark.parametrize("spec", SPECS, ids=["ppo", "gspo", "cispo", "tis+kl+entropy", "per-token"])
def test_tool_tokens_get_no_gradient(model, spec):
    model.zero_grad()
    mb, lp, loss, _ = objective(model, [MULTI], [0.7], spec, denominator=1.0)
    loss.backward()
    tool = torch.zeros(mb.num_tokens, dtype=torch.bool)
    P = MULTI.prompt_length
    tool[P + 3:P + 8] = True  # the tool's five tokens
    assert torch.equal(mb.loss_mask[tool], torch.zeros(5))
    assert float(lp.grad[tool].abs().sum()) == 0.0  # nothing flows from predicting a tool token
    assert float(lp.grad[mb.loss_mask.bool()].abs().sum()) > 0  # the model's tokens do get a gradient
    grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()  # whatever sits under the tool tokens (advantages, old / ref / engine log-probs) is ignored
    _, _, loss2, _ = objective(model, [MULTI], [0.7], spec, denominator=1.0, perturb=True)
    loss2.backward()
    assert torch.equal(loss, loss2)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


@pytest.mark.parametrize("spec", SPECS, ids=["ppo", "gspo", "cispo", "tis+kl+entropy", "per-token"])
def test_a_multi_turn_sample_packed_with_others_has_the_loss_it_has_alone(model, spec):
    _, _, _, alone = objective(model, [MULTI], [0.7], spec, denominator=3.0)
    _, _, _, packed = objective(model, [OTHERS[0], MULTI, OTHERS[1]], [-0.2, 0.7, 1.1], spec, denominator=3.0)
    torch.testing.assert_close(packed[1], alone[0], atol=1e-6, rtol=1e-6)

    model.zero_grad()  # and the batch's gradient is the sum of the samples' own
    _, _, loss, _ = objective(model, [OTHERS[0], MULTI, OTHERS[1]], [-0.2, 0.7, 1.1], spec, denominator=3.0)
    loss.backward()
    together = [p.grad.clone() for p in model.parameters()]
    parts = [torch.zeros_like(p) for p in model.parameters()]
    for s, a in zip([OTHERS[0], MULTI, OTHERS[1]], [-0.2, 0.7, 1.1]):
        model.zero_grad()
        objective(model, [s], [a], spec, denominator=3.0)[2].backward()
        parts = [x + p.grad for x, p in zip(parts, model.parameters())]
    for a, b in zip(together, parts):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-3)  # float32 sums in another order


def test_aggregation_counts_only_the_models_tokens(model):
    """Closed form: with old = current log-probs (ratio 1) and no other terms, the token loss is −A on the model's
    tokens. Per sample: the mean over the model's 5 tokens is −A whatever the tool's 5 tokens; per token: the
    step's denominator is the model's tokens (what the train worker sums: Σ loss_mask)."""
    mb = make_micro_batch([MULTI], [2.0])
    lp, ent = packed_forward(model, mb)
    m = mb.loss_mask
    assert int(m.sum()) == 5 and MULTI.response_length == 10
    args = dict(log_probs=lp, entropy=ent, old_log_probs=lp.detach(), ref_log_probs=None,
                rollout_log_probs=mb.rollout_log_probs, advantages=mb.advantages, loss_mask=m,
                cu_seqlens=mb.cu_seqlens)
    loss, stats, per_sample = policy_objective(LossSpec(), denominator=1.0, **args)
    assert float(per_sample[0].detach()) == pytest.approx(-2.0) and float(loss.detach()) == pytest.approx(-2.0)
    assert float(stats["tokens"]) == 5
    loss, _, _ = policy_objective(LossSpec(per_token_loss=True), denominator=float(m.sum()), **args)
    assert float(loss.detach()) == pytest.approx(-2.0)  # Σ over 5 model tokens of −2, divided by 5 (not by 10)
