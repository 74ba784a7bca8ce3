"""rollflow's requests against SGLang's own request schemas, and SGLang-shaped requests against the built-in engine.

The schemas are SGLang's request classes, read from its source with the search tool and kept in
tests/data/sglang_schema.json:
- python/sglang/srt/managers/io_struct.py at 001067fffe33427bee0ed2f007fb7551a1d76b44: GenerateReqInput,
  UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput, InitWeightsUpdateGroupReqInput,
  UpdateWeightsFromDistributedReqInput, DestroyWeightsUpdateGroupReqInput, Release/ResumeMemoryOccupationReqInput,
  FlushCacheReqInput, AbortReq, PauseGenerationReqInput, ContinueGenerationReqInput, CheckWeightsReqInput;
- python/sglang/srt/sampling/sampling_params.py at 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03: SamplingParams.

Every JSON body the client side sends (rollout loop, scoring, weight updates by tensor, disk and broadcast, the
control endpoints) is recorded at the engine's ASGI boundary over real HTTP and must use only SGLang's field names,
carry its required fields and keep its value domains. The one body that is not SGLang's is named and excluded: the
raw safetensors upload (`application/octet-stream`), the built-in engine's fast path.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

KEY = "schema-test-key"  # weight and memory endpoints need an API key (SGLang's --api-key)
SCHEMA = json.loads((Path(__file__).parent / "data" / "sglang_schema.json").read_text())


class Recorder:
    """ASGI middleware: keeps (path, content-type, body) of every HTTP request, then passes it on unchanged."""

    def __init__(self, app):
        self.app, self.seen, self.headers = app, [], []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        headers = {k.decode(): v.decode() for k, v in scope.get("headers") or []}
        self.headers.append(headers)
        self.seen.append((scope["path"], headers.get("content-type", ""), body))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@pytest.fixture(scope="module")
def recorded_engine(tiny_model, tmp_path_factory):
    from engine.rollout.ports import free_loopback_port
    from engine.rollout.server import EngineState, ServerThread

    weights = tmp_path_factory.mktemp("weights")
    state = EngineState(tiny_model, threads=1, max_new_tokens=8, weight_dirs=[str(weights)], api_key=KEY)
    server = ServerThread(state, "127.0.0.1", free_loopback_port())
    rec = Recorder(server.config.app)
    server.config.app = rec  # uvicorn loads config.app when the server starts
    url = server.start()
    yield state, url, rec, weights
    server.stop()


def schema_problems(path: str, body: dict) -> list[str]:
    ep = SCHEMA["endpoints"].get(path)
    if ep is None:
        return [f"{path} is not one of SGLang's endpoints in the schema"]
    out = [f"{path}: field {k!r} is not in SGLang's {ep['class']}" for k in body if k not in ep["fields"]]
    out += [f"{path}: SGLang's {ep['class']} requires {k!r}" for k in ep["required"] if k not in body]
    for k, allowed in ep.get("literals", {}).items():
        if k in body and body[k] not in allowed:
            out.append(f"{path}: {k}={body[k]!r}, SGLang takes {allowed}")
    if path == "/generate":
        sp = body.get("sampling_params") or {}
        for params in sp if isinstance(sp, list) else [sp]:
            out += [f"/generate: sampling param {k!r} is not in SGLang's SamplingParams" for k in params
                    if k not in SCHEMA["sampling_params"]["fields"]]
            if "top_k" in params and not (params["top_k"] == -1 or params["top_k"] >= 1):
                out.append(f"/generate: top_k={params['top_k']} (SGLang: -1 or >= 1)")
            if "top_p" in params and not 0 < params["top_p"] <= 1:
                out.append(f"/generate: top_p={params['top_p']} (SGLang: in (0, 1])")
            if "max_new_tokens" in params and params["max_new_tokens"] < 0:
                out.append(f"/generate: max_new_tokens={params['max_new_tokens']} (SGLang: >= 0)")
    return out


def test_the_schema_checker_catches_what_sglang_would_refuse():
    """The check can fail: a field SGLang lacks, a missing required field, a bad literal, bad sampling params."""
    assert schema_problems("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}) == []
    assert schema_problems("/generate", {"prompt_ids": [1]})  # not SGLang's name
    assert schema_problems("/update_weights_from_disk", {"weight_version": "3"})  # model_path missing
    assert schema_problems("/pause_generation", {"mode": "soft"})
    assert schema_problems("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}})
    assert schema_problems("/generate", {"input_ids": [1], "sampling_params": [{"seed": 3}]})
    assert schema_problems("/update_weights", {})


def test_every_body_the_client_side_sends_is_sglangs(recorded_engine, tiny_model):
    from engine.data import PromptDataset, load_prompts
    from engine.config.data import BUNDLED_TRAIN
    from engine.modeling import render_prompt
    from engine.rewards import RewardModel
    from engine.rollout.client import EngineClient
    from engine.rollout.loop import Prompt, SamplingParams, StaticEngines, generate_rollout
    from engine.rollout.ports import free_loopback_port
    from engine.weights import encode_tensors, save_weights_dir, unique_tensors
    from engine.weights.distributed import DistributedSender

    state, url, rec, weights = recorded_engine
    rec.seen.clear()
    rec.headers.clear()
    ds = PromptDataset(load_prompts(BUNDLED_TRAIN, input_key="prompt", label_key="label"), shuffle=False, seed=0)

    def draw(k):
        return [Prompt(r, render_prompt(state.tokenizer, r.prompt, True)) for r in ds.next_batch(k)]

    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9, top_k=5, stop=["\n\n"],
                            stop_token_ids=state.generator.eos_ids)
    generate_rollout(draw, rollout_id=0, batch_size=2, n=2, params=params, reward_model=RewardModel("exact_match", None),
                     seed=1, engines=StaticEngines([url], api_key=KEY), timeout_s=120)
    c = EngineClient(url, api_key=KEY)
    c.score([[1, 2, 3]], temperature=1.0)
    sd = unique_tensors(state.generator.model.state_dict())
    c.update_weights_from_tensor([encode_tensors(sd)], load_format="safetensors", version=1, flush_cache=True)
    save_weights_dir(sd, weights / "v2")
    c.update_weights_from_disk(str(weights / "v2"), 2)
    sender = DistributedSender([c], "127.0.0.1", free_loopback_port(), backend="gloo")
    sender.push({k: sd[k] for k in list(sd)[:3]}, version=3)
    sender.close()
    c.abort("some-rid")
    c.abort()
    c.pause_generation("abort")
    c.continue_generation()
    c.flush_cache()
    c.release_memory()
    c.resume_memory()
    c.check_weights("checksum")

    posted = [(p, t, b) for p, t, b in rec.seen if b]
    paths = {p for p, _, _ in posted}
    assert paths >= {"/generate", "/update_weights_from_tensor", "/update_weights_from_disk",
                     "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
                     "/abort_request", "/pause_generation", "/weights_checker"}, paths
    problems = []
    for path, ctype, body in posted:
        assert ctype.startswith("application/json"), (path, ctype)
        problems += schema_problems(path, json.loads(body))
    assert problems == []
    loop_bodies = [json.loads(b) for p, _, b in posted if p == "/generate"]
    assert any(isinstance(b.get("sampling_params"), list) and b["sampling_params"][0].get("sampling_seed") is not None
               for b in loop_bodies)  # the rollout loop's batched shape, per-sample seeds
    # the rollout's two groups were announced as one burst of 2 (a header: SGLang's body is untouched)
    heads = [h["x-rollflow-burst"] for (p, _, _), h in zip(rec.seen, rec.headers) if "x-rollflow-burst" in h]
    bursts = {h for h in heads if h.startswith("rf")}
    assert len(bursts) == 1 and next(iter(bursts)).endswith(" 2"), bursts
    # every other /generate (EngineClient's: the probe, a score) is a burst of one by itself, each id its own
    alone = [h for h in heads if not h.startswith("rf")]
    assert alone and all(h.startswith("one-") and h.endswith(" 1") for h in alone), alone
    assert len(set(alone)) == len(alone)


def test_the_raw_tensor_upload_is_the_one_non_sglang_body(recorded_engine):
    """rollflow's own sync to the built-in engine posts one safetensors blob as the body (no base64, no JSON);
    a SGLang server is driven with the JSON form checked above instead."""
    from engine.rollout.client import EngineClient
    from engine.weights import pack_tensors, unique_tensors

    state, url, rec, _ = recorded_engine
    rec.seen.clear()
    sd = unique_tensors(state.generator.model.state_dict())
    EngineClient(url, api_key=KEY).update_weights_from_tensor_raw(pack_tensors(sd), version=5, flush_cache=True)
    (path, ctype, _), = [x for x in rec.seen if x[0] != "/get_model_info"]
    assert (path, ctype) == ("/update_weights_from_tensor", "application/octet-stream")


@pytest.mark.parametrize("path", sorted(SCHEMA["endpoints"]))
def test_the_engine_takes_sglangs_minimal_request(recorded_engine, path):
    """Each endpoint with only SGLang's required fields (and its defaults): served, or refused with a 400 that
    names why (never a 404 or 422)."""
    import httpx

    state, url, _, weights = recorded_engine
    minimal = {"/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
               "/update_weights_from_tensor": {"serialized_named_tensors": []},
               "/update_weights_from_disk": {"model_path": str(weights / "missing")},
               "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                              "world_size": 2},
               "/update_weights_from_distributed": {"names": [], "dtypes": [], "shapes": []}}.get(path, {})
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + path, json=minimal, timeout=60, headers=auth)
    assert r.status_code in (200, 400), (path, r.status_code, r.text)
    if r.status_code == 400:
        why = r.json()["message"]
        expected = {"/update_weights_from_tensor": "load_format",  # SGLang's default format: CUDA IPC pickles
                    "/update_weights_from_disk": "missing",
                    "/init_weights_update_group": "nccl",  # SGLang's default backend; this engine is on the CPU
                    "/update_weights_from_distributed": "not joined",
                    "/destroy_weights_update_group": "not joined"}
        assert path in expected and expected[path] in why, (path, why)
    if path == "/pause_generation":
        httpx.post(url + "/continue_generation", json={}, timeout=60, headers=auth)


def test_weights_by_broadcast_reach_the_engine_and_a_bad_name_changes_nothing(recorded_engine):
    """SGLang's broadcast path with gloo: the engine holds exactly the sent tensors and reports the version; an
    update naming a tensor the engine does not serve is refused after the broadcast (the sender never hangs)
    and leaves the weights as they were."""
    from engine.rollout.client import EngineClient
    from engine.rollout.ports import free_loopback_port
    from engine.weights.distributed import DistributedSender

    state, url, _, _ = recorded_engine
    model = state.generator.model
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    c = EngineClient(url, api_key=KEY)
    sender = DistributedSender([c], "127.0.0.1", free_loopback_port(), backend="gloo")
    try:
        name = "model.layers.0.mlp.up_proj.weight"
        new = {name: before[name] + 0.25, "model.norm.weight": before["model.norm.weight"] * 2}
        out = sender.push(new, version=11)
        assert out[0]["success"] and state.weight_version == "11"
        assert torch.equal(model.state_dict()[name], new[name])
        assert torch.equal(model.state_dict()["model.norm.weight"], new["model.norm.weight"])
        with pytest.raises(RuntimeError, match="no.such"):
            sender.push({"no.such.weight": torch.zeros(3), name: before[name]}, version=12)
        assert state.weight_version == "11" and torch.equal(model.state_dict()[name], new[name])
        sender.push({k: before[k] for k in new}, version=13)  # the group still works after a refusal
        assert torch.equal(model.state_dict()[name], before[name])
    finally:
        sender.close()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(before[k])
