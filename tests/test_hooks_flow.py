"""Custom rollouts in the whole flow (Prefect harness, real Ray, the built-in engine): the tool-use example
(examples/tool.yaml) trains with its multi-turn generate hook, and a hook that raises fails its rollout task once —
not retried by the task or by --flow-retries — with the hook's name and traceback."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent


def tool_cfg(tmp_path, **over):
    from engine.config import RunConfig

    raw = yaml.safe_load((ROOT / "examples" / "tool.yaml").read_text())
    raw.update(hf_checkpoint=str(ROOT / "examples" / "tiny-qwen2-calc"),
               custom_generate_function_path=str(ROOT / "examples" / "tool_calc.py") + ":generate",
               custom_rm_path=str(ROOT / "examples" / "tool_calc.py") + ":reward",
               work_dir=str(tmp_path / "work"), summary_json=None, save=str(tmp_path / "ckpt"), progress=False,
               num_rollout=3, rollout_batch_size=4, global_batch_size=32, eval_max_samples=8,
               experiment_name="tests")
    raw.update(over)
    return RunConfig(**raw)


def test_the_tool_example_trains_through_the_flow(prefect_harness, shared_ray, tmp_path):
    from flows.train import rl_train

    cfg = tool_cfg(tmp_path)
    result = rl_train(cfg)
    assert result["rollouts"] == 3
    h = result["history"]
    calls = h["rollout/reward_tool_calls_mean"]
    assert len(calls) == 3 and all(0.0 <= v <= 2.0 for v in calls.values())
    # the engine's log-probs of the model's tokens are the trainer's (tool tokens masked out of the comparison)
    assert all(v < 1e-3 for v in h["train/mismatch"].values())
    assert all(v > 0 for v in h["rollout/response_len_mean"].values())


def test_a_raising_hook_fails_its_rollout_once(prefect_harness, shared_ray, tmp_path):
    from engine.rollout.hooks import HookError
    from flows.train import rl_train
    from test_orchestration import _flow_run_named

    cfg = tool_cfg(tmp_path, custom_generate_function_path="hook_fakes:raises", rollout_retries=2, flow_retries=2,
                   flow_retry_delay=0, run_name="hook-raises", eval_prompt_data="")
    with pytest.raises(HookError) as e:
        rl_train(cfg)
    assert "--custom-generate-function-path 'hook_fakes:raises' raised KeyError" in str(e.value)
    fr, trs = _flow_run_named("hook-raises")
    assert fr.state.is_failed() and fr.run_count == 1
    rollout = [t for t in trs if t.name == "rollout-0"]
    assert len(rollout) == 1 and rollout[0].run_count == 1 and rollout[0].state.is_failed()
    assert "hook_fakes:raises" in (rollout[0].state.message or "")


calls: list[tuple] = []


def take_odd_rollouts(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """--custom-rollout-log-function-path: logs a metric of its own; takes over rollflow's logging of rollout 1."""
    calls.append(("rollout", rollout_id, len(samples), dict(rollout_extra_metrics), rollout_time))
    args.tracker.log_metrics({"custom/samples": float(len(samples))}, step=rollout_id)
    return rollout_id == 1


def take_every_eval(rollout_id, args, data, extra_metrics):
    calls.append(("eval", rollout_id, {k: len(v["rewards"]) for k, v in data.items()}, dict(extra_metrics)))
    return True


def test_logging_hooks_see_each_rollout_and_evaluation_and_may_take_over(prefect_harness, shared_ray, small_cfg):
    """slime's --custom-rollout-log-function-path / --custom-eval-rollout-log-function-path: called with the
    samples and rollflow's metrics; True keeps those metrics out of MLflow (the run's history keeps them), and
    args.tracker logs the hook's own."""
    from mlflow.tracking import MlflowClient

    from flows.train import rl_train

    calls.clear()
    out = rl_train(small_cfg(save="", eval_max_samples=8,
                             custom_rollout_log_function_path="test_hooks_flow:take_odd_rollouts",
                             custom_eval_rollout_log_function_path="test_hooks_flow:take_every_eval"))
    mine = [c for c in calls if c[0] == "rollout"]  # the run imports this very module (by its name)
    assert [(c[1], c[2]) for c in mine] == [(0, 16), (1, 16)]
    assert mine[0][3]["rollout/reward_mean"] == out["history"]["rollout/reward_mean"]["0"] and mine[0][4] > 0
    evals = [c for c in calls if c[0] == "eval"]
    assert [(c[1], c[2]) for c in evals] == [(0, {"test": 8}), (2, {"test": 8})]
    assert evals[0][3]["eval/test_accuracy"] == out["test_accuracy_before"]
    client = MlflowClient(tracking_uri=out["mlflow_tracking_uri"])

    def steps(key):
        return sorted(m.step for m in client.get_metric_history(out["mlflow_run_id"], key))

    assert steps("rollout/reward_mean") == [0] and sorted(out["history"]["rollout/reward_mean"]) == ["0", "1"]
    assert steps("custom/samples") == [0, 1]
    assert steps("eval/test_accuracy") == [] and out["test_accuracy_after"] is not None
