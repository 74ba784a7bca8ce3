"""The update is the same for DP = 1, 2, 4: real Ray train workers, FSDP2 over one gloo group for DP > 1 (NCCL on
GPUs: the same code), the same global batch.

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
        per_rank_params = group._all(lambda w: w.parameters)
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


def test_sharded_checkpoint_is_layout_free_and_the_sync_gathers_full_weights(ray_cluster, small_cfg, tmp_path):
    """DP = 2 (FSDP2 shards the weights and Adam's state): a checkpoint holds full tensors, so DP = 1 resumes it
    exactly, and the weights handed to the engines are the full ones (every rank joins the gather)."""
    import ray

    from engine.cluster import TrainGroup
    from engine.packing.microbatch import make_micro_batch
    from engine.packing.schedule import build_dp_schedule

    samples = fake_samples(LENGTHS, n=4, seed=3)
    base = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16, micro_batch_size=2, lr=1e-3,
                logprob_mismatch_threshold=1e3)
    cfg2 = small_cfg(actor_num_gpus_per_node=2, **base)
    (step,) = build_dp_schedule([len(s.tokens) for s in samples], dp_size=2, global_batch_size=16, micro_batch_size=2)
    per_rank = [[[make_micro_batch([samples[i] for i in mb], [0.0] * len(mb)) for mb in step.ranks[r]]]
                for r in range(2)]
    two = TrainGroup(cfg2, train_iters=2, timeout_s=600, threads=1)
    try:
        two.set_rollout(per_rank, [s.scalar_reward for s in samples], need_ref=False)
        two.train_step(0, 16)
        trained = two._all(lambda w: w.parameters)[0]
        ref, mb = two.weights_ref()
        synced = ray.get(ref).tensors()
        files = two.save(str(tmp_path / "ck"))
    finally:
        two.shutdown()
    assert "optim/state.pt" in files and mb > 1.0
    assert all(torch.equal(synced[k], trained[k]) for k in synced)  # full tensors, not rank 0's shards

    one = TrainGroup(small_cfg(**base), train_iters=2, timeout_s=600, threads=1)
    try:
        one.load(str(tmp_path / "ck"))
        resumed = one._all(lambda w: w.parameters)[0]
        exp_avg = ray.get(one.workers[0].__ray_call__.remote(
            lambda w: sorted(v["exp_avg"].abs().sum().item() for v in w.backend.optimizer.state.values())))
        one.save(str(tmp_path / "ck1"))  # DP = 1 writes the unsharded format ...
    finally:
        one.shutdown()
    assert all(torch.equal(resumed[k], trained[k]) for k in trained)
    assert len(exp_avg) > 0 and all(v > 0 for v in exp_avg)  # Adam's state came back, unsharded

    again = TrainGroup(cfg2, train_iters=2, timeout_s=600, threads=1)
    try:  # ... and DP = 2 shards it again
        again.load(str(tmp_path / "ck1"))
        assert all(torch.equal(v, trained[k]) for k, v in again._all(lambda w: w.parameters)[1].items())
        sharded = ray.get([w.__ray_call__.remote(lambda w: sorted(  # full_tensor: a collective, on both ranks
            v["exp_avg"].full_tensor().abs().sum().item() for v in w.backend.optimizer.state.values()))
            for w in again.workers])[0]
    finally:
        again.shutdown()
    assert sharded == pytest.approx(exp_avg, rel=1e-6)


def test_bf16_with_fp32_masters_is_the_same_step_sharded_or_not(ray_cluster, small_cfg):
    """--bf16: DP = 1 keeps fp32 masters itself (Fp32Masters), DP = 2 lets FSDP2 cast its fp32 shards to bf16
    (MixedPrecisionPolicy). Same weights in, the same update out — up to bf16 rounding: the two layouts pack other
    micro-batches, so bf16 products round differently, and a gradient entry that is ~0 (cancelling terms) can flip
    the sign of Adam's first step (≈ ±lr). A wrong scale (a mean instead of a sum) would move the grad norm 2×."""
    samples = fake_samples(LENGTHS, n=4, seed=11)
    base = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16, micro_batch_size=2, lr=1e-4,
                clip_grad=0.0, bf16=True, logprob_mismatch_threshold=1e3)
    one, two = (one_step(small_cfg(actor_num_gpus_per_node=dp, **base), samples) for dp in (1, 2))
    a, b = one["params"][0], two["params"][0]
    assert all(v.dtype == torch.float32 for v in list(a.values()) + list(b.values()))  # the masters, both ways
    same = sum(int(((b[k] - a[k]).abs() <= 1e-6).sum()) for k in a) / sum(v.numel() for v in a.values())
    print(f"bf16 DP=2 vs DP=1: {same:.4%} of weights within 1e-6, grad norm {two['grad_norm']:.6g} vs "
          f"{one['grad_norm']:.6g}, loss {two['loss']:.6g} vs {one['loss']:.6g}")
    assert same > 0.99
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-2)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-2, abs=1e-4)


def test_frozen_parameters_stay_put_sharded_or_not(ray_cluster, small_cfg):
    """--freeze-params-name-list under FSDP2 (DP = 2): the frozen tensors keep their initial values on every rank
    and the trained ones match DP = 1."""
    samples = fake_samples(LENGTHS, n=4, seed=5)
    base = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16, micro_batch_size=2, lr=1e-4,
                clip_grad=0.0, weight_decay=0.1, freeze_params_name_list=["embed_tokens", r"layers\.1\."])
    results = {dp: one_step(small_cfg(actor_num_gpus_per_node=dp, **base), samples) for dp in (1, 2)}

    from engine.modeling import load_causal_lm

    initial = {k: v.detach() for k, v in load_causal_lm(small_cfg().hf_checkpoint).named_parameters()}
    frozen = [k for k in initial if "embed_tokens" in k or ".layers.1." in k]
    assert frozen
    for dp, r in results.items():
        for rank_params in r["params"]:
            assert all(torch.equal(rank_params[k], initial[k]) for k in frozen), dp
        assert any(not torch.equal(r["params"][0][k], initial[k]) for k in initial if k not in frozen), dp
    diff = max(float((results[2]["params"][0][k] - results[1]["params"][0][k]).abs().max()) for k in initial)
    assert diff <= 1e-6, diff


def test_log_probs_chunk_size_under_fsdp2_takes_the_dp_1_step(ray_cluster, small_cfg):
    """--log-probs-chunk-size 3 with DP = 2: the chunks run inside the root module's forward, where FSDP2 has
    gathered the (tied) head's weight, and their recomputation in the backward reaches it too: the same step as
    DP = 1 without chunks."""
    samples = fake_samples(LENGTHS, n=4, seed=9)
    base = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16, micro_batch_size=2, lr=1e-4,
                clip_grad=0.0, entropy_coef=0.01)
    plain = one_step(small_cfg(actor_num_gpus_per_node=1, **base), samples)
    chunked = one_step(small_cfg(actor_num_gpus_per_node=2, log_probs_chunk_size=3, **base), samples)
    assert all(torch.equal(chunked["params"][1][k], chunked["params"][0][k]) for k in chunked["params"][0])
    # Adam's first step is ≈ lr·sign(g) (module docstring): a gradient at rounding level (~1e-8) may flip sign
    # between the two summation orders (measured: 9 of 821,760 entries); a head gradient lost under FSDP2 would
    # move the whole tied embedding and the grad norm
    d = torch.cat([(chunked["params"][0][k] - plain["params"][0][k]).abs().flatten() for k in plain["params"][0]])
    assert float(d.max()) <= 2e-4 and int((d > 1e-6).sum()) <= 1e-4 * d.numel()
    assert chunked["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)


def test_stateless_adam_under_fsdp2_takes_the_dp_1_step(ray_cluster, small_cfg):
    """--use-stateless-adam with DP = 2: the update runs on each rank's FSDP2 shards (DTensors) and keeps no state;
    the same step as DP = 1."""
    samples = fake_samples(LENGTHS, n=4, seed=9)
    base = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16, micro_batch_size=2, lr=1e-4,
                clip_grad=1.0, weight_decay=0.1, use_stateless_adam=True)
    one, two = (one_step(small_cfg(actor_num_gpus_per_node=n, **base), samples) for n in (1, 2))
    assert all(torch.equal(two["params"][1][k], two["params"][0][k]) for k in two["params"][0])
    # the update is lr·g/(|g| + ε): a gradient at rounding level may flip sign between the two summation orders
    # (module docstring); a shard updated twice or not at all would move a whole tensor
    d = torch.cat([(two["params"][0][k] - one["params"][0][k]).abs().flatten() for k in one["params"][0]])
    assert float(d.max()) <= 2e-4 and int((d > 1e-6).sum()) <= 1e-4 * d.numel()
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)


def test_train_env_vars_reach_every_train_rank_before_torch(ray_cluster, small_cfg):
    """--train-env-vars: each rank's process has them (set by Ray when it starts the process) and reports them for
    the summary's placement, a secret-looking one redacted; the run's thread settings stay rollflow's."""
    from engine.cluster import TrainGroup

    cfg = small_cfg(actor_num_gpus_per_node=2, train_env_vars={"ROLLFLOW_TEST_MARK": "on", "HF_TOKEN": "hf_x",
                                                               "TORCH_SHOW_CPP_STACKTRACES": 1})
    group = TrainGroup(cfg, train_iters=1, timeout_s=600, threads=1)
    try:
        assert [n["env"] for n in group.nodes] == [{"ROLLFLOW_TEST_MARK": "on", "HF_TOKEN": "<redacted>",
                                                    "TORCH_SHOW_CPP_STACKTRACES": "1"}] * 2
        assert len({n["pid"] for n in group.nodes}) == 2
    finally:
        group.shutdown()
