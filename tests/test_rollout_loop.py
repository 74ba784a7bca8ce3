"""The rollout loop over real HTTP against the built-in engine: order, statuses, seeds, over-sampling and the
dynamic filter, a failing engine with and without fault tolerance, the deadline."""
from __future__ import annotations

import time

import pytest

from engine.rollout.loop import EngineFailure, Prompt, RolloutTimeout, SamplingParams, StaticEngines, \
    generate_rollout, rollout_metrics
from conftest import served_engine
from engine.samples import Status
from engine.rollout.ports import free_loopback_port


_free_port = free_loopback_port  # engine/rollout/ports.py


@pytest.fixture(scope="module")
def engine(tiny_model):
    with served_engine(tiny_model, max_new_tokens=8, deterministic=True) as served:
        yield served


@pytest.fixture
def draw(engine):
    from engine.config.data import BUNDLED_TRAIN
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import render_prompt

    state, _ = engine
    ds = PromptDataset(load_prompts(BUNDLED_TRAIN, input_key="prompt", label_key="label"), shuffle=False, seed=0)

    def next_prompts(k: int) -> list[Prompt]:
        return [Prompt(r, render_prompt(state.tokenizer, r.prompt, True)) for r in ds.next_batch(k)]

    next_prompts.dataset = ds
    return next_prompts


def _params(state, max_new: int = 6) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=state.generator.eos_ids)


def _rm():
    from engine.rewards import RewardModel

    return RewardModel("exact_match", None)


def _run(engine, draw, **kw):
    state, url = engine
    args = dict(rollout_id=3, batch_size=4, n=3, params=_params(state), reward_model=_rm(), seed=1,
                engines=StaticEngines([url]), timeout_s=120)
    args.update(kw)
    return generate_rollout(draw, **args)


def test_groups_come_back_in_prompt_order_with_statuses_rewards_and_logprobs(engine, draw):
    res = _run(engine, draw)
    assert [len(g) for g in res.groups] == [3, 3, 3, 3]
    assert [g[0].metadata["row"] for g in res.groups] == [1, 2, 3, 4]  # the first four lines, in order
    for gi, g in enumerate(res.groups):
        for j, s in enumerate(g):
            assert (s.group_index, s.index, s.rollout_id) == (gi, gi * 3 + j, 3)
            assert s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert (s.status == Status.TRUNCATED) == (s.metadata["finish_reason"]["type"] == "length")
            assert len(s.rollout_log_probs) == s.response_length == len(s.tokens) - s.prompt_length
            assert all(lp <= 0 for lp in s.rollout_log_probs)
            assert s.reward == float(s.response.strip() == s.label)
    m = rollout_metrics(res, 1.0)
    assert m["rollout/groups_drawn"] == 4 and m["rollout/groups_filtered"] == 0
    assert 0.0 <= m["rollout/truncated_share"] <= 1.0


def test_groups_that_start_together_share_one_request_per_engine_when_the_pool_says_so(engine, draw):
    """EnginePool.join_rows (a built-in CPU engine: it answers a batch only once every row is done): the groups a
    round starts together go out as one /generate of at most join_rows rows, and each group gets its own rows back:
    every sample continues its own prompt with its own log-probs (the engine scores each sequence alone and agrees)."""
    from engine.rollout.client import EngineClient

    state, url = engine
    pool = StaticEngines([url])
    pool.join_rows = 6  # two groups of 3 per request: 4 groups → 2 requests
    before = len(state.scheduler.batch_sizes)
    res = _run(engine, draw, engines=pool)
    assert state.scheduler.batch_sizes[before:] == [6, 6]  # two requests, each a batch by itself
    assert [g[0].metadata["row"] for g in res.groups] == [1, 2, 3, 4]
    client = EngineClient(url)
    for gi, g in enumerate(res.groups):
        prompt = g[0].tokens[:g[0].prompt_length]
        assert len(g) == 3 and all(s.tokens[:s.prompt_length] == prompt for s in g)
        for s in g:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.response_length > 0
            (scored,) = client.score([s.tokens], temperature=1.0)
            got = scored[s.prompt_length - 1:]
            assert max(abs(a - b) for a, b in zip(got, s.rollout_log_probs)) < 1e-4, (gi, got, s.rollout_log_probs)
    # the pool's default (and SGLang's, and a GPU engine's): one request per group
    before = len(state.scheduler.batch_sizes)
    draw.dataset.load_state({"epoch": 0, "offset": 0})
    _run(engine, draw)
    assert state.scheduler.batch_sizes[before:] == [3, 3, 3, 3]  # deterministic: one request per batch


def test_same_rollout_id_same_samples_other_id_other_samples(engine, draw):
    def tokens(rollout_id):
        draw.dataset.load_state({"epoch": 0, "offset": 0})
        res = _run(engine, draw, rollout_id=rollout_id)
        return [(s.tokens, s.rollout_log_probs) for g in res.groups for s in g]

    a, b, c = tokens(5), tokens(5), tokens(6)
    assert a == b  # bit-identical: per-sample seeds, one batch per request (deterministic engine)
    assert a != c


def test_over_sampling_keeps_the_first_passing_groups_in_draw_order(engine, draw):
    # keep odd draws only: B = 2 from a round of 4 → draws 1 and 3 kept, 0 and 2 filtered
    odd = lambda group: group[0].metadata["draw_index"] % 2 == 1  # noqa: E731
    res = _run(engine, draw, batch_size=2, round_size=4, keep=odd)
    assert [g[0].metadata["draw_index"] for g in res.groups] == [1, 3]
    assert [g[0].group_index for g in res.groups] == [0, 1]  # re-indexed to their place in the rollout
    assert res.stats["filtered"] == 2 and res.stats["drawn"] == 4 and res.stats["aborted"] == 0


def test_round_is_cut_and_later_groups_aborted_once_enough_pass(engine, draw):
    state, _ = engine
    res = _run(engine, draw, batch_size=2, round_size=8, keep=lambda g: True, concurrency=3 * 8)
    assert [g[0].metadata["draw_index"] for g in res.groups] == [0, 1]
    assert res.stats["aborted"] >= 1 and res.stats["drawn"] == 8
    deadline = time.monotonic() + 10  # an abort stops a row at its next decode step, as SGLang's does
    while state.generator.aborts._live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not state.generator.aborts._live  # nothing left running on the engine


def test_filter_that_keeps_nothing_stops_after_the_dataset(engine, draw):
    from engine.diagnosis import DiagnosisError

    with pytest.raises(DiagnosisError, match="kept 0 of 2 groups after drawing 4 prompts"):
        _run(engine, draw, batch_size=2, round_size=2, keep=lambda g: False, max_prompts=4)


def test_builtin_filter_drops_groups_with_equal_rewards(engine, draw):
    from engine.rollout.filters import check_reward_nonzero_std

    res = _run(engine, draw, batch_size=2, round_size=6, keep=check_reward_nonzero_std, n=4, max_prompts=200)
    for g in res.groups:
        rewards = [s.reward for s in g]
        assert max(rewards) > min(rewards)
    assert res.stats["drawn"] >= 6


def test_raising_reward_marks_failed_and_the_rollout_completes(engine, draw, tmp_path):
    from engine.rewards import RewardModel

    mod = tmp_path / "rm.py"
    mod.write_text("def score(s):\n    if s.index % 2:\n        raise RuntimeError('judge down')\n    return 1.0\n")
    res = _run(engine, draw, reward_model=RewardModel(None, f"{mod}:score"))
    samples = [s for g in res.groups for s in g]
    failed = [s for s in samples if s.status == Status.FAILED]
    assert len(failed) == 6 and all("judge down" in s.metadata["failure"] for s in failed)
    assert rollout_metrics(res, 1.0)["rollout/failed_share"] == 0.5


def test_a_rollout_where_every_sample_failed_says_why(engine, draw, tmp_path):
    from engine.rewards import RewardModel
    from engine.rollout.loop import NothingToTrain

    mod = tmp_path / "rm_down.py"
    mod.write_text("def score(s):\n    raise ConnectionError('reward service down')\n")
    with pytest.raises(NothingToTrain, match="all 12 samples failed.*reward service down"):
        _run(engine, draw, reward_model=RewardModel(None, f"{mod}:score"))


class _Pool:
    """Two engines, the first dead (nothing listens on its port)."""

    def __init__(self, url: str, fault_tolerant: bool):
        self.urls = [f"http://127.0.0.1:{_free_port()}", url]
        self.fault_tolerant = fault_tolerant
        self.failed: list[str] = []

    def serving(self) -> list[str]:
        return [u for u in self.urls if u not in self.failed]

    def report_failure(self, url: str) -> None:
        self.failed.append(url)


def test_a_dead_engine_is_reported_and_its_groups_resent(engine, draw):
    _, url = engine
    pool = _Pool(url, fault_tolerant=True)
    res = _run(engine, draw, engines=pool)
    assert set(pool.failed) == {pool.urls[0]} and res.stats["retried_requests"] == len(pool.failed) >= 1
    assert all(len(g) == 3 for g in res.groups)


def test_without_fault_tolerance_a_dead_engine_fails_the_rollout(engine, draw):
    _, url = engine
    pool = _Pool(url, fault_tolerant=False)
    with pytest.raises(EngineFailure, match="--use-fault-tolerance"):
        _run(engine, draw, engines=pool)


def test_rollout_deadline(engine, draw):
    # 5 ms: less than one request's round trip; the bundled model's answers end at EOS after a few tokens, so on a
    # fast machine a whole rollout can finish within 50 ms (it did)
    with pytest.raises(RolloutTimeout, match="--rollout-timeout"):
        _run(engine, draw, timeout_s=0.005, params=SamplingParams(max_new_tokens=200, temperature=1.0))


# ---- --partial-rollout: a stop string across the pause between two segments -------------------------------------
def test_a_stop_string_split_by_a_pause_stops_the_sample_where_one_request_would_have():
    """Segment 1 ends with "<" (aborted by a weight sync), segment 2 starts with "/a>..." and runs on: neither engine
    saw "</a>" whole. The continuation is cut after the token that completes it, the text trimmed before it."""
    from types import SimpleNamespace

    from engine.rollout.loop import Partial, PartialBuffer, _Round, stop_across_segments

    def decode(ids):
        return "".join(chr(i) for i in ids)

    def segment(text, reason):
        triples = [[-0.5 - i, ord(c), None] for i, c in enumerate(text)]
        return {"text": text, "meta_info": {"output_token_logprobs": triples, "finish_reason": {"type": reason},
                                            "weight_version": "1"}}

    params = SamplingParams(max_new_tokens=32, stop=["</a>", "zz"])
    round_ = SimpleNamespace(params=params, partial=PartialBuffer(0, decode=decode))
    row = Partial()
    _Round._extend(round_, row, segment("x<", "abort"))
    assert row.finish_reason is None and row.ids == [ord("x"), ord("<")]  # paused: continued under new weights
    _Round._extend(round_, row, segment("/a>yy", "length"))
    assert row.finish_reason == {"type": "stop", "matched": "</a>"}
    assert decode(row.ids) == "x</a>" and row.text == "x" and row.lengths == [2, 3] and len(row.logprobs) == 5

    # a match inside the new segment only is the engine's (nothing cut here); so is a row without a pause
    row = Partial(ids=[ord("x")], logprobs=[-1.0], text="x", versions=["0"], lengths=[1])
    row.ids += [ord(c) for c in "zz"]
    row.logprobs += [-1.0, -1.0]
    row.text += "zz"
    assert stop_across_segments(row, 1, params.stop, decode) is None
    # of two spanning strings, the one completed first wins (the engine checks after every token), though the
    # other starts earlier; without a decoder (e.g. no tokenizer) nothing changes
    row = Partial(ids=[ord(c) for c in "qz</z"], logprobs=[0.0] * 5, text="qz</z", versions=["0"], lengths=[5])
    row.ids += [ord(c) for c in "a>b"]
    row.logprobs += [0.0] * 3
    row.text += "a>b"
    row.lengths.append(3)
    assert stop_across_segments(row, 5, ["</za>", "/za"], decode) == {"type": "stop", "matched": "/za"}
    assert decode(row.ids) == "qz</za" and row.text == "qz<" and row.lengths == [5, 1]
    row = Partial()
    plain = SimpleNamespace(params=params, partial=PartialBuffer(0))
    _Round._extend(plain, row, segment("x<", "abort"))
    _Round._extend(plain, row, segment("/a>yy", "length"))
    assert row.finish_reason == {"type": "length"} and decode(row.ids) == "x</a>yy"


def test_a_runs_partial_buffer_decodes_as_the_engines_do(tiny_model, tmp_path):
    """stages.partial_buffer gives the buffer the run's tokenizer, special tokens skipped (SamplingParams.to_sglang),
    also for a buffer a checkpoint restored."""
    from engine import stages
    from engine.config import RunConfig
    from engine.modeling import load_tokenizer
    from engine.rollout.loop import PartialBuffer
    from engine.run import Run

    run = Run(RunConfig(hf_checkpoint=tiny_model, work_dir=str(tmp_path), async_mode="one-step",
                        partial_rollout=True))
    run.tokenizer = load_tokenizer(tiny_model)
    ids = run.tokenizer("12+3=15", add_special_tokens=False)["input_ids"] + [run.tokenizer.eos_token_id]
    assert stages.partial_buffer(run, 0, None).decode(ids) == "12+3=15"
    run.state.resume_partial[1] = ({"next": 0}, PartialBuffer(1))
    assert stages.partial_buffer(run, 1, {"next": 0}).decode(ids) == "12+3=15"


def test_a_context_cap_asks_each_group_for_what_its_prompt_leaves(engine, draw):
    """slime's --rollout-max-context-len: prompt + response ≤ the cap. With a cap 2 tokens above a prompt, that
    group's samples stop at 2 new tokens (TRUNCATED when the answer needed more), whatever max_new_tokens says."""
    state, url = engine
    prompts = draw(4)
    shortest = min(len(p.ids) for p in prompts)

    def again(k, it=iter([prompts])):
        return next(it)

    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=state.generator.eos_ids,
                            max_context_len=shortest + 2)
    res = _run(engine, again, params=params)
    for g, p in zip(res.groups, prompts):
        room = max(1, min(8, shortest + 2 - len(p.ids)))
        for s in g:
            assert s.prompt_length + s.response_length <= max(shortest + 2, len(p.ids) + 1)
            assert s.response_length <= room
            if s.status == Status.TRUNCATED:
                assert s.response_length == room
    assert any(s.status == Status.TRUNCATED for g in res.groups for s in g)
    assert SamplingParams(max_new_tokens=8).budget(100) == 8  # no cap: max_new_tokens


def test_mask_offpolicy_in_partial_rollout_reaches_the_buffer_and_is_counted(tiny_model, tmp_path):
    """--mask-offpolicy-in-partial-rollout (slime's flag): stages.partial_buffer turns it on in the buffer (the
    loop then masks the older segments: tests/test_async.py, under a real pause), also in a restored one; the
    share it masked is logged; without --partial-rollout the flag is refused."""
    from engine import stages
    from engine.config import RunConfig
    from engine.diagnosis import ConfigError
    from engine.rollout.loop import PartialBuffer, offpolicy_mask
    from engine.run import Run
    from engine.samples import Sample

    cfg = dict(hf_checkpoint=tiny_model, work_dir=str(tmp_path), async_mode="one-step", partial_rollout=True)
    assert stages.partial_buffer(Run(RunConfig(**cfg)), 0, None).mask_offpolicy is False
    run = Run(RunConfig(**cfg, mask_offpolicy_in_partial_rollout=True))
    assert stages.partial_buffer(run, 0, None).mask_offpolicy is True
    run.state.resume_partial[1] = ({"next": 0}, PartialBuffer(1))
    assert stages.partial_buffer(run, 1, {"next": 0}).mask_offpolicy is True
    assert offpolicy_mask([3, 2], 5) == [0, 0, 0, 1, 1] and offpolicy_mask([4, 0], 4) == [0] * 4

    def sample(lengths):
        meta = {"weight_versions": [str(i) for i in range(len(lengths))], "segment_lengths": lengths} \
            if len(lengths) > 1 else {}
        return Sample(index=0, group_index=0, rollout_id=0, prompt="", response_length=sum(lengths), metadata=meta)

    assert stages.offpolicy_masked([sample([3, 2]), sample([5])]) == {"rollout/offpolicy_masked_share": 0.3}
    with pytest.raises(ConfigError, match="without --partial-rollout no sample has them"):
        RunConfig(hf_checkpoint=tiny_model, mask_offpolicy_in_partial_rollout=True)
