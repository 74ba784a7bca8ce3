"""Flags whose effect no other test showed: each one, set, changes what the stage that reads it does.

The stages' collaborators that need Ray or engines are hand-written fakes here; the functions they call with the
flags' values are tested on their own elsewhere (the loop, the engines, the health monitor). tests/test_flag_audit.py
lists, for every flag, the test that shows its effect.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from train_fakes import fake_samples, pack

from engine.config import RunConfig
from engine.config.data import BUNDLED_MODEL, BUNDLED_TRAIN
from engine.diagnosis import ConfigError, DiagnosisError
from engine.run import Run
from engine.samples import Status


def _run(tmp_path, **over) -> Run:
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import eos_token_ids, load_tokenizer
    from engine.rewards import RewardModel

    cfg = RunConfig(**{"hf_checkpoint": BUNDLED_MODEL, "prompt_data": BUNDLED_TRAIN, "eval_prompt_data": "",
                       "work_dir": str(tmp_path / "w"), "rollout_batch_size": 2, "n_samples_per_prompt": 2, **over})
    run = Run(cfg)
    run.tokenizer = load_tokenizer(cfg.hf_checkpoint)
    run.eos_ids = eos_token_ids(cfg.hf_checkpoint, run.tokenizer)
    run.dataset = PromptDataset(load_prompts(cfg.prompt_data, input_key="prompt", label_key="label"), shuffle=False,
                                seed=0)
    run.reward_model = RewardModel(cfg.rm_type, None)
    run.engines = SimpleNamespace(release_memory=lambda: None)
    return run


# ---- rollout: sampling, concurrency, over-sampling, the truncation limit -------------------------------------------
def test_sampling_flags_are_what_the_engines_are_asked_for(tmp_path):
    from engine.stages import sampling_params

    run = _run(tmp_path, rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=20, rollout_stop=["</a>"],
               rollout_stop_token_ids=[7], rollout_max_response_len=33)
    got = sampling_params(run).to_sglang(seed=5)
    assert got["temperature"] == 0.7 and got["top_p"] == 0.9 and got["top_k"] == 20 and got["stop"] == ["</a>"]
    assert got["max_new_tokens"] == 33 and 7 in got["stop_token_ids"] and got["sampling_seed"] == 5
    assert sampling_params(run, greedy=True).temperature == 0.0  # eval: greedy whatever the flag
    assert got["skip_special_tokens"] is True  # SGLang's default
    kept = _run(tmp_path, rollout_skip_special_tokens=False)
    assert sampling_params(kept).to_sglang(seed=None)["skip_special_tokens"] is False
    from engine.stages import eval_sampling_params

    kept.eval_datasets = {}
    assert eval_sampling_params(kept).to_sglang(seed=None)["skip_special_tokens"] is False


def test_eval_sampling_flags_reach_the_evaluation(tmp_path, monkeypatch):
    """--eval-temperature / --eval-top-p / --eval-max-response-len are what the evaluation asks the engines for
    (and a generate hook's args.sampling_params); unset, greedy with one sample, the rollout's with k > 1."""
    from engine import stages
    from engine.config.data import BUNDLED_TEST
    from engine.data import load_prompts
    from engine.rollout import loop

    def evaluated_with(**over):
        captured: dict = {}
        monkeypatch.setattr(loop, "generate_rollout", _fake_generate(captured, truncated=0))
        run = _run(tmp_path, rollout_temperature=0.7, rollout_top_p=0.9, rollout_max_response_len=33, **over)
        run.eval_sets = {"test": load_prompts(BUNDLED_TEST, input_key="prompt", label_key="label")[:2]}
        stages.evaluate(run, 0)
        return captured["params"], captured["hook_args"].sampling_params

    params, hooked = evaluated_with()
    assert (params.temperature, params.top_p, params.max_new_tokens) == (0.0, 0.9, 33)
    params, _ = evaluated_with(n_samples_per_eval_prompt=4)
    assert params.temperature == 0.7
    params, hooked = evaluated_with(eval_temperature=0.6, eval_top_p=0.95, eval_max_response_len=64)
    assert (params.temperature, params.top_p, params.max_new_tokens) == (0.6, 0.95, 64)
    assert (hooked["temperature"], hooked["top_p"], hooked["max_new_tokens"]) == (0.6, 0.95, 64)
    assert params.min_new_tokens == 0 and "min_new_tokens" not in params.to_sglang(None)
    # --eval-min-new-tokens (slime's): sent as SGLang's min_new_tokens, within each request's max_new_tokens
    params, hooked = evaluated_with(eval_min_new_tokens=5)
    assert params.min_new_tokens == 5 and hooked["min_new_tokens"] == 5
    assert loop.SamplingParams.fit({"max_new_tokens": 3, "min_new_tokens": 5}) == {"max_new_tokens": 3,
                                                                                  "min_new_tokens": 3}
    assert loop.SamplingParams.fit({"max_new_tokens": 30, "min_new_tokens": 5}, done=4)["min_new_tokens"] == 1
    with pytest.raises(ConfigError, match="--eval-min-new-tokens 40: eval set 'test'.s min_new_tokens 40 is more"):
        RunConfig(eval_min_new_tokens=40, rollout_max_response_len=33)


def _fake_generate(captured: dict, truncated: int, total: int = 4):
    from engine.rollout.loop import RolloutResult
    from engine.samples import Sample

    def generate(prompts_of, **kw):
        captured.update(kw, prompts=prompts_of(2))
        samples = [Sample(index=i, group_index=i // 2, rollout_id=kw["rollout_id"], prompt="p", tokens=[1, 2, 3],
                          response_length=2, reward=0.0, loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0],
                          status=Status.TRUNCATED if i < truncated else Status.COMPLETED) for i in range(total)]
        return RolloutResult([samples[:2], samples[2:]], {"drawn": 2, "filtered": 0, "aborted": 0,
                                                          "retried_requests": 0})
    return generate


def test_rollout_flags_reach_the_loop_and_the_truncation_limit(tmp_path, monkeypatch):
    from engine import stages
    from engine.rollout import loop
    from engine.rollout.filters import check_reward_nonzero_std

    captured: dict = {}
    monkeypatch.setattr(loop, "generate_rollout", _fake_generate(captured, truncated=3))
    run = _run(tmp_path, rollout_concurrency=7, rollout_timeout=12.5, over_sampling_batch_size=5,
               dynamic_sampling_filter_path="engine.rollout.filters:check_reward_nonzero_std",
               rollout_max_truncated_share=0.8)
    run.sample_filter = check_reward_nonzero_std
    batch = stages.rollout(run, 0)  # 3 of 4 truncated = 0.75 ≤ 0.8
    assert captured["concurrency"] == 7 and captured["timeout_s"] == 12.5
    assert captured["round_size"] == 5 and captured["keep"] is check_reward_nonzero_std
    assert batch.metrics["rollout/truncated_share"] == 0.75
    run.cfg = RunConfig(**{**run.cfg.model_dump(), "rollout_max_truncated_share": 0.7})
    with pytest.raises(DiagnosisError) as e:  # 0.75 > 0.7: RF10
        stages.rollout(run, 1)
    assert e.value.codes == ["RF10"]
    run.sample_filter, run.cfg = None, RunConfig(**{**run.cfg.model_dump(), "over_sampling_batch_size": None,
                                                    "dynamic_sampling_filter_path": None,
                                                    "rollout_max_truncated_share": 1.0})
    stages.rollout(run, 2)
    assert captured["round_size"] is None and captured["keep"] is None  # no filter: one round of B prompts


# ---- place: Ray, the train workers' deadline and threads, data order, the reward, health checks ------------------
def test_place_flags(tmp_path, monkeypatch):
    from engine import cluster, stages
    from engine.rollout import health

    seen: dict = {}
    monkeypatch.setattr(cluster, "connected", lambda: False)
    monkeypatch.setattr(cluster, "connect", lambda address, num_cpus, ray_code, services: seen.update(
        address=address, num_cpus=num_cpus, ray_code=ray_code, services=services) or {"CPU": 2})
    monkeypatch.setattr(stages, "fits_cluster", lambda cfg: None)

    def plan(run):
        run.placement = SimpleNamespace(layout=SimpleNamespace(train_bundles=[]))  # CPU engines only
        run.engine_in_trainer = stages.engine_in_trainer(run.cfg, 0.0)

    def launch(run, host=None):
        seen["engine_host"] = host
        run.engines = SimpleNamespace(wait_started=lambda: None)
    monkeypatch.setattr(stages, "plan_rollout_engines", plan)
    monkeypatch.setattr(stages, "launch_rollout_engines", launch)

    class FakeTrainGroup:
        def __init__(self, cfg, **kw):
            seen["train"] = kw

        def wait_ready(self):
            return self
    monkeypatch.setattr(cluster, "TrainGroup", FakeTrainGroup)
    monkeypatch.setattr(health, "HealthMonitor", lambda group, **kw: seen.update(health=kw) or SimpleNamespace(
        start=lambda: None))
    from engine.config.data import BUNDLED_TEST

    cfg = RunConfig(hf_checkpoint=BUNDLED_MODEL, prompt_data=BUNDLED_TRAIN, eval_prompt_data=BUNDLED_TEST,
                    eval_max_samples=3, seed=11,
                    work_dir=str(tmp_path / "w"), ray_address="auto", ray_code="image", num_cpus=3,
                    train_step_timeout=77.0,
                    train_threads=2, rollout_shuffle=True, rm_type="f1", use_fault_tolerance=True,
                    rollout_health_check_interval=4.0, rollout_health_check_timeout=5.0,
                    rollout_health_check_first_wait=6.0)
    run = stages.place(cfg, tracker=SimpleNamespace(run_id=None))
    assert seen["address"] == "auto" and seen["num_cpus"] == 3 and seen["ray_code"] == "image"
    assert seen["services"] == "lean"
    assert seen["train"]["placement"] is None  # one node on CPU: the workers are not placed
    assert seen["engine_host"] is None  # --use-fault-tolerance: the engine has a process of its own
    assert seen["train"]["timeout_s"] == 77.0 and seen["train"]["threads"] == 2
    order = [r.row for r in run.dataset.next_batch(5)]
    assert run.dataset.shuffle and order != [1, 2, 3, 4, 5] and run.dataset.seed == 11  # shuffled, by --seed
    assert len(run.eval_sets["test"]) == 3  # --eval-max-samples
    from engine.rewards import f1_reward
    assert run.reward_model.builtin is f1_reward
    assert seen["health"] == {"interval_s": 4.0, "timeout_s": 5.0, "first_wait_s": 6.0}


def test_the_doctor_reads_the_cluster_ray_address_names(monkeypatch):
    from engine.doctor import checks

    monkeypatch.setattr(checks.Environment, "from_ray", staticmethod(lambda address: f"cluster at {address}"))
    assert checks.Environment.for_config(RunConfig(ray_address="10.0.0.1:6379")) == "cluster at 10.0.0.1:6379"


def test_where_the_engine_runs():
    """--rollout-engine-process: auto serves the engine from train rank 0's process exactly when the flags and the
    cluster allow it; trainer where they do not is a ConfigError naming the field and what stands in the way;
    in the trainer's process the weights go by an in-process copy (tests/test_flow.py runs it end to end)."""
    from engine import stages
    from engine.diagnosis import ConfigError

    assert stages.engine_in_trainer(RunConfig(), 0.0)  # the CPU demo's shape: one engine, one rank, sync
    assert stages.engine_in_trainer(RunConfig(rollout_engine_process="trainer"), 0.0)
    for over in ({"rollout_engine_process": "own"}, {"async_mode": "one-step"}, {"use_fault_tolerance": True},
                 {"rollout_num_engines": 2}, {"actor_num_gpus_per_node": 2}):
        assert not stages.engine_in_trainer(RunConfig(**over), 0.0), over
    assert not stages.engine_in_trainer(RunConfig(), 1.0)  # GPU engines have bundles of their own
    with pytest.raises(ConfigError) as e:
        stages.engine_in_trainer(RunConfig(rollout_engine_process="trainer"), 2.0)
    assert e.value.diagnoses[0].facts["field"] == "rollout_engine_process" and "2 GPUs" in str(e.value)
    for over, named in (({"async_mode": "one-step"}, "--async-mode one-step"),
                        ({"use_fault_tolerance": True}, "--use-fault-tolerance")):
        with pytest.raises(ConfigError) as e:
            RunConfig(rollout_engine_process="trainer", **over)
        assert named in str(e.value) and e.value.diagnoses[0].facts["field"] == "rollout_engine_process"
    assert stages.sync_transport(RunConfig(), on_gpu=False, in_trainer=True) == "in_process"
    assert stages.sync_transport(RunConfig(), on_gpu=False) == "object_store"
    assert stages.sync_transport(RunConfig(weight_sync_method="disk"), on_gpu=False, in_trainer=True) == "disk"


def test_engine_spec_flags():
    from engine.rollout.engines import engine_spec

    spec = engine_spec(RunConfig(rollout_engine="sglang", weight_sync_method="disk",
                                 rollout_engine_python="/opt/sgl/bin/python", rollout_engine_start_timeout=42.0,
                                 sglang_args={"max-running-requests": "96"}), threads=1, log_dir="/tmp", on_gpu=False)
    assert spec.python == "/opt/sgl/bin/python" and spec.start_timeout_s == 42.0 and spec.max_batch == 96
    assert spec.cuda_graphs and not spec.compile_decode  # the built-in engine's GPU defaults (SGLang's)
    spec = engine_spec(RunConfig(sglang_args={"disable-cuda-graph": True, "enable-torch-compile": True}), threads=1,
                       log_dir="/tmp", on_gpu=True)
    assert not spec.cuda_graphs and spec.compile_decode  # SGLang's flags, honoured by the built-in engine


def test_the_builtin_engine_refuses_the_sglang_flags_it_does_not_read():
    """Every flag of BUILTIN_READS changes the built-in engine's spec; any other SGLang flag would do nothing with
    it and is refused, naming rollflow's own flag where one exists. SGLang takes them all; a name SGLang does not
    have is the doctor's (it names the nearest)."""
    from engine.config.sglang_args import BUILTIN_READS, known_flags
    from engine.rollout.engines import engine_spec

    given = {"api-key": "k", "max-running-requests": "7", "max-total-tokens": "99",
             "enable-deterministic-inference": True, "disable-cuda-graph": True, "enable-torch-compile": True}
    assert set(given) == set(BUILTIN_READS)
    assert set(BUILTIN_READS) <= known_flags()[1]  # SGLang's flags, as the check reads them
    assert all(f"--sglang-{k}" in RunConfig.model_fields["sglang_args"].description for k in BUILTIN_READS)  # docs
    plain = engine_spec(RunConfig(), threads=1, log_dir="/tmp", on_gpu=True)
    for flag, value in given.items():
        spec = engine_spec(RunConfig(sglang_args={flag: value}), threads=1, log_dir="/tmp", on_gpu=True)
        changed = {f for f in ("api_key", "max_batch", "max_total_tokens", "deterministic", "cuda_graphs",
                               "compile_decode") if getattr(spec, f) != getattr(plain, f)}
        assert len(changed) == 1, (flag, changed)
    with pytest.raises(ConfigError) as e:
        RunConfig(sglang_args={"mem-fraction-static": "0.7", "dtype": "bfloat16", "max-running-requests": "8"})
    d = e.value.diagnoses[0]
    assert "--sglang-mem-fraction-static, --sglang-dtype would do nothing" in d.what
    assert "--rollout-dtype for --sglang-dtype" in d.fix and "--rollout-engine sglang" in d.fix
    assert d.facts["field"] == "sglang_args" and d.facts["value"] == {"mem-fraction-static": "0.7", "dtype": "bfloat16"}
    with pytest.raises(ConfigError) as e:
        RunConfig(sglang_args={"port": "30000", "dtype": "bfloat16"})
    assert "rollflow sets --sglang-port itself" in str(e.value) and "launch SGLang with --sglang-dtype" in str(e.value)
    RunConfig(rollout_engine="sglang", weight_sync_method="disk", sglang_args={"mem-fraction-static": "0.7",
                                                                                "dtype": "bfloat16"})
    RunConfig(sglang_args={"mem-fracton-static": "0.7"})  # not SGLang's: the doctor's check names the nearest
    with pytest.raises(ConfigError, match="the built-in engine \\(--rollout-engine builtin\\) would not use it"):
        RunConfig(rollout_engine_python="/envs/sglang/bin/python")  # SGLang's environment, for the built-in engine
    with pytest.raises(ConfigError, match="--sglang-api-key \\(they configure the engines\\) would do nothing"):
        RunConfig(debug_train_only=True, rollout_function_path="engine.rollout.sft:generate_rollout",
                  sglang_args={"api-key": "k"})


# ---- train: advantages, TIS, the optimizers --------------------------------------------------------------------------
def _worker(**over):
    from engine.train.worker import TrainWorker

    cfg = RunConfig(hf_checkpoint=BUNDLED_MODEL, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8,
                    micro_batch_size=2, **over)
    return TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=2, threads=1)


def _advantages(**over) -> list[float]:
    samples = fake_samples([(4, 3)] * 8, n=4, rewards=[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    steps = [pack(samples, [[0, 1], [2, 3], [4, 5], [6, 7]])]
    _worker(**over).set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False)
    return [float(mb.advantages[mb.loss_mask > 0][k]) for mb in steps[0] for k in (0, 3)]


def test_grpo_std_normalisation_flag_and_advantage_whitening():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std 0.5774 → ±0.866 with the std, ±0.5 without (Dr.GRPO)
    assert _advantages()[:2] == pytest.approx([0.866, -0.866], abs=1e-3)
    assert _advantages(disable_grpo_std_normalization=True)[:2] == pytest.approx([0.5, -0.5])
    # slime's --disable-rewards-normalization: the raw rewards [1, 0, …] are the advantages
    assert _advantages(disable_rewards_normalization=True)[:4] == pytest.approx([1.0, 0.0, 0.0, 1.0])
    for over, says in ((dict(advantage_estimator="reinforce_plus_plus"), "has no effect"),
                       (dict(disable_grpo_std_normalization=True), "no std to leave out"),
                       (dict(custom_reward_post_process_path="m:f"), "already replace the normalisation")):
        with pytest.raises(ConfigError, match=says):
            RunConfig(disable_rewards_normalization=True, **over)
    # whitened over the rollout's 24 trained tokens (8 samples × 3, one value per sample): mean 0, unbiased token std
    # 1, so the 8 values' plain std is √(23/24) = 0.9789
    white = torch.tensor(_advantages(disable_grpo_std_normalization=True, normalize_advantages=True))
    assert float(white.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(white.std(unbiased=False)) == pytest.approx((23 / 24) ** 0.5, abs=1e-5)


def test_tis_clip_low_bounds_the_importance_weight_from_below():
    from engine.algorithms import LossSpec, policy_objective

    def loss(**over):
        spec = LossSpec.of(RunConfig(use_tis=True, tis_clip=2.0, **over))
        lp = torch.tensor([0.0, -1.0, -1.0])
        return policy_objective(spec, log_probs=lp, entropy=torch.zeros(3), old_log_probs=lp, ref_log_probs=None,
                                rollout_log_probs=torch.tensor([0.0, 0.0, 0.0]), advantages=torch.ones(3),
                                loss_mask=torch.tensor([0.0, 1.0, 1.0]), cu_seqlens=torch.tensor([0, 3]),
                                denominator=1.0)[0]
    # w = π_train / π_engine = e⁻¹ = 0.368 per trained token: kept at tis_clip_low 0, raised to 0.5 at 0.5;
    # the PPO loss per token is −ρA = −1, so the sample's token mean is −w
    assert float(loss()) == pytest.approx(-0.3679, abs=1e-4)
    assert float(loss(tis_clip_low=0.5)) == pytest.approx(-0.5)


def test_tis_level_reaches_the_policy_objective():
    """--tis-level sequence / geometric: the sample's trained tokens' log-ratios (-1 and -2 here) summed or averaged,
    one weight for the sample; the PPO loss per token is −ρA = −1, so the sample's token mean is −w."""
    from engine.algorithms import LossSpec, policy_objective

    def loss(**over):
        spec = LossSpec.of(RunConfig(use_tis=True, tis_clip=2.0, **over))
        lp = torch.tensor([0.0, -1.0, -2.0])
        return policy_objective(spec, log_probs=lp, entropy=torch.zeros(3), old_log_probs=lp, ref_log_probs=None,
                                rollout_log_probs=torch.zeros(3), advantages=torch.ones(3),
                                loss_mask=torch.tensor([0.0, 1.0, 1.0]), cu_seqlens=torch.tensor([0, 3]),
                                denominator=1.0)[0]
    assert float(loss()) == pytest.approx(-(math.exp(-1) + math.exp(-2)) / 2, abs=1e-5)  # token level
    assert float(loss(tis_level="sequence")) == pytest.approx(-math.exp(-3), abs=1e-5)
    assert float(loss(tis_level="geometric")) == pytest.approx(-math.exp(-1.5), abs=1e-5)
    with pytest.raises(ConfigError) as e:
        RunConfig(tis_level="sequence")
    assert e.value.diagnoses[0].facts["field"] == "tis_level" and "without --use-tis" in e.value.diagnoses[0].what
    # a custom TIS function may read it (slime's MIS helper reads args.tis_level)
    assert RunConfig(use_tis=True, tis_level="geometric", custom_tis_function_path="examples/hooks.py:icepop")


def test_optimizer_flags():
    w = _worker(weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, advantage_estimator="ppo", lr=1e-4,
                critic_lr=3e-5)
    g = w.backend.optimizer.param_groups[0]
    assert g["weight_decay"] == 0.1 and g["betas"] == (0.8, 0.95) and g["lr"] == 1e-4
    assert w.critic.optimizer.param_groups[0]["lr"] == 3e-5  # the critic's own learning rate
    assert _worker(advantage_estimator="ppo", lr=1e-4).critic.optimizer.param_groups[0]["lr"] == 1e-4  # default


def test_reset_optimizer_states_zeroes_adams_moments_before_each_rollout():
    """slime's --reset-optimizer-states: at the start of a rollout's training Adam's moments and step count are 0,
    so after that rollout's one step exp_avg = (1 − β1)·g of that step alone (without the flag it also carries
    β1 times the first step's); the LR schedule is not reset."""
    def two_rollouts(**over):
        w = _worker(lr=1e-3, **over)
        for seed in (0, 1):
            samples = fake_samples([(4, 3)] * 8, n=4, seed=seed)
            steps = [pack(samples, [[0, 1], [2, 3], [4, 5], [6, 7]])]
            w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False)
            w.train_step(0, 8)
        p = next(q for q in w.backend.model.parameters() if q.grad is not None and q.grad.abs().sum() > 0)
        st = w.backend.optimizer.state[p]
        return st, p.grad, w.backend.scheduler.last_epoch

    beta1 = RunConfig().adam_beta1
    st, g, steps = two_rollouts(reset_optimizer_states=True)
    assert float(st["step"]) == 1.0 and steps == 2
    torch.testing.assert_close(st["exp_avg"], (1 - beta1) * g)
    st, g, _ = two_rollouts()
    assert float(st["step"]) == 2.0 and not torch.allclose(st["exp_avg"], (1 - beta1) * g)
    # the megatron backend resets its inner optimizers the same way (tests/test_megatron_backend.py, on a GPU)
    assert RunConfig(reset_optimizer_states=True, train_backend="megatron").reset_optimizer_states


def test_stateless_adam_keeps_no_state_and_trains_as_adamw_reset_before_every_step(tmp_path):
    """slime's --use-stateless-adam: no optimizer state at all (policy and PPO's critic), and with one step per
    rollout the same weights as AdamW reset before each step (--reset-optimizer-states); a checkpoint still
    resumes bit for bit (the schedule and RNG state)."""
    def rollout(w, seed):
        samples = fake_samples([(4, 3)] * 8, n=4, seed=seed)
        steps = [pack(samples, [[0, 1], [2, 3], [4, 5], [6, 7]])]
        w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False)
        return w.train_step(0, 8)

    def trained(n, **over):
        torch.manual_seed(0)
        w = _worker(lr=1e-3, weight_decay=0.1, advantage_estimator="ppo", **over)
        for seed in range(n):
            rollout(w, seed)
        return w

    def far(a, b) -> float:  # the share of weights more than 1e-6 apart
        d = torch.cat([(p - q).abs().flatten() for p, q in zip(a.parameters(), b.parameters())])
        return float((d > 1e-6).float().mean())

    one = [trained(1, use_stateless_adam=True), trained(1, reset_optimizer_states=True)]
    for a, b in ((one[0].backend.model, one[1].backend.model), (one[0].critic.model, one[1].critic.model)):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=1e-7, rtol=0, msg=name)  # one step: equal up to rounding
    stateless, reset = trained(3, use_stateless_adam=True), trained(3, reset_optimizer_states=True)
    assert len(stateless.backend.optimizer.state) == 0 and len(stateless.critic.optimizer.state) == 0
    assert len(reset.backend.optimizer.state) > 0  # AdamW keeps exp_avg / exp_avg_sq per parameter
    # three steps: Adam's first step moves a weight by ≈ lr·sign(g), so where a gradient is at rounding level
    # the two may step apart; that is a small share, where plain AdamW (its moments carried) differs almost
    # everywhere
    assert far(stateless.backend.model, reset.backend.model) < 0.005
    assert far(trained(3).backend.model, reset.backend.model) > 0.5
    # a checkpoint of a stateless run resumes exactly: save after rollout 2, load into a fresh worker, train on
    stateless.save(str(tmp_path / "ck"))
    after = _worker(lr=1e-3, weight_decay=0.1, advantage_estimator="ppo", use_stateless_adam=True)
    after.load(str(tmp_path / "ck"))
    assert after.backend.scheduler.last_epoch == stateless.backend.scheduler.last_epoch == 3
    rollout(stateless, 3)
    rollout(after, 3)
    assert all(torch.equal(p, q) for p, q in zip(stateless.backend.model.parameters(),
                                                 after.backend.model.parameters()))
    for over, says in ((dict(train_backend="megatron"), "torch backend only"),
                       (dict(reset_optimizer_states=True), "nothing to reset")):
        with pytest.raises(ConfigError, match=says):
            RunConfig(use_stateless_adam=True, **over)


def test_megatron_cuda_graphs_flag_reaches_the_kernels():
    from engine.train.megatron_model import Kernels, cuda_graphs_off_reason

    off = Kernels.of(RunConfig(megatron_cuda_graphs=False))
    assert cuda_graphs_off_reason(off, tp=1, pp=1, dtype=torch.bfloat16) == "--no-megatron-cuda-graphs"
    assert Kernels.of(RunConfig(recompute_activations=True)).recompute


def test_train_threads_sizes_the_workers():
    assert Run(RunConfig(train_threads=3)).train_threads == 3
    # 0: synchronous runs alternate engine and trainer, each gets the cores less one for the driver; async runs share
    assert Run(RunConfig(num_cpus=8, rollout_num_engines=1)).train_threads == 7  # one core left to the driver
    assert Run(RunConfig(num_cpus=8, rollout_num_engines=1, async_mode="one-step")).train_threads == 4
    assert Run(RunConfig(num_cpus=8, rollout_num_engines=3)).threads_per_process == 2  # 7 // max(1 worker, 3 engines)
    assert Run(RunConfig(num_cpus=2, rollout_num_engines=1)).threads_per_process == 1  # the CPU demo: 1 + the driver
    assert Run(RunConfig(num_cpus=1, rollout_num_engines=1)).threads_per_process == 1


# ---- sync: deadlines and bucket sizes -------------------------------------------------------------------------------
def test_sync_flags(tmp_path, monkeypatch):
    from engine import stages
    from engine.weights import sync

    seen: dict = {}
    monkeypatch.setattr(sync, "push_object_store",
                        lambda slots, ref, version, timeout_s, api_key=None: seen.update(os=timeout_s))
    monkeypatch.setattr(sync, "push_ipc",
                        lambda slots, buckets, version, timeout_s, api_key=None: seen.update(ipc=timeout_s))
    group = SimpleNamespace(weights_ref=lambda: ("ref", 1.0), ipc_release=lambda: None,
                            ipc_export=lambda dtype, size, exporters: seen.update(bucket=size) or [[]])
    run = _run(tmp_path, weight_sync_timeout=33.0, update_weight_buffer_size=8 * 2**20)
    run.train_group = group
    stages.push_weights(run, [SimpleNamespace(index=0, bundle=0)], 1)
    assert seen["os"] == 33.0
    run.sync_transport = "cuda_ipc"
    stages.push_weights(run, [SimpleNamespace(index=0, bundle=0)], 2)
    assert seen["ipc"] == 33.0 and seen["bucket"] == 8 * 2**20


def test_update_weight_buffer_size_splits_the_buckets():
    from engine.weights.ipc import flatten_buckets

    named = {f"w{i}": torch.ones(256, 256) for i in range(4)}  # 4 × 128 KiB in bf16
    assert len(flatten_buckets(named, torch.bfloat16, 2**20)) == 1
    assert len(flatten_buckets(named, torch.bfloat16, 256 * 1024)) == 2


# ---- the command line and tracking -----------------------------------------------------------------------------------
def test_progress_flag_turns_the_bar_off():
    from plumbing.ui import progress_bar

    assert progress_bar(RunConfig(progress=False), 0).disable
    bar = progress_bar(RunConfig(progress=True, num_rollout=4), 1)
    assert not bar.disable and bar.total == 4 and bar.n == 1
    bar.close()


def test_summary_json_is_written_by_rollflow_train(tmp_path, monkeypatch):
    import json

    import flows.train
    from flows.cli import main

    summary = {"rollouts": 0, "reward_first": None, "reward_last": None, "test_accuracy_before": None,
               "test_accuracy_after": None, "wall_s": 0.0, "flow_run_id": "f", "save_dir": None}
    monkeypatch.setattr(flows.train, "rl_train", lambda cfg: summary)
    from plumbing import prestart  # no Prefect server nor Ray cluster for a flow that is not run (they would
    monkeypatch.setattr(prestart, "launch_ephemeral_api_early", lambda: None)  # outlive the test in this
    monkeypatch.setattr(prestart, "launch_ephemeral_api", lambda: None)  # process)
    monkeypatch.setattr(prestart, "start_ray", lambda cfg: False)
    out = tmp_path / "deep" / "summary.json"
    import gc

    try:
        assert main(["train", "--summary-json", str(out), "--eval-prompt-data", ""]) == 0
        # start-up ran without the cyclic collector; it is back on, start-up's objects frozen (plumbing/prestart)
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert json.loads(out.read_text()) == summary


# ---- tracking ---------------------------------------------------------------------------------------------------------
def test_log_samples_interval():
    from engine.tracking.record import should_log_samples

    cfg = RunConfig(log_samples_interval=5, num_rollout=12)
    assert [i for i in range(12) if should_log_samples(cfg, i)] == [0, 5, 10, 11]  # and always the last
    assert not any(should_log_samples(RunConfig(log_samples_interval=0, num_rollout=12), i) for i in range(12))


def test_rollout_max_prompt_len_drops_the_long_rows_when_the_data_is_loaded(tmp_path, caplog):
    """slime's --rollout-max-prompt-len: rows whose rendered prompt (chat template included) is longer are not
    drawn; the log names them; a limit that drops every row is a DATA error; preflight does not count the dropped
    rows against the context; a resume keeps the setting."""
    import json
    import logging

    from engine import stages
    from engine.doctor.checks import Environment, prompts_fit_context
    from engine.modeling import render_prompt

    p = tmp_path / "d.jsonl"
    prompts = ["1+1=", "12+34=", "7+" * 1100, "2+2="]
    p.write_text("".join(json.dumps({"prompt": q, "label": "1"}) + "\n" for q in prompts))
    run = _run(tmp_path, prompt_data=str(p), apply_chat_template=True)
    sizes = [len(render_prompt(run.tokenizer, q, True)) for q in prompts]
    limit = sizes[0]  # "1+1=" and "2+2=" fit, "12+34=" is 2 tokens longer, the third far too long
    run = _run(tmp_path, prompt_data=str(p), apply_chat_template=True, rollout_max_prompt_len=limit)
    with caplog.at_level(logging.WARNING):
        kept = stages.short_prompts(run, run.dataset.rows)
    assert [r.row for r in kept] == [1, 4] and "dropped 2 of 4 --prompt-data rows (lines 2, 3" in caplog.text
    stages.load_driver_side(run, SimpleNamespace(run_id=None))  # what place() reads: the dataset drawn from
    assert [r.row for r in run.dataset.rows] == [1, 4]
    run = _run(tmp_path, prompt_data=str(p), apply_chat_template=True, rollout_max_prompt_len=2)
    with pytest.raises(DiagnosisError, match=f"drops every one of the 4 --prompt-data rows.*{min(sizes)} tokens"):
        stages.short_prompts(run, run.dataset.rows)
    # the 2,200-token row overflows the tiny model's 2,048-token context; once dropped it does not count
    cfg = RunConfig(prompt_data=str(p), apply_chat_template=True, eval_prompt_data="", rollout_max_response_len=8)
    assert [d.code for d in prompts_fit_context(cfg, Environment())] == ["DATA"]
    assert prompts_fit_context(RunConfig(**{**cfg.model_dump(), "rollout_max_prompt_len": 64}), Environment()) == []
    assert "rollout_max_prompt_len" in RunConfig(rollout_max_prompt_len=64).fixed_settings()


def test_max_context_len_caps_prompts_and_answers_and_the_doctor_counts_the_cap(tmp_path, caplog):
    """slime's --rollout-max-context-len / --eval-max-context-len: prompts of the cap or more tokens are dropped
    (slime's default --rollout-max-prompt-len = cap − 1), the engines get the cap with the sampling params (the
    loop asks each group for what its prompt leaves: tests/test_rollout_loop.py), preflight checks the cap against
    the model's context instead of counting each prompt, and a resume keeps it."""
    import json

    from engine import stages
    from engine.doctor.checks import Environment, prompts_fit_context
    from engine.modeling import render_prompt

    p = tmp_path / "d.jsonl"
    prompts = ["1+1=", "12+34=", "7+" * 1100, "2+2="]
    p.write_text("".join(json.dumps({"prompt": q, "label": "1"}) + "\n" for q in prompts))
    run = _run(tmp_path, prompt_data=str(p), apply_chat_template=True)
    cap = len(render_prompt(run.tokenizer, "1+1=", True)) + 1  # "1+1=" leaves one token; "12+34=" none
    run = _run(tmp_path, prompt_data=str(p), apply_chat_template=True, rollout_max_context_len=cap)
    assert run.cfg.prompt_cap() == (cap - 1, "--rollout-max-context-len")
    stages.load_driver_side(run, SimpleNamespace(run_id=None))
    assert [r.row for r in run.dataset.rows] == [1, 4]
    assert stages.sampling_params(run).max_context_len == cap
    assert stages.sampling_params(run).budget(cap - 1) == 1
    run.eval_datasets = {}
    assert stages.eval_sampling_params(run).max_context_len == cap  # the eval's default
    assert RunConfig(rollout_max_context_len=64, eval_max_context_len=32).prompt_cap(evaluation=True) == \
        (31, "--eval-max-context-len")
    with pytest.raises(ConfigError, match="--rollout-max-prompt-len 10 is not below --rollout-max-context-len 10"):
        RunConfig(rollout_max_prompt_len=10, rollout_max_context_len=10)
    # the 2,200-token row would overflow the model's 2,048 tokens with any answer; under a cap it is dropped
    cfg = dict(prompt_data=str(p), apply_chat_template=True, eval_prompt_data="", rollout_max_response_len=8)
    assert [d.code for d in prompts_fit_context(RunConfig(**cfg), Environment())] == ["DATA"]
    assert prompts_fit_context(RunConfig(**cfg, rollout_max_context_len=64), Environment()) == []
    (d,) = prompts_fit_context(RunConfig(**cfg, rollout_max_context_len=4096), Environment())
    assert "--rollout-max-context-len 4096 is above the model's context of 2048" in d.what
    assert "rollout_max_context_len" in RunConfig(rollout_max_context_len=64).fixed_settings()


def test_eval_max_prompt_len_drops_long_eval_rows_before_the_eval_max_samples_are_taken(tmp_path, caplog):
    """slime's --eval-max-prompt-len: the same as --rollout-max-prompt-len for each eval set, before
    --eval-max-samples; the log names the set; preflight does not count the dropped rows against the context."""
    import json
    import logging

    from engine import stages
    from engine.doctor.checks import Environment, prompts_fit_context

    p = tmp_path / "e.jsonl"
    prompts = ["7+" * 1100, "1+1=", "12+34=", "2+2=", "3+3="]
    p.write_text("".join(json.dumps({"prompt": q, "label": "1"}) + "\n" for q in prompts))
    over = dict(apply_chat_template=True, eval_prompt_data=["long", str(p)], eval_max_samples=2)
    run = _run(tmp_path, eval_max_prompt_len=64, **over)
    with caplog.at_level(logging.WARNING):
        stages.load_driver_side(run, SimpleNamespace(run_id=None))
    assert [r.row for r in run.eval_sets["long"]] == [2, 3]  # row 1 dropped, then the first 2 kept
    assert "--eval-max-prompt-len 64: dropped 1 of 5 eval set 'long' rows (lines 1;" in caplog.text
    run = _run(tmp_path, **over)
    stages.load_driver_side(run, SimpleNamespace(run_id=None))
    assert [r.row for r in run.eval_sets["long"]] == [1, 2]
    cfg = RunConfig(rollout_max_response_len=8, **over)
    assert [d.code for d in prompts_fit_context(cfg, Environment())] == ["DATA"]
    assert prompts_fit_context(RunConfig(eval_max_prompt_len=64, rollout_max_response_len=8, **over),
                               Environment()) == []


def _thinking_model(tmp_path):
    """The bundled model with a Qwen3-style template: `enable_thinking=false` writes an empty think block."""
    import json
    import shutil

    d = tmp_path / "thinking-model"
    shutil.copytree(BUNDLED_MODEL, d)
    template = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
                "{%- endif %}{%- endif %}")
    (d / "chat_template.jinja").write_text(template)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    conf["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    return str(d)


def test_apply_chat_template_kwargs_reach_every_rendering_of_a_prompt(tmp_path):
    """slime's --apply-chat-template-kwargs: the rollout's prompts, the RF14 probe prompts and the doctor's length
    check render with them; a key the template never reads, bad JSON, a key rollflow sets itself, or the flag
    without --apply-chat-template is refused, naming the flag."""
    from engine import stages
    from engine.config.cli import parse_args
    from engine.diagnosis import ConfigError
    from engine.doctor.checks import Environment, model_dir_usable, prompts_fit_context

    model = _thinking_model(tmp_path)
    off = '{"enable_thinking": false}'
    plain = _run(tmp_path, hf_checkpoint=model, apply_chat_template=True)
    thinking_off = _run(tmp_path, hf_checkpoint=model, apply_chat_template=True, apply_chat_template_kwargs=off)
    rows = plain.dataset.rows[:2]
    without = [p.ids for p in stages._prompts(plain, rows)]
    with_kw = [p.ids for p in stages._prompts(thinking_off, rows)]
    assert all("<think>" not in plain.tokenizer.decode(ids) for ids in without)
    assert all(plain.tokenizer.decode(b).endswith("<think>\n\n</think>\n\n") and b[:len(a)] == a
               for a, b in zip(without, with_kw))
    thinking_off.dataset.load_state({"epoch": 0, "offset": 0})
    drawn = stages.data_source(thinking_off).get_samples(1)[0][0]  # what a generate hook / rollout function draws
    assert drawn.tokens == with_kw[0]
    thinking_off.eval_sets = {}
    assert stages.probe_prompts(thinking_off)[0] == with_kw[0]
    # the doctor's context check counts the longer prompt: a response length that leaves room for the plain
    # rendering of the longest prompt but not for the think block
    ctx = 2048
    longest = max(len(p.ids) for p in stages._prompts(plain, plain.dataset.rows))
    cfg = dict(hf_checkpoint=model, apply_chat_template=True, eval_prompt_data="",
               rollout_max_response_len=ctx - longest)
    assert prompts_fit_context(RunConfig(**cfg), Environment()) == []
    assert [d.code for d in prompts_fit_context(RunConfig(**cfg, apply_chat_template_kwargs=off), Environment())] \
        == ["DATA"]
    assert model_dir_usable(RunConfig(hf_checkpoint=model, apply_chat_template=True,
                                      apply_chat_template_kwargs=off), Environment()) == []
    (bad,) = model_dir_usable(RunConfig(hf_checkpoint=model, apply_chat_template=True,
                                        apply_chat_template_kwargs='{"enable_thinkng": false}'), Environment())
    assert bad.code == "CONFIG" and "never reads enable_thinkng" in bad.what and "enable_thinking" in bad.what
    # the command line's JSON; the refusals name the flag
    cfg = parse_args(["--apply-chat-template", "--apply-chat-template-kwargs", off])
    assert cfg.apply_chat_template_kwargs == {"enable_thinking": False}
    for value, why in (("{enable_thinking: false}", "not JSON"), ('["x"]', "a JSON object is needed"),
                       ('{"add_generation_prompt": false}', "set by rollflow itself")):
        with pytest.raises(ConfigError, match=f"--apply-chat-template-kwargs.*{why}"):
            parse_args(["--apply-chat-template", "--apply-chat-template-kwargs", value])
    with pytest.raises(ConfigError, match="--apply-chat-template is off"):
        parse_args(["--apply-chat-template-kwargs", off])


def test_freeze_and_only_train_params_leave_the_matching_weights_untouched():
    """slime's --freeze-params-name-list / --only-train-params-name-list (re.search on the HF names): a frozen
    parameter gets no gradient and no update (not even AdamW's decay), the others move; a tied embedding / LM head
    is frozen by either name; a pattern that matches nothing, or freezing everything, is a CONFIG error."""
    def one_step(**over):
        w = _worker(lr=1e-3, weight_decay=0.1, **over)
        before = {k: v.clone() for k, v in w.backend.model_state().items()}
        samples = fake_samples([(4, 3)] * 8, n=4, seed=2)
        steps = [pack(samples, [[0, 1], [2, 3], [4, 5], [6, 7]])]
        w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False)
        w.train_step(0, 8)
        after = w.backend.model_state()
        return {k for k in before if not torch.equal(before[k], after[k])}, set(before)

    moved, names = one_step(freeze_params_name_list=["embed_tokens", r"layers\.0\."])
    assert moved and not any("embed_tokens" in k or ".layers.0." in k for k in moved)
    assert any(".layers.1." in k for k in moved)
    moved, _ = one_step(only_train_params_name_list=[r"layers\.3\.mlp"])
    assert moved and all(".layers.3.mlp" in k for k in moved)
    moved, _ = one_step(only_train_params_name_list=[r"layers\.3\."], freeze_params_name_list=["mlp"])
    assert moved and all(".layers.3." in k and "mlp" not in k for k in moved)
    with pytest.raises(ConfigError, match="'no_such_layer' matches no parameter"):
        one_step(freeze_params_name_list=["no_such_layer"])
    with pytest.raises(ConfigError, match="freeze every parameter"):
        one_step(freeze_params_name_list=["."])
    from engine.config.cli import parse_args

    with pytest.raises(ConfigError, match="--freeze-params-name-list .*'layers.\\(' is not a regular expression"):
        parse_args(["--freeze-params-name-list", "layers.("])
    with pytest.raises(ConfigError, match="--only-train-params-name-list with --train-backend megatron: only the "
                                          "torch backend has it"):
        RunConfig(only_train_params_name_list=["mlp"], train_backend="megatron")


TOOLS_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\nTools: ' }}{%- for t in tools %}{{- t['function']['name'] + ' ' }}"
                  "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + "
                  "message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if "
                  "add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_tool_key_puts_each_rows_tools_into_its_prompt_and_metadata(tmp_path):
    """slime's --tool-key: a row's tools (a list, or its JSON text) reach the chat template as `tools` and the
    sample's metadata; the eval sets read them with --eval-tool-key (default --tool-key); the doctor's length check
    counts them; '' reads none; a value that is not a list is a DATA error naming the line."""
    import json
    import shutil

    from engine import stages
    from engine.data import load_prompts
    from engine.doctor.checks import Environment, prompts_fit_context

    model = tmp_path / "m"
    shutil.copytree(BUNDLED_MODEL, model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)  # lists the tools, as Qwen's template does
    fn = lambda name: {"type": "function", "function": {"name": name, "parameters": {}}}  # noqa: E731
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "1+1=", "label": "2", "tools": [fn("calc")]},
        {"prompt": "2+2=", "label": "4", "tools": json.dumps([fn("adder"), fn("mul")])},
        {"prompt": "3+3=", "label": "6"}]))
    run = _run(tmp_path, hf_checkpoint=str(model), prompt_data=str(p), apply_chat_template=True)
    stages.load_driver_side(run, SimpleNamespace(run_id=None))
    rows = run.dataset.rows
    assert [r.tools and [t["function"]["name"] for t in r.tools] for r in rows] == [["calc"], ["adder", "mul"], None]
    assert rows[1].metadata["tools"] == rows[1].tools and "tools" not in rows[2].metadata
    texts = [run.tokenizer.decode(pr.ids) for pr in stages._prompts(run, rows)]
    assert "Tools: calc <|im_end|>" in texts[0] and "Tools: adder mul <|im_end|>" in texts[1]
    assert "Tools" not in texts[2]
    assert texts[0].endswith("<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n")

    assert [d.tool_key for d in RunConfig().eval_datasets()] == ["tools"]
    assert [d.tool_key for d in RunConfig(eval_tool_key="fns").eval_datasets()] == ["fns"]
    assert load_prompts(str(p), input_key="prompt", label_key="label", tool_key=None)[0].tools is None
    assert RunConfig(tool_key="").tool_key == ""  # '' reads none (load_prompts skips a falsy key)

    long = tmp_path / "long.jsonl"  # tools of ~2,100 characters: past the tiny model's 2,048-token context
    long.write_text(json.dumps({"prompt": "1+1=", "label": "2", "tools": [fn("f" * 2100)]}) + "\n")
    cfg = dict(hf_checkpoint=str(model), prompt_data=str(long), apply_chat_template=True, eval_prompt_data="",
               rollout_max_response_len=8)
    assert [d.code for d in prompts_fit_context(RunConfig(**cfg), Environment())] == ["DATA"]
    assert prompts_fit_context(RunConfig(**cfg, tool_key=""), Environment()) == []

    for bad, why in (({"calc": 1}, "a dict, not a list of tools"), ("[oops", "text that is not JSON")):
        p.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n" + json.dumps(
            {"prompt": "1+1=", "label": "2", "tools": bad}) + "\n")
        with pytest.raises(ConfigError, match=f"line 2 has 'tools' = .*{why}"):
            load_prompts(str(p), input_key="prompt", label_key="label", tool_key="tools")


def test_deterministic_mode_reaches_the_train_worker_and_megatron_core(monkeypatch):
    """--deterministic-mode: a train worker (its own process: the setting is process-wide) runs with deterministic
    algorithms only and cuDNN's autotuning off, cuBLAS's reproducible workspace and NCCL's Ring algorithm set, a
    value the environment gives kept; without the flag none of it. The Megatron backend's TransformerConfig gets
    megatron-core's deterministic_mode."""
    import json
    import os
    import subprocess
    import sys

    probe = ("import json, os, sys, torch\n"
             "from engine.config import RunConfig\n"
             "from engine.train.worker import TrainWorker\n"
             "cfg = RunConfig(hf_checkpoint=sys.argv[1], deterministic_mode=sys.argv[2] == '1')\n"
             "TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=1, threads=1)\n"
             "print(json.dumps([torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,\n"
             "                  torch.backends.cudnn.benchmark, os.environ.get('CUBLAS_WORKSPACE_CONFIG'),\n"
             "                  os.environ.get('NCCL_ALGO')]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO")}

    def worker(on: bool, **extra) -> list:
        out = subprocess.run([sys.executable, "-c", probe, BUNDLED_MODEL, "1" if on else "0"], capture_output=True,
                             text=True, timeout=120, env={**env, **extra})
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert worker(True, NCCL_ALGO="Tree") == [True, True, False, ":4096:8", "Tree"]
    before = (torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    _worker()  # (in this process: without the flag a worker leaves all of it as it is)
    assert (torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")) == before

    import megatron.core.transformer.transformer_config as tc

    from engine.model_shape import read
    from engine.train import megatron_model as mm

    seen = {}

    def capture(**kw):
        seen.update(kw)
        raise RuntimeError("captured")
    monkeypatch.setattr(tc, "TransformerConfig", capture)
    for on in (True, False):
        seen.clear()
        with pytest.raises(RuntimeError, match="captured"):
            mm.build_model(read(BUNDLED_MODEL), vocab_padded=128, dtype=torch.float32, tp=1, pp=1, deterministic=on)
        assert seen.get("deterministic_mode", False) is on
