"""The update is the same for DP = 1, 2, 4: real Ray train workers in one gloo group, the same global batch.

Adam's first step is ≈ lr·sign(g), which would hide a gradient off by a constant factor (e.g. dividing by the
local instead of the global batch): the grad norm and the loss are compared too, and they would show it.
lr = 1e-4: Adam's g/(|g| + 1e-8) amplifies the summation-order rounding of gradients that are ~1e-8 (sums of
cancelling terms); at lr = 1e-3 that gave a 1.8e-6 parameter difference (measured), at 1e-4 it is 10× smaller,
while a wrong sign or a missing sample still moves a parameter by ~2·lr = 2e-4.
"""
from __future__ import annotations

import pytest
import torch
from train_fakes import fake_samples

pytestmark = pytest.mark.slow

# 4 prompts × 4 samples with varied lengths, so each DP layout packs differently
LENGTHS = [(5, 9), (7, 3), (4, 12), (9, 6), (3, 4), (8, 10), (6, 2), (5, 7),
           (7, 11), (4, 5), (6, 8), (9, 3), (3, 9), (5, 6), (8, 4), (6, 13)]


@pytest.fixture(scope="module")
def ray_cluster():
    from engine import cluster

    cluster.connect(None, num_cpus=2)
    yield
    cluster.shutdown()


def one_step(cfg, samples) -> dict:
    """Schedule + pack for cfg's DP size, set_rollout and one optimizer step on real workers."""
    from engine.cluster import TrainGroup
    from engine.packing.microbatch import make_micro_batch
    from engine.packing.schedule import build_dp_schedule
    from engine.train.backend import reduce_metrics

    dp = cfg.dp_size
    (step,) = build_dp_schedule([len(s.tokens) for s in samples], dp_size=dp, global_batch_size=16,
                                micro_batch_size=cfg.micro_batch_size)
    per_rank = [[[make_micro_batch([samples[i] for i in mb], [0.0] * len(mb)) for mb in step.ranks[r]]]
                for r in range(dp)]
    group = TrainGroup(cfg, train_iters=1, timeout_s=600, threads=1)
    try:
        group.set_rollout(per_rank, [s.scalar_reward for s in samples], need_ref=True)
        parts = group.train_step(0, 16)
        per_rank_params = group._all("parameters")
    finally:
        group.shutdown()
    m = reduce_metrics(parts)
    return {"loss": sum(p["loss_total"] for p in parts), "grad_norm": m["grad_norm"],
            "critic_grad_norm": m.get("critic_grad_norm"), "pg_loss": m["pg_loss"], "params": per_rank_params}


# one configuration that exercises every cross-rank path: the policy's and the critic's gradient all-reduce,
# advantage whitening over all ranks, KL loss + shaping, entropy, TIS (per-token aggregation: test_objective.py)
CONFIG = dict(advantage_estimator="ppo", kl_coef=0.05, gamma=0.99, lambd=0.95, normalize_advantages=True,
              use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True)


def test_one_step_is_the_same_for_dp_1_2_4(ray_cluster, small_cfg):
    samples = fake_samples(LENGTHS, n=4, seed=7)
    base = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16, micro_batch_size=2, lr=1e-4,
                clip_grad=0.0, **CONFIG)
    results = {dp: one_step(small_cfg(actor_num_gpus_per_node=dp, **base), samples) for dp in (1, 2, 4)}

    from engine.modeling import load_causal_lm

    initial = {k: v.detach() for k, v in load_causal_lm(small_cfg().hf_checkpoint).named_parameters()}
    ref = results[1]
    moved = max(float((ref["params"][0][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 5e-5  # the step did something (Adam's first step moves a parameter by up to lr = 1e-4)
    for dp in (2, 4):
        r = results[dp]
        # every rank of a DP group holds the same weights after the step
        for other in r["params"][1:]:
            assert all(torch.equal(other[k], r["params"][0][k]) for k in other)
        diff = max(float((r["params"][0][k] - ref["params"][0][k]).abs().max()) for k in initial)
        print(f"DP={dp}: max |Δparam| {diff:.3g}, grad norm {r['grad_norm']:.6g} vs {ref['grad_norm']:.6g}, "
              f"loss {r['loss']:.6g} vs {ref['loss']:.6g}")
        assert diff <= 1e-6, f"DP={dp}: parameters differ from DP=1 by {diff:.3g}"
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), dp
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), dp
        assert r["pg_loss"] == pytest.approx(ref["pg_loss"], rel=1e-5, abs=1e-7), dp
        if ref["critic_grad_norm"] is not None:
            assert r["critic_grad_norm"] == pytest.approx(ref["critic_grad_norm"], rel=1e-5), dp
