"""The torch backend and the train stage in one process (no Ray): updates, LR, clipping, RF01 / RF09 / RF13."""
from __future__ import annotations

import math

import pytest
import torch
from train_fakes import fake_samples, pack

from engine.config import RunConfig
from engine.diagnosis import ConfigError, DiagnosisError
from engine.train.checks import first_step_check, grad_norm_spike
from engine.train.optim import lr_lambda

LENGTHS = [(6, 5), (4, 9), (8, 3), (5, 7), (7, 6), (3, 4), (9, 8), (6, 2)]  # (prompt, response), 2 groups of 4
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def make_cfg(tiny_model, **over) -> RunConfig:
    base = dict(hf_checkpoint=tiny_model, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8,
                micro_batch_size=2, lr=1e-3, num_rollout=1, train_threads=1)
    return RunConfig(**(base | over))


def make_worker(cfg: RunConfig, train_iters: int = 4):
    from engine.train.worker import TrainWorker

    return TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=train_iters, threads=1)


def one_rollout(rewards=REWARDS, steps=1):
    samples = fake_samples(LENGTHS, n=4, seed=0, rewards=rewards)
    per = 8 // steps
    return [pack(samples, [[i, i + 1] for i in range(k * per, (k + 1) * per, 2)]) for k in range(steps)], rewards


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# ---- pure checks --------------------------------------------------------------------------------------------
def test_lr_schedule_closed_forms():
    # warm-up W = 2 then cosine to min_lr/lr = 0.1 over train_iters = 6 (n = step + 1):
    # n=1 → 1/2; n=2 → 1; n=3 → 0.1 + 0.9·½(1 + cos(π·1/4)) = 0.868198; n=6 → 0.1 (min_lr at the last step)
    f = lambda s: lr_lambda(s, warmup=2, total=6, style="cosine", min_ratio=0.1)  # noqa: E731
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert f(5) == pytest.approx(0.1)
    assert lr_lambda(7, warmup=0, total=6, style="constant", min_ratio=0.0) == 1.0


def test_first_step_check():
    assert first_step_check(ref_logp_maxdiff=0.0, ratio_maxdev=0.0) is None
    d = first_step_check(ref_logp_maxdiff=0.7, ref_source="/ref", policy_source="/pol")
    assert d.code == "RF01" and "0.7" in d.what and "--ref-load" in d.fix
    assert first_step_check(ratio_maxdev=float("nan")).code == "RF01"  # NaN is a failure, not a pass


def test_grad_norm_spike():
    # median of [1, 2, 1, 1, 3] = 1: 12 > 10·1 → spike; 9 is not; with fewer than 5 steps nothing is judged
    assert grad_norm_spike([1, 2, 1, 1, 3], 12.0) == 1.0
    assert grad_norm_spike([1, 2, 1, 1, 3], 9.0) is None
    assert grad_norm_spike([1, 1, 1, 1], 1000.0) is None


# ---- the backend ----------------------------------------------------------------------------------------------
def test_every_parameter_changes_after_one_step_and_the_reference_does_not(tiny_model):
    w = make_worker(make_cfg(tiny_model, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01))
    before = params(w.backend.model)
    steps, rewards = one_rollout()
    facts = w.set_rollout(steps, rewards, need_ref=True)
    assert facts["ref_logp_maxdiff"] == 0.0  # policy == reference before the first update
    ref_before = params(w.backend.ref)
    out = w.train_step(0, 8)
    assert out["ratio_maxdev"] == 0.0 and out["skipped"] == 0.0
    after = params(w.backend.model)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == [], f"parameters that did not change: {unchanged}"
    assert all(torch.equal(ref_before[k], v) for k, v in params(w.backend.ref).items())
    # the KL metric is 0 before any update; after the update the policy moved away from the reference
    w.set_rollout(steps, rewards, need_ref=True)
    assert w.train_step(0, 8)["kl_sum"] > 0


def test_clip_grad_bounds_the_gradient_and_reports_the_norm_before_clipping(tiny_model):
    w = make_worker(make_cfg(tiny_model, clip_grad=1e-3))
    steps, rewards = one_rollout()
    w.set_rollout(steps, rewards, need_ref=False)
    out = w.train_step(0, 8)
    clipped = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in w.backend.model.parameters()))
    assert out["grad_norm"] > 1e-2  # the raw norm is reported…
    assert float(clipped) == pytest.approx(1e-3, rel=1e-4)  # …and the gradient the optimizer used was clipped


def test_lr_follows_warmup_across_steps(tiny_model):
    w = make_worker(make_cfg(tiny_model, lr_warmup_iters=2, lr_decay_style="cosine", min_lr=1e-4), train_iters=4)
    steps, rewards = one_rollout(steps=2)  # k = 2 steps of G = 4; cfg G = 8 is not used by the worker
    w.set_rollout(steps, rewards, need_ref=False)
    lrs = [w.train_step(k, 4)["lr"] for k in range(2)]
    assert lrs == pytest.approx([5e-4, 1e-3])  # lr·1/2, lr·2/2
    # Megatron-LM's --lr-warmup-fraction: 0.25 of the 8 steps the worker is sized for is the same 2-step warm-up
    w = make_worker(make_cfg(tiny_model, lr_warmup_fraction=0.25), train_iters=8)
    w.set_rollout(*one_rollout(steps=2), need_ref=False)
    assert [w.train_step(k, 4)["lr"] for k in range(2)] == pytest.approx([5e-4, 1e-3])
    with pytest.raises(ConfigError, match="both set the warm-up's length"):
        make_cfg(tiny_model, lr_warmup_fraction=0.25, lr_warmup_iters=2)


def test_nan_step_fails_with_the_culprit_sample(tiny_model):
    w = make_worker(make_cfg(tiny_model, advantage_estimator="reinforce_plus_plus"))
    rewards = list(REWARDS)
    rewards[5] = float("nan")  # sample 5's own reward: REINFORCE++ has no group coupling
    steps, _ = one_rollout()
    w.set_rollout(steps, rewards, need_ref=False)
    with pytest.raises(DiagnosisError) as e:
        w.train_step(0, 8)
    (d,) = e.value.diagnoses
    assert d.code == "RF13" and d.facts["bad_sample_ids"] == [5]
    assert "--no-check-for-nan-in-loss-and-grad" in d.fix


def test_nan_step_is_skipped_and_counted_with_the_flag(tiny_model):
    w = make_worker(make_cfg(tiny_model, advantage_estimator="reinforce_plus_plus",
                             check_for_nan_in_loss_and_grad=False, lr_warmup_iters=4), train_iters=4)
    bad = list(REWARDS)
    bad[5] = float("nan")
    steps, _ = one_rollout()
    before = params(w.backend.model)
    w.set_rollout(steps, bad, need_ref=False)
    out = w.train_step(0, 8)
    assert out["skipped"] == 1.0 and out["skipped_steps_total"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in params(w.backend.model).items())  # no update
    w.set_rollout(steps, REWARDS, need_ref=False)
    good = w.train_step(0, 8)
    assert good["skipped"] == 0.0 and good["skipped_steps_total"] == 1.0
    assert good["lr"] == out["lr"] == pytest.approx(1e-3 / 4)  # the skipped step did not advance the schedule


def test_per_token_loss_needs_and_uses_the_global_token_count(tiny_model):
    w = make_worker(make_cfg(tiny_model, calculate_per_token_loss=True))
    steps, rewards = one_rollout()
    w.set_rollout(steps, rewards, need_ref=False)
    trained = sum(float(mb.loss_mask.sum()) for mb in steps[0])
    assert w.step_tokens == [trained]
    out = w.train_step(0, 8)
    # loss = Σ_t ℓ_t / N at ratio 1 → pg = −A; Σ over tokens of −A / N  (advantages are in mb.advantages)
    exp = -sum(float((mb.advantages * mb.loss_mask).sum()) for mb in steps[0]) / trained
    assert out["loss_total"] == pytest.approx(exp, abs=1e-6)


@pytest.mark.parametrize("estimator", ["gspo", "cispo", "reinforce_plus_plus_baseline", "ppo"])
def test_each_estimator_trains(tiny_model, estimator):
    extra = {"kl_coef": 0.05} if estimator in ("ppo", "reinforce_plus_plus_baseline") else {}
    w = make_worker(make_cfg(tiny_model, advantage_estimator=estimator, use_tis=True, **extra))
    before = params(w.backend.model)
    steps, rewards = one_rollout()
    w.set_rollout(steps, rewards, need_ref=True)
    out = w.train_step(0, 8)
    assert math.isfinite(out["loss_total"]) and out["grad_norm"] > 0 and "tis_clipfrac_sum" in out
    assert any(not torch.equal(before[k], v) for k, v in params(w.backend.model).items())
    assert ("value_loss_sum" in out) == (estimator == "ppo")


def test_ppo_critic_starts_at_zero_learns_and_round_trips(tiny_model, tmp_path):
    w = make_worker(make_cfg(tiny_model, advantage_estimator="ppo", lr=3e-3))
    steps, rewards = one_rollout(rewards=[1.0] * 8)  # γ = λ = 1, no KL: every return is 1
    w.set_rollout(steps, rewards, need_ref=True)
    assert all(float(v.abs().max()) == 0.0 for v in w.values[0])  # zero-initialised head → V = 0
    losses = []
    for _ in range(4):
        w.set_rollout(steps, rewards, need_ref=True)
        losses.append(w.train_step(0, 8)["value_loss_sum"])
    # first loss: Σ (0 − 1)² over the 44 trained tokens; value clipping lets V move ~0.2 per rollout
    assert losses[0] == pytest.approx(44.0) and losses[-1] < 0.5 * losses[0]
    files = w.save(str(tmp_path / "ck"))
    assert "critic/model/model.safetensors" in files and "model/model.safetensors" in files
    w2 = make_worker(make_cfg(tiny_model, advantage_estimator="ppo", lr=3e-3))
    w2.load(str(tmp_path / "ck"))
    for a, b in zip(w.critic.model.parameters(), w2.critic.model.parameters()):
        assert torch.equal(a, b)


# ---- the train stage's runtime checks (a hand-written in-process group instead of Ray actors) --------------------
class InProcessGroup:
    def __init__(self, worker):
        self.worker = worker
        self.calls: list[str] = []  # the worker calls the stage made, in order (each a Ray round trip in a run)

    def set_rollout(self, per_rank_steps, rewards, need_ref, normalized=False, old_from="forward", rollout_id=-1,
                    old_version=None):
        self.calls.append("set_rollout")
        return [self.worker.set_rollout(per_rank_steps[0], rewards, need_ref, normalized, old_from, rollout_id,
                                        old_version)]

    def set_rollout_and_step(self, per_rank_steps, rewards, need_ref, normalized, old_from, global_batch_size,
                             rollout_id=-1):
        self.calls.append("set_rollout_and_step")
        facts, out = self.worker.set_rollout_and_step(per_rank_steps[0], rewards, need_ref, normalized, old_from,
                                                      global_batch_size, rollout_id)
        return [facts], None if out is None else [out]

    def train_step(self, k, global_batch_size, policy=True):
        self.calls.append("train_step")
        return [self.worker.train_step(k, global_batch_size, policy)]

    def update_ref(self):
        self.calls.append("update_ref")
        self.worker.update_ref()

    def save_train_data(self, pattern, rollout_id):
        self.calls.append("save_train_data")
        return [self.worker.save_train_data(pattern, rollout_id)]

    def profile_end(self, rollout_id):
        self.calls.append("profile_end")
        return [self.worker.profile_end(rollout_id)]


def stage_run(cfg, worker):
    from engine.run import Run

    run = Run(cfg)
    run.train_group = InProcessGroup(worker)
    return run


def packed_rollout(rollout_id=0):
    from engine.stages import PackedRollout

    steps, rewards = one_rollout()
    return PackedRollout(rollout_id, [steps], {"pack/tokens": float(sum(a + b for a, b in LENGTHS))}, rewards)


def test_train_stage_reports_the_metrics(tiny_model):
    from engine.stages import train

    # the fake engine log-probs are random (|Δ| ≈ 26 from the trainer's): RF14 would stop this run (next test)
    cfg = make_cfg(tiny_model, use_tis=True, logprob_mismatch_threshold=1e3)
    out = train(stage_run(cfg, make_worker(cfg)), packed_rollout())
    for key in ("loss", "pg_loss", "entropy", "kl", "clipfrac", "ratio", "mismatch", "mismatch_max", "grad_norm",
                "grad_norm_max", "lr", "tokens_per_s", "skipped_steps", "tis_clipfrac"):
        assert math.isfinite(out[f"train/{key}"]), key
    assert out["train/kl"] == 0.0 and out["train/ratio"] == pytest.approx(1.0)  # first step: π = π_ref = π_old
    assert 0 < out["train/mismatch"] <= out["train/mismatch_max"]  # fake engine log-probs differ from the trainer's


def test_use_opsm_masks_the_drifted_samples_with_negative_advantages(tiny_model):
    """--use-opsm through the train stage, with --use-rollout-logprobs: the fake engine's log-probs (−3 … 0) are far
    above the trainer's for these random tokens, so every sample has drifted past --opsm-delta, and exactly those
    with a negative advantage leave the loss: samples 1, 2, 4, 5, 6, 30 of the 44 trained tokens."""
    from engine.stages import train

    cfg = make_cfg(tiny_model, use_opsm=True, opsm_delta=0.5, use_rollout_logprobs=True,
                   logprob_mismatch_threshold=1e3)
    out = train(stage_run(cfg, make_worker(cfg)), packed_rollout(rollout_id=1))  # not the run's first step
    assert out["train/opsm_masked"] == pytest.approx(30 / 44)


def test_num_critic_only_steps_fits_the_critic_before_the_policy_moves(tiny_model):
    """slime's --num-critic-only-steps (ppo): rollout 0 trains the critic alone (the policy's weights and LR
    schedule stay, only critic metrics are logged); rollout 1 trains both."""
    from engine.stages import train

    cfg = make_cfg(tiny_model, advantage_estimator="ppo", lr=3e-3, num_critic_only_steps=1, num_rollout=4,
                   logprob_mismatch_threshold=1e3)  # the fake engine log-probs are random
    w = make_worker(cfg)
    run = stage_run(cfg, w)
    policy, critic = params(w.backend.model), params(w.critic.model)
    out = train(run, packed_rollout(0))
    assert out["train/critic_only"] == 1.0 and out["train/value_loss"] > 0 and "train/critic_grad_norm" in out
    assert not {"train/loss", "train/pg_loss", "train/grad_norm"} & set(out), sorted(out)
    assert all(torch.equal(policy[k], v) for k, v in params(w.backend.model).items())
    assert any(not torch.equal(critic[k], v) for k, v in params(w.critic.model).items())
    assert w.backend.scheduler.last_epoch == 0  # the policy's schedule waits too
    out = train(run, packed_rollout(1))
    assert "train/critic_only" not in out and math.isfinite(out["train/loss"]) and "train/value_loss" in out
    assert any(not torch.equal(policy[k], v) for k, v in params(w.backend.model).items())
    with pytest.raises(ConfigError, match="only --advantage-estimator ppo has a critic"):
        make_cfg(tiny_model, num_critic_only_steps=1)
    with pytest.raises(ConfigError, match="the policy would never train"):
        make_cfg(tiny_model, advantage_estimator="ppo", num_critic_only_steps=4, num_rollout=4)


def test_ref_update_interval_moves_the_reference_to_the_policy_and_checkpoints_it(tiny_model, tmp_path):
    """slime's --ref-update-interval 2: after rollout 1 (not 0) the reference is the policy (KL 0 again); the
    checkpoint holds that reference (iter_*/ref/), and a trainer loading it gets the same one."""
    from engine.stages import train

    cfg = make_cfg(tiny_model, use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=2, num_rollout=4,
                   logprob_mismatch_threshold=1e3)  # the fake engine log-probs are random
    w = make_worker(cfg)
    run = stage_run(cfg, w)
    initial = params(w.backend.model)
    out = train(run, packed_rollout(0))
    assert "train/ref_updated" not in out and run.train_group.calls.count("update_ref") == 0
    assert all(torch.equal(initial[k], v) for k, v in params(w.backend.ref).items())
    out = train(run, packed_rollout(1))
    assert out["train/ref_updated"] == 1.0 and out["train/kl"] > 0  # the KL of the step, before the move
    policy, ref = params(w.backend.model), params(w.backend.ref)
    assert all(torch.equal(policy[k], ref[k]) for k in ref) and any(not torch.equal(initial[k], ref[k]) for k in ref)
    steps, rewards = one_rollout()
    assert w.set_rollout(steps, rewards, need_ref=True)["ref_logp_maxdiff"] == 0.0
    files = w.save(str(tmp_path / "ck"))
    assert "ref/model/model.safetensors" in files
    w2 = make_worker(cfg)
    w2.load(str(tmp_path / "ck"))
    assert all(torch.equal(ref[k], v) for k, v in params(w2.backend.ref).items())
    with pytest.raises(ConfigError, match="moves the reference, which nothing reads without a KL term"):
        make_cfg(tiny_model, ref_update_interval=2)


def test_save_debug_train_data_writes_what_each_sample_was_trained_with(tiny_model, tmp_path):
    """slime's --save-debug-train-data: after the rollout's steps, per sample over its response tokens: the
    tokens, loss mask, advantage, old / reference / engine log-probs as the step used them."""
    from engine.stages import train

    pattern = str(tmp_path / "debug" / "train_{rollout_id}_{rank}.pt")
    cfg = make_cfg(tiny_model, use_kl_loss=True, kl_loss_coef=0.1, save_debug_train_data=pattern,
                   logprob_mismatch_threshold=1e3)
    w = make_worker(cfg)
    rollout = packed_rollout(0)
    (steps,) = rollout.per_rank_steps
    train(stage_run(cfg, w), rollout)
    got = torch.load(tmp_path / "debug" / "train_0_0.pt")
    assert sorted(got["sample_ids"]) == list(range(8))
    by_id = dict(zip(got["sample_ids"], range(8)))
    for mb in steps[0]:
        cu = mb.cu_seqlens.tolist()
        for i, sid in enumerate(mb.sample_ids):
            r = got["response_lengths"][by_id[sid]]
            end = cu[i + 1]
            for key, x in (("tokens", mb.tokens), ("loss_masks", mb.loss_mask), ("advantages", mb.advantages),
                           ("rollout_log_probs", mb.rollout_log_probs)):
                assert torch.equal(got[key][by_id[sid]], x[end - r:end]), key
    assert all(x.numel() == r for x, r in zip(got["log_probs"], got["response_lengths"]))
    assert all(x is not None for x in got["ref_log_probs"]) and got["values"] == [None] * 8
    with pytest.raises(ConfigError, match="has no \\{rank\\}: the 2 train ranks would write one file"):
        make_cfg(tiny_model, save_debug_train_data="t_{rollout_id}.pt", actor_num_gpus_per_node=2)
    with pytest.raises(ConfigError, match="'t_\\{rollout_id\\}.pt'"):
        make_cfg(tiny_model, save_debug_train_data="t.pt")


def test_rf14_stops_the_run_before_the_update_when_the_engine_disagrees(tiny_model):
    from engine.stages import train

    cfg = make_cfg(tiny_model)  # default threshold: 1e-3 for fp32 trainer and engine
    w = make_worker(cfg)
    run = stage_run(cfg, w)
    before = params(w.backend.model)
    with pytest.raises(DiagnosisError) as e:
        train(run, packed_rollout())
    (d,) = e.value.diagnoses
    assert d.code == "RF14" and d.facts["threshold"] == 1e-3 and d.facts["mean"] > 1 and d.facts["tokens"] == 44
    assert "--use-tis" in d.fix and "weight mapping" in d.fix
    assert all(torch.equal(before[k], v) for k, v in params(w.backend.model).items())  # nothing trained
    assert run.history["train/mismatch"][0] == d.facts["mean"]  # recorded for MLflow with the failure


def test_rf14_passes_when_the_engine_log_probs_are_the_trainers(tiny_model):
    from engine.stages import train

    cfg = make_cfg(tiny_model)
    w = make_worker(cfg)
    rollout = packed_rollout()
    (steps,) = rollout.per_rank_steps
    for mbs in steps:  # what an engine serving exactly the trainer's weights returns (fp32, same kernels)
        for mb, lp in zip(mbs, w.backend.compute_log_probs(mbs)):
            mb.rollout_log_probs = lp * mb.loss_mask
    out = train(stage_run(cfg, w), rollout)
    assert out["train/mismatch"] == 0.0 and out["train/mismatch_max"] == 0.0


def test_mismatch_threshold_follows_the_precision(tiny_model):
    assert make_cfg(tiny_model).mismatch_threshold("float32") == 1e-3
    assert make_cfg(tiny_model).mismatch_threshold("bfloat16") == 0.05  # the engine rounds to bf16
    assert make_cfg(tiny_model, bf16=True).mismatch_threshold("float32") == 0.05
    assert make_cfg(tiny_model, logprob_mismatch_threshold=0.2).mismatch_threshold("bfloat16") == 0.2
    assert make_cfg(tiny_model, bf16=True).engine_dtype("cuda") == "bfloat16"
    assert make_cfg(tiny_model).engine_dtype("cuda") == "float32"  # follows the trainer's precision
    assert make_cfg(tiny_model, bf16=True).engine_dtype("cpu") == "float32"
    assert make_cfg(tiny_model, rollout_dtype="bfloat16").engine_dtype("cpu") == "bfloat16"


def test_wrong_reference_fails_the_first_step_with_rf01_before_any_update(tiny_model, tmp_path):
    from engine.modeling import load_causal_lm
    from engine.stages import train

    half_loaded = load_causal_lm(tiny_model)
    with torch.no_grad():  # as if one layer had not been loaded
        for p in half_loaded.model.layers[2].parameters():
            p.normal_(0, 0.02)
    half_loaded.save_pretrained(tmp_path / "ref")
    cfg = make_cfg(tiny_model, ref_load=str(tmp_path / "ref"), logprob_mismatch_threshold=1e3)
    w = make_worker(cfg)
    before = params(w.backend.model)
    with pytest.raises(DiagnosisError) as e:
        train(stage_run(cfg, w), packed_rollout())
    assert e.value.codes == ["RF01"] and e.value.diagnoses[0].facts["ref_logp_maxdiff"] > 1e-2
    assert all(torch.equal(before[k], v) for k, v in params(w.backend.model).items())


def test_reference_from_a_checkpoint_directory(tiny_model, tmp_path):
    from engine import checkpoint

    w = make_worker(make_cfg(tiny_model))
    checkpoint.save_iteration(checkpoint.Store(tmp_path / "ck"), 3, w.backend.save, {})
    w2 = make_worker(make_cfg(tiny_model, ref_load=str(tmp_path / "ck")))
    steps, rewards = one_rollout()
    assert w2.set_rollout(steps, rewards, need_ref=True)["ref_logp_maxdiff"] == 0.0
    bad = make_worker(make_cfg(tiny_model, ref_load=str(tmp_path)))  # neither HF dir nor marker
    with pytest.raises(DiagnosisError) as e:
        bad.set_rollout(steps, rewards, need_ref=True)
    assert e.value.codes == ["RF01"]


def test_grad_norm_spike_is_reported_with_the_step_samples(tiny_model):
    from engine.stages import train

    cfg = make_cfg(tiny_model, logprob_mismatch_threshold=1e3)  # fake engine log-probs (see above)
    run = stage_run(cfg, make_worker(cfg))
    run.state.grad_norms = [1e-6] * 5  # a calm history; this step's norm is ≫ 10 × 1e-6
    out = train(run, packed_rollout(rollout_id=3))
    (d,) = run.state.diagnoses
    assert d.code == "RF09" and d.severity == "warning" and d.facts["sample_ids"] == list(range(8))
    assert out["train/grad_norm_spikes"] == 1.0 and len(run.state.grad_norms) == 6


def test_rf13_report_without_per_sample_losses_names_the_step_samples():
    """The Megatron backend knows no per-sample loss: the report names the step's samples, not 'losses finite'."""
    from engine.train.checks import nan_diagnosis

    d = nan_diagnosis(step=3, rank_losses=float("nan"), grad_norm=float("nan"), bad_sample_ids=None,
                      step_sample_ids=[7, 8])
    assert d.code == "RF13" and "samples of the step: [7, 8]" in d.what and "finite" not in d.what
    assert d.facts["bad_sample_ids"] == [] and d.facts["sample_ids"] == [7, 8]


# ---- precision and memory flags (CPU; the GPU tests run the same code on CUDA) ------------------------------------
def test_recompute_activations_reruns_each_layer_in_the_backward_and_changes_nothing(tiny_model):
    plain, recomputed = (make_worker(make_cfg(tiny_model, recompute_activations=r)) for r in (False, True))
    calls = []
    for layer in recomputed.backend.model.model.layers:  # (the recomputation stops early: hook the layer's start)
        layer.input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    out = {}
    for name, w in (("plain", plain), ("recomputed", recomputed)):
        steps, rewards = one_rollout()
        w.set_rollout(steps, rewards, need_ref=False)
        calls.clear()
        out[name] = w.train_step(0, 8)
        out[name + "_calls"] = len(calls)
    n_layers, n_mbs = len(recomputed.backend.model.model.layers), 4
    assert out["recomputed_calls"] == 2 * n_layers * n_mbs  # forward + recomputation in the backward
    assert out["recomputed"]["grad_norm"] == pytest.approx(out["plain"]["grad_norm"], rel=1e-6)
    a, b = params(plain.backend.model), params(recomputed.backend.model)
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)  # names unchanged too


def test_log_probs_chunk_size_takes_the_same_step_with_the_head_run_in_chunks(tiny_model, monkeypatch):
    """--log-probs-chunk-size 4: the head runs on ≤ 4 positions at a time (again in the backward) and the
    optimizer step, its loss and the weights after it are the plain run's up to float rounding."""
    import engine.train.forward as fw

    real, seen = fw.token_log_probs, []
    monkeypatch.setattr(fw, "token_log_probs", lambda logits, *a, **k: (seen.append(logits.shape[0]),
                                                                        real(logits, *a, **k))[1])
    out, rows = {}, {}
    for chunk in (-1, 4):
        w = make_worker(make_cfg(tiny_model, log_probs_chunk_size=chunk))
        steps, rewards = one_rollout()
        w.set_rollout(steps, rewards, need_ref=False)
        seen.clear()
        out[chunk] = (w.train_step(0, 8), params(w.backend.model))
        rows[chunk] = list(seen)
    # plain: one head call per micro-batch (an on-policy step: its own forward gives the old log-probs), each on
    # all its trained tokens; chunked: ≤ 4 positions a call, each chunk once more in the backward
    assert len(rows[-1]) == 4 and max(rows[-1]) > 4
    assert max(rows[4]) <= 4 and sum(rows[4]) == 2 * sum(rows[-1])
    (a, pa), (b, pb) = out[-1], out[4]
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert b["loss_total"] == pytest.approx(a["loss_total"], rel=1e-5, abs=1e-7)
    assert set(pa) == set(pb)
    # AdamW's first step moves every weight by lr·g/(|g| + eps) ≈ lr·sign(g) (1e-3): where |g| is at rounding level
    # (near eps) the two sums' roundings move it by up to 2·lr; elsewhere the weights agree (a machine with other
    # SIMD kernels measured 94 of 821,760 weights apart by > 1e-6, the largest by 1.4e-4)
    diff = torch.cat([(pb[k] - pa[k]).abs().flatten() for k in pa])
    assert float(diff.max()) <= 2e-3 + 1e-6 and int((diff > 1e-6).sum()) <= 1e-3 * diff.numel()


def test_recompute_loss_function_keeps_only_the_logits_for_the_backward_and_takes_the_same_step(tiny_model,
                                                                                                  monkeypatch):
    """--recompute-loss-function: of the [tokens, vocabulary] tensors, the backward keeps only the logits (the CPU
    formula keeps two others per micro-batch: its log-softmax and their exponentials); the log-softmax runs once
    more per micro-batch, in the backward; the step, its loss and the weights after it are the plain run's."""
    import engine.train.forward as fw
    from engine.diagnosis import ConfigError

    real, calls = fw.token_log_probs, []
    monkeypatch.setattr(fw, "token_log_probs", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    out, saved, ran = {}, {}, {}
    for on in (False, True):
        w = make_worker(make_cfg(tiny_model, recompute_loss_function=on))
        head = w.backend.model.lm_head.weight  # [V, H]: its transpose is saved by the head's product
        vocab = head.shape[0]
        steps, rewards = one_rollout()
        w.set_rollout(steps, rewards, need_ref=False)
        # distinct [K, V] activations saved for the backward: storage → (K, grad_fn, the tensor). The tensor is held
        # so that its storage is not freed after its micro-batch's backward and reused by a later one's (which
        # would then count as the same)
        kept: dict[int, tuple] = {}

        def keep(t):
            ptr = t.untyped_storage().data_ptr()
            if t.dim() == 2 and t.shape[-1] == vocab and ptr != head.untyped_storage().data_ptr():
                kept.setdefault(ptr, (t.shape[0], type(t.grad_fn).__name__, t))
            return t

        calls.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out[on] = (w.train_step(0, 8), params(w.backend.model))
        saved[on], ran[on] = sorted((k, fn) for k, fn, _ in kept.values()), len(calls)
    trained = [int(mb.loss_mask.sum()) for mb in one_rollout()[0][0]]  # K of each of the 4 micro-batches
    assert saved[False] == sorted([(k, "LogSoftmaxBackward0") for k in trained] + [(k, "ExpBackward0")
                                                                                     for k in trained])
    assert saved[True] == sorted((k, "SelectBackward0") for k in trained)  # the logits, out.logits[0]
    assert (ran[False], ran[True]) == (4, 8)  # each micro-batch's log-softmax again in the backward
    (a, pa), (b, pb) = out[False], out[True]
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    assert b["loss_total"] == pytest.approx(a["loss_total"], rel=1e-6, abs=1e-8)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    with pytest.raises(ConfigError, match="already recompute"):
        make_cfg(tiny_model, recompute_loss_function=True, log_probs_chunk_size=64)
    # the fused CUDA kernel (torch on a GPU, Megatron at TP = 1) keeps only the logits already: refused there
    with pytest.raises(ValueError, match="would change nothing"):
        fw.check_recompute_loss(fused=True)
    fw.check_recompute_loss(fused=False)


def test_train_share_prefix_runs_each_prompt_once_and_takes_the_same_step(tiny_model):
    """--train-share-prefix: two GRPO groups (4 samples repeating a 12-token prompt) in one micro-batch each; on,
    the model sees each prompt once (fewer tokens) and the optimizer step is the same up to float rounding."""
    from engine.diagnosis import ConfigError
    from engine.samples import Sample, Status

    g = torch.Generator().manual_seed(3)
    samples = []
    for gi in range(2):
        prompt = torch.randint(0, 259, (12,), generator=g).tolist()
        for r in (3, 9, 5, 7):
            samples.append(Sample(index=len(samples), group_index=gi, rollout_id=0, prompt="x",
                                  tokens=prompt + torch.randint(0, 259, (r,), generator=g).tolist(),
                                  response_length=r, loss_mask=[1] * r, rollout_log_probs=[-2.0] * r,
                                  reward=REWARDS[len(samples)], status=Status.COMPLETED))
    out, seen = {}, {}
    for mode in ("off", "on"):
        w = make_worker(make_cfg(tiny_model, train_share_prefix=mode))
        assert w.backend.share_prefix == (mode == "on")
        seen[mode] = []
        w.backend.model.model.embed_tokens.register_forward_hook(lambda m, i, o, k=mode: seen[k].append(i[0].numel()))
        w.set_rollout([pack(samples, [[0, 1, 2, 3], [4, 5, 6, 7]])], REWARDS, need_ref=False)
        out[mode] = (w.train_step(0, 8), {k: v.grad.clone() for k, v in w.backend.model.named_parameters()})
    # two forwards (old log-probs, the step) of two micro-batches: each prompt 4 times, then once
    assert seen["off"] == [4 * 12 + 3 + 9 + 5 + 7] * 4
    assert seen["on"] == [12 + 3 + 9 + 5 + 7] * 4
    assert out["on"][0]["grad_norm"] == pytest.approx(out["off"][0]["grad_norm"], rel=1e-5)
    a, b = out["off"][1], out["on"][1]  # the step's gradients (Adam's first update is ~lr·sign(g): compare g)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert sum(float(v.abs().sum()) for v in a.values()) > 0
    assert make_worker(make_cfg(tiny_model)).backend.share_prefix  # auto on the CPU
    with pytest.raises(ConfigError, match="train-share-prefix"):
        make_cfg(tiny_model, train_share_prefix="on", train_backend="megatron")


def test_bf16_computes_in_bf16_over_fp32_master_weights(tiny_model):
    w = make_worker(make_cfg(tiny_model, bf16=True, lr=1e-2))
    seen = []
    w.backend.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    f32 = make_worker(make_cfg(tiny_model))
    steps, rewards = one_rollout()
    lp16 = w.backend.compute_log_probs(steps[0])
    lp32 = f32.backend.compute_log_probs(steps[0])
    assert seen == [torch.bfloat16] * len(steps[0])  # autocast: the matrix products run in bf16
    d = torch.cat([(a - b).abs()[mb.loss_mask > 0] for a, b, mb in zip(lp16, lp32, steps[0])])
    print(f"bf16 vs fp32 log-probs: mean {float(d.mean()):.3g}, max {float(d.max()):.3g}")
    assert 0 < float(d.mean()) < 0.05 and float(d.max()) < 0.5  # bf16 rounding, not another model
    before = params(w.backend.model)
    w.set_rollout(steps, rewards, need_ref=False)
    w.train_step(0, 8)
    after = params(w.backend.model)
    assert all(v.dtype == torch.bfloat16 for v in after.values())  # the model holds bf16 weights ...
    masters = w.backend.named_parameters_full()
    assert all(v.dtype == torch.float32 for v in masters.values())  # ... rounded from fp32 masters
    assert all(torch.equal(masters[k].to(torch.bfloat16), after[k]) for k in after)
    assert all(st["exp_avg"].dtype == torch.float32 for st in w.backend.optimizer.state.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert w.backend.model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers are not rounded
    assert all(v.dtype == torch.float32 for v in w.backend.model_state().values())  # what engines and saves get


def test_bf16_masters_keep_updates_smaller_than_bf16_resolution(tiny_model):
    # lr = 1e-4 (Adam's first step moves each weight by ≈ lr): for a weight near 1.0 bf16's spacing is 2⁻⁷ ≈ 0.0078,
    # so a bf16-only optimizer would round the update away; the fp32 master keeps it
    w = make_worker(make_cfg(tiny_model, bf16=True, lr=1e-4))
    norm_before = w.backend.named_parameters_full()["model.norm.weight"].clone()
    steps, rewards = one_rollout()
    w.set_rollout(steps, rewards, need_ref=False)
    w.train_step(0, 8)
    norm_after = w.backend.named_parameters_full()["model.norm.weight"]
    moved = (norm_after - norm_before).abs()
    assert float(moved.max()) > 5e-5 and float(moved.max()) < 2e-4  # ≈ lr, well below bf16's spacing at ~1


# ---- where the old log-probs come from (issue 18: no forward the configuration makes unnecessary) ----------------
@pytest.mark.parametrize("old_from", ["train", "rollout"])
def test_old_log_probs_without_their_forward_train_the_same(tiny_model, old_from):
    """old_from "train" (the step's own forward, detached) is the same numbers as the no-grad forward: the same
    update bitwise. "rollout" (--use-rollout-logprobs) with engine log-probs equal to the trainer's: the same too.
    Either way the mismatch metric comes from the train step, equal to what the forward path reports."""
    cfg = make_cfg(tiny_model)
    ref_w, w = make_worker(cfg), make_worker(cfg)
    steps, rewards = one_rollout()
    for mbs in steps:  # an engine serving exactly these weights, plus a known offset on one token
        for mb, lp in zip(mbs, ref_w.backend.compute_log_probs(mbs)):
            mb.rollout_log_probs = lp * mb.loss_mask
    if old_from == "train":
        first = steps[0][0]
        first.rollout_log_probs[int(first.loss_mask.nonzero()[0])] += 0.5
    facts = ref_w.set_rollout(steps, rewards, need_ref=False, old_from="forward")
    a = ref_w.train_step(0, 8)
    assert "ref_logp_maxdiff" not in facts  # no reference forward was run
    steps2, _ = one_rollout()
    for mb, mb2 in zip(steps[0], steps2[0]):
        mb2.rollout_log_probs = mb.rollout_log_probs.clone()
    facts2 = w.set_rollout(steps2, rewards, need_ref=False, old_from=old_from)
    assert "mismatch_sum" not in facts2 and w.old is None if old_from == "train" else w.old is not None
    b = w.train_step(0, 8)
    for k, v in params(ref_w.backend.model).items():
        assert torch.equal(v, params(w.backend.model)[k]), k
    for key in ("mismatch_sum", "mismatch_count", "mismatch_max"):
        assert b[key] == pytest.approx(facts[key], abs=1e-7), key
    assert a["pg_loss_sum"] == pytest.approx(b["pg_loss_sum"], abs=1e-7)
    if old_from == "train":
        assert facts["mismatch_max"] == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize("old_from", ["train", "rollout"])
def test_set_rollout_and_step_in_one_call_is_the_two_calls(tiny_model, old_from):
    """The folded call (set_rollout, then step 0 in the same worker call) updates the weights bitwise as the two
    calls do and returns the same metrics; where the mismatch is judged before the update (old_from "forward",
    or a backend without the step's log-probs) it runs no step at all."""
    cfg = make_cfg(tiny_model, use_rollout_logprobs=old_from == "rollout", logprob_mismatch_threshold=1e3)
    two, one = make_worker(cfg), make_worker(cfg)
    steps, rewards = one_rollout()
    facts = two.set_rollout(steps, rewards, need_ref=False, old_from=old_from)
    a = two.train_step(0, 8)
    steps2, _ = one_rollout()
    facts2, b = one.set_rollout_and_step(steps2, rewards, False, False, old_from, 8)
    assert facts2 == facts and b is not None
    assert {k: v for k, v in b.items() if k != "seconds"} == {k: v for k, v in a.items() if k != "seconds"}
    for k, v in params(two.backend.model).items():
        assert torch.equal(v, params(one.backend.model)[k]), k
    for w, frm in ((make_worker(cfg), "forward"), (make_worker(cfg), "rollout")):
        if frm == "rollout":
            del w.backend.last_log_probs  # a backend that does not keep its step's log-probs (Megatron)
        before = params(w.backend.model)
        f, out = w.set_rollout_and_step(one_rollout()[0], rewards, False, False, frm, 8)
        assert out is None and f["mismatch_count"] > 0  # judged by the driver before it asks for the step
        assert all(torch.equal(before[k], v) for k, v in params(w.backend.model).items())


def test_train_stage_asks_for_the_first_step_with_the_rollout_when_nothing_is_judged_between(tiny_model):
    """The stage's worker calls: the run's first step needs RF01 and the mismatch between set_rollout and the
    update (two calls); a later one-step rollout judges the mismatch from the step's own forward (one call); a
    backend without the step's log-probs judges it before the update again (two)."""
    from engine.stages import train

    def calls(rollout_id, drop_step_log_probs=False, **over):
        cfg = make_cfg(tiny_model, logprob_mismatch_threshold=1e3, **over)
        w = make_worker(cfg)
        if drop_step_log_probs:
            del w.backend.last_log_probs
        run = stage_run(cfg, w)
        out = train(run, packed_rollout(rollout_id=rollout_id))
        assert math.isfinite(out["train/mismatch"]) and math.isfinite(out["train/loss"])
        return run.train_group.calls

    assert calls(0) == ["set_rollout", "train_step"]
    assert calls(1) == ["set_rollout_and_step"]
    assert calls(1, use_rollout_logprobs=True) == ["set_rollout_and_step"]
    assert calls(1, use_rollout_logprobs=True, drop_step_log_probs=True) == ["set_rollout_and_step", "train_step"]
    # a KL reward needs the old log-probs (and the reference) before the step
    assert calls(1, kl_coef=0.1, advantage_estimator="reinforce_plus_plus") == ["set_rollout", "train_step"]


def test_train_stage_skips_the_reference_forward_after_the_first_step_unless_kl_is_used(tiny_model):
    from engine.stages import old_log_probs_source, train

    def run_at(rollout_id, **over):
        cfg = make_cfg(tiny_model, logprob_mismatch_threshold=1e3, **over)
        w = make_worker(cfg)
        run = stage_run(cfg, w)
        return w, run, train(run, packed_rollout(rollout_id=rollout_id))

    w, run, out = run_at(0)  # the run's first step: reference and old forward (RF01)
    assert w.ref is not None and "train/kl" in out and old_log_probs_source(run, True) == "forward"
    w, run, out = run_at(1)
    assert w.ref is None and "train/kl" not in out and "train/mismatch" in out
    assert old_log_probs_source(run, False) == "train"
    w, run, out = run_at(1, log_kl=True)
    assert w.ref is not None and out["train/kl"] == 0.0  # a fresh worker: policy = reference
    w, run, out = run_at(1, use_kl_loss=True, kl_loss_coef=0.1)
    assert w.ref is not None and "train/kl" in out
    w, run, out = run_at(1, use_rollout_logprobs=True)
    assert old_log_probs_source(run, False) == "rollout" and "train/mismatch" in out
    cfg = make_cfg(tiny_model, use_mis=True)  # MIS masks with the old log-probs before the step
    assert old_log_probs_source(stage_run(cfg, None), False) == "forward"


def test_use_rollout_logprobs_refuses_the_corrections_it_would_void(tiny_model):
    from engine.diagnosis import ConfigError

    for flag in ("use_tis", "use_mis"):
        with pytest.raises(ConfigError) as e:
            make_cfg(tiny_model, use_rollout_logprobs=True, **{flag: True})
        d = e.value.diagnoses[0]
        assert d.facts["field"] == "use_rollout_logprobs" and "--use-rollout-logprobs" in d.fix


def test_use_rollout_logprobs_on_a_backend_without_train_step_log_probs(tiny_model):
    """A backend that does not keep its train step's log-probs (Megatron) still reports the mismatch, from a
    no-grad forward before the update, and trains with the engine's log-probs as the old ones."""
    from engine.stages import train

    cfg = make_cfg(tiny_model, use_rollout_logprobs=True, logprob_mismatch_threshold=1e3)
    w = make_worker(cfg)
    del w.backend.last_log_probs
    steps, rewards = one_rollout()
    with pytest.raises(ValueError, match="keeps its train-step log-probs"):
        w.set_rollout(steps, rewards, need_ref=False, old_from="train")
    facts = w.set_rollout(steps, rewards, need_ref=False, old_from="rollout")
    assert facts["mismatch_count"] > 0 and not w.mismatch_deferred
    assert "mismatch_sum" not in w.train_step(0, 8)
    w2 = make_worker(cfg)
    del w2.backend.last_log_probs
    out = train(stage_run(cfg, w2), packed_rollout(rollout_id=1))
    assert out["train/mismatch"] > 0  # the fake engine log-probs differ from the trainer's


def test_a_custom_tis_function_weights_the_step_and_logs_its_metrics(tiny_model):
    """--custom-tis-function-path examples/hooks.py:icepop through the worker and the torch backend: engine
    log-probs within ±1 of the trainer's put some ratios outside [--tis-clip-low, --tis-clip], which IcePop zeroes
    where --use-tis clamps, so the step's loss differs; its metrics arrive as train/tis, tis_clipfrac, tis_abs."""
    def step(**over):
        w = make_worker(make_cfg(tiny_model, **({"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.5} | over)))
        steps, rewards = one_rollout()
        g = torch.Generator().manual_seed(3)
        for mb, lp in zip(steps[0], w.backend.compute_log_probs(steps[0])):
            mb.rollout_log_probs = (lp + 2 * torch.rand(lp.shape, generator=g) - 1) * mb.loss_mask
        w.set_rollout(steps, rewards, need_ref=False)
        return w.train_step(0, 8)

    clamp, ice = step(), step(custom_tis_function_path="examples/hooks.py:icepop")
    assert {"tis_sum", "tis_abs_sum", "tis_clipfrac_sum"} <= set(ice) and "tis_abs_sum" not in clamp
    share = ice["tis_clipfrac_sum"] / ice["tis_clipfrac_count"]
    assert share == pytest.approx(clamp["tis_clipfrac_sum"] / clamp["tis_clipfrac_count"]) and 0 < share < 1
    assert ice["loss_total"] != pytest.approx(clamp["loss_total"], rel=1e-4)
    # --get-mismatch-metrics: the same function without --use-tis measures and leaves the loss unweighted
    plain = step(use_tis=False, tis_clip=2.0, tis_clip_low=0.0)  # the bounds alone would do nothing: refused
    measured = step(use_tis=False, get_mismatch_metrics=True, custom_tis_function_path="examples/hooks.py:icepop")
    assert measured["loss_total"] == plain["loss_total"] and "tis_abs_sum" not in plain
    assert measured["tis_abs_sum"] == pytest.approx(ice["tis_abs_sum"])
    with pytest.raises(ConfigError, match="--get-mismatch-metrics calls --custom-tis-function-path"):
        make_cfg(tiny_model, get_mismatch_metrics=True)


def _default_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """--custom-pg-loss-reducer-function-path that reproduces the default per-sample token mean."""
    return lambda x: sum((xi * mi).sum() / mi.sum().clamp(min=1) for xi, mi in zip(x.split(response_lengths),
                                                                                     loss_masks))


def test_a_custom_pg_loss_reducer_reaches_the_step(tiny_model):
    """--custom-pg-loss-reducer-function-path through the worker and the torch backend, loaded from its flag: a
    reducer that reproduces the default gives the default step loss; examples/hooks.py's Dr.GRPO reducer another."""
    def step(**over):
        w = make_worker(make_cfg(tiny_model, **over))
        steps, rewards = one_rollout()
        w.set_rollout(steps, rewards, need_ref=False)
        return w.train_step(0, 8)

    default = step()
    same = step(custom_pg_loss_reducer_function_path="tests/test_train_backend.py:_default_reducer")
    dr = step(custom_pg_loss_reducer_function_path="examples/hooks.py:dr_grpo_reducer")
    assert same["loss_total"] == pytest.approx(default["loss_total"], rel=1e-6, abs=1e-9)
    assert same["grad_norm"] == pytest.approx(default["grad_norm"], rel=1e-5) and default["grad_norm"] > 0
    assert dr["loss_total"] != pytest.approx(default["loss_total"], rel=1e-3)
    assert dr["grad_norm"] != pytest.approx(default["grad_norm"], rel=1e-3)


def test_a_rollout_data_postprocess_hook_rewrites_masks_and_advantages_before_the_step(tiny_model, monkeypatch):
    """--rollout-data-postprocess-path (slime's contract) through the stage, the worker and the torch backend:
    the hook sees this rank's samples with their old log-probs and advantages and the rollout id; masking each
    response's second half gives the step of a rollout packed with those masks (to float32 rounding); doubling
    the advantages doubles the gradient; a mask raised above the rollout's is refused; examples/hooks.py's
    confident-token mask takes a share of tokens out, logged as train/postprocess_masked_share."""
    from engine.rollout.hooks import HookError
    from engine.stages import train

    def step(**over):
        w = make_worker(make_cfg(tiny_model, **over))
        steps, rewards = one_rollout()
        w.set_rollout(steps, rewards, need_ref=False, rollout_id=7)
        return w.train_step(0, 8)

    import hook_fakes

    hook_fakes.POSTPROCESS_CALLS.clear()
    halved = step(rollout_data_postprocess_path="hook_fakes:halve_masks")
    [(rid, data)] = hook_fakes.POSTPROCESS_CALLS
    assert rid == 7 and len(data["loss_masks"]) == 8 and data["sample_ids"] == list(range(8))
    assert [len(x) for x in data["log_probs"]] == data["response_lengths"] == [len(m) for m in data["advantages"]]
    assert all(float(lp.abs().sum()) > 0 for lp in data["log_probs"]) and data["ref_log_probs"] is None
    assert [len(t) for t in data["tokens"]] == data["total_lengths"]

    # the same step from a rollout whose masks were halved before it was packed
    w = make_worker(make_cfg(tiny_model))
    steps, rewards = one_rollout()
    for mb in steps[0]:
        for a, b in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()):
            r = mb.response_lengths[mb.cu_seqlens[:-1].tolist().index(a)]
            mb.loss_mask[b - r + r // 2:b] = 0
    w.set_rollout(steps, rewards, need_ref=False)
    direct = w.train_step(0, 8)
    # the same maths, not the same float32 rounding: logits are computed only at trained positions, so the old
    # forward (before the hook, full masks) multiplies more rows than the direct one (halved masks), and the CPU's
    # GEMM may block them differently (log-probs ~1e-7 apart on some Xeons, equal on others); the on-policy loss is
    # ±advantage terms cancelling to ~0, so it is compared in absolute terms
    assert halved["loss_total"] == pytest.approx(direct["loss_total"], abs=1e-5)
    assert halved["grad_norm"] == pytest.approx(direct["grad_norm"], rel=2e-5) and direct["grad_norm"] > 0

    plain = step()
    doubled = step(rollout_data_postprocess_path="hook_fakes:double_advantages")
    assert doubled["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-5)
    # a --custom-config argument reaches the train worker's hooks as args.<key>
    tripled = step(rollout_data_postprocess_path="hook_fakes:scale_advantages", custom_config={"adv_scale": 3.0})
    assert tripled["grad_norm"] == pytest.approx(3 * plain["grad_norm"], rel=1e-5)
    with pytest.raises(HookError, match="--rollout-data-postprocess-path.*a mask can only take tokens out"):
        step(rollout_data_postprocess_path="hook_fakes:raise_masks")

    # the fake samples' tokens are random: no token is confident at p > 0.95, so the threshold is set at the
    # median old log-prob, which takes about half of the trained tokens out
    import examples.hooks

    median = float(torch.cat(data["log_probs"])[torch.cat(data["loss_masks"]) > 0].median())
    monkeypatch.setattr(examples.hooks, "CONFIDENT_LOGP", median)
    cfg = make_cfg(tiny_model, rollout_data_postprocess_path="examples.hooks:mask_confident_tokens",
                   logprob_mismatch_threshold=1e3)
    out = train(stage_run(cfg, make_worker(cfg)), packed_rollout())
    assert 0.3 < out["train/postprocess_masked_share"] < 0.7


def test_use_rollout_entropy_hands_the_old_policys_entropy_to_the_hooks(tiny_model):
    """--use-rollout-entropy: rollout_data["entropy"] holds the old policy's per-token entropy, the one the
    on-policy step's own forward sees (their sums over the trained tokens agree); examples/hooks.py's
    keep_high_entropy_tokens keeps the top 20% of the trained tokens; without a function reading it the flag is
    refused; with --use-rollout-logprobs the forward still runs for it."""
    import hook_fakes
    from engine.stages import train

    def step(**over):
        w = make_worker(make_cfg(tiny_model, use_rollout_entropy=True, **over))
        steps, rewards = one_rollout()
        w.set_rollout(steps, rewards, need_ref=False, old_from="rollout" if over.get("use_rollout_logprobs")
                      else "forward")
        return w.train_step(0, 8)

    hook_fakes.POSTPROCESS_CALLS.clear()
    plain = make_worker(make_cfg(tiny_model))
    steps, rewards = one_rollout()
    plain.set_rollout(steps, rewards, need_ref=False)
    reference = plain.train_step(0, 8)
    out = step(rollout_data_postprocess_path="hook_fakes:record_only")
    [(_, data)] = hook_fakes.POSTPROCESS_CALLS
    assert [len(e) for e in data["entropy"]] == data["response_lengths"]
    total = sum(float((e * m).sum()) for e, m in zip(data["entropy"], data["loss_masks"]))
    assert total == pytest.approx(reference["entropy_sum"], rel=1e-5) and total > 0
    assert out["loss_total"] == pytest.approx(reference["loss_total"], rel=1e-6, abs=1e-9)

    hook_fakes.POSTPROCESS_CALLS.clear()
    step(rollout_data_postprocess_path="hook_fakes:record_only", use_rollout_logprobs=True,
         logprob_mismatch_threshold=1e3)
    [(_, data)] = hook_fakes.POSTPROCESS_CALLS
    assert sum(float(e.sum()) for e in data["entropy"]) == pytest.approx(total, rel=1e-5)

    cfg = make_cfg(tiny_model, use_rollout_entropy=True, logprob_mismatch_threshold=1e3,
                   rollout_data_postprocess_path="examples/hooks.py:keep_high_entropy_tokens")
    metrics = train(stage_run(cfg, make_worker(cfg)), packed_rollout())
    assert metrics["train/postprocess_masked_share"] == pytest.approx(0.8, abs=0.05)
    with pytest.raises(ConfigError, match="--use-rollout-entropy computes the old policy's entropies"):
        make_cfg(tiny_model, use_rollout_entropy=True)


def test_the_worker_calls_the_backends_before_train_step_hook_and_megatron_hooks_need_megatron(tiny_model):
    """--custom-megatron-before-train-step-hook-path: the worker calls the backend's before_train_step(rollout_id,
    step) before every optimizer step (the megatron backend runs the user's function there: its GPU test); the
    three --custom-megatron-*-path flags are refused with another backend, where they would never be called."""
    w = make_worker(make_cfg(tiny_model, global_batch_size=4))
    calls = []
    w.backend.before_train_step = lambda rollout_id, step_id: calls.append((rollout_id, step_id))
    steps, rewards = one_rollout(steps=2)
    w.set_rollout(steps, rewards, need_ref=False, rollout_id=9)
    w.train_step(0, 4)
    w.train_step(1, 4)
    assert calls == [(9, 0), (9, 1)]
    for flag in ("custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
                 "custom_megatron_before_train_step_hook_path"):
        with pytest.raises(ConfigError, match="hook into the megatron backend, and --train-backend is torch"):
            make_cfg(tiny_model, **{flag: "hook_fakes:megatron_init"})


def _wait_in_all_reduce(rank: int, port: int, queue) -> None:  # a spawned DP rank (test below)
    import time

    import torch.distributed as dist

    from engine.config import RunConfig
    from engine.train.torch_backend import join_group

    join_group(RunConfig(distributed_timeout_minutes=0.05), rank=rank, world_size=2, master=f"127.0.0.1:{port}",
               device="cpu")
    if rank == 1:
        time.sleep(20)  # never joins the collective
        return
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        queue.put(("returned", time.monotonic() - t0))
    except Exception as e:  # gloo's timeout
        queue.put((type(e).__name__, time.monotonic() - t0))


def test_distributed_timeout_minutes_bounds_a_collective_a_rank_never_joins():
    """--distributed-timeout-minutes 0.05 (3 s) on the DP group: rank 0's all-reduce fails after ~3 s instead of
    waiting for rank 1 (torch's default: 30 minutes for gloo)."""
    import torch.multiprocessing as mp

    from engine.rollout.ports import free_loopback_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_loopback_port()
    procs = [ctx.Process(target=_wait_in_all_reduce, args=(r, port, queue), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        what, seconds = queue.get(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    assert what != "returned" and 2.5 <= seconds <= 15, (what, seconds)


def test_keep_old_actor_scores_a_stale_rollout_with_the_weights_that_generated_it(tiny_model):
    """--keep-old-actor: the worker keeps version r's weights when it sets rollout r; a rollout generated by an
    older version gets its old log-probs from that version's copy (the same numbers as before the updates), while
    the policy's own weights are untouched; versions past the staleness bound are forgotten."""
    cfg = make_cfg(tiny_model, keep_old_actor=True, async_mode="one-step")
    w = make_worker(cfg, train_iters=8)
    steps, rewards = one_rollout()
    w.set_rollout(steps, rewards, need_ref=False, rollout_id=0)
    v0 = [x.clone() for x in w.old[0]]  # version 0's log-probs of these samples
    w.train_step(0, 8)
    after = params(w.backend.model)
    steps1, _ = one_rollout()  # the same samples again, as if version 0 generated rollout 1
    w.set_rollout(steps1, rewards, need_ref=False, rollout_id=1, old_version=0)
    assert all(torch.equal(a, b) for a, b in zip(w.old[0], v0))  # version 0's weights scored them
    assert all(torch.equal(after[k], v) for k, v in params(w.backend.model).items())  # the policy is back
    w.train_step(0, 8)
    steps2, _ = one_rollout()
    w.set_rollout(steps2, rewards, need_ref=False, rollout_id=2, old_version=2)  # on-policy: the current weights
    assert max(float((a - b).abs().max()) for a, b in zip(w.old[0], v0)) > 1e-4
    assert sorted(w.old_actors) == [1, 2]  # one-step: version 0 can no longer generate a rollout
    with pytest.raises(ValueError, match="weight version 0, which this train rank never held"):
        w.set_rollout(one_rollout()[0], rewards, need_ref=False, rollout_id=3, old_version=0)

    plain = make_worker(make_cfg(tiny_model, async_mode="one-step"), train_iters=8)  # without the flag
    plain.set_rollout(one_rollout()[0], rewards, need_ref=False, rollout_id=0)
    plain.train_step(0, 8)
    plain.set_rollout(one_rollout()[0], rewards, need_ref=False, rollout_id=1, old_version=0)
    assert max(float((a - b).abs().max()) for a, b in zip(plain.old[0], v0)) > 1e-4 and not plain.old_actors


def test_ci_grad_norms_are_recorded_then_reproduced_and_a_different_one_stops_the_run(tiny_model, tmp_path):
    """slime's --ci-save-grad-norm / --ci-load-grad-norm: a file per optimizer step; the same run again passes the
    check, a reference 5% off (beyond slime's 1%) is a REPRODUCE error naming both numbers, a missing file too."""
    import json

    from engine.stages import train

    pattern = str(tmp_path / "gn" / "{role}_{rollout_id}_{step_id}.json")
    cfg = make_cfg(tiny_model, ci_save_grad_norm=pattern, logprob_mismatch_threshold=1e3)
    out = train(stage_run(cfg, make_worker(cfg)), packed_rollout())
    ref = tmp_path / "gn" / "actor_0_0.json"
    recorded = json.loads(ref.read_text())
    assert recorded["grad_norm"] == out["train/grad_norm"] > 0 and sorted(p.name for p in ref.parent.iterdir()) == [
        "actor_0_0.json"]

    check = make_cfg(tiny_model, ci_load_grad_norm=pattern, logprob_mismatch_threshold=1e3)
    train(stage_run(check, make_worker(check)), packed_rollout())  # the same run: reproduced
    ref.write_text(json.dumps({"grad_norm": recorded["grad_norm"] * 1.05}))
    with pytest.raises(DiagnosisError, match="the gradient norm of rollout 0, step 0, actor is") as e:
        train(stage_run(check, make_worker(check)), packed_rollout())
    (d,) = e.value.diagnoses
    assert d.code == "REPRODUCE" and d.facts["want"] == pytest.approx(recorded["grad_norm"] * 1.05)
    assert d.facts["got"] == pytest.approx(recorded["grad_norm"])
    ref.unlink()
    with pytest.raises(DiagnosisError, match="no reference gradient norm for rollout 0, step 0, actor"):
        train(stage_run(check, make_worker(check)), packed_rollout())

    with pytest.raises(ConfigError, match="both set"):
        make_cfg(tiny_model, ci_save_grad_norm=pattern, ci_load_grad_norm=pattern)
    with pytest.raises(ConfigError, match=r"has no \{step_id\}, so steps would share a file"):
        make_cfg(tiny_model, ci_save_grad_norm=str(tmp_path / "gn_{rollout_id}.json"))
    with pytest.raises(ConfigError, match=r"only \{role\}, \{rollout_id\} and \{step_id\} are filled in \(KeyError"):
        make_cfg(tiny_model, ci_save_grad_norm=str(tmp_path / "{run}_{rollout_id}_{step_id}.json"))
    with pytest.raises(ConfigError, match=r"has no \{role\}"):
        make_cfg(tiny_model, advantage_estimator="ppo", ci_load_grad_norm=str(tmp_path / "{rollout_id}_{step_id}"))
