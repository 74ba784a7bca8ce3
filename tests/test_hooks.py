"""slime's hook flags through the rollout stage, over real HTTP against the built-in engine: a multi-turn generate
hook (tool tokens masked, the engine's log-probs for the model's tokens), the other hooks' contracts, and every
hook's failure path (a HookError naming the flag, the function and the traceback; never retried)."""
from __future__ import annotations

from types import SimpleNamespace

import hook_fakes
import pytest
import torch

from engine.config import RunConfig
from engine.config.data import BUNDLED_TRAIN
from engine.diagnosis import ConfigError
from engine.rollout.hooks import HookError
from engine.rollout.loop import StaticEngines
from engine.rollout.ports import free_loopback_port
from engine.rollout.server import EngineState, ServerThread
from engine.samples import Status


@pytest.fixture(scope="module")
def engine_url(tiny_model):
    state = EngineState(tiny_model, threads=1, max_new_tokens=8, deterministic=True)
    server = ServerThread(state, "127.0.0.1", free_loopback_port())
    yield server.start()
    server.stop()


def make_run(tmp_path, url, **over):
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import eos_token_ids, load_tokenizer
    from engine.rewards import RewardModel
    from engine.run import Run
    from engine.stages import load_hooks

    base = dict(prompt_data=BUNDLED_TRAIN, eval_prompt_data="", work_dir=str(tmp_path / "w"), rollout_batch_size=2,
                n_samples_per_prompt=2, rollout_max_response_len=16, apply_chat_template=True)
    cfg = RunConfig(**{**base, **over})
    run = Run(cfg)
    run.tokenizer = load_tokenizer(cfg.hf_checkpoint)
    run.eos_ids = eos_token_ids(cfg.hf_checkpoint, run.tokenizer)
    run.dataset = PromptDataset(load_prompts(cfg.prompt_data, input_key="prompt", label_key="label"), shuffle=False,
                                seed=0)
    run.reward_model = RewardModel.of(cfg)
    run.engines = StaticEngines([url]) if url else SimpleNamespace(release_memory=lambda: None)
    load_hooks(run)
    return run


def rollout(run, rollout_id=0):
    from engine import stages

    return stages.rollout(run, rollout_id)


# ---- --custom-generate-function-path: multi-turn with a tool ------------------------------------------------------
def test_multi_turn_sample_masks_the_tool_and_keeps_the_engines_logprobs(tmp_path, engine_url, tiny_model):
    from transformers import AutoModelForCausalLM

    from engine.packing.microbatch import make_micro_batch
    from engine.train.forward import packed_forward

    hook_fakes.CALLS.clear()
    run = make_run(tmp_path, engine_url, custom_generate_function_path="hook_fakes:two_turns",
                   rollout_batch_size=2, n_samples_per_prompt=3)
    batch = rollout(run, rollout_id=5)
    samples = [s for g in batch.groups for s in g]
    assert len(samples) == 6 and [s.index for s in samples] == list(range(6))
    assert len(hook_fakes.CALLS) == 6 and {c["rollout_id"] for c in hook_fakes.CALLS} == {5}
    assert len({c["seed"] for c in hook_fakes.CALLS}) == 6  # a sampling seed of its own per sample
    tool = run.tokenizer.encode(hook_fakes.TOOL_TEXT, add_special_tokens=False)
    for s in samples:
        n1, nt, n2 = s.metadata["turns"]
        assert nt == len(tool) and s.response_length == n1 + nt + n2
        assert s.tokens[s.prompt_length + n1:s.prompt_length + n1 + nt] == tool
        assert s.loss_mask == [1] * n1 + [0] * nt + [1] * n2
        assert s.metadata["draw_index"] == s.group_index and s.reward is not None

    # the engine's log-probs are those of the model's own tokens: the trainer's forward of the whole sample agrees
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    mb = make_micro_batch(samples, [0.0] * len(samples))
    with torch.no_grad():
        lp, _ = packed_forward(model, mb)
    trained = mb.loss_mask.bool()
    assert int(trained.sum()) == sum(sum(s.loss_mask) for s in samples)
    assert torch.allclose(lp[trained], mb.rollout_log_probs[trained], atol=2e-4)
    assert float(lp[~trained].abs().sum()) == 0.0  # tool and prompt tokens: no log-prob, no loss


def test_log_multi_turn_counts_model_and_tool_tokens_and_rounds(tmp_path, engine_url):
    """--log-multi-turn (slime's flag) on the two-turn generate hook: trained tokens are the model's two turns,
    observation tokens the tool's, rounds the metadata's; off, none of these metrics is logged."""
    run = make_run(tmp_path, engine_url, custom_generate_function_path="hook_fakes:two_turns", log_multi_turn=True,
                   rollout_batch_size=2, n_samples_per_prompt=3)
    batch = rollout(run)
    samples = [s for g in batch.groups for s in g]
    turns = [s.metadata["turns"] for s in samples]
    m = batch.metrics
    assert m["rollout/multi_turn_trained_len_mean"] == pytest.approx(sum(a + c for a, _, c in turns) / len(turns))
    assert m["rollout/multi_turn_trained_len_max"] == max(a + c for a, _, c in turns)
    obs = sum(b for _, b, _ in turns) / len(turns)
    assert m["rollout/multi_turn_observation_len_mean"] == pytest.approx(obs) and obs > 0
    assert m["rollout/multi_turn_response_len_min"] == min(s.response_length for s in samples)
    assert m["rollout/multi_turn_round_number_mean"] == m["rollout/multi_turn_round_number_max"] == 2
    assert 0 <= m["rollout/multi_turn_clip_ratio"] <= 1
    off = rollout(make_run(tmp_path, engine_url, custom_generate_function_path="hook_fakes:two_turns"))
    assert not [k for k in off.metrics if "multi_turn" in k]


def test_generate_hook_failures_name_the_hook_and_are_not_retried(tmp_path, engine_url):
    from plumbing.policy import retry_unless_config_error

    run = make_run(tmp_path, engine_url, custom_generate_function_path="hook_fakes:raises")
    position = run.dataset.state()
    with pytest.raises(HookError) as e:
        rollout(run)
    msg = str(e.value)
    assert "--custom-generate-function-path 'hook_fakes:raises' raised KeyError" in msg
    assert "hook_fakes.py" in msg and "in raises" in msg  # the hook's own traceback
    assert run.dataset.state() == position  # a rerun takes the same prompts
    state = SimpleNamespace(result=lambda: (_ for _ in ()).throw(e.value))
    assert retry_unless_config_error(None, None, state) is False

    with pytest.raises(HookError, match="1 loss-mask entries for response_length 2|loss-mask entries for response"):
        rollout(make_run(tmp_path, engine_url, custom_generate_function_path="hook_fakes:short_mask",
                         rollout_max_response_len=2))
    with pytest.raises(HookError, match="returned a list instead of a Sample"):
        rollout(make_run(tmp_path, engine_url, custom_generate_function_path="hook_fakes:fan_out"))


def test_a_hook_path_that_does_not_load_fails_at_start(tmp_path):
    with pytest.raises(ConfigError, match="--custom-generate-function-path 'hook_fakes:nope' cannot be loaded"):
        make_run(tmp_path, None, custom_generate_function_path="hook_fakes:nope")
    with pytest.raises(ConfigError, match="--rollout-function-path .* replaces the built-in rollout"):
        RunConfig(rollout_function_path="hook_fakes:fixed_rollout",
                  custom_generate_function_path="hook_fakes:two_turns")


def test_a_hook_with_the_wrong_signature_fails_when_it_is_loaded():
    """Every hook flag's function is checked against how rollflow calls it when it is loaded (at start), not at its
    first call: a wrong arity is a ConfigError naming the flag, the function's signature and the expected call;
    every example of examples/hooks.py passes for the flag its comment names; each checked flag is a real flag."""
    import re
    from pathlib import Path

    from engine.rewards import HOOK_CALLS, load_function

    with pytest.raises(ConfigError, match=r"--rollout-data-postprocess-path 'hook_fakes:slime_filter' has the "
                                          r"signature slime_filter\(args, samples\), but rollflow calls it as "
                                          r"fn\(args, rollout_id, rollout_data\)"):
        load_function("hook_fakes:slime_filter", "--rollout-data-postprocess-path")
    with pytest.raises(ConfigError, match="--custom-tis-function-path .* calls it as fn\\(args, \\*, pg_loss"):
        load_function("hook_fakes:slime_filter", "--custom-tis-function-path")
    with pytest.raises(ConfigError, match="--rollout-sample-filter-path"):
        make_run_cfg = RunConfig(rollout_sample_filter_path="hook_fakes:record_all_samples")
        from engine.rollout.hooks import Hooks

        Hooks.load(make_run_cfg)
    assert load_function("hook_fakes:slime_filter", "--dynamic-sampling-filter-path")  # fn(args, group)
    assert load_function("engine.rollout.filters:check_reward_nonzero_std", "--dynamic-sampling-filter-path")

    ex = Path(__file__).parent.parent / "examples" / "hooks.py"
    named = re.findall(r"^# (?:--loss-type custom_loss |--use-tis )?(--[a-z-]+) examples/hooks.py:(\w+)",
                       ex.read_text(), flags=re.M)
    assert len(named) >= 14
    for flag, name in named:
        load_function(f"{ex}:{name}", flag)
    fields = set(RunConfig.model_fields)
    assert all(f[2:].replace("-", "_") in fields for f in HOOK_CALLS)


def test_slime_dotted_paths_load():
    from engine.rewards import load_function

    assert load_function("hook_fakes.minus_one", "--x") is hook_fakes.minus_one
    assert load_function("hook_fakes:minus_one", "--x") is hook_fakes.minus_one


# ---- --dynamic-sampling-filter-path with slime's signature -------------------------------------------------------
def test_slime_style_dynamic_filter_and_its_failure(tmp_path, engine_url):
    run = make_run(tmp_path, engine_url, dynamic_sampling_filter_path="hook_fakes:slime_filter",
                   over_sampling_batch_size=4, rollout_temperature=1.0)
    batch = rollout(run)
    for g in batch.groups:  # every kept group has rewards that differ
        assert len({s.scalar_reward for s in g}) > 1
    with pytest.raises(HookError, match="--dynamic-sampling-filter-path 'hook_fakes:broken_filter' raised "
                                        "ZeroDivisionError"):
        rollout(make_run(tmp_path, engine_url, dynamic_sampling_filter_path="hook_fakes:broken_filter"))


# ---- --rollout-all-samples-process-path ---------------------------------------------------------------------------
def test_the_all_samples_hook_sees_the_groups_the_dynamic_filter_dropped(tmp_path, engine_url):
    hook_fakes.ALL_SAMPLES.clear()
    run = make_run(tmp_path, engine_url, dynamic_sampling_filter_path="hook_fakes:slime_filter",
                   rollout_all_samples_process_path="hook_fakes:record_all_samples", over_sampling_batch_size=4,
                   rollout_temperature=1.0, rollout_batch_size=2, n_samples_per_prompt=2)
    batch = rollout(run, rollout_id=3)
    [(rid, every, source)] = hook_fakes.ALL_SAMPLES
    assert rid == 3 and source is run.data_source
    dropped = [g for g in every if not any(g is k for k in batch.groups)]
    assert all(any(g is k for g in every) for k in batch.groups)  # the kept groups themselves, not copies
    assert len(dropped) == batch.metrics["rollout/groups_filtered"] > 0  # seed-fixed: the filter drops some
    assert all(len({s.scalar_reward for s in g}) == 1 for g in dropped)  # what slime_filter drops
    assert len(every) == len(batch.groups) + len(dropped)

    with pytest.raises(HookError, match="--rollout-all-samples-process-path 'hook_fakes:broken_all_samples' "
                                        "raised IndexError"):
        rollout(make_run(tmp_path, engine_url, rollout_all_samples_process_path="hook_fakes:broken_all_samples"))


# ---- --rollout-sample-filter-path --------------------------------------------------------------------------------
def test_removed_samples_stay_out_of_the_loss(tmp_path, engine_url):
    from engine.packing.microbatch import make_micro_batch

    run = make_run(tmp_path, engine_url, rollout_sample_filter_path="hook_fakes:drop_truncated",
                   rollout_max_response_len=3, n_samples_per_prompt=4, rollout_max_truncated_share=1.0,
                   rollout_batch_size=4)
    batch = rollout(run)
    samples = [s for g in batch.groups for s in g]
    removed = [s for s in samples if s.remove_sample]
    assert removed == [s for s in samples if s.status == Status.TRUNCATED] and removed
    assert len(removed) < len(samples)  # two-digit answers ("42<|im_end|>") fit in 3 tokens
    assert batch.metrics["rollout/removed_samples"] == len(removed)
    mb = make_micro_batch(samples, [1.0] * len(samples))
    for s, (a, b) in zip(samples, zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist())):
        assert float(mb.loss_mask[a:b].sum()) == (0 if s.remove_sample else sum(s.loss_mask))

    with pytest.raises(HookError, match="--rollout-sample-filter-path 'hook_fakes:broken_sample_filter' raised "
                                        "AttributeError"):
        rollout(make_run(tmp_path, engine_url, rollout_sample_filter_path="hook_fakes:broken_sample_filter"))


# ---- --custom-reward-post-process-path ---------------------------------------------------------------------------
def test_post_processed_rewards_replace_the_group_normalisation(tmp_path, engine_url):
    from engine import stages
    from engine.algorithms.advantages import compute_advantages

    run = make_run(tmp_path, engine_url, custom_reward_post_process_path="hook_fakes:minus_one")
    batch = rollout(run)
    samples = [s for g in batch.groups for s in g]
    assert [s.advantage_reward for s in samples] == [s.scalar_reward - 1.0 for s in samples]
    run.plan = run.cfg.batch
    packed = stages.pack(run, batch)
    assert packed.rewards_normalized and packed.rewards == [s.scalar_reward - 1.0 for s in samples]
    # the estimator takes them as they are: advantage of every response token = the post-processed reward
    mb = packed.per_rank_steps[0][0][0]
    adv, _ = compute_advantages("grpo", rewards=torch.tensor(packed.rewards), n_samples_per_prompt=2,
                                sample_ids=mb.sample_ids, cu_seqlens=mb.cu_seqlens, loss_mask=mb.loss_mask,
                                kl=torch.zeros(mb.num_tokens), rewards_normalized=True)
    for i, (a, b) in zip(mb.sample_ids, zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist())):
        m = mb.loss_mask[a:b].bool()
        assert torch.all(adv[a:b][m] == packed.rewards[i])

    with pytest.raises(HookError, match="returned 1 rewards for 4 samples"):
        rollout(make_run(tmp_path, engine_url, custom_reward_post_process_path="hook_fakes:wrong_count"))


# ---- --rollout-function-path -------------------------------------------------------------------------------------
def test_custom_rollout_function_contract(tmp_path):
    run = make_run(tmp_path, None, rollout_function_path="hook_fakes:fixed_rollout", n_samples_per_prompt=3)
    batch = rollout(run, rollout_id=4)
    assert [[s.index for s in g] for g in batch.groups] == [[0, 1, 2], [3, 4, 5]]
    assert all(s.rollout_id == 4 for g in batch.groups for s in g)
    # the unscored samples got the run's reward (exact match of "0" against the label), the others kept theirs
    assert [g[0].reward for g in batch.groups] == [float(g[0].label == "0") for g in batch.groups]
    assert [s.reward for g in batch.groups for s in g[1:]] == [1.0, 2.0, 1.0, 2.0]
    assert batch.metrics["rollout/custom_metric"] == 3.0 and "note" not in batch.metrics
    assert run.dataset.state()["offset"] == 2  # it drew B prompts from the data source

    with pytest.raises(HookError, match="returned groups \\[3\\]; expected --rollout-batch-size 2 groups"):
        rollout(make_run(tmp_path, None, rollout_function_path="hook_fakes:short_rollout",
                         n_samples_per_prompt=3))


# ---- --data-source-path ------------------------------------------------------------------------------------------
def test_custom_data_source_feeds_the_rollout_and_is_checkpointed(tmp_path, engine_url):
    from engine import stages

    run = make_run(tmp_path, engine_url, data_source_path="hook_fakes:CountingSource")
    batch = rollout(run)
    assert [g[0].prompt for g in batch.groups] == ["0+1=", "1+1="]
    assert all(s.metadata["source"] == "counting" for g in batch.groups for s in g)
    assert stages.data_source(run).state() == {"next": 2}  # what the checkpoint manifest keeps (data_state)
    stages.data_source(run).load_state({"next": 7})
    assert [g[0].prompt for g in rollout(run).groups] == ["7+1=", "8+1="]

    run = make_run(tmp_path, engine_url, data_source_path="hook_fakes:WrongGroups")
    with pytest.raises(HookError, match="handed out a group of 1 samples; --n-samples-per-prompt is 2"):
        rollout(run)
    assert stages.data_source(run).state() == {"next": 0}  # restored for the next attempt


# ---- the README's examples (examples/hooks.py), each through the rollout stage ------------------------------------
def test_the_example_hooks_run(tmp_path, engine_url):
    from pathlib import Path

    ex = Path(__file__).parent.parent / "examples" / "hooks.py"
    run = make_run(tmp_path, engine_url, rollout_function_path=f"{ex}:rollout",
                   data_source_path=f"{ex}:AdditionCurriculum", custom_reward_post_process_path=f"{ex}:leave_one_out",
                   rollout_sample_filter_path=f"{ex}:drop_truncated", rollout_batch_size=3, n_samples_per_prompt=3,
                   rollout_max_response_len=4)
    batch = rollout(run, rollout_id=1)
    samples = [s for g in batch.groups for s in g]
    assert [g[0].metadata["top"] for g in batch.groups] == [9, 9, 9] and len(samples) == 9
    for g in batch.groups:
        assert all(s.prompt == g[0].prompt and s.tokens[:s.prompt_length] == g[0].tokens[:g[0].prompt_length]
                   for s in g)
        a, b = (int(x) for x in g[0].prompt[:-1].split("+"))
        assert g[0].label == str(a + b) and max(a, b) <= 9
        r = [s.scalar_reward for s in g]
        assert [s.advantage_reward for s in g] == pytest.approx([r[i] - (sum(r) - r[i]) / 2 for i in range(3)])
    assert all(s.remove_sample == (s.status == Status.TRUNCATED) for s in samples)
    assert 0.0 <= batch.metrics["rollout/custom_accuracy"] <= 1.0
    assert run.data_source.state() == {"drawn": 3}

    run = make_run(tmp_path, engine_url, dynamic_sampling_filter_path=f"{ex}:some_right_some_wrong",
                   over_sampling_batch_size=4)
    assert all(len({s.scalar_reward for s in g}) > 1 for g in rollout(run).groups)


def test_trajectories_are_in_flight_together_and_the_engine_batches_them(tmp_path, tiny_model):
    """Every sample of a group, and several groups, run their hook concurrently: the engine (batching, not the
    deterministic one-request-per-batch mode) sees requests of different trajectories in one batch."""
    import httpx

    state = EngineState(tiny_model, threads=1, max_new_tokens=8, deterministic=False)
    server = ServerThread(state, "127.0.0.1", free_loopback_port())
    url = server.start()
    try:
        run = make_run(tmp_path, url, custom_generate_function_path="hook_fakes:two_turns", rollout_batch_size=4,
                       n_samples_per_prompt=4)
        assert len([s for g in rollout(run).groups for s in g]) == 16
        sizes = httpx.get(url + "/server_info").json()["batch_sizes"]
    finally:
        server.stop()
    assert sum(sizes) == 32  # 16 trajectories × 2 engine calls, one row each
    assert max(sizes) > 1 and len(sizes) < 32


@pytest.mark.parametrize("flag,path,boom", [
    ("rollout_function_path", "hook_fakes:raising_rollout", "ValueError: boom in the rollout"),
    ("custom_reward_post_process_path", "hook_fakes:raising_post_process", "ValueError: boom in the post-process"),
    ("data_source_path", "hook_fakes:RaisingSource", "ValueError: boom in the data source"),
])
def test_every_hook_that_raises_is_a_hook_error_naming_it(tmp_path, engine_url, flag, path, boom):
    from engine.rollout.hooks import HOOK_FLAGS

    with pytest.raises(HookError) as e:
        rollout(make_run(tmp_path, engine_url, **{flag: path}))
    assert f"{HOOK_FLAGS[flag]} {path!r} raised {boom}" in str(e.value) and "Traceback" in str(e.value)
    assert e.value.codes == ["HOOK"] and not e.value.retryable


def test_a_data_source_that_cannot_be_built_fails_at_start(tmp_path):
    with pytest.raises(HookError, match="--data-source-path 'hook_fakes:RaisingInit' raised ValueError: boom building"):
        make_run(tmp_path, None, data_source_path="hook_fakes:RaisingInit")


def test_slime_style_reward_functions_get_args(tmp_path, engine_url):
    batch = rollout(make_run(tmp_path, engine_url, custom_rm_path="hook_fakes:slime_reward"))
    assert all(s.reward == 10.0 + float(s.response.strip() == s.label) for g in batch.groups for s in g)


# ---- --reward-key / --eval-reward-key ----------------------------------------------------------------------------
def test_reward_key_picks_the_training_and_the_eval_reward_from_a_dict(tmp_path, engine_url):
    """A custom reward returns {"correct", "format"}: --reward-key format trains on the format reward (1.0 for
    every answer) while both are logged; --eval-reward-key correct keeps the evaluation on correctness, which
    --reward-key alone would also have moved to format."""
    from engine import stages
    from engine.config.data import BUNDLED_TEST
    from engine.data import load_prompts

    rows = load_prompts(BUNDLED_TEST, input_key="prompt", label_key="label")[:8]
    acc, correct = {}, {}
    for key, eval_key in (("format", None), ("format", "correct"), ("correct", None)):
        run = make_run(tmp_path, engine_url, custom_rm_path="hook_fakes:two_part_reward", reward_key=key,
                       eval_reward_key=eval_key, eval_prompt_data=BUNDLED_TEST, rollout_max_response_len=8)
        batch = rollout(run)
        samples = [s for g in batch.groups for s in g]
        correct[key] = [s.reward["correct"] for s in samples]
        assert [s.scalar_reward for s in samples] == [s.reward[key] for s in samples]
        assert batch.metrics["rollout/reward_mean"] == sum(s.reward[key] for s in samples) / len(samples)
        assert "rollout/reward_correct_mean" in batch.metrics and "rollout/reward_format_mean" in batch.metrics
        run.eval_sets = {"test": rows}
        acc[(key, eval_key)] = stages.evaluate(run, 0)
    assert acc[("format", None)] == 1.0 and acc[("format", "correct")] == acc[("correct", None)] < 1.0, acc

    # a rollout function's own dict rewards: the key selects from them; a dict without it is a HOOK error
    run = make_run(tmp_path, None, rollout_function_path="hook_fakes:dict_reward_rollout", reward_key="correct")
    assert [[s.scalar_reward for s in g] for g in rollout(run).groups] == [[0.0, 1.0], [0.0, 1.0]]
    run = make_run(tmp_path, None, rollout_function_path="hook_fakes:dict_reward_rollout", reward_key="quality")
    with pytest.raises(HookError, match="the reward dict has no key 'quality'.*its keys: correct, format"):
        rollout(run)


def test_log_reward_category_logs_the_share_of_each_reason(tmp_path, engine_url):
    """slime's --log-reward-category: the named key of a reward dict (any text) leaves the reward for the sample's
    metadata, and rollout/reward_category/<reason> is the share of the rollout's samples with that reason; a
    rollout function's own rewards too; a run whose rewards name no category refuses the flag."""
    batch = rollout(make_run(tmp_path, engine_url, custom_rm_path="hook_fakes:reward_with_a_reason",
                             log_reward_category="why", n_samples_per_prompt=4))
    samples = [s for g in batch.groups for s in g]
    assert all(set(s.reward) == {"score"} for s in samples)  # the reason is not a reward
    shares = {k.rsplit("/", 1)[1]: v for k, v in batch.metrics.items() if k.startswith("rollout/reward_category/")}
    assert abs(sum(shares.values()) - 1.0) < 1e-12 and set(shares) <= {"correct", "empty", "not_a_number",
                                                                        "wrong_number"}
    assert shares.get("correct", 0.0) == batch.metrics["rollout/reward_mean"]
    assert shares == {c.replace(" ", "_"): sum(s.metadata["reward_category"] == c for s in samples) / len(samples)
                      for c in {s.metadata["reward_category"] for s in samples}}
    run = make_run(tmp_path, None, rollout_function_path="hook_fakes:reason_rollout", log_reward_category="why")
    m = rollout(run).metrics
    assert m["rollout/reward_category/right"] == m["rollout/reward_category/wrong"] == 0.5
    with pytest.raises(ConfigError, match="--log-reward-category 'why': the rewards of this run come from --rm-type"):
        RunConfig(log_reward_category="why")


def test_log_passrate_logs_pass_at_k_of_the_rollout(tmp_path, engine_url):
    batch = rollout(make_run(tmp_path, engine_url, log_passrate=True, n_samples_per_prompt=4))
    m = batch.metrics
    rewards = [s.scalar_reward for g in batch.groups for s in g]
    assert abs(m["rollout/pass_at_1"] - sum(r == 1 for r in rewards) / len(rewards)) < 1e-12  # pass@1 = accuracy
    assert m["rollout/pass_at_1"] <= m["rollout/pass_at_2"] <= m["rollout/pass_at_4"] and "rollout/pass_at_8" not in m
    assert not [k for k in rollout(make_run(tmp_path, engine_url)).metrics if "pass_at" in k]


def test_log_correct_samples_describes_the_rollouts_correct_answers(tmp_path, engine_url):
    """slime's --log-correct-samples: how many samples have reward 1, where their lengths fall among the quarters
    of the length limit (slime's cut points L/4, L/2, 3L/4, L), and their mean −log p under the engine."""
    run = make_run(tmp_path, engine_url, log_correct_samples=True, n_samples_per_prompt=8, rollout_batch_size=4)
    batch = rollout(run)
    m, L = batch.metrics, run.cfg.rollout_max_response_len
    correct = [s for g in batch.groups for s in g if s.scalar_reward == 1]
    assert 0 < len(correct) < 32 and m["rollout/correct_samples"] == len(correct)  # the tiny model: some right
    cuts = [L / 4, L / 2, 3 * L / 4, L]
    where = [next(i for i, c in enumerate(cuts) if s.response_length <= c) for s in correct]
    assert [m[f"rollout/correct_length_p{q}"] for q in (25, 50, 75, 100)] == [
        where.count(i) / len(correct) for i in range(4)]
    per_sample = [sum(-lp for lp, k in zip(s.rollout_log_probs, s.loss_mask) if k) / sum(s.loss_mask)
                  for s in correct]
    assert abs(m["rollout/correct_entropy"] - sum(per_sample) / len(per_sample)) < 1e-12
    assert m["rollout/correct_entropy"] > 0
    assert not [k for k in rollout(make_run(tmp_path, engine_url)).metrics if "correct_" in k]


def test_rollout_seed_seeds_the_sampling_apart_from_seed(tmp_path, engine_url):
    """slime's --rollout-seed: the engines' sampling follows it, not --seed (which still seeds the trainer); a
    resume keeps it."""
    def responses(**over):
        return [s.response for g in rollout(make_run(tmp_path, engine_url, n_samples_per_prompt=4, **over)).groups
                for s in g]

    assert responses(seed=99, rollout_seed=5) == responses(seed=5)
    assert responses(seed=99, rollout_seed=5) != responses(seed=99)
    assert RunConfig(seed=3).sampling_seed == 3 and RunConfig(seed=3, rollout_seed=4).sampling_seed == 4
    assert "rollout_seed" in RunConfig(rollout_seed=4).fixed_settings()


def test_reward_key_flags_are_refused_where_they_would_do_nothing():
    for over, msg in ((dict(reward_key="score"), "--reward-key 'score': the rewards of this run are numbers"),
                      (dict(custom_rm_path="m:f", reward_key=" "), "--reward-key is empty"),
                      (dict(custom_rm_path="m:f", eval_reward_key="acc", eval_prompt_data=""),
                       "--eval-reward-key 'acc' with no --eval-prompt-data"),
                      (dict(custom_rm_path="m:f", eval_reward_key="acc", eval_function_path="m:ev"),
                       "--eval-reward-key 'acc' with --eval-function-path")):
        with pytest.raises(ConfigError, match=msg):
            RunConfig(**over)
    RunConfig(rm_type="remote_rm", rm_url="http://127.0.0.1:1/r", reward_key="score")
    RunConfig(rm_type="f1", reward_key="recall")
    RunConfig(metadata_key="meta", reward_key="recall")  # a row may name f1
    RunConfig(rollout_function_path="m:f", reward_key="score", eval_reward_key="acc")


def test_the_example_logging_hooks_log_their_own_metrics_beside_rollflows(tmp_path, engine_url):
    """examples/hooks.py:log_answer_lengths and :log_eval_truncation through the rollout and evaluate stages: each
    logs its metric with args.tracker and returns False, so rollflow's metrics are logged as well."""
    from pathlib import Path

    from engine import stages
    from engine.config.data import BUNDLED_TEST
    from engine.data import load_prompts

    ex = Path(__file__).parent.parent / "examples" / "hooks.py"
    run = make_run(tmp_path, engine_url, eval_prompt_data=BUNDLED_TEST, rollout_max_response_len=8,
                   custom_rollout_log_function_path=f"{ex}:log_answer_lengths",
                   custom_eval_rollout_log_function_path=f"{ex}:log_eval_truncation")
    logged: list[tuple[dict, int]] = []
    run.tracker = SimpleNamespace(log_metrics=lambda m, step, **kw: logged.append((dict(m), step)))
    run.eval_sets = {"test": load_prompts(BUNDLED_TEST, input_key="prompt", label_key="label")[:6]}
    batch = rollout(run, rollout_id=3)
    samples = [s for g in batch.groups for s in g]
    mine = [m for m, step in logged if "custom/answer_digits_mean" in m and step == 3]
    assert mine == [{"custom/answer_digits_mean": sum(sum(c.isdigit() for c in s.response) for s in samples) / 4}]
    assert any("rollout/reward_mean" in m and step == 3 for m, step in logged)  # rollflow's too (False)
    stages.evaluate(run, 2)
    assert any("custom/test_truncated" in m and step == 2 for m, step in logged)
    assert any("eval/test_accuracy" in m and step == 2 for m, step in logged)


# ---- --eval-function-path ---------------------------------------------------------------------------------------
def test_the_example_eval_function_scores_what_the_built_in_evaluation_scores(tmp_path, engine_url):
    """examples/hooks.py:evaluate (greedy, exact match, by hand) through the evaluate stage gives the built-in
    greedy evaluation's accuracy on the same engine and rows, and its truncated share; both at step 0."""
    from pathlib import Path

    from engine import stages
    from engine.config.data import BUNDLED_TEST
    from engine.data import load_prompts

    ex = Path(__file__).parent.parent / "examples" / "hooks.py"
    rows = load_prompts(BUNDLED_TEST, input_key="prompt", label_key="label")[:12]
    accuracy = {}
    for how in (f"{ex}:evaluate", None):
        run = make_run(tmp_path, engine_url, eval_prompt_data=BUNDLED_TEST, eval_function_path=how,
                       rm_type="exact_match", rollout_max_response_len=8)
        run.eval_sets = {"test": rows}
        accuracy[how] = stages.evaluate(run, 0)
        if how:
            assert set(run.history) == {"eval/test_accuracy", "eval/test_truncated_share"}, sorted(run.history)
    assert accuracy[f"{ex}:evaluate"] == accuracy[None] and 0 < accuracy[None] < 1, accuracy


def test_an_eval_function_that_breaks_the_contract_is_a_hook_error():
    from engine.config import RunConfig
    from engine.diagnosis import ConfigError
    from engine.rollout.hooks import RolloutFnEvalOutput, eval_output_metrics

    ok = RolloutFnEvalOutput(data={"aime": {"rewards": [1, 0, 0, 1], "truncated": [False, True, False, False]}},
                             metrics={"eval/aime_pass_at_4": 1.0, "note": "text is dropped"})
    assert eval_output_metrics(ok, "--eval-function-path", "m:f") == {
        "eval/aime_accuracy": 0.5, "eval/aime_truncated_share": 0.25, "eval/aime_pass_at_4": 1.0}
    assert eval_output_metrics({"gsm8k": {"rewards": [0.5]}}, "f", "p") == {"eval/gsm8k_accuracy": 0.5}
    for bad, says in (([[1.0]], "returned list"), ({}, "at least one eval set"),
                      ({"a b": {"rewards": [1]}}, "is not a word"), ({"x": {"rewards": []}}, "non-empty list"),
                      ({"x": {"rewards": [float("nan")]}}, "finite numbers"),
                      ({"x": {"rewards": [1, 0], "truncated": [True]}}, "one bool per reward")):
        with pytest.raises(HookError, match=says):
            eval_output_metrics(bad, "--eval-function-path", "m:f")
    with pytest.raises(ConfigError, match="the evaluation it replaces never runs"):
        RunConfig(eval_function_path="m:f", eval_prompt_data="")


# ---- --rollout-sample-hook-path ----------------------------------------------------------------------------------
def test_sample_hooks_run_in_order_before_the_reward_and_in_the_evaluation(tmp_path, engine_url):
    from engine import stages

    hook_fakes.SAMPLE_HOOKS.clear()
    run = make_run(tmp_path, engine_url, rollout_sample_hook_path=["hook_fakes:tag_sample",
                                                                   "hook_fakes:truncate_to_two"])
    batch = rollout(run, rollout_id=4)
    samples = [s for g in batch.groups for s in g]
    tags = [c for c in hook_fakes.SAMPLE_HOOKS if c["hook"] == "tag"]
    assert len(tags) == len(samples) == 4 and {c["rollout_id"] for c in tags} == {4}
    assert not any(c["evaluation"] for c in tags) and all(c["reward"] is None for c in tags)  # before the reward
    assert all(c["tagged"] for c in hook_fakes.SAMPLE_HOOKS if c["hook"] == "truncate")  # in order
    assert any(c["response_length"] > 2 for c in tags)  # the cut below changed something
    for s in samples:  # the second hook's Sample replaced the first's (which kept its metadata)
        assert s.metadata["tagged"] and s.response_length <= 2 and len(s.loss_mask) == s.response_length
        assert s.reward is not None  # scored after the hooks, on the cut responses
    # the built-in evaluation runs them too, with evaluation=True
    hook_fakes.SAMPLE_HOOKS.clear()
    run.eval_sets = {"test": list(run.dataset.rows[:2])}
    stages.evaluate(run, 0)
    assert [c["evaluation"] for c in hook_fakes.SAMPLE_HOOKS if c["hook"] == "tag"] == [True, True]


def test_a_sample_hook_that_breaks_its_contract_fails_the_rollout(tmp_path, engine_url):
    with pytest.raises(HookError, match="--rollout-sample-hook-path 'hook_fakes:returns_a_string' returned str"):
        rollout(make_run(tmp_path, engine_url, rollout_sample_hook_path=["hook_fakes:returns_a_string"]))
    with pytest.raises(HookError, match=r"breaks_the_mask' returned sample \d+ with \d+ loss-mask entries"):
        rollout(make_run(tmp_path, engine_url, rollout_sample_hook_path=["hook_fakes:breaks_the_mask"]))
    with pytest.raises(ConfigError, match="rollout-sample-hook-path.*signature"):
        make_run(tmp_path, engine_url, rollout_sample_hook_path=["hook_fakes:record_only"])  # 3 positional args
    with pytest.raises(ConfigError, match="--rollout-sample-hook-path"):
        RunConfig(rollout_function_path="hook_fakes:fixed_rollout", rollout_sample_hook_path=["hook_fakes:tag_sample"])


def test_a_repeated_list_flag_adds_to_the_list():
    from engine.config.cli import parse_args

    cfg = parse_args(["--rollout-sample-hook-path", "a:f", "--rollout-sample-hook-path", "b:g", "c:h"])
    assert cfg.rollout_sample_hook_path == ["a:f", "b:g", "c:h"]


def test_custom_config_path_arguments_reach_the_hooks_args(tmp_path, engine_url):
    """--custom-config-path (slime's flag): the YAML's keys are attributes of every hook's args; the values are kept
    in the run's flags (a dumped config needs no file); a key that is a flag sets it (given twice with two values:
    an error), one that args already hold is refused."""
    hook_fakes.SAMPLE_HOOKS.clear()
    (tmp_path / "custom.yaml").write_text("cut_to: 1\nnote: short answers\n")
    run = make_run(tmp_path, engine_url, rollout_sample_hook_path=["hook_fakes:cut_to_custom_length"],
                   custom_config_path=str(tmp_path / "custom.yaml"))
    assert run.cfg.custom_config == {"cut_to": 1, "note": "short answers"}
    batch = rollout(run)
    assert {c["cut_to"] for c in hook_fakes.SAMPLE_HOOKS} == {1}
    assert all(s.response_length == 1 for g in batch.groups for s in g)
    (tmp_path / "custom.yaml").unlink()
    assert RunConfig.from_dump(run.cfg.model_dump()).cut_to == 1  # another node: from the recorded values
    (tmp_path / "flag.yaml").write_text("lr: 0.1\n")  # a flag's key sets the flag, as slime's setattr does
    cfg = RunConfig(custom_config_path=str(tmp_path / "flag.yaml"))
    assert cfg.lr == 0.1 and cfg.custom_config == {}
    assert RunConfig(custom_config_path=str(tmp_path / "flag.yaml"), lr=0.1).lr == 0.1
    with pytest.raises(ConfigError, match="sets lr: 0.1, and --lr is also given as 0.2"):
        RunConfig(custom_config_path=str(tmp_path / "flag.yaml"), lr=0.2)
    (tmp_path / "bad.yaml").write_text("tokenizer: mine\n")
    with pytest.raises(ConfigError, match="sets tokenizer, which hooks' args already hold"):
        RunConfig(custom_config_path=str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match="no such file"):
        RunConfig(custom_config_path=str(tmp_path / "missing.yaml"))
