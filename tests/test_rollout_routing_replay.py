"""--use-rollout-routing-replay (R3): the engine returns the experts it routed each token to, as SGLang does; the
micro-batches carry them; the policy's forwards replay them; a flow trains on them end to end."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from train_fakes import fake_samples

from engine.diagnosis import ConfigError

FAMILIES = ("qwen3moe", "mixtral", "qwen2moe")  # tests/model_families.py's mixtures of experts
LENGTHS = [(5, 3), (4, 4), (6, 2), (3, 5)]


def _model(family: str, path, tiny_model: str) -> str:
    from model_families import save_model

    return save_model(path / family, family, tiny_model)


def _alone(model, tokens: list[int]) -> torch.Tensor:
    """The experts the model's routers pick for `tokens` run alone (on the model's device): [len(tokens), #routers,
    k], on the host."""
    from engine.train.routing import TorchRouters

    hooks = TorchRouters(model)
    with torch.no_grad(), hooks.recording() as got:
        model(input_ids=torch.tensor([tokens], device=next(model.parameters()).device))
    hooks.remove()
    return torch.stack(got, 1).view(len(tokens), len(got), -1).cpu()


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_returns_the_experts_each_token_was_routed_to(family, tmp_path, tiny_model):
    """Over HTTP, SGLang's layout: base64 int32 [P + R - 1, num_hidden_layers, k], a dense layer -1. A batch with
    a repeated prompt (its prefill shared) and a shorter one (left padding): each row's experts are those the model
    picks for the same tokens run alone. A request that does not ask gets none."""
    from conftest import served_engine

    from engine.train.routing import decode_routes

    path = _model(family, tmp_path, tiny_model)
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
    with served_engine(path, return_routed_experts=True) as (state, url):
        body = {"input_ids": prompts, "return_logprob": True, "return_routed_experts": [True, True, True, False],
                "sampling_params": [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
                                    for i in range(len(prompts))]}
        answers = httpx.post(url + "/generate", json=body, timeout=60).json()
        late = httpx.post(url + "/generate", json={**body, "routed_experts_start_len": 2}, timeout=60).json()
        bad = httpx.post(url + "/generate", json={**body, "routed_experts_start_len": 3}, timeout=60)
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        layout, model = state.generator.route_layout, state.generator.model
    assert info["enable_return_routed_experts"] is True
    assert "routed_experts" not in answers[3]["meta_info"]
    assert bad.status_code == 400 and "`routed_experts_start_len` 3 must be in [0, 2]" in bad.text
    for a, b in zip(answers[:3], late[:3]):  # the same seeds: the same tokens; the rows from prompt position 2 on
        assert a["output_ids"] == b["output_ids"]
        assert base64.b64decode(b["meta_info"]["routed_experts"]) == \
            base64.b64decode(a["meta_info"]["routed_experts"])[2 * layout.num_layers * layout.top_k * 4:]
    assert layout.moe_layers == ((1,) if family == "qwen2moe" else (0, 1))  # Qwen2-MoE's layer 0 is dense
    for p, a in zip(prompts[:3], answers[:3]):
        tokens = p + a["output_ids"]
        assert len(a["output_ids"]) == 6
        raw = np.frombuffer(base64.b64decode(a["meta_info"]["routed_experts"]), dtype="<i4")
        full = raw.reshape(len(tokens) - 1, layout.num_layers, layout.top_k)
        dense = [i for i in range(layout.num_layers) if i not in layout.moe_layers]
        assert (full[:, dense] == -1).all()
        routes = torch.from_numpy(decode_routes(a["meta_info"]["routed_experts"], len(tokens), layout))
        assert bool(_same_sets(routes, _alone(model, tokens[:-1])).all())


def test_the_graph_decoder_records_each_rows_experts_also_for_requests_that_join(tmp_path, tiny_model):
    """The CUDA-graph decode loop (its steps run without the capture on the CPU, as in test_continuous_batching.py)
    records every step's experts into its host slots: each request, those of the first batch (a shared prompt, rows
    that finish at different steps) and those that join the running batch later, gets the experts the model picks
    for its tokens run alone, at SGLang's P + R - 1 rows; routed_experts_start_len drops the leading ones. Qwen2-MoE:
    a dense layer 0 and a shared expert beside the routed ones."""
    from engine.modeling import eos_token_ids, load_causal_lm, load_tokenizer
    from engine.rollout.cuda_graphs import GraphDecoder
    from engine.rollout.generation import Feed, GenRequest, Generator

    path = _model("qwen2moe", tmp_path, tiny_model)
    model = load_causal_lm(path, impl="transformers").eval()
    gen = Generator(model, load_tokenizer(path), eos_token_ids(path, load_tokenizer(path)), return_routed_experts=True)
    gen.on_gpu = True  # the device sampler and the graph decoder's logic, on the CPU
    gen.graphs = GraphDecoder(model, gen._cache_kw, capture=False, tape=gen.routers)

    def req(rid, ids, n, seed, **kw):
        return GenRequest(rid=rid, input_ids=ids, max_new_tokens=n, seed=seed, ignore_eos=True,
                          return_routed_experts=True, **kw)

    first = [req("a", [5, 6, 7, 8, 9], 9, 1), req("b", [5, 6, 7, 8, 9], 4, 2), req("c", [11, 12], 7, 3)]
    late = [req("d", [13, 14, 15], 5, 4), req("e", [16, 17], 1, 5), req("f", [18, 19], 3, 6, routed_experts_start_len=1)]
    feed, got = Feed(), {}
    feed.put(late[:2])
    feed.put(late[2:])
    gen.generate(first, feed=feed, deliver=lambda q, r: got.setdefault(q.rid, (q, r)))
    assert gen.graphs.joined_rows == 3 and gen.graphs.launched >= 8
    for rid, (q, res) in got.items():
        tokens = q.input_ids + res.output_ids
        assert len(res.output_ids) == q.max_new_tokens, rid
        assert res.routed_experts.shape == (len(tokens) - 1 - q.routed_experts_start_len, len(gen.routers.routers),
                                            gen.route_layout.top_k), rid
        alone = _alone(model, tokens[:-1])[q.routed_experts_start_len:]
        assert bool(_same_sets(res.routed_experts, alone).all()), rid


def test_an_engine_without_the_flag_refuses_the_request_and_a_dense_model_the_flag(tmp_path, tiny_model):
    from conftest import served_engine

    from engine.rollout.server import EngineState

    with served_engine(_model("qwen3moe", tmp_path, tiny_model)) as (_, url):
        r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": True,
                                                "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 400 and "--enable-return-routed-experts" in r.text
        r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": "yes",
                                                "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 400 and "must be true / false" in r.text
    with pytest.raises(ValueError, match=r"--enable-return-routed-experts: .* has no router"):
        EngineState(tiny_model, threads=1, return_routed_experts=True, model_impl="transformers")


def _routed(samples, layout, seed: int = 0):
    """Random engine routings for the samples, SGLang's base64 [L - 1, num_layers, k] (dense layers -1)."""
    from engine.train.routing import encode_routes

    g = np.random.default_rng(seed)
    for s in samples:
        picks = np.stack([np.stack([g.choice(layout.num_experts, layout.top_k, replace=False)
                                    for _ in layout.moe_layers]) for _ in range(len(s.tokens) - 1)])
        s.rollout_routed_experts = encode_routes(picks, list(layout.moe_layers), layout)
    return samples


def test_micro_batches_carry_the_engine_routing_or_refuse_by_name():
    from engine.packing.microbatch import make_micro_batch, regroup
    from engine.rollout.loop import Partial, PartialBuffer
    from engine.samples import Sample, Status
    from engine.train.routing import RouteLayout, decode_routes

    layout = RouteLayout(num_layers=3, top_k=2, moe_layers=(1, 2), num_experts=4)
    samples = _routed(fake_samples(LENGTHS, n=2, seed=1, vocab=50), layout)
    mb = make_micro_batch(samples[:2], [0.0, 0.0], pad_to_multiple=8, routes=layout)
    assert mb.routed_experts.shape == (mb.num_tokens, 2, 2) and mb.routed_experts.dtype == torch.int16
    first = decode_routes(samples[0].rollout_routed_experts, 8, layout)
    assert torch.equal(mb.routed_experts[:7], torch.from_numpy(first))
    assert (mb.routed_experts[7] == -1).all()  # the last token: no engine forward saw it
    assert (mb.routed_experts[16:] == -1).all()  # padding
    # slime's array form, [L - 1, num_layers, k], gives the same micro-batch; Sample.to_dict makes it JSON-ready
    arr = Sample.from_dict(samples[0].to_dict())
    arr.rollout_routed_experts = np.frombuffer(base64.b64decode(samples[0].rollout_routed_experts),
                                               dtype="<i4").reshape(7, 3, 2)
    assert isinstance(arr.to_dict()["rollout_routed_experts"], str)
    again = make_micro_batch([arr, samples[1]], [0.0, 0.0], pad_to_multiple=8, routes=layout)
    assert torch.equal(again.routed_experts, mb.routed_experts)
    joined = regroup([mb, make_micro_batch(samples[2:], [0.0, 0.0], routes=layout)], cap=10_000)
    assert joined[0].routed_experts.shape[0] == joined[0].num_tokens
    # a partial rollout's buffer keeps a row's routing through a checkpoint
    buf = PartialBuffer(3, {(0, 1): Partial(ids=[4], logprobs=[-1.0], routes="AAAA")})
    assert PartialBuffer.from_snapshot(buf.snapshot()).get(0, 1).routes == "AAAA"

    missing = fake_samples(LENGTHS[:1], n=1, vocab=50)
    with pytest.raises(ValueError, match=r"sample 0: --use-rollout-routing-replay, and the engine returned no routed"):
        make_micro_batch(missing, [0.0], routes=layout)
    missing[0].status = Status.FAILED  # not trained: routed anywhere, in no loss
    assert (make_micro_batch(missing, [0.0], routes=layout).routed_experts == -1).all()
    short = _routed(fake_samples([(2, 2)], n=1, vocab=50), layout)[0]
    short.tokens.append(3)
    with pytest.raises(ValueError, match=r"3 rows of 3 layers × top 2 experts for a sequence of 5 tokens \(4 rows"):
        make_micro_batch([short], [0.0], routes=layout)
    wide = RouteLayout(num_layers=3, top_k=2, moe_layers=(1, 2), num_experts=2)
    with pytest.raises(ValueError, match=r"expert id [23] in a MoE layer, outside \[0, 2\)"):
        make_micro_batch(samples[:1], [0.0], routes=wide)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_policy_forwards_replay_the_engine_routing(family, tmp_path, small_cfg, tiny_model):
    """The old log-probs' forward, the reference's and the step's route each token to the micro-batch's experts.
    Replaying the model's own routing changes nothing (diff 0); a random routing changes the log-probs (the
    policy's and the reference's alike: on the first step they still agree, as RF01 wants) and shows in
    train/routing_replay_diff."""
    from engine.model_shape import read
    from engine.packing.microbatch import make_micro_batch
    from engine.train.routing import RouteLayout, encode_routes
    from engine.train.torch_backend import TorchBackend

    path = _model(family, tmp_path, tiny_model)
    layout = RouteLayout.of_shape(read(path))
    tb = TorchBackend(small_cfg(hf_checkpoint=path, use_rollout_routing_replay=True))
    plain = TorchBackend(small_cfg(hf_checkpoint=path))
    samples = fake_samples(LENGTHS, n=2, seed=3, vocab=101)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    for s in samples:  # the engine's routing = the model's own
        own = _alone(hf, s.tokens[:-1])
        s.rollout_routed_experts = encode_routes(own, list(layout.moe_layers), layout)
    mbs = [make_micro_batch(samples[i:i + 2], [0.0, 0.0], routes=layout) for i in (0, 2)]
    g = torch.Generator().manual_seed(0)
    for mb in mbs:
        mb.advantages = torch.randn(mb.num_tokens, generator=g) * mb.loss_mask
    same, base = tb.compute_log_probs(mbs), plain.compute_log_probs(mbs)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(same, base))
    out = tb.train_step(mbs, same, None, 4)
    assert out["routing_replay_diff_sum"] == 0 and out["routing_replay_diff_count"] == \
        sum(mb.num_tokens - mb.num_samples for mb in mbs) * len(layout.moe_layers)  # a sample's last: its own

    tb = TorchBackend(small_cfg(hf_checkpoint=path, use_rollout_routing_replay=True))
    other = [make_micro_batch(_routed(samples[i:i + 2], layout, seed=9), [0.0, 0.0], routes=layout) for i in (0, 2)]
    for mb, was in zip(other, mbs):
        mb.advantages = was.advantages
    moved = tb.compute_log_probs(other)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(moved, base))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(tb.compute_log_probs(other, ref=True), moved))
    resumed = TorchBackend(small_cfg(hf_checkpoint=path, use_rollout_routing_replay=True))
    resumed.load_weights(path, ref=True)  # a resumed run's reference, from its checkpoint: it replays as well
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(resumed.compute_log_probs(other, ref=True), moved))
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append(o[2])) for r in tb.router_hooks.routers]
    out = tb.train_step(other, moved, None, 4)
    for h in hooks:
        h.remove()
    want = [i for mb in other for i in mb.routed_experts.unbind(1)]
    assert len(seen) == len(want) and all(torch.equal(a[b[:, 0] >= 0], b[b[:, 0] >= 0].long())
                                          for a, b in zip(seen, want))
    assert out["routing_replay_diff_sum"] > 0


def test_rollout_routing_replay_is_refused_where_it_cannot_replay(small_cfg, tiny_model):
    from engine.doctor.checks import Environment, routing_replay_has_routers

    with pytest.raises(ConfigError, match="replay one routing"):
        small_cfg(use_rollout_routing_replay=True, use_routing_replay=True)
    with pytest.raises(ConfigError, match="supervised data has no rollout engine's routing"):
        small_cfg(use_rollout_routing_replay=True, loss_type="sft_loss")
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 2 and --recompute-activations"):
        small_cfg(use_rollout_routing_replay=True, train_backend="megatron", pipeline_model_parallel_size=2,
                  recompute_activations=True)
    small_cfg(use_rollout_routing_replay=True, train_backend="megatron", pipeline_model_parallel_size=2)  # (each stage its own)
    found = routing_replay_has_routers(small_cfg(use_rollout_routing_replay=True), Environment())
    assert [d.facts["field"] for d in found] == ["use_rollout_routing_replay"]
    assert "--use-rollout-routing-replay" in found[0].what and "has no experts" in found[0].what


def test_a_flow_trains_on_the_engine_routing(prefect_harness, shared_ray, small_cfg, tmp_path, tiny_model):
    """The built-in engine started with --enable-return-routed-experts, every request asking: each rollout's first
    step replays the engine's routing token for token (the trainer's routers alone agree on nearly every routing:
    the same weights; a routing shifted by one token would disagree on most), and the run trains."""
    from flows.train import rl_train

    path = _model("qwen3moe", tmp_path, tiny_model)
    out = rl_train(small_cfg(hf_checkpoint=path, num_rollout=3, eval_prompt_data=[], use_rollout_routing_replay=True,
                             rollout_max_response_len=6, rollout_max_truncated_share=1.0))
    diffs = out["history"]["train/routing_replay_diff"]
    assert sorted(diffs, key=int) == ["0", "1", "2"]
    assert all(v < 0.01 for v in diffs.values()), diffs
    assert all(v < 1e-3 for v in out["history"]["train/mismatch"].values())
