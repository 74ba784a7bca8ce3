"""--loss-type sft_loss / custom_loss and --debug-train-only (slime's flags): supervised fine-tuning through the
flow, with engine.rollout.sft making the samples from the prompt file and no engine started."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from train_fakes import fake_samples, pack

from engine.config import RunConfig
from engine.config.data import BUNDLED_MODEL, BUNDLED_TRAIN
from engine.diagnosis import ConfigError
from engine.samples import Sample

SFT = dict(loss_type="sft_loss", debug_train_only=True, rollout_function_path="engine.rollout.sft:generate_rollout",
           n_samples_per_prompt=1)


def _tok():
    from engine.modeling import load_tokenizer

    return load_tokenizer(BUNDLED_MODEL)


def _sample(prompt, label=None, *, template=True) -> Sample:
    from engine.modeling import render_prompt

    tokens = render_prompt(_tok(), prompt, template) if isinstance(prompt, str) or template else []
    return Sample(index=0, group_index=0, rollout_id=0, prompt=prompt, tokens=tokens, label=label,
                  metadata={"row": 7})


def _args(**over):
    return SimpleNamespace(**{"tokenizer": _tok(), "apply_chat_template": True, "apply_chat_template_kwargs": {},
                              "label_key": "label", "n_samples_per_prompt": 1, "rollout_batch_size": 1, **over})


def test_the_sft_rollout_trains_each_assistant_turn_and_nothing_else():
    from engine.modeling import render_prompt
    from engine.rollout.sft import fill

    tok = _tok()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"}]
    s = fill(_args(), _sample(msgs))
    trained = [t for t, m in zip(s.tokens[s.prompt_length:], s.loss_mask) if m]
    assert tok.decode(trained) == "3<|im_end|>4<|im_end|>"  # the answers and their ends of turn, not the "\n"
    assert tok.decode(s.tokens) == tok.apply_chat_template(msgs, tokenize=False)  # the whole conversation
    assert s.loss_mask[0] == 1 and len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    assert tok.decode(s.tokens[:s.prompt_length]).endswith("<|im_start|>assistant\n")
    # a prompt and its answer: the prompt exactly as the RL rollout renders it, then answer + end of turn
    s = fill(_args(), _sample("3+15=", "18"))
    assert s.tokens[:s.prompt_length] == render_prompt(tok, "3+15=", True)
    assert tok.decode([t for t, m in zip(s.tokens[s.prompt_length:], s.loss_mask) if m]) == "18<|im_end|>"
    s = fill(_args(apply_chat_template=False), _sample("3+15=", "18", template=False))
    assert s.tokens[:s.prompt_length] == render_prompt(tok, "3+15=", False) and s.loss_mask == [1, 1, 1]
    assert s.tokens[-1] == tok.eos_token_id and s.reward == 0.0 and s.status.value == "completed"
    # rows it cannot train on, each named
    for sample, args, says in (
            (_sample("1+1="), _args(), "row 7: no answer to train on"),
            (_sample([{"role": "user", "content": "hi"}]), _args(), "row 7: the conversation has no assistant"),
            (_sample([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"},
                      {"role": "assistant", "content": "y"}]), _args(), "starts with an assistant message"),
            (_sample(msgs, template=False), _args(apply_chat_template=False), "needs --apply-chat-template")):
        with pytest.raises(ValueError, match=says):
            fill(args, sample)


def test_a_conversations_tools_are_rendered_and_never_trained():
    """--tool-key with the SFT rollout: the row's tools (its metadata["tools"]) reach the template, as in the RL
    rollout, and their tokens are masked like every non-assistant part."""
    from test_flag_wiring import TOOLS_TEMPLATE

    from engine.rollout.sft import fill

    tok = _tok()
    tok.chat_template = TOOLS_TEMPLATE  # lists the tools in a system block, as Qwen's template does
    msgs = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    sample = _sample(msgs, template=False)
    sample.metadata["tools"] = [{"type": "function", "function": {"name": "calc"}}]
    s = fill(_args(tokenizer=tok), sample)
    assert tok.decode(s.tokens).startswith("<|im_start|>system\nTools: calc <|im_end|>\n<|im_start|>user\n1+2=")
    assert tok.decode([t for t, m in zip(s.tokens[s.prompt_length:], s.loss_mask) if m]) == "3<|im_end|>"
    assert "Tools" not in tok.decode(fill(_args(tokenizer=tok), _sample(msgs, template=False)).tokens)


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_turn_named():
    from engine.rollout.sft import conversation_tokens

    class DropsOldAnswers:  # renders only the last assistant message's content, as templates that drop reasoning
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
            text = "".join(f"[{m['role']}]{m['content'] if m['role'] != 'assistant' or i == last else ''}"
                           for i, m in enumerate(messages))
            return text + ("[assistant]" if add_generation_prompt else "")

    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(ValueError, match="row 3: the chat template does not render assistant message 1"):
        conversation_tokens(DropsOldAnswers(), msgs, row=3)


def test_the_sft_rollout_wants_one_sample_per_row():
    from engine.rollout.sft import generate_rollout

    with pytest.raises(ValueError, match="--n-samples-per-prompt 1 \\(now 4"):
        generate_rollout(_args(n_samples_per_prompt=4), 0, None)
    with pytest.raises(ValueError, match="training samples only"):
        generate_rollout(_args(), 0, None, evaluation=True)


@pytest.mark.parametrize("kw, says", [
    (dict(debug_train_only=True), "--debug-train-only starts no rollout engine"),
    (dict(SFT, eval_interval=2), "--eval-interval 2 (evaluation generates on the engines) would do nothing"),
    (dict(SFT, async_mode="one-step"), "--async-mode one-step"),
    (dict(SFT, use_fault_tolerance=True), "--use-fault-tolerance"),
    (dict(SFT, debug_rollout_only=True), "one starts no engine, the other no trainer"),
    (dict(SFT, use_kl_loss=True, kl_loss_coef=0.1), "--use-kl-loss would do nothing"),
    (dict(SFT, use_tis=True, entropy_coef=0.01), "--use-tis, --entropy-coef would do nothing"),
    (dict(SFT, advantage_estimator="ppo"), "--advantage-estimator ppo would do nothing"),
    (dict(SFT, custom_advantage_function_path="m:f"), "--custom-advantage-function-path would do nothing"),
    (dict(loss_type="custom_loss"), "--loss-type custom_loss needs --custom-loss-function-path"),
    (dict(custom_loss_function_path="m:f"), "is called only with --loss-type custom_loss (now policy_loss)"),
])
def test_loss_type_and_debug_train_only_refuse_what_would_do_nothing(kw, says):
    with pytest.raises(ConfigError) as e:
        RunConfig(**kw)
    assert says in str(e.value), str(e.value)


def test_debug_train_only_starts_no_engine():
    cfg = RunConfig(**SFT)
    assert cfg.no_engines and not cfg.replay and not cfg.engine_in_trainer_on_cpu()
    assert cfg.engine_in_trainer_blockers() == ["--debug-train-only (no engine at all)"]


def _worker(**over):
    from engine.train.worker import TrainWorker

    cfg = RunConfig(hf_checkpoint=BUNDLED_MODEL, rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8,
                    micro_batch_size=4, **over)
    return TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=2, threads=1)


def _batch(seed: int = 0):
    samples = fake_samples([(5, 3), (4, 2), (6, 4), (3, 3), (5, 1), (4, 4), (2, 3), (5, 2)], n=2, seed=seed,
                           rewards=[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    samples[2].loss_mask = [1, 0, 1, 1]  # a masked token (a tool's) stays out of the loss
    return samples, [pack(samples, [[0, 1, 2, 3], [4, 5, 6, 7]])]


def test_sft_loss_is_the_answers_negative_log_likelihood():
    """train/loss = (1/G) Σ_i mean over sample i's trained tokens of −log π(token), computed here with
    transformers' own model; nothing is computed before the step (no old or reference forward, no advantages)."""
    from engine.modeling import load_causal_lm
    from engine.train.backend import reduce_metrics

    samples, steps = _batch()
    w = _worker(loss_type="sft_loss")
    calls = []
    w.backend.compute_log_probs = lambda *a, **k: calls.append(a) or pytest.fail("no forward before the step")
    facts = w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False, old_from="none")
    assert "mismatch_sum" not in facts and not calls
    out = w.train_step(0, 8)
    model = load_causal_lm(BUNDLED_MODEL, device="cpu", impl="transformers")
    per_sample = []
    with torch.no_grad():
        for s in samples:
            logp = model(torch.tensor([s.tokens])).logits[0].float().log_softmax(-1)  # [L, V]
            P = s.prompt_length
            lp = logp[P - 1:-1].gather(1, torch.tensor(s.tokens[P:])[:, None])[:, 0]  # [R]
            m = torch.tensor(s.loss_mask, dtype=torch.float32)
            per_sample.append(float(-(lp * m).sum() / m.sum()))
    assert out["loss_total"] == pytest.approx(sum(per_sample) / 8, rel=1e-5)
    m = reduce_metrics([out])
    assert m["nll"] > 0 and "entropy" in m and not {"pg_loss", "kl", "clipfrac", "ratio"} & set(m), sorted(m)
    with pytest.raises(ValueError, match="old_from 'none' is for --loss-type sft_loss"):
        _worker().set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False, old_from="none")


def test_a_custom_loss_gets_the_packed_batch_and_its_metrics_are_step_values():
    """examples/hooks.py:vanilla_policy_gradient (−ρ·A, no clip) on a rollout's first step: the same update as the
    built-in clipped loss (the clip is inactive at ρ = 1); its metric, the mean ratio, is exactly 1 summed over the
    micro-batches. A function returning something else is a HOOK error naming the flag."""
    from engine.diagnosis import DiagnosisError
    from engine.train.backend import reduce_metrics

    def step(**over):
        samples, steps = _batch(seed=1)
        w = _worker(**over)
        w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False)
        out = w.train_step(0, 8)
        return out, w.backend.model_state()

    builtin, w_builtin = step(lr=1e-3)
    custom, w_custom = step(lr=1e-3, loss_type="custom_loss",
                            custom_loss_function_path="examples/hooks.py:vanilla_policy_gradient")
    assert custom["loss_total"] == pytest.approx(builtin["loss_total"], abs=1e-6)
    assert all(torch.allclose(w_custom[k], w_builtin[k], atol=1e-6) for k in w_builtin)
    start = _worker().backend.model_state()
    assert any(not torch.allclose(w_custom[k], start[k], atol=1e-6) for k in w_custom)  # the step moved them
    m = reduce_metrics([custom])
    assert m["custom_ratio"] == pytest.approx(1.0, abs=1e-6) and "pg_loss" not in m

    with pytest.raises(DiagnosisError, match="--custom-loss-function-path .* returned float; expected"):
        step(loss_type="custom_loss", custom_loss_function_path="tests/test_sft.py:a_number_is_not_a_loss")


def a_number_is_not_a_loss(args, batch, sum_of_sample_mean):
    return 0.5


def nll_without_advantages(args, batch, sum_of_sample_mean):
    """A custom supervised loss that reads no advantage or old log-prob (and checks none was computed)."""
    if not (batch["advantages"] is None and batch["old_log_probs"] is None and batch["ref_log_probs"] is None):
        raise AssertionError("advantages or old log-probs were computed")
    return -sum_of_sample_mean(batch["log_probs"]), {}


def test_disable_compute_advantages_and_returns_runs_no_forward_before_a_custom_loss():
    """slime's --disable-compute-advantages-and-returns: a custom loss that needs neither advantages nor old
    log-probs gets None for them and nothing is computed before the step; here it is sft_loss's NLL, so the step's
    loss and weights are sft_loss's. Refused where the loss would need what it turns off."""
    from engine import stages

    def step(**over):
        samples, steps = _batch(seed=2)
        w = _worker(lr=1e-3, **over)
        w.backend.compute_log_probs = lambda *a, **k: pytest.fail("no forward before the step")
        facts = w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False, old_from="none")
        assert "mismatch_sum" not in facts
        return w.train_step(0, 8), w.backend.model_state()

    custom, w_custom = step(loss_type="custom_loss", disable_compute_advantages_and_returns=True,
                            custom_loss_function_path="tests/test_sft.py:nll_without_advantages")
    sft, w_sft = step(loss_type="sft_loss")
    assert custom["loss_total"] == pytest.approx(sft["loss_total"], rel=1e-6)
    assert all(torch.allclose(w_custom[k], w_sft[k], atol=1e-7) for k in w_sft)
    cfg = RunConfig(loss_type="custom_loss", custom_loss_function_path="m:f",
                    disable_compute_advantages_and_returns=True)
    assert stages.old_log_probs_source(SimpleNamespace(cfg=cfg), first=True) == "none"
    for over, says in ((dict(), "with --loss-type policy_loss: the policy loss is made of"),
                       (dict(loss_type="sft_loss"), "sft_loss computes none of them anyway"),
                       (dict(loss_type="custom_loss", custom_loss_function_path="m:f", use_kl_loss=True,
                             kl_loss_coef=0.1), "--use-kl-loss would do nothing"),
                       (dict(loss_type="custom_loss", custom_loss_function_path="m:f", advantage_estimator="ppo"),
                        "--advantage-estimator ppo would do nothing")):
        with pytest.raises(ConfigError, match=says):
            RunConfig(disable_compute_advantages_and_returns=True, **over)


@pytest.mark.slow
def test_sft_through_the_flow_with_no_engine(prefect_harness, shared_ray, small_cfg, tmp_path):
    """`rollflow train --loss-type sft_loss --debug-train-only --rollout-function-path
    engine.rollout.sft:generate_rollout`: no engine, no sync, no evaluation; rollout 0's train/loss is the NLL of
    its rows' answers under the starting weights (computed here with transformers' model), and the trained
    weights give those answers a lower NLL."""
    from safetensors.torch import load_file

    from engine import checkpoint
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import load_causal_lm, load_tokenizer, render_prompt
    from flows.train import rl_train

    cfg = small_cfg(num_rollout=4, rollout_batch_size=8, global_batch_size=8, lr=3e-4, **SFT)
    out = rl_train(cfg)
    assert out["placement"]["engines"] == [] and out["weight_sync"] == "none"
    assert out["test_accuracy_before"] is None
    h = out["history"]
    assert sorted(h["train/loss"]) == ["0", "1", "2", "3"] and out["loss_last"] < out["loss_first"]
    assert not [k for k in h if k.startswith(("sync/", "eval/")) or k in ("train/pg_loss", "train/mismatch")], \
        sorted(h)

    tok = load_tokenizer(cfg.hf_checkpoint)
    rows = PromptDataset(load_prompts(BUNDLED_TRAIN, input_key="prompt", label_key="label"), shuffle=False,
                         seed=0).next_batch(8)  # rollout 0's rows

    def nll(model) -> float:
        per = []
        with torch.no_grad():
            for r in rows:
                p = render_prompt(tok, r.prompt, True)
                a = tok(str(r.label) + "<|im_end|>", add_special_tokens=False)["input_ids"]
                logp = model(torch.tensor([p + a])).logits[0].float().log_softmax(-1)
                per.append(float(-logp[len(p) - 1:-1].gather(1, torch.tensor(a)[:, None]).mean()))
        return sum(per) / len(per)

    model = load_causal_lm(cfg.hf_checkpoint, device="cpu", impl="transformers")
    before = nll(model)
    assert h["train/loss"]["0"] == pytest.approx(before, rel=1e-4)
    trained = load_file(str(checkpoint.iter_dir(cfg.save, 3) / "model" / "model.safetensors"))
    model.load_state_dict(trained, strict=False)
    assert nll(model) < 0.8 * before, (before, nll(model))


def test_preflight_takes_conversation_rows_and_reads_no_eval_set_without_an_engine(tmp_path):
    """Rows of chat messages (`--input-key messages --label-key ''`): the default eval set, whose rows have no
    such key, is not read (nothing is evaluated), and a conversation is checked against the whole context (no
    answer is generated after it)."""
    import json

    from engine.doctor.checks import Environment
    from engine.stages import preflight

    p = tmp_path / "conv.jsonl"
    msgs = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    p.write_text(json.dumps({"messages": msgs}) + "\n")
    cfg = RunConfig(**SFT, prompt_data=str(p), input_key="messages", label_key="", apply_chat_template=True,
                    rollout_max_response_len=2047)  # would leave no room for a prompt if an answer followed
    assert [d for d in preflight(cfg, Environment()) if d.severity == "error"] == []
    engines = RunConfig(prompt_data=str(p), input_key="messages", label_key="", apply_chat_template=True)
    with pytest.raises(ConfigError, match="test.jsonl: line 1 has no key 'messages'"):
        preflight(engines, Environment())


seen_rollout_data: list[dict] = []


def record_and_zero(args, rollout_data):
    seen_rollout_data.append(rollout_data)
    rollout_data["advantages"] = [torch.zeros(r) for r in rollout_data["response_lengths"]]
    rollout_data["returns"] = rollout_data["advantages"]


def wrong_lengths(args, rollout_data):
    rollout_data["advantages"] = [torch.zeros(1) for _ in rollout_data["response_lengths"]]
    rollout_data["returns"] = rollout_data["advantages"]


def test_a_custom_advantage_function_gets_each_samples_response_and_sets_its_advantages():
    """slime's --custom-advantage-function-path: per-sample response slices in (the engine's log-probs and the loss
    masks are each sample's own), advantages out. examples/hooks.py:rloo_advantages gives the same advantages as
    the RLOO reward post-process hook (whose rewards GRPO takes as they are); lengths that do not match are a HOOK
    error naming the flag."""
    from engine.diagnosis import DiagnosisError
    from engine.rollout.hooks import HookError

    def advantages(samples, steps, **over):
        w = _worker(**over)
        w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False,
                      normalized="custom_reward_post_process_path" in over)
        return w, torch.cat([mb.advantages for mb in steps[0]])

    samples, steps = _batch()
    w, adv = advantages(samples, steps, custom_advantage_function_path="tests/test_sft.py:record_and_zero")
    assert not adv.any()
    seen = w.custom_advantages.__globals__["seen_rollout_data"]  # the module as the worker loaded it
    assert [d["sample_ids"] for d in seen] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    got = {i: (lp.tolist(), m.tolist(), r) for d in seen for i, lp, m, r in zip(
        d["sample_ids"], d["rollout_log_probs"], d["loss_masks"], d["rewards"])}
    for s in samples:
        assert got[s.index][0] == pytest.approx(s.rollout_log_probs) and got[s.index][1] == s.loss_mask
        assert got[s.index][2] == s.scalar_reward and len(seen[0]["log_probs"][0]) == seen[0]["response_lengths"][0]
    assert seen[0]["ref_log_probs"] is None and seen[0]["all_rewards"] == [s.scalar_reward for s in samples]

    _, rloo = advantages(*_batch(), custom_advantage_function_path="examples/hooks.py:rloo_advantages")
    samples, steps = _batch()
    from examples.hooks import leave_one_out

    _, left = leave_one_out(SimpleNamespace(n_samples_per_prompt=2), samples)
    for s, r in zip(samples, left):
        s.reward = r
    _, post = advantages(samples, steps, custom_reward_post_process_path="examples/hooks.py:leave_one_out")
    assert rloo.abs().sum() > 0 and torch.allclose(rloo, post)

    with pytest.raises((HookError, DiagnosisError), match="--custom-advantage-function-path .*expected a list of 4"):
        advantages(*_batch(), custom_advantage_function_path="tests/test_sft.py:wrong_lengths")


def test_the_run_summary_shows_the_sft_loss_and_leaves_out_placeholder_rewards(capsys):
    """engine.rollout.sft's samples carry reward 0: the printed summary shows the SFT loss instead, and says the
    accuracy was not measured; an SFT run on engine samples (rejection-sampling style) shows both."""
    from flows.cli import _print_summary

    s = {"rollouts": 4, "reward_first": 0.0, "reward_last": 0.0, "loss_first": 0.34, "loss_last": 0.07,
         "test_accuracy_before": None, "test_accuracy_after": None, "wall_s": 5.0, "flow_run_id": "f"}
    _print_summary(s, RunConfig(**SFT))
    out = capsys.readouterr().out
    assert "SFT loss (mean of first 3 / last 3 rollouts): 0.34 → 0.07" in out and "reward (" not in out
    assert "test accuracy: not measured (no rollout engine" in out
    _print_summary({**s, "reward_first": 0.3, "reward_last": 0.5}, RunConfig(loss_type="sft_loss"))
    out = capsys.readouterr().out
    assert "reward (mean of first 3 / last 3 rollouts): 0.300 → 0.500" in out and "SFT loss" in out


def test_preflight_names_the_rows_the_sft_rollout_could_not_train_on(tmp_path):
    """The doctor checks engine.rollout.sft's rows before anything starts: a row without an answer, a conversation
    without an assistant turn or starting with one, and more than one sample per row are named."""
    import json

    from engine.doctor.checks import Environment
    from engine.stages import preflight

    p = tmp_path / "rows.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": ""},
            {"prompt": [{"role": "user", "content": "hi"}], "label": None},
            {"prompt": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"}], "label": None}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RunConfig(**SFT, prompt_data=str(p), apply_chat_template=True)
    with pytest.raises(ConfigError) as e:
        preflight(cfg, Environment())
    (d,) = [d for d in e.value.diagnoses if d.code == "DATA"]
    assert "3 of 4 --prompt-data rows cannot be trained on" in d.what and d.facts["lines"] == [2, 3, 4]
    assert "no assistant message" in d.what and "starts with an assistant message" in d.what
    with pytest.raises(ConfigError, match="--n-samples-per-prompt is 4"):
        preflight(RunConfig(**{**SFT, "n_samples_per_prompt": 4}, prompt_data=str(p), apply_chat_template=True),
                  Environment())


@pytest.mark.slow
def test_an_sft_run_resumes_bit_for_bit(prefect_harness, shared_ray, small_cfg, tmp_path):
    """3 SFT rollouts, then a resume to 4, end with the weights of 4 uninterrupted ones (the data position and the
    optimizer come back from the checkpoint; no engine is involved)."""
    from safetensors.torch import load_file

    from engine import checkpoint
    from flows.train import rl_train

    over = dict(SFT, rollout_batch_size=8, global_batch_size=8, lr=3e-4, save_interval=1)
    rl_train(small_cfg(num_rollout=4, save=str(tmp_path / "whole"), work_dir=str(tmp_path / "w1"), **over))
    rl_train(small_cfg(num_rollout=3, save=str(tmp_path / "cut"), work_dir=str(tmp_path / "w2"), **over))
    resumed = rl_train(small_cfg(num_rollout=4, save=str(tmp_path / "cut"), work_dir=str(tmp_path / "w2"), **over))
    assert resumed["start_rollout"] == 3

    def weights(save):
        return load_file(str(checkpoint.iter_dir(save, 3) / "model" / "model.safetensors"))

    a, b = weights(str(tmp_path / "whole")), weights(str(tmp_path / "cut"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
