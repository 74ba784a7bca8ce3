"""The built-in engine over real HTTP: SGLang's fields, log-probs vs a direct forward, stops, batching."""
from __future__ import annotations


import httpx
import pytest
import torch

from engine.rollout.server import EngineState, ServerThread
from engine.rollout.ports import free_loopback_port


_free_port = free_loopback_port  # engine/rollout/ports.py


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


RNG_SCRIPT = """
import random, sys
import httpx, numpy as np, torch
from engine.rollout.server import EngineState, ServerThread
from engine.rollout.ports import free_loopback_port

state = EngineState(sys.argv[1], threads=1, max_new_tokens=8)
server = ServerThread(state, "127.0.0.1", free_loopback_port())
url = server.start()
ids = state.tokenizer("37+48=", add_special_tokens=False)["input_ids"]
before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
for body in ({"input_ids": [ids, ids], "sampling_params": {"temperature": 1.0, "max_new_tokens": 4}},
             {"input_ids": [ids], "return_logprob": True, "logprob_start_len": 0,
              "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}):
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
moved = [name for name, same in (("python", random.getstate() == before[0]),
                                 ("numpy", bool((np.random.get_state()[1] == before[1]).all())),
                                 ("torch", torch.equal(torch.get_rng_state(), before[2]))) if not same]
server.stop()
print("MOVED", moved)
"""


def test_serving_leaves_the_process_random_states_alone(tiny_model):
    """Unseeded requests and a score (prefill) do not draw from the process's python / numpy / torch generators: an
    engine serving from a train worker's process must not move the RNG states its checkpoints carry. In a process
    of its own: in the test process, Prefect's events websocket (left by earlier flow tests) pings with
    random.getrandbits on its own thread whenever it likes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", RNG_SCRIPT, tiny_model], cwd=root, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MOVED []" in r.stdout, r.stdout + r.stderr[-2000:]


def test_compact_logprobs_header_gives_the_same_answer(engine):
    """The rollout loop's header (X-Rollflow-Logprobs): the same tokens and bit-identical log-probs as SGLang's
    triples, and the answer says which encoding it used; without the header the answer is SGLang's JSON."""
    from engine.rollout.protocol import COMPACT_F64, COMPACT_HEADER, output_logprobs

    state, url = engine
    body = {"input_ids": [_prompt_ids(state), _prompt_ids(state, "1+2=")], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 5}}
    plain = httpx.post(url + "/generate", json=body, timeout=60)
    packed = httpx.post(url + "/generate", json=body, headers={COMPACT_HEADER: COMPACT_F64}, timeout=60)
    assert COMPACT_HEADER not in plain.headers and packed.headers[COMPACT_HEADER] == COMPACT_F64
    for p, c in zip(plain.json(), packed.json()):
        assert "output_token_logprobs" in p["meta_info"] and "output_token_logprobs" not in c["meta_info"]
        ids, lps = output_logprobs(c)
        assert ids == p["output_ids"] == [t[1] for t in p["meta_info"]["output_token_logprobs"]]
        assert [x.hex() for x in lps] == [float(t[0]).hex() for t in p["meta_info"]["output_token_logprobs"]]


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
    # SGLang's trim_matched_stop: the stop token stays in output_ids and leaves the text, unless no_stop_trim
    assert r2["text"] == ""
    r3 = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 8, "stop_token_ids": [first], "no_stop_trim": True}}, timeout=60).json()
    assert r3["text"] == state.tokenizer.decode([first]) != ""


def test_min_new_tokens_keeps_stops_from_ending_the_answer_early(engine):
    """SGLang's min_new_tokens: neither EOS, a stop token id nor a stop string ends the answer before it has that
    many tokens (the stop tokens' logits are masked, so greedy decoding picks the next best); after that they end
    it as before. More than max_new_tokens is refused, naming the field."""
    state, url = engine
    ids = _prompt_ids(state)

    def gen(**sp):
        return httpx.post(url + "/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 8, **sp}}, timeout=60).json()

    base = gen()["output_ids"]
    eos = set(state.generator.eos_ids)
    k = len(base)
    assert k < 8 and base[-1] in eos  # the greedy answer ends with EOS early ("85<|im_end|>")
    r = gen(min_new_tokens=k + 2)
    out = r["output_ids"]
    assert len(out) >= k + 2 and not eos & set(out[:k + 1]) and out[:k - 1] == base[:k - 1], (base, out)
    assert all(lp <= 0 for lp, _, _ in r["meta_info"]["output_token_logprobs"])
    first = base[0]
    r = gen(stop_token_ids=[first], min_new_tokens=2)
    assert r["output_ids"][0] != first and len(r["output_ids"]) >= 2
    text = state.tokenizer.decode(base[:1])  # the answer's first character as a stop string
    assert gen(stop=[text])["output_ids"] == base[:1]
    assert len(gen(stop=[text], min_new_tokens=3)["output_ids"]) >= 3
    bad = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 4, "min_new_tokens": 5}}, timeout=60)
    assert bad.status_code == 400 and "min_new_tokens=5" in bad.json()["message"]


def test_skip_special_tokens_decides_whether_special_tokens_reach_the_text(engine):
    """SGLang's `skip_special_tokens` (--rollout-skip-special-tokens): the EOS that ended a response leaves its text
    either way (trimmed); kept with no_stop_trim, it shows only when special tokens are not skipped."""
    state, url = engine

    def text(**params):
        return httpx.post(url + "/generate", json={"input_ids": _prompt_ids(state), "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 8, **params}}, timeout=60).json()["text"]

    assert "<|im_end|>" not in text(skip_special_tokens=False) and "<|im_end|>" not in text()
    assert text(skip_special_tokens=False, no_stop_trim=True).endswith("<|im_end|>")
    assert "<|im_end|>" not in text(skip_special_tokens=True, no_stop_trim=True)


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
    # an engine started without --api-key never frees its memory (or takes weights) on anyone's request
    r = httpx.post(url + "/release_memory_occupation")
    assert r.status_code == 403 and "--api-key" in r.json()["message"]
    state.api_key = "k3y"
    try:
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.post(url + "/release_memory_occupation", headers=auth).json()["success"] is True
        assert httpx.post(url + "/generate", json={"text": "1", "sampling_params": {}},
                          headers=auth).status_code == 503
        assert httpx.post(url + "/resume_memory_occupation", headers=auth).json()["success"] is True
    finally:
        state.api_key = None
    assert httpx.post(url + "/generate", json={"sampling_params": {}}).status_code == 400


def test_prompt_scoring_returns_input_logprobs_of_the_served_weights(engine):
    # max_new_tokens = 0 + logprob_start_len = 0: SGLang's way to score a fixed sequence
    state, url = engine
    seq = _prompt_ids(state, "12+34=46")
    r = httpx.post(url + "/generate", json={"input_ids": seq, "return_logprob": True, "logprob_start_len": 0,
                                            "sampling_params": {"max_new_tokens": 0}}, timeout=60).json()
    assert r["output_ids"] == [] and r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    got = r["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in got] == seq and got[0][0] is None  # the first token has no prediction
    with torch.no_grad():
        logits = state.generator.model(torch.tensor([seq])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor([t[0] for t in got[1:]]), ref, atol=1e-5)


def test_abort_stops_an_inflight_request_by_rid_prefix(engine):
    import threading
    import time

    state, url = engine
    before = len(state.scheduler.batch_sizes)
    out = {}

    def long_request():
        out["r"] = httpx.post(url + "/generate", json={
            "input_ids": [_prompt_ids(state)] * 4, "rid": [f"grp7-{j}" for j in range(4)],
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}}, timeout=120).json()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while len(state.scheduler.batch_sizes) == before and time.monotonic() < deadline:  # wait until it runs
        time.sleep(0.005)
    assert httpx.post(url + "/abort_request", json={"rid": "grp7-"}).json()["aborted"] == 4
    t.join(60)
    for r in out["r"]:
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert r["meta_info"]["completion_tokens"] < 200  # stopped early, keeping what it had
    # nothing is left marked: the same rids can run again to completion
    again = httpx.post(url + "/generate", json={"input_ids": _prompt_ids(state), "rid": "grp7-0", "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}}, timeout=60).json()
    assert again["meta_info"]["finish_reason"]["type"] == "length"


def test_unsupported_sampling_param_is_refused_not_ignored(engine):
    _, url = engine
    r = httpx.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}})
    assert r.status_code == 400 and "frequency_penalty" in r.json()["message"]


def test_model_info_and_weight_version_endpoints(engine):
    state, url = engine
    for path in ("/get_model_info", "/model_info"):
        assert httpx.get(url + path).json()["weight_version"] == state.weight_version
    assert httpx.get(url + "/weight_version").json() == {"weight_version": state.weight_version}


def test_port_in_use_is_rf08_naming_the_holder(tiny_model, engine):
    import os

    from engine.diagnosis import DiagnosisError

    state, url = engine
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(DiagnosisError) as e:
        ServerThread(state, "127.0.0.1", port).start()
    assert e.value.codes == ["RF08"] and f"pid {os.getpid()}" in str(e.value)


def test_a_port_taken_after_the_allocator_checked_it_is_rf08_and_the_actor_moves_on(tiny_model, engine,
                                                                                   monkeypatch):
    """Two runs, each with its own Ray cluster, start engines on one machine at once: both port registries begin at
    30000, both free checks pass, one bind wins. The loser's server must not die in uvicorn's bind ("exited during
    start-up", seen on the H200 with two demos side by side) but raise RF08, which the engine actor retries with
    the next port."""
    import socket

    from engine.diagnosis import DiagnosisError
    from engine.rollout import actor as actor_mod
    from engine.rollout import ports

    state, _ = engine
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    try:
        monkeypatch.setattr(ports, "is_port_free", lambda *a, **k: True)  # the check ran before the other bind
        with pytest.raises(DiagnosisError) as e:
            ServerThread(state, "127.0.0.1", taken).start()
        assert e.value.codes == ["RF08"] and f"port {taken}" in str(e.value)

        free = _free_port()
        offered = iter([taken, free])
        a = actor_mod.EngineActor(actor_mod.EngineSpec(kind="builtin", model_path=tiny_model, log_dir=".",
                                                        threads=1, max_new_tokens=8, start_timeout_s=30), 0, None)
        a._ports = lambda node, k: [next(offered)]
        started = []

        class Spy(ServerThread):
            def start(self, timeout_s=60.0):
                started.append(self.port)
                return super().start(timeout_s)

        monkeypatch.setattr("engine.rollout.server.ServerThread", Spy)
        url, used, _ = a._start_builtin("127.0.0.1", [])
        try:
            assert started == [taken, free] and used == [free] and url.endswith(f":{free}")
            assert httpx.get(url + "/health", timeout=10).status_code == 200
        finally:
            a.server.stop()
    finally:
        holder.close()


def test_deterministic_mode_runs_each_request_as_its_own_batch(tiny_model):
    import asyncio

    state = EngineState(tiny_model, threads=1, max_new_tokens=4, deterministic=True)
    server = ServerThread(state, "127.0.0.1", _free_port())
    url = server.start()
    try:
        ids = _prompt_ids(state)

        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"input_ids": [ids] * 3, "sampling_params": {"temperature": 1.0, "max_new_tokens": 2}}
                return await asyncio.gather(*[c.post(url + "/generate", json=body) for _ in range(5)])

        assert all(r.status_code == 200 for r in asyncio.run(go()))
        assert state.scheduler.batch_sizes == [3] * 5  # never merged across requests
    finally:
        server.stop()
