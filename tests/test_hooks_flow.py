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
