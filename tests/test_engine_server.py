"""The built-in engine over real HTTP: SGLang's fields, log-probs vs a direct forward, stops, batching."""
from __future__ import annotations

import socket

import httpx
import pytest
import torch

from engine.rollout.server import EngineState, ServerThread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine(tiny_model):
    state = EngineState(tiny_model, threads=1, max_new_tokens=8)
    server = ServerThread(state, "127.0.0.1", _free_port())
    url = server.start()
    yield state, url
    server.stop()


def _prompt_ids(state, text="37+48="):
    return state.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_generate_fields_and_logprobs_match_a_direct_forward(engine):
    state, url = engine
    ids = _prompt_ids(state)
    r = httpx.post(url + "/generate", json={"input_ids": ids, "return_logprob": True,
                                            "sampling_params": {"temperature": 1.0, "max_new_tokens": 8,
                                                                "sampling_seed": 3}}, timeout=60).json()
    meta = r["meta_info"]
    assert set(meta) >= {"finish_reason", "prompt_tokens", "completion_tokens", "output_token_logprobs"}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(r["output_ids"])
    out = r["output_ids"]
    assert [t[1] for t in meta["output_token_logprobs"]] == out
    # the engine's log-probs are log softmax(logits / T)[token] of the served weights
    with torch.no_grad():
        logits = state.generator.model(torch.tensor([ids + out])).logits[0].float()
    ref = torch.log_softmax(logits[len(ids) - 1:-1], -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
    got = torch.tensor([t[0] for t in meta["output_token_logprobs"]])
    assert torch.allclose(got, ref, atol=1e-4), (got, ref)


def test_eos_stops_generation_and_is_reported(engine):
    state, url = engine
    r = httpx.post(url + "/generate", json={"input_ids": _prompt_ids(state), "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 8}}, timeout=60).json()
    fr = r["meta_info"]["finish_reason"]
    assert fr["type"] == "stop" and fr["matched"] in state.generator.eos_ids
    assert r["output_ids"][-1] == fr["matched"]  # the stop token is part of the trained response
    assert "<|im_end|>" not in r["text"]


def test_length_finish_and_stop_token_ids(engine):
    state, url = engine
    ids = _prompt_ids(state)
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}}, timeout=60).json()
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    first = r["output_ids"][0]
    r2 = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 8, "stop_token_ids": [first]}}, timeout=60).json()
    assert r2["output_ids"] == [first] and r2["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_stop_string_is_trimmed(engine):
    state, url = engine
    ids = _prompt_ids(state)
    greedy = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 8}}, timeout=60).json()["text"]
    assert len(greedy) >= 1
    stop = greedy[0]
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 8, "stop": [stop]}}, timeout=60).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == ""  # trimmed at the stop string (no_stop_trim=False)


def test_batched_request_and_text_input(engine):
    state, url = engine
    r = httpx.post(url + "/generate", json={"text": ["1+1=", "2+2="], "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 4}}, timeout=60).json()
    assert isinstance(r, list) and len(r) == 2 and all("output_ids" in x for x in r)


def test_concurrent_requests_are_generated_as_one_batch(engine):
    import asyncio

    state, url = engine
    ids = _prompt_ids(state)
    before = len(state.scheduler.batch_sizes)

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"input_ids": ids, "sampling_params": {"temperature": 1.0, "max_new_tokens": 4}}
            return await asyncio.gather(*[c.post(url + "/generate", json=body) for _ in range(16)])

    rs = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    sizes = state.scheduler.batch_sizes[before:]
    assert sum(sizes) == 16 and max(sizes) > 1, sizes  # not one at a time


def test_control_endpoints(engine):
    state, url = engine
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(url + "/get_model_info").json()
    assert info["is_generation"] is True and "weight_version" in info
    assert httpx.post(url + "/flush_cache").json()["success"] is True
    assert httpx.post(url + "/release_memory_occupation").json()["success"] is True
    assert httpx.post(url + "/generate", json={"text": "1", "sampling_params": {}}).status_code == 503
    assert httpx.post(url + "/resume_memory_occupation").json()["success"] is True
    assert httpx.post(url + "/generate", json={"sampling_params": {}}).status_code == 400
