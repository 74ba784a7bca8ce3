"""--eval-config (slime's): eval sets from one YAML file, each with its own keys, reward and sampling; a field set
nowhere in the file comes from the flags. Config errors, resolution, preflight, and the evaluation on a real engine."""
from __future__ import annotations

import json

import pytest

from engine.config import RunConfig
from engine.config.data import BUNDLED_TEST
from engine.diagnosis import ConfigError


def _yaml(tmp_path, text: str, name: str = "eval.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def qa_file(tmp_path):
    """The bundled test rows under other keys ("question", "answer"), as another dataset would have them."""
    rows = [json.loads(line) for line in open(BUNDLED_TEST)][:8]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["label"]}) + "\n" for r in rows))
    return str(path)


def test_fields_come_from_the_dataset_then_defaults_then_the_flags(tmp_path, qa_file):
    path = _yaml(tmp_path, f"""
eval:
  defaults:
    n_samples_per_eval_prompt: 4
    temperature: 0.6
  datasets:
    - name: arith
      path: {BUNDLED_TEST}
      rm_type: math
      temperature: 0.2
      max_response_len: 12
      metadata_overrides: {{split: test}}
    - name: qa
      path: {qa_file}
      prompt_key: question
      label_key: answer
""")
    cfg = RunConfig(eval_config=path, eval_top_p=0.9, rollout_max_response_len=8, rollout_stop=["\n\n"])
    a, q = cfg.eval_datasets()
    assert cfg.eval_sets == [("arith", BUNDLED_TEST), ("qa", qa_file)]
    assert (a.temperature, a.n_samples_per_eval_prompt, a.max_response_len, a.top_p) == (0.2, 4, 12, 0.9)
    assert (q.temperature, q.n_samples_per_eval_prompt, q.max_response_len, q.input_key, q.label_key) == \
        (0.6, 4, 8, "question", "answer")
    assert q.stop == ["\n\n"] and q.rm_type is None
    assert a.row_metadata({"x": 1}) == {"x": 1, "rm_type": "math", "split": "test"}

    mapping = _yaml(tmp_path, f"eval:\n  datasets:\n    qa: {{path: {qa_file}, input_key: question}}\n", "m.yaml")
    (only,) = RunConfig(eval_config=mapping, n_samples_per_eval_prompt=2).eval_datasets()
    assert (only.name, only.input_key, only.n_samples_per_eval_prompt, only.temperature) == ("qa", "question", 2, None)
    # without --eval-config: --eval-prompt-data's sets with the flags
    (t,) = RunConfig(eval_max_response_len=20).eval_datasets()
    assert (t.name, t.path, t.max_response_len, t.input_key) == ("test", BUNDLED_TEST, 20, "prompt")


@pytest.mark.parametrize("text, msg", [
    ("datasets: []", "has no `eval:` mapping at the top"),
    ("eval: {datasets: []}", "needs `datasets:`, a non-empty list"),
    ("eval: {datasets: [{name: a, path: p}], extra: 1}", "keys rollflow does not read: extra"),
    ("eval: {datasets: [{name: a, path: p, temprature: 0.5}]}", "dataset 'a': temprature = 0.5: Extra inputs"),
    ("eval: {datasets: [{name: a, path: p, min_new_tokens: -1}]}", "min_new_tokens = -1"),
    ("eval: {datasets: [{name: a, path: p, min_new_tokens: 9999}]}", "min_new_tokens 9999 is more than its answer"),
    ("eval: {datasets: [{name: a, path: p, rm_type: judge}]}", "rm_type = 'judge'"),
    ("eval: {datasets: [{name: a, path: p, top_p: 2}]}", "top_p = 2"),
    ("eval: {datasets: [{name: a, path: p}, {name: a, path: q}]}", "names a dataset twice"),
    ("eval: {datasets: [{name: a b, path: p}]}", "name = 'a b'"),
    ("eval: [", "is not YAML"),
])
def test_a_bad_file_is_a_config_error_naming_what_is_wrong(tmp_path, text, msg):
    with pytest.raises(ConfigError, match="--eval-config .*" + msg.replace("[", "\\[").replace("(", "\\(")) as e:
        RunConfig(eval_config=_yaml(tmp_path, text))
    assert e.value.diagnoses[0].facts["field"] == "eval_config"


def test_it_replaces_eval_prompt_data_and_what_starts_no_engine_refuses_it(tmp_path):
    path = _yaml(tmp_path, f"eval: {{datasets: [{{name: a, path: {BUNDLED_TEST}}}]}}")
    with pytest.raises(ConfigError, match="cannot be read"):
        RunConfig(eval_config=str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="both name eval sets"):
        RunConfig(eval_config=path, eval_prompt_data=["x", BUNDLED_TEST])
    with pytest.raises(ConfigError, match="--eval-config"):
        RunConfig(eval_config=path, load_debug_rollout_data=str(tmp_path / "r_{rollout_id}.json"))
    with pytest.raises(ConfigError, match="names an rm_type for a, but --custom-rm-path m:f scores every sample"):
        RunConfig(eval_config=_yaml(tmp_path, f"eval: {{datasets: [{{name: a, path: {BUNDLED_TEST}, rm_type: f1}}]}}",
                                    "f.yaml"), custom_rm_path="m:f")
    f1 = _yaml(tmp_path, f"eval: {{datasets: [{{name: qa, path: {BUNDLED_TEST}, rm_type: f1}}]}}", "f1.yaml")
    RunConfig(eval_config=f1, eval_reward_key="recall")  # f1's dict, from the set's own rm_type
    with pytest.raises(ConfigError, match="--eval-reward-key 'recall': the rewards of this run are numbers"):
        RunConfig(eval_config=path, eval_reward_key="recall")
    moved = {**RunConfig(eval_config=path).model_dump(), "eval_config": str(tmp_path / "only-on-the-driver.yaml")}
    assert RunConfig.from_dump(moved).eval_config.endswith("only-on-the-driver.yaml")  # a worker does not read it
    RunConfig(eval_config=path, eval_prompt_data=[])  # '' beside it is no conflict
    RunConfig(eval_config=path, eval_prompt_data=[], eval_function_path="m:f")  # the sets the function reads


def test_preflight_reads_each_set_with_its_own_keys_and_answer_length(tmp_path, qa_file, tiny_model):
    from engine.doctor.checks import Environment, run_preflight

    ok = _yaml(tmp_path, f"eval: {{datasets: [{{name: qa, path: {qa_file}, prompt_key: question, "
                         f"label_key: answer}}]}}")
    assert [d for d in run_preflight(RunConfig(eval_config=ok), Environment()) if d.severity == "error"] == []

    remote = _yaml(tmp_path, f"eval: {{datasets: [{{name: a, path: {BUNDLED_TEST}, rm_type: remote_rm}}]}}", "r.yaml")
    found = [d for d in run_preflight(RunConfig(eval_config=remote), Environment()) if d.code == "DATA"]
    assert len(found) == 1 and "remote_rm" in found[0].what and "--eval-config" in found[0].what, found

    ctx = json.load(open(f"{tiny_model}/config.json"))["max_position_embeddings"]
    long = _yaml(tmp_path, f"eval: {{datasets: [{{name: a, path: {BUNDLED_TEST}, max_response_len: {ctx}}}]}}",
                 "l.yaml")
    found = [d for d in run_preflight(RunConfig(eval_config=long), Environment()) if d.code == "DATA"]
    assert len(found) == 1 and "--eval-config a's max_response_len" in found[0].what, found


def test_each_set_is_evaluated_with_its_own_keys_reward_and_sampling(tmp_path, qa_file, tiny_model):
    """Two sets on one engine: "qa" under other keys, greedy; "arith4" with 4 samples at temperature 1 (pass@4
    logged) and the f1 reward named by the file (a row's rm_type, read by the per-sample reward). "qa" holds the
    same rows as "arith" of --eval-prompt-data, so its greedy accuracy equals the flags' evaluation."""
    from engine import stages
    from engine.modeling import eos_token_ids, load_tokenizer
    from engine.rewards import RewardModel
    from engine.rollout.loop import StaticEngines
    from engine.rollout.ports import free_loopback_port
    from engine.rollout.server import EngineState, ServerThread
    from engine.run import Run

    state = EngineState(tiny_model, threads=1, max_new_tokens=8, deterministic=True)
    server = ServerThread(state, "127.0.0.1", free_loopback_port())
    url = server.start()
    path = _yaml(tmp_path, f"""
eval:
  datasets:
    - {{name: qa, path: {qa_file}, prompt_key: question, label_key: answer}}
    - {{name: arith4, path: {BUNDLED_TEST}, n_samples_per_eval_prompt: 4, temperature: 1.0, rm_type: f1}}
""")

    def run_of(**over):
        cfg = RunConfig(apply_chat_template=True, eval_max_samples=8, rollout_max_response_len=8,
                        work_dir=str(tmp_path / "w"), **over)
        run = Run(cfg)
        run.tokenizer = load_tokenizer(cfg.hf_checkpoint)
        run.eos_ids = eos_token_ids(cfg.hf_checkpoint, run.tokenizer)
        run.reward_model = RewardModel(cfg.rm_type, None)
        run.engines = StaticEngines([url])
        run.eval_datasets = {d.name: d for d in cfg.eval_datasets()}
        run.eval_sets = {name: stages.eval_rows(d, cfg.eval_max_samples) for name, d in run.eval_datasets.items()}
        return run

    try:
        run = run_of(eval_config=path, log_passrate=True)
        assert all(r.metadata["rm_type"] == "f1" for r in run.eval_sets["arith4"])
        assert stages.evaluate(run, 0) == run.history["eval/qa_accuracy"][0]
        assert sorted(run.history) == ["eval/arith4_accuracy", "eval/arith4_mean_at_k", "eval/arith4_pass_at_1",
                                       "eval/arith4_pass_at_2", "eval/arith4_pass_at_4", "eval/arith4_pass_at_k",
                                       "eval/qa_accuracy"]  # --log-passrate: none for qa's one sample a prompt
        p = [run.history[f"eval/arith4_pass_at_{k}"][0] for k in (1, 2, 4)]
        assert p == sorted(p) and p[2] <= run.history["eval/arith4_pass_at_k"][0], p
        flags = run_of(eval_prompt_data=["arith", BUNDLED_TEST])
        assert stages.evaluate(flags, 0) == run.history["eval/qa_accuracy"][0]
        assert run.history["eval/arith4_pass_at_k"][0] >= run.history["eval/arith4_accuracy"][0]
        assert stages.eval_sampling_params(run, run.eval_datasets["arith4"]).temperature == 1.0
        assert stages.eval_sampling_params(run, run.eval_datasets["qa"]).temperature == 0.0
    finally:
        server.stop()


def test_eval_key_and_top_k_flags_are_every_sets_default(tmp_path, qa_file):
    (d,) = RunConfig(eval_prompt_data=["qa", qa_file], eval_input_key="question", eval_label_key="answer",
                     eval_top_k=5, rollout_top_k=20).eval_datasets()
    assert (d.input_key, d.label_key, d.top_k) == ("question", "answer", 5)
    (d,) = RunConfig(rollout_top_k=20).eval_datasets()
    assert (d.input_key, d.label_key, d.top_k) == ("prompt", "label", 20)
    with pytest.raises(ConfigError, match="--skip-eval-before-train with no eval sets"):
        RunConfig(eval_prompt_data=[], skip_eval_before_train=True)


@pytest.mark.slow
def test_a_run_with_an_eval_config_that_skips_the_evaluation_before_training(prefect_harness, shared_ray,
                                                                              small_cfg, tmp_path, qa_file):
    """Through the flow: --eval-config's set (its own keys) is evaluated after training only
    (--skip-eval-before-train): no step-0 accuracy, and the summary says the accuracy before is unknown."""
    from flows.train import rl_train

    path = _yaml(tmp_path, f"eval: {{datasets: [{{name: qa, path: {qa_file}, prompt_key: question, "
                           f"label_key: answer}}]}}")
    out = rl_train(small_cfg(num_rollout=1, eval_prompt_data=[], eval_config=path, skip_eval_before_train=True))
    assert out["history"]["eval/qa_accuracy"].keys() == {"1"}, out["history"]["eval/qa_accuracy"]
    assert out["test_accuracy_before"] is None and out["test_accuracy_after"] is not None


def test_pass_rates_are_the_unbiased_estimator():
    """pass@k = the share of k-subsets of a group's n samples holding a correct one (reward 1), averaged over
    groups: checked against that count by enumeration."""
    from itertools import combinations

    from engine.stages import pass_rates

    groups = [[1, 0, 0, 0, 1, 0, 0, 0], [0] * 8, [1] * 8, [0, 0.5, 1, 0, 0, 0, 0, 0]]
    got = pass_rates(groups)
    assert sorted(got) == [1, 2, 4, 8]
    for k, v in got.items():
        want = sum(sum(any(g[i] == 1 for i in c) for c in combinations(range(8), k)) /
                   len(list(combinations(range(8), k))) for g in groups) / len(groups)
        assert abs(v - want) < 1e-12, (k, v, want)
    assert pass_rates([[1.0], [0.0]]) == {}


def test_the_example_file_loads_from_the_repository_root(monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    sets = RunConfig(eval_config="examples/eval/sets.yaml").eval_datasets()
    assert [(d.name, d.n_samples_per_eval_prompt, d.temperature) for d in sets] == [("test", 1, None),
                                                                                  ("test_at_8", 8, 1.0)]
    assert all(Path(d.path).is_file() for d in sets)
