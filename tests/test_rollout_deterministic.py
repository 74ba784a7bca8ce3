"""--deterministic-rollout: one batched request per engine per rollout, so a redone rollout meets the same batch."""
from __future__ import annotations

import socket

import pytest

from engine.data import PromptRow
from engine.rewards import RewardModel
from engine.rollout.loop import SamplingParams, generate_rollout, split_in_order
from engine.rollout.server import EngineState, ServerThread


@pytest.mark.parametrize("groups, engines, sizes", [
    (10, 3, [4, 3, 3]),  # 10 = 3·3 + 1: the first engine takes the extra group
    (2, 3, [1, 1, 0]),  # more engines than groups: the last one gets no request
    (8, 1, [8]),
])
def test_split_in_order(groups, engines, sizes):
    shares = split_in_order(groups, engines)
    assert [len(r) for r in shares] == sizes
    assert [g for r in shares for g in r] == list(range(groups))  # contiguous, in order, each group once


@pytest.fixture(scope="module")
def two_engines(tiny_model):
    servers = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        state = EngineState(tiny_model, threads=1, max_new_tokens=6)
        servers.append((state, ServerThread(state, "127.0.0.1", port)))
    urls = [srv.start() for _, srv in servers]
    yield [st for st, _ in servers], urls
    for _, srv in servers:
        srv.stop()


def test_each_engine_gets_one_batch_and_a_redo_is_identical(two_engines):
    states, urls = two_engines
    tok = states[0].tokenizer
    rows = [PromptRow(i + 1, f"{a}+{b}=", str(a + b), {}) for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6)])]
    ids = [tok(r.prompt, add_special_tokens=False)["input_ids"] for r in rows]

    def once():
        before = [len(s.scheduler.batch_sizes) for s in states]
        groups = generate_rollout(rows, rollout_id=7, prompt_ids=ids, urls=urls, n=2,
                                  params=SamplingParams(max_new_tokens=6),
                                  reward_model=RewardModel("exact_match", None), seed=1, deterministic=True)
        return groups, [s.scheduler.batch_sizes[b:] for s, b in zip(states, before)]

    g1, batches1 = once()
    g2, batches2 = once()
    # groups 0, 1 → engine 0 (one batch of 2·2 samples); group 2 → engine 1 (one batch of 2)
    assert batches1 == batches2 == [[4], [2]]
    assert [[s.tokens for s in g] for g in g1] == [[s.tokens for s in g] for g in g2]
    assert [[s.rollout_log_probs for s in g] for g in g1] == [[s.rollout_log_probs for s in g] for g in g2]
    assert [s.index for g in g1 for s in g] == list(range(6)) and [g[0].group_index for g in g1] == [0, 1, 2]
