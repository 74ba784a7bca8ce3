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


def test_parquet_with_metadata_and_row_numbers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"q": "1+1=", "a": "2", "meta": {"source": "s1"}},
        {"q": "2+2=", "a": "4", "meta": {"source": "s2"}}]), p)
    rows = load_prompts(str(p) + "@[1:]", input_key="q", label_key="a", metadata_key="meta")
    assert [(r.row, r.prompt, r.label, r.metadata) for r in rows] == [(2, "2+2=", "4", {"source": "s2"})]
    pq.write_table(pa.Table.from_pylist([{"q": "1+1=", "a": "2"}, {"q": None, "a": "4"}]), p)
    with pytest.raises(ConfigError, match="line 2 has 'q' = 'None'"):
        load_prompts(str(p), input_key="q", label_key="a")


def test_metadata_that_is_not_an_object_names_the_line(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": "a", "label": "b", "m": {"k": 1}}, {"prompt": "a", "label": "b",
                                                                                     "m": "oops"}])
    with pytest.raises(ConfigError, match="line 2 has 'm' = 'oops', a str, not an object"):
        load_prompts(p, input_key="prompt", label_key="label", metadata_key="m")


def test_chat_message_prompts_are_accepted_and_bad_ones_named(tmp_path):
    msgs = [{"role": "user", "content": "1+1="}]
    p = _write(tmp_path / "d.jsonl", [{"prompt": msgs, "label": "2"}, {"prompt": [{"text": "x"}], "label": "2"}])
    with pytest.raises(ConfigError, match="line 2 .* neither text nor a list of chat messages"):
        load_prompts(p, input_key="prompt", label_key="label")
    rows = load_prompts(p + "@[:1]", input_key="prompt", label_key="label")
    assert rows[0].prompt == msgs


def test_shuffle_is_seeded_per_epoch(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": str(i), "label": str(i)} for i in range(20)])
    rows = load_prompts(p, input_key="prompt", label_key="label")
    a = [r.prompt for r in PromptDataset(rows, shuffle=True, seed=7).next_batch(40)]
    b = [r.prompt for r in PromptDataset(rows, shuffle=True, seed=7).next_batch(40)]
    assert a == b and sorted(a[:20]) == sorted(a[20:]) and a[:20] != a[20:]  # each epoch a new permutation
    assert a[:20] != [str(i) for i in range(20)]


def test_math_reward_normalisation_and_sympy_equivalence():
    from engine.rewards import math_equal

    assert math_reward("\\boxed{\\dfrac{3}{6}}", "1/2") == 1.0  # sympy: 3/6 = 1/2
    assert math_reward("x = \\boxed{2\\sqrt{2}}", "sqrt(8)") == 1.0
    assert math_reward("\\boxed{1,000}", "1000") == 1.0
    assert math_reward("\\boxed{x^2+2x+1}", "(x+1)^2") == 1.0
    assert math_reward("\\boxed{x^2+1}", "(x+1)^2") == 0.0
    assert not math_equal("not math ((", "2")


def test_sympy_is_stopped_at_its_time_limit():
    import time

    from engine import rewards

    assert rewards.math_equal("(x+1)^2", "x^2+2x+1")  # starts (and warms) the sympy process
    t0 = time.monotonic()
    # factorial(10**7) is evaluated eagerly: minutes of CPU; the worker is killed at the limit
    assert not rewards.math_equal("factorial(10^7)", "3", timeout_s=0.5)
    assert time.monotonic() - t0 < 5 and rewards._SYMPY.proc is None and rewards._SYMPY.timeouts >= 1
    assert rewards.math_equal("2/4", "1/2")  # a fresh worker takes over


def test_f1_reward():
    from engine.rewards import f1_reward

    # SQuAD normalisation drops the articles: pred "cat sat", gold "cat": P = 1/2, R = 1 → F1 = 2·(1/2)/(3/2) = 2/3
    got = f1_reward("The cat sat", "the cat")
    assert got["score"] == pytest.approx(2 / 3) and got["precision"] == 0.5 and got["recall"] == 1.0
    assert f1_reward("dog", "the cat")["score"] == 0.0


def test_async_group_and_dict_rewards(tmp_path):
    mod = tmp_path / "rms.py"
    mod.write_text(
        "import asyncio\n"
        "async def judge(s):\n    await asyncio.sleep(0.01)\n    return {'score': float(s.response == 'a'), 'len': 1.0}\n"
        "def by_group(samples):\n    return [i / 2 for i in range(len(samples))]\n"
        "def bad(s):\n    return 'high'\n"
        "def nan(s):\n    return float('nan')\n")
    group = lambda: [Sample(index=i, group_index=0, rollout_id=0, prompt="p", response=r, status=Status.COMPLETED)  # noqa
                     for i, r in enumerate(["a", "b", "a"])]
    g = group()
    RewardModel(None, f"{mod}:judge").score_group(g)
    assert [s.reward for s in g] == [{"score": 1.0, "len": 1.0}, {"score": 0.0, "len": 1.0},
                                     {"score": 1.0, "len": 1.0}]
    assert [s.scalar_reward for s in g] == [1.0, 0.0, 1.0]
    g = group()
    RewardModel(None, f"{mod}:by_group", group_rm=True).score_group(g)
    assert [s.reward for s in g] == [0.0, 0.5, 1.0]
    g = group()
    RewardModel(None, f"{mod}:bad").score_group(g)
    assert all(s.status == Status.FAILED and "returned str 'high'" in s.metadata["failure"] for s in g)
    g = group()
    RewardModel(None, f"{mod}:nan").score_group(g)  # kept: the train step reports it as RF13 with the sample ids
    assert all(s.status == Status.COMPLETED and s.reward != s.reward for s in g)
    with pytest.raises(ConfigError, match="--group-rm needs --custom-rm-path"):
        RewardModel("math", None, group_rm=True)

    # --reward-key: the dict's "len" is the training reward; a key the dict lacks fails the sample, naming its keys
    g = group()
    keyed = RewardModel(None, f"{mod}:judge", reward_key="len")
    keyed.score_group(g)
    assert [s.scalar_reward for s in g] == [1.0, 1.0, 1.0] and all(s.reward_key == "len" for s in g)
    g = group()
    keyed.keyed("quality").score_group(g)
    assert all(s.status == Status.FAILED and "no key 'quality'" in s.metadata["failure"]
               and "its keys: len, score" in s.metadata["failure"] for s in g)
    assert keyed.reward_key == "len"  # keyed() is a copy
    g = group()
    RewardModel(None, f"{mod}:by_group", group_rm=True, reward_key="len").score_group(g)  # numbers pass
    assert [s.scalar_reward for s in g] == [0.0, 0.5, 1.0]
    g = [Sample(index=0, group_index=0, rollout_id=0, prompt="p", response="the cat sat", label="the cat",
                status=Status.COMPLETED)]
    RewardModel("f1", None, reward_key="recall").score_group(g)  # f1's own dict
    assert g[0].scalar_reward == 1.0 and g[0].reward["precision"] < 1.0


# ---- --rm-type remote_rm ------------------------------------------------------------------------------------------
@pytest.fixture
def reward_service():
    """A reward service on loopback: /score → 1.0 when response == label (as JSON), /dict → a dict reward,
    /flaky → 503 on each sample's first request, /refuse → 400, /text → a reply that is not JSON."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[dict] = []
    tried: set = set()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, **body})
            path = self.path.split("?")[0]
            right = float(body["response"].strip() == str(body["label"]))
            if path == "/flaky" and (key := body["response"]) not in tried:
                tried.add(key)
                code, out = 503, b"busy"
            elif path == "/refuse":
                code, out = 400, b"bad label"
            elif path == "/text":
                code, out = 200, b"yes"
            elif path == "/dict":
                code, out = 200, json.dumps({"score": right, "format": 0.5}).encode()
            else:
                code, out = 200, json.dumps(right).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", seen
    server.shutdown()


def _group(prompt="1+1=", label="2", responses=("2", "3")):
    return [Sample(index=i, group_index=0, rollout_id=0, prompt=prompt, response=r, label=label,
                   status=Status.COMPLETED) for i, r in enumerate(responses)]


def test_a_remote_reward_service_scores_each_sample_as_slime_sends_it(reward_service, monkeypatch):
    from engine.rewards import RemoteReward

    url, seen = reward_service
    g = _group(responses=("2", "3", " 2 "))
    RewardModel("remote_rm", None, rm_url=url + "/score").score_group(g)
    assert [s.reward for s in g] == [1.0, 0.0, 1.0] and all(s.status == Status.COMPLETED for s in g)
    assert sorted(x["response"] for x in seen) == [" 2 ", "2", "3"]
    assert set(seen[0]) == {"path", "prompt", "response", "label"} and seen[0]["prompt"] == "1+1="

    g = _group()
    RewardModel("remote_rm", None, rm_url=url + "/dict").score_group(g)
    assert [s.reward for s in g] == [{"score": 1.0, "format": 0.5}, {"score": 0.0, "format": 0.5}]

    seen.clear()  # a 503 is retried (each sample's first request here), then scored
    g = _group()
    RewardModel("remote_rm", None, rm_url=url + "/flaky").score_group(g)
    assert [s.reward for s in g] == [1.0, 0.0] and len(seen) == 4

    # a 4xx is not retried; a reply that is not JSON, or no service, fails the sample with the reason, and the
    # URL's token never shows
    monkeypatch.setattr(RemoteReward, "ATTEMPTS", 2)
    port = __import__("engine.rollout.ports", fromlist=["free_loopback_port"]).free_loopback_port()
    for path, says in ((url + "/refuse?token=s3cr3tvalue", "refused the sample: HTTP 400 'bad label'"),
                       (url + "/text", "answered with no JSON"),
                       (f"http://127.0.0.1:{port}/score?token=s3cr3tvalue", "did not answer after 2 attempts")):
        seen.clear()
        g = _group()
        RewardModel("remote_rm", None, rm_url=path).score_group(g)
        for s in g:
            assert s.status == Status.FAILED and s.reward == 0.0, (path, s)
            assert says in s.metadata["failure"] and "s3cr3tvalue" not in s.metadata["failure"], s.metadata
        if "refuse" in path:
            assert len(seen) == 2  # once per sample


def test_remote_reward_flags_and_preflight(reward_service):
    from engine.config import RunConfig
    from engine.doctor.checks import Environment, reward_service_reachable
    from engine.rollout.ports import free_loopback_port

    for kw, says in ((dict(rm_type="remote_rm"), "needs the service's --rm-url"),
                     (dict(rm_url="http://h/x"), "is read only with --rm-type remote_rm"),
                     (dict(rm_type="remote_rm", rm_url="h:1/x"), "is not an http"),
                     (dict(rm_type="remote_rm", rm_url="http://h/x", custom_rm_path="m:f"), "replaces it"),
                     (dict(rm_url="http://u:pw@h/x?token=abc"), "is read only with")):
        with pytest.raises(ConfigError, match=says) as e:
            RunConfig(**kw)
        assert "pw@" not in str(e.value) and "abc" not in str(e.value)
    url, _ = reward_service
    assert reward_service_reachable(RunConfig(rm_type="remote_rm", rm_url=url + "/score"), Environment()) == []
    (d,) = reward_service_reachable(RunConfig(rm_type="remote_rm", rm_url=f"http://127.0.0.1:{free_loopback_port()}/s"),
                                    Environment())
    assert d.severity == "warning" and "does not take a connection" in d.what


def test_a_samples_metadata_names_its_reward_as_in_slime(reward_service):
    """metadata["rm_type"] overrides --rm-type per sample (a dataset mixing tasks), slime's boxed_ prefix grades the
    last \\boxed{} only; a name rollflow does not have fails that sample, with the names it has."""
    url, seen = reward_service

    def sample(response, label, rm_type=None):
        return Sample(index=0, group_index=0, rollout_id=0, prompt="q", response=response, label=label,
                      status=Status.COMPLETED, metadata={"rm_type": rm_type} if rm_type else {})

    g = [sample("so \\boxed{7}", "7", "boxed_exact_match"), sample("so \\boxed{7}", "7"),
         sample("the cat sat", "a cat sat down", "f1"), sample("so \\boxed{\\frac{1}{2}}", "0.5", "math"),
         sample("7", "7", "nonsense"), sample("7", "7", "remote_rm"), sample("no box", "7", "boxed_exact_match")]
    RewardModel("exact_match", None).score_group(g)
    assert g[0].reward == 1.0 and g[1].reward == 0.0  # the run's exact_match compares the whole text
    assert g[2].reward["score"] == pytest.approx(0.8)  # "cat sat" in "cat sat down" (articles dropped)
    assert g[3].reward == 1.0 and g[6].reward == 0.0
    assert g[4].status == Status.FAILED and "'nonsense' is not one of boxed_exact_match" in g[4].metadata["failure"]
    assert g[5].status == Status.FAILED and "no --rm-url" in g[5].metadata["failure"]

    # with a reward service: rows without rm_type (and remote_rm ones) go to it, the others are graded here
    g = [sample("so \\boxed{7}", "7"), sample("7", "7")]  # the run's reward may be a boxed_ one too
    RewardModel("boxed_exact_match", None).score_group(g)
    assert [s.reward for s in g] == [1.0, 0.0]
    seen.clear()
    g = [sample("7", "7"), sample("so \\boxed{7}", "7", "boxed_exact_match"), sample("8", "7", "remote_rm")]
    RewardModel("remote_rm", None, rm_url=url + "/score").score_group(g)
    assert [s.reward for s in g] == [1.0, 1.0, 0.0] and sorted(x["response"] for x in seen) == ["7", "8"]


def test_preflight_names_rows_whose_reward_does_not_exist(tmp_path):
    from engine.config import RunConfig
    from engine.doctor.checks import Environment, data_readable

    p = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "1+1", "label": "2", "meta": {"rm_type": t}} for t in
            ("math", "boxed_f1", "nonsense", "remote_rm", "f1")]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d,) = data_readable(RunConfig(prompt_data=str(p), metadata_key="meta", eval_prompt_data=""), Environment())
    assert d.code == "DATA" and "line 3: 'nonsense'" in d.what and "line 4: 'remote_rm'" in d.what, d.what
    assert data_readable(RunConfig(prompt_data=str(p), metadata_key="meta", eval_prompt_data="",
                                   custom_rm_path="engine.rewards:exact_match"), Environment()) == []
    (d,) = data_readable(RunConfig(prompt_data=str(p), metadata_key="meta", eval_prompt_data="", rm_type="remote_rm",
                                   rm_url="http://127.0.0.1:9/x"), Environment())
    assert "line 3" in d.what and "line 4" not in d.what
