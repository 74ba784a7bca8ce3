"""Prompt data and rewards: errors name the file, the line and the fix."""
from __future__ import annotations

import json

import pytest

from engine.data import PromptDataset, load_prompts
from engine.doctor import ConfigError
from engine.rewards import RewardModel, exact_match, math_reward
from engine.samples import Sample, Status


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_prompts(str(tmp_path / "nope.jsonl"), input_key="prompt", label_key="label")
    assert "--prompt-data" in str(e.value) and "no such file" in str(e.value)


def test_row_without_input_key_names_line(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": "1+1=", "label": "2"}, {"question": "2+2=", "label": "4"}])
    with pytest.raises(ConfigError) as e:
        load_prompts(p, input_key="prompt", label_key="label")
    msg = str(e.value)
    assert "line 2" in msg and "'prompt'" in msg and "--input-key" in msg


def test_invalid_json_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "label": "b"}\n{oops\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        load_prompts(str(p), input_key="prompt", label_key="label")


def test_slice_and_epochs(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": str(i), "label": str(i)} for i in range(10)])
    rows = load_prompts(p + "@[2:5]", input_key="prompt", label_key="label")
    assert [r.prompt for r in rows] == ["2", "3", "4"]
    ds = PromptDataset(rows, shuffle=False, seed=0)
    assert [r.prompt for r in ds.next_batch(4)] == ["2", "3", "4", "2"]  # wraps into epoch 1
    assert ds.state() == {"epoch": 1, "offset": 1}


def test_dataset_state_round_trip(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": str(i), "label": str(i)} for i in range(7)])
    rows = load_prompts(p, input_key="prompt", label_key="label")
    a = PromptDataset(rows, shuffle=True, seed=3)
    a.next_batch(5)
    b = PromptDataset(rows, shuffle=True, seed=3)
    b.load_state(a.state())
    assert [r.prompt for r in a.next_batch(6)] == [r.prompt for r in b.next_batch(6)]


def test_builtin_rewards():
    assert exact_match(" 85 ", "85") == 1.0 and exact_match("84", "85") == 0.0
    assert math_reward("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("the result is 12", "12") == 1.0
    assert math_reward("no number", "3") == 0.0


def test_raising_reward_marks_sample_failed(tmp_path):
    mod = tmp_path / "myrm.py"
    mod.write_text("def score(sample):\n    if sample.response == 'bad':\n        raise ValueError('boom')\n"
                   "    return 1.0\n")
    rm = RewardModel(None, f"{mod}:score")
    group = [Sample(index=i, group_index=0, rollout_id=0, prompt="p", response=r, status=Status.COMPLETED)
             for i, r in enumerate(["ok", "bad"])]
    rm.score_group(group)
    assert group[0].reward == 1.0 and group[0].status == Status.COMPLETED
    assert group[1].status == Status.FAILED and "boom" in group[1].metadata["failure"]


def test_custom_reward_path_errors():
    with pytest.raises(ConfigError, match="not module:function"):
        RewardModel(None, "no_colon_here")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        RewardModel(None, "does.not.exist:fn")
