"""rollflow's native Llama-family model (engine/native_model.py) computes what transformers' class computes, bit for
bit in float32 on the CPU, under the same parameter names; what it does not cover loads transformers' class."""
from __future__ import annotations

import json

import pytest
import torch
from test_forward import grpo_samples
from train_fakes import pack

from engine import native_model
from engine.diagnosis import ConfigError
from engine.modeling import impl_of, load_causal_lm
from engine.train.forward import packed_forward, use_varlen_attention

SMALL = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=256, eos_token_id=258)


def save_random(tmp_path_factory, name: str, config) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases and norm weights away from their 0 / 1 init, so a mixed-up one shows
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def family(request, tiny_model, tmp_path_factory) -> str:
    """A model directory per family: the bundled Qwen2 (tied embeddings), a Qwen3 (q/k norms) and a Llama with
    attention_bias (biased q/k/v and output projections), both untied."""
    if request.param == "qwen2":
        return tiny_model
    if request.param == "qwen3":
        from transformers import Qwen3Config

        return save_random(tmp_path_factory, "qwen3", Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=False))
    from transformers import LlamaConfig

    return save_random(tmp_path_factory, "llama", LlamaConfig(**SMALL, attention_bias=True, tie_word_embeddings=False))


def both(path: str, dtype: str = "float32"):
    hf, na = (load_causal_lm(path, dtype=dtype, impl=i) for i in ("transformers", "native"))
    assert (impl_of(hf), impl_of(na)) == ("transformers", "native")
    return hf, na


def test_the_same_names_in_the_same_order(family):
    hf, na = both(family)
    assert list(na.state_dict()) == list(hf.state_dict())
    assert [n for n, _ in na.named_parameters()] == [n for n, _ in hf.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(na.state_dict().values(), hf.state_dict().values()))
    assert (na.lm_head.weight is na.model.embed_tokens.weight) == (hf.lm_head.weight is hf.model.embed_tokens.weight)
    # the pad token's embedding row gets no gradient in either
    assert na.model.embed_tokens.padding_idx == hf.model.embed_tokens.padding_idx == 256


@pytest.mark.parametrize("pad_factor", [float("inf"), 0.0], ids=["padded", "per-sample"])
@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared-prompts"])
def test_packed_log_probs_and_gradients_are_transformers_bit_for_bit(family, pad_factor, share, monkeypatch):
    import engine.train.forward as fw

    monkeypatch.setattr(fw, "PAD_FACTOR", pad_factor)
    samples = grpo_samples(seed=8)
    (mb,) = pack(samples, [list(range(len(samples)))])
    w = torch.randn(mb.num_tokens, generator=torch.Generator().manual_seed(0))  # a loss that weighs every token
    got = []
    for model in both(family):
        use_varlen_attention(model)
        lp, ent = packed_forward(model, mb, share_prefix=share)
        ((lp * w).sum() + ent.sum()).backward()
        got.append((lp, ent, [(n, p.grad) for n, p in model.named_parameters()]))
    (lp_h, ent_h, g_h), (lp_n, ent_n, g_n) = got
    assert (lp_n < 0).any() and torch.equal(lp_n, lp_h) and torch.equal(ent_n, ent_h)
    for (name, a), (_, b) in zip(g_n, g_h):
        assert a is not None and torch.equal(a, b), name


def test_generation_is_transformers_bit_for_bit(family):
    """The engine's batched generation: a GRPO group's prompt prefilled once and its cache reordered to the rows,
    prompts of different lengths left-padded, sampled decode steps over the cache, prompt log-probs."""
    from engine.modeling import load_tokenizer
    from engine.rollout.generation import Generator, GenRequest

    tok = load_tokenizer("examples/tiny-qwen2-arith")
    prompts = [[5, 17, 99, 3], [42, 7], [5, 17, 99, 3], [8, 8, 8, 8, 8, 1], [42, 7]]
    outs = []
    for model in both(family):
        gen = Generator(model.eval(), tok, [258], "cpu")
        reqs = [GenRequest(rid=str(i), input_ids=p, max_new_tokens=6, temperature=1.0, seed=100 + i, ignore_eos=True,
                           logprob_start_len=0 if i == 3 else -1) for i, p in enumerate(prompts)]
        outs.append([(r.output_ids, r.logprobs, r.input_logprobs) for r in gen.generate(reqs)])
        assert gen.prefill_rows == 3  # five rows, three distinct prompts
    assert outs[0] == outs[1]
    assert all(len(ids) == 6 for ids, _, _ in outs[1])


def test_bf16_weights_keep_rope_in_float32_and_match(tiny_model):
    hf, na = both(tiny_model, dtype="bfloat16")
    assert {p.dtype for p in na.parameters()} == {torch.bfloat16}
    assert na.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.no_grad():
        assert torch.equal(na(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_save_pretrained_writes_a_directory_transformers_loads(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    na = load_causal_lm(tiny_model, impl="native")
    with torch.no_grad():
        na.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # a trained model's weights, not the source's
    na.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, na(input_ids=ids).logits)
        assert torch.equal(native_model.load(tmp_path)(input_ids=ids).logits, na(input_ids=ids).logits)


def edited(src: str, dst, **changes) -> str:
    """A copy of the model directory `src` with config.json keys changed (None deletes one)."""
    import shutil

    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        c.pop(k) if v is None else c.__setitem__(k, v)
    (dst / "config.json").write_text(json.dumps(c))
    return str(dst)


def test_what_native_does_not_cover_loads_transformers_and_says_why(tiny_model, tmp_path):
    assert native_model.unsupported(tiny_model) is None
    assert "device cuda" in native_model.unsupported(tiny_model, "cuda:0")
    cases = {"rope": edited(tiny_model, tmp_path / "rope", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 10000.0}),
             "sliding": edited(tiny_model, tmp_path / "sliding", use_sliding_window=True, sliding_window=8),
             "act": edited(tiny_model, tmp_path / "act", hidden_act="gelu")}
    assert "RoPE type 'linear'" in native_model.unsupported(cases["rope"])
    assert "sliding-window" in native_model.unsupported(cases["sliding"])
    assert "hidden_act 'gelu'" in native_model.unsupported(cases["act"])
    (tmp_path / "nosafe").mkdir()
    (tmp_path / "nosafe" / "config.json").write_text((tmp_path / "act" / "config.json").read_text()
                                                     .replace('"gelu"', '"silu"'))
    assert "no safetensors" in native_model.unsupported(tmp_path / "nosafe")
    (tmp_path / "nosafe" / "model.safetensors.index.json").write_text("{not json")
    assert "model.safetensors.index.json" in native_model.unsupported(tmp_path / "nosafe")
    # auto: transformers' class where native cannot; native: a config error naming the flag and the reason
    assert impl_of(load_causal_lm(cases["rope"])) == "transformers"
    with pytest.raises(ConfigError) as e:
        load_causal_lm(cases["rope"], impl="native")
    assert e.value.diagnoses[0].facts["field"] == "model_impl" and "RoPE type 'linear'" in str(e.value)


def test_model_impl_without_rollflows_model_code_is_a_config_error():
    from engine.config import RunConfig

    with pytest.raises(ConfigError) as e:
        RunConfig(model_impl="native", train_backend="megatron", rollout_engine="sglang", weight_sync_method="disk")
    assert "--model-impl native" in str(e.value) and e.value.diagnoses[0].facts["field"] == "model_impl"
    assert RunConfig(model_impl="transformers").model_impl == "transformers"


def test_model_impl_reaches_the_trainer_and_the_engine():
    from engine.config import RunConfig
    from engine.rollout.engines import engine_spec
    from engine.rollout.server import EngineState
    from engine.train.torch_backend import TorchBackend

    for impl, loaded in (("auto", "native"), ("transformers", "transformers")):
        cfg = RunConfig(model_impl=impl)
        assert TorchBackend(cfg).model_impl == loaded
        spec = engine_spec(cfg, threads=1, log_dir="/tmp", on_gpu=False)
        assert EngineState(spec.model_path, model_impl=spec.model_impl).model_impl == loaded


def test_preflight_finds_what_native_cannot_run_before_anything_starts(small_cfg, tiny_model, tmp_path):
    from engine.doctor.checks import CHECKS, Environment, native_model_code_runs

    assert native_model_code_runs in CHECKS["MODEL"]
    cpu, gpu = Environment(gpus=0.0), Environment(gpus=8.0, source="the Ray cluster")
    assert native_model_code_runs(small_cfg(model_impl="native"), cpu) == []
    assert native_model_code_runs(small_cfg(), gpu) == []  # auto: transformers' classes on CUDA, nothing to report
    (d,) = native_model_code_runs(small_cfg(model_impl="native"), gpu)
    assert d.severity == "error" and "device cuda" in d.what and "the Ray cluster" in d.what
    assert d.facts["field"] == "model_impl" and "--model-impl auto" in d.fix
    scaled = edited(tiny_model, tmp_path / "scaled", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 10000.0})
    (d,) = native_model_code_runs(small_cfg(model_impl="native", hf_checkpoint=scaled), cpu)
    assert "RoPE type 'linear'" in d.what


def test_weight_names_native_does_not_know_load_transformers_class_under_auto(tiny_model, tmp_path):
    """A checkpoint that saved RoPE's inverse frequencies (older Llama-family ones did) loads natively: they are
    recomputed. A name the model does not have: auto loads transformers' class (its loader knows key renames and
    ignores extras); native refuses, naming the key."""
    from safetensors.torch import load_file, save_file

    def with_extra(name: str, key: str) -> str:
        d = edited(tiny_model, tmp_path / name)
        state = load_file(f"{d}/model.safetensors")
        save_file({**state, key: torch.ones(8)}, f"{d}/model.safetensors", metadata={"format": "pt"})
        return d

    old = with_extra("old", "model.layers.0.self_attn.rotary_emb.inv_freq")
    ids = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        assert torch.equal(load_causal_lm(old, impl="native")(input_ids=ids).logits,
                           load_causal_lm(tiny_model, impl="native")(input_ids=ids).logits)
    odd = with_extra("odd", "model.extra.weight")
    assert impl_of(load_causal_lm(odd)) == "transformers"
    with pytest.raises(ConfigError) as e:
        load_causal_lm(odd, impl="native")
    assert "model.extra.weight" in str(e.value)


def test_preflight_finds_a_model_the_megatron_backend_cannot_build(small_cfg, tiny_model, tmp_path):
    """--train-backend megatron maps Qwen2, Qwen3(-MoE), Llama and Mistral (not Qwen2's own sliding windows): another
    model is a MODEL error before anything starts (before, the train workers' model build raised, after Ray and the
    engines were up)."""
    from engine.doctor.checks import CHECKS, Environment, megatron_maps_the_model

    assert megatron_maps_the_model in CHECKS["MODEL"]
    env = Environment(gpus=1.0)
    assert megatron_maps_the_model(small_cfg(train_backend="megatron"), env) == []  # the bundled Qwen2
    gemma = edited(tiny_model, tmp_path / "gemma2", model_type="gemma2", sliding_window=4096)
    assert megatron_maps_the_model(small_cfg(hf_checkpoint=gemma), env) == []  # the torch backend builds anything
    (d,) = megatron_maps_the_model(small_cfg(train_backend="megatron", hf_checkpoint=gemma), env)
    assert d.severity == "error" and "model_type 'gemma2'" in d.what and "--train-backend torch" in d.fix
    mistral = edited(tiny_model, tmp_path / "mistral", model_type="mistral", sliding_window=4096)
    assert megatron_maps_the_model(small_cfg(train_backend="megatron", hf_checkpoint=mistral), env) == []
    windowed = edited(tiny_model, tmp_path / "windowed", use_sliding_window=True, sliding_window=16)
    (d,) = megatron_maps_the_model(small_cfg(train_backend="megatron", hf_checkpoint=windowed), env)
    assert "sliding-window" in d.what and d.facts["field"] == "train_backend"


def test_preflight_takes_a_qwen3_moe_for_megatron_at_tp_1_only(small_cfg, tiny_model, tmp_path):
    """The Megatron mapping builds Qwen3-MoE's experts at TP = 1 (with dense layers too); at TP = 2 the preflight
    says so, naming the flag; a variant it does not map (Mixtral's router jitter) is refused by name."""
    from engine.doctor.checks import Environment, megatron_maps_the_model
    from model_families import save_model

    moe = save_model(tmp_path / "moe", "qwen3moe", tiny_model)
    env = Environment(gpus=2.0)
    assert megatron_maps_the_model(small_cfg(train_backend="megatron", hf_checkpoint=moe), env) == []
    (d,) = megatron_maps_the_model(small_cfg(train_backend="megatron", hf_checkpoint=moe,
                                             tensor_model_parallel_size=2), env)
    assert d.severity == "error" and "mixture of experts" in d.what and d.facts["field"] == "tensor_model_parallel_size"
    dense = edited(tiny_model, tmp_path / "dense-moe", model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, mlp_only_layers=[0])  # a dense layer 0: mapped
    assert megatron_maps_the_model(small_cfg(train_backend="megatron", hf_checkpoint=dense), env) == []
    jitter = edited(tiny_model, tmp_path / "jitter", model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    router_jitter_noise=0.01)
    (d,) = megatron_maps_the_model(small_cfg(train_backend="megatron", hf_checkpoint=jitter), env)
    assert "router_jitter_noise 0.01" in d.what and "--train-backend torch" in d.fix
