"""--log-probs-max-tokens-per-gpu: the no-grad forwards before the steps run over the samples re-packed under their
own token cap, and every micro-batch of the step gets the same per-token results back."""
from __future__ import annotations

import pytest
import torch
from train_fakes import fake_samples, pack

from engine.config import RunConfig
from engine.config.data import BUNDLED_MODEL
from engine.diagnosis import ConfigError
from engine.packing.microbatch import make_micro_batch, regroup, split_like

# 8 samples in groups of 4, of 5 to 12 tokens; the step's micro-batches hold 2 samples each
LENGTHS = [(4, 3), (4, 5), (6, 2), (6, 6), (3, 4), (3, 7), (5, 3), (5, 5)]


def _worker(**over):
    from engine.train.worker import TrainWorker

    cfg = RunConfig(hf_checkpoint=BUNDLED_MODEL, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8,
                    use_dynamic_batch_size=True, max_tokens_per_gpu=24, kl_coef=0.1, advantage_estimator="ppo",
                    **over)
    return TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=2, threads=1)


def _set_rollout(**over):
    """The worker after set_rollout, with the token counts of every micro-batch each no-grad forward ran."""
    torch.manual_seed(0)
    w = _worker(**over)
    calls: list[tuple[str, list[int]]] = []
    policy, values = w.backend.compute_log_probs, w.critic.compute_values

    def log_probs(mbs, **kw):
        calls.append(("ref" if kw.get("ref") else "policy", [mb.num_tokens for mb in mbs]))
        return policy(mbs, **kw)

    def critic(mbs):
        calls.append(("values", [mb.num_tokens for mb in mbs]))
        return values(mbs)

    w.backend.compute_log_probs, w.critic.compute_values = log_probs, critic
    samples = fake_samples(LENGTHS, n=4, seed=3)
    steps = [pack(samples, [[0, 1], [2, 3], [4, 5], [6, 7]])]
    w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=True)
    return w, calls


def test_the_no_grad_forwards_run_under_their_own_cap_with_the_same_results():
    base, base_calls = _set_rollout()
    # without the flag: the step's 4 micro-batches of 16, 20, 17, 18 tokens, for each of the three forwards
    assert base_calls == [(kind, [16, 20, 17, 18]) for kind in ("policy", "ref", "values")]
    # samples of 7, 9, 8, 12, 7, 10, 8, 10 tokens, packed in order: all in one, two, or one each (9, 12 and 10 alone
    # above the cap of 8)
    for cap, expect in ((80, [71]), (40, [36, 35]), (8, [7, 9, 8, 12, 7, 10, 8, 10])):
        w, calls = _set_rollout(log_probs_max_tokens_per_gpu=cap)
        assert calls == [(kind, expect) for kind in ("policy", "ref", "values")], cap
        for name in ("old", "ref", "values"):
            got, want = getattr(w, name), getattr(base, name)
            for g, b, mb in zip(got[0], want[0], base.steps[0]):
                assert g.shape == (mb.num_tokens,)
                torch.testing.assert_close(g, b, atol=1e-5, rtol=1e-5)
        # the advantages (GAE from these values, rewards and the KL term) are the same
        for mb, ref_mb in zip(w.steps[0], base.steps[0]):
            torch.testing.assert_close(mb.advantages, ref_mb.advantages, atol=1e-5, rtol=1e-5)
        assert w.train_step(0, 8)["grad_norm"] == pytest.approx(base.train_step(0, 8)["grad_norm"], rel=1e-4)
        base, _ = _set_rollout()  # a fresh baseline: train_step changed its weights


def test_regroup_keeps_the_token_order_and_padding_and_split_like_undoes_it():
    samples = fake_samples([(3, 2), (2, 2), (4, 1)], n=3)
    mbs = [make_micro_batch(samples[:2], [0.0, 0.0], pad_to_multiple=8), make_micro_batch(samples[2:], [0.0])]
    assert [mb.num_tokens for mb in mbs] == [16, 5]  # 5 + 4 tokens padded by a 7-token segment, then 5
    merged = regroup(mbs, 12)
    assert [mb.cu_seqlens.tolist() for mb in merged] == [[0, 5, 9], [0, 7, 12]]  # the pad segment stays one
    assert [mb.sample_ids for mb in merged] == [[0, 1], [2]]
    assert torch.equal(torch.cat([mb.tokens for mb in merged]), torch.cat([mb.tokens for mb in mbs]))
    assert torch.equal(torch.cat([mb.position_ids for mb in merged]), torch.cat([mb.position_ids for mb in mbs]))
    back = split_like([mb.loss_mask for mb in merged], mbs)
    assert [torch.equal(b, mb.loss_mask) for b, mb in zip(back, mbs)] == [True, True]
    with pytest.raises(ValueError, match="per-token results"):
        split_like([merged[0].loss_mask], mbs)


def test_the_flag_needs_dynamic_batching():
    with pytest.raises(ConfigError, match="--use-dynamic-batch-size") as e:
        RunConfig(log_probs_max_tokens_per_gpu=4096)
    (d,) = e.value.diagnoses
    assert d.facts["field"] == "log_probs_max_tokens_per_gpu" and d.facts["value"] == 4096
    assert RunConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=512,
                     log_probs_max_tokens_per_gpu=4096).log_probs_max_tokens_per_gpu == 4096
