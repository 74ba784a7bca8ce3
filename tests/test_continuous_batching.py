"""Continuous batching on the CUDA-graph decoder (engine/rollout/cuda_graphs.py, generation.py, server.py), run on
the CPU: the decoder's steps without the capture (`capture=False`), the same logic a GPU replays.

A request that arrives while a batch decodes joins it in a free row between two steps and draws what it would draw
alone; its result is handed back when it finishes, not when the batch does."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from engine.rollout.cuda_graphs import GraphDecoder
from engine.rollout.generation import Feed, GenRequest, Generator


def _graph_generator(tiny_model) -> Generator:
    from engine.modeling import eos_token_ids, load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, impl="transformers").eval()  # the GPU's model code (CUDA graphs hook it)
    gen = Generator(model, tok, eos_token_ids(tiny_model, tok))
    gen.on_gpu = True  # the device sampler and the graph decoder's logic, on the CPU
    gen.graphs = GraphDecoder(model, gen._cache_kw, capture=False)
    return gen


def _ids(gen: Generator, q: str) -> list[int]:
    return gen.tokenizer(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)["input_ids"]


def _req(gen, rid, q, n, seed, **kw) -> GenRequest:
    return GenRequest(rid=rid, input_ids=_ids(gen, q), max_new_tokens=n, seed=seed, ignore_eos=True, **kw)


def test_a_request_offered_to_a_running_batch_joins_it_and_draws_what_it_draws_alone(tiny_model):
    gen = _graph_generator(tiny_model)
    first = [_req(gen, f"r{i}", q, 24, 1 + i) for i, q in enumerate(("57+38=", "3+4=", "120-99="))]
    plain = gen.generate(first)  # the same batch with nothing offered
    feed, order = Feed(), []
    short = _req(gen, "short", "8+9=", 5, 10)
    pair = [_req(gen, "p0", "1+2=", 5, 11), _req(gen, "p1", "2+3=", 5, 12)]
    feed.put([short])
    feed.put(pair)
    out = gen.generate(first, feed=feed, deliver=lambda q, r: order.append((q.rid, len(r.output_ids))))
    # the batch has 16 rows (JOIN_ROWS): both groups joined, after the first step, and finished first
    assert gen.graphs.joined_rows == 3 and len(feed) == 0
    assert [rid for rid, _ in order[:3]] == ["short", "p0", "p1"] and order[0][1] == 5
    assert {rid for rid, _ in order} == {"r0", "r1", "r2", "short", "p0", "p1"}
    for a, b in zip(plain, out):  # the rows already running are unchanged by the ones that joined (up to float
        assert a.output_ids == b.output_ids  # rounding: 2e-5 apart on a 16-core machine's CPU)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    alone = gen.generate([short])[0]  # the joined request, in a batch of its own: the same draws
    joined = {}
    feed.put([short])
    gen.generate(first, feed=feed, deliver=lambda q, r: joined.setdefault(q.rid, r))
    assert joined["short"].output_ids == alone.output_ids
    assert torch.allclose(torch.tensor(joined["short"].logprobs), torch.tensor(alone.logprobs), atol=1e-4)
    assert joined["short"].finish_reason == {"type": "length", "length": 5}


def test_a_longer_prompt_waits_until_the_batch_has_slots_for_it_then_joins(tiny_model):
    gen = _graph_generator(tiny_model)
    first = [_req(gen, "a", "1+1=", 120, 1)]
    long_q = "what is 123456+654321 and 98765-4321 and 111*3="
    late = _req(gen, "late", long_q, 6, 5)
    P0, P = len(first[0].input_ids), len(late.input_ids)
    assert P > P0 + 3  # it cannot join at the first step: its prompt needs P slots before the next one
    joined_at = []
    feed = Feed()
    feed.put([late])
    res = {}

    def deliver(q, r):
        res[q.rid] = r
        joined_at.append((q.rid, gen.graphs._slot))

    gen.generate(first, feed=feed, deliver=deliver)
    assert gen.graphs.joined_rows == 1 and res["late"].finish_reason["type"] == "length"
    alone = gen.generate([late])[0]
    assert res["late"].output_ids == alone.output_ids
    # it finished ~P - P0 steps in (it joined when the slot reached its prompt length), well before `a`
    assert [rid for rid, _ in joined_at] == ["late", "a"]
    assert P + 5 - 1 <= dict(joined_at)["late"] <= P + 5 + 1, (P, joined_at)


def test_what_cannot_join_waits_in_the_feed(tiny_model):
    """Other filters than the batch's graph, a prompt-scoring request, a group larger than the batch, and any
    request while a weight update waits for the generator: none joins, all stay offered (the server starts the
    next batch with them)."""
    gen = _graph_generator(tiny_model)
    first = [_req(gen, "a", "1+1=", 12, 1)]
    for group in ([_req(gen, "k", "2+2=", 4, 2, top_k=5)],  # the batch's graph has no top-k
                  [_req(gen, "p", "2+2=", 4, 2, top_p=0.9)],
                  [GenRequest(rid="s", input_ids=_ids(gen, "2+2="), max_new_tokens=0, logprob_start_len=0)],
                  [_req(gen, f"g{i}", "2+2=", 4, i) for i in range(17)]):  # more than the batch's 16 rows
        feed = Feed()
        feed.put(group)
        gen.generate(first, feed=feed)
        assert len(feed) == 1 and gen.graphs.joined_rows == 0, group[0].rid
    feed = Feed()
    feed.put([_req(gen, "w", "2+2=", 4, 2)])
    gen.waiting = 1  # a weight update is waiting in Generator.exclusive()
    gen.generate(first, feed=feed)
    gen.waiting = 0
    assert len(feed) == 1 and gen.graphs.joined_rows == 0
    gen.generate(first, feed=feed)
    assert len(feed) == 0 and gen.graphs.joined_rows == 1


def test_can_join_checks_slots_cache_length_and_filters(tiny_model):
    gen = _graph_generator(tiny_model)
    g = gen.graphs
    ids = torch.tensor([_ids(gen, "1+1=")])
    P = ids.shape[1]
    knobs = {"temperature": torch.ones(1), "top_p": torch.ones(1), "top_k": torch.tensor([20])}
    g.start(ids, torch.ones_like(ids), torch.arange(P)[None], seeds=torch.tensor([1]), max_new=10, min_rows=4,
            **knobs)
    L = g._current.length  # len_bucket(P + 10) = 256
    assert g.rows == 4 and L == 256
    assert g.can_join(P, 10, -1, 1.0) and not g.can_join(P + 1, 10, -1, 1.0)  # the prompt must fit before slot P
    assert g.can_join(P, L - P + 1, -1, 1.0) and not g.can_join(P, L - P + 2, -1, 1.0)  # its tokens: in the cache
    assert g.can_join(P, 10, 20, 1.0) and g.can_join(P, 10, 5, 1.0) and not g.can_join(P, 10, 21, 1.0)
    assert not g.can_join(P, 10, -1, 0.9)  # no top-p in this graph


@pytest.fixture()
def graph_engine(tiny_model):
    from engine.rollout.ports import free_loopback_port
    from engine.rollout.server import EngineState, ServerThread

    state = EngineState(tiny_model, threads=1, max_new_tokens=8, model_impl="transformers")  # as on a GPU
    state.generator.on_gpu = True
    state.generator.graphs = GraphDecoder(state.generator.model, state.generator._cache_kw, capture=False)
    server = ServerThread(state, "127.0.0.1", free_loopback_port())
    url = server.start()
    yield state, url
    server.stop()


def test_the_server_lets_requests_join_a_running_batch_and_answers_each_when_it_finishes(graph_engine):
    state, url = graph_engine
    ids = state.tokenizer("<|im_start|>user\n57+38=<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)["input_ids"]
    info = httpx.get(url + "/get_server_info").json()
    assert info["continuous_batching"] is True
    before = len(info["batch_sizes"])
    out = {}

    def long_request():
        out["long"] = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True, "sampling_seed": 1}}, timeout=300).json()
        out["long_done"] = time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    while len(httpx.get(url + "/get_server_info").json()["batch_sizes"]) == before:  # the long one is decoding
        assert time.monotonic() < deadline
        time.sleep(0.02)

    async def shorts():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 6,
                                                          "ignore_eos": True}}
            rs = await asyncio.gather(*[c.post(url + "/generate", json=body) for _ in range(3)])
            return rs, time.monotonic()

    rs, shorts_done = asyncio.run(shorts())
    t.join()
    assert all(r.status_code == 200 for r in rs) and "long_done" in out
    assert shorts_done < out["long_done"]  # answered while the long one still decoded
    info = httpx.get(url + "/get_server_info").json()
    assert info["batch_sizes"][before:] == [1] and info["joined_requests"] == 3  # one batch: they joined it
    greedy = [r.json()["output_ids"] for r in rs]
    alone = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}, timeout=60).json()["output_ids"]
    assert greedy == [alone] * 3 and len(out["long"]["output_ids"]) == 400


def test_max_total_tokens_bounds_the_cache_a_batch_takes(tiny_model):
    """--max-total-tokens: a call that would take the batch's cache (rows, a power of two, × prompt + max_new
    rounded up to 256) past the budget starts the next batch; each batch stays within it (CPU: 1 row minimum)."""
    from engine.rollout.ports import free_loopback_port
    from engine.rollout.server import EngineState, ServerThread

    state = EngineState(tiny_model, threads=1, max_new_tokens=8, max_total_tokens=512, batch_window_s=0.5,
                        batch_gap_s=0.5)
    server = ServerThread(state, "127.0.0.1", free_loopback_port())
    url = server.start()
    try:
        ids = state.tokenizer("1+1=", add_special_tokens=False)["input_ids"]

        async def go():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"input_ids": ids, "sampling_params": {"temperature": 1.0, "max_new_tokens": 8}}
                return await asyncio.gather(*[c.post(url + "/generate", json=body) for _ in range(5)])

        rs = asyncio.run(go())
        assert all(r.status_code == 200 for r in rs)
        sizes = state.scheduler.batch_sizes
        assert sum(sizes) == 5 and max(sizes) == 2, sizes  # 2 rows × 256 = 512; 3 rows would take 4 × 256
    finally:
        server.stop()


def test_the_engine_counts_from_the_run_config_are_checked():
    from engine.config import RunConfig
    from engine.diagnosis import ConfigError
    from engine.rollout.engines import engine_spec

    ok = engine_spec(RunConfig(sglang_args={"max-total-tokens": "4096", "max-running-requests": "64"}), threads=1,
                     log_dir="/tmp", on_gpu=False)
    assert ok.max_total_tokens == 4096 and ok.max_batch == 64
    assert engine_spec(RunConfig(), threads=1, log_dir="/tmp", on_gpu=False).max_total_tokens is None
    for bad in ("lots", True, "0"):
        with pytest.raises(ConfigError, match="--sglang-max-total-tokens"):
            engine_spec(RunConfig(sglang_args={"max-total-tokens": bad}), threads=1, log_dir="/tmp", on_gpu=False)


def test_a_batch_that_fails_fails_its_calls_and_the_waiting_ones_run_next(graph_engine):
    """A decode step raises mid-batch: the call that ran in the batch gets a 500 naming the error; a call still
    waiting in the batch's feed (it could not join: other filters) is not failed with it but runs in the next
    batch."""
    state, url = graph_engine
    dec = state.generator.graphs
    launch, calls = dec.launch, []

    def failing_launch():
        calls.append(1)
        if len(calls) == 40:
            raise RuntimeError("device lost (injected)")
        return launch()

    dec.launch = failing_launch
    ids = state.tokenizer("1+1=", add_special_tokens=False)["input_ids"]
    out = {}

    def long_request():
        out["long"] = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True}}, timeout=120)

    before = len(state.scheduler.batch_sizes)
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    while len(state.scheduler.batch_sizes) == before or not calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waiting = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 4, "top_k": 5}}, timeout=120)  # no top-k in the running batch's graph: it waits
    t.join()
    assert out["long"].status_code == 500 and "device lost (injected)" in out["long"].json()["message"]
    assert waiting.status_code == 200 and len(waiting.json()["output_ids"]) <= 4
    assert state.scheduler.batch_sizes[before:] == [1, 1]


def test_serve_refuses_a_token_budget_below_one(capsys):
    from engine.rollout.server import main

    assert main(["--max-total-tokens", "0", "--port", "1"]) == 2
    assert "--max-total-tokens 0 must be at least 1" in capsys.readouterr().err
