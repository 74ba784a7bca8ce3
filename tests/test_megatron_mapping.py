"""HF ⇄ Megatron weight mapping (pure tensors, CPU): round trips, GQA layout semantics, TP sharding."""
from __future__ import annotations

import pytest
import torch

from engine.train.megatron_mapping import (ModelShape, check_tp, fuse_qkv, hf_to_megatron, megatron_to_hf,
                                           padded_vocab, shape_from_hf_config, split_qkv, tp_gather, tp_kind,
                                           tp_shard)

# Tiny GQA configs of each family: a = 4 query heads over g = 2 kv groups (Llama: a = 6, g = 2, d = 8).
TINY = {
    "qwen2": dict(model_type="qwen2", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, num_hidden_layers=2, vocab_size=101, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=48, num_hidden_layers=2, vocab_size=101, tie_word_embeddings=False),
    "llama": dict(model_type="llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64, num_hidden_layers=2, vocab_size=101, tie_word_embeddings=False),
    # a window of 4 binds inside the CPU model test's samples of 5, 7 and 12 tokens
    "mistral": dict(model_type="mistral", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=48, num_hidden_layers=2, vocab_size=101, tie_word_embeddings=False,
                    sliding_window=4),
}
MOE = ("qwen3moe", "mixtral", "qwen2moe")  # tests/model_families.py


def hf_model(family: str):
    import transformers

    if family.startswith("qwen3moe") or family in MOE:  # tests/model_families.py: 4 experts, 2 a token (Qwen3: q/k
        from model_families import random_model  # norms; Mixtral: a window of 6; Qwen2-MoE: a gated shared expert,
        # a dense layer 0); "-norm": the top-k weights renormalised (Qwen3-30B-A3B's norm_topk_prob)
        model = random_model(family.removesuffix("-norm"), 101)
        # its pad_token_id 0 made transformers' embedding nn.Embedding(padding_idx=0), whose row 0 never trains;
        # Megatron's embedding trains every row (as for a model without a pad token)
        model.model.embed_tokens.padding_idx = None
        if family == "qwen3moe-norm":
            model.config.norm_topk_prob = True
            for layer in model.model.layers:
                layer.mlp.gate.norm_topk_prob = True
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        return model

    cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    cfg = getattr(transformers, cls[0])(**{k: v for k, v in TINY[family].items() if k != "model_type"})
    torch.manual_seed(0)
    model = getattr(transformers, cls[1])(cfg).eval()
    with torch.no_grad():  # biases and norm weights are 0 / 1 at init: make every tensor distinguishable
        for p in model.parameters():
            p.normal_()
    return model


def canonical(sd: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The HF weights that carry information (a tied lm_head is the embedding again)."""
    return {k: v for k, v in sd.items() if not (shape.tie_embeddings and k == "lm_head.weight")}


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("fused_norms", [False, True])
def test_hf_to_megatron_to_hf_is_identity(family, fused_norms):
    model = hf_model(family)
    shape = shape_from_hf_config(model.config.to_dict())
    hf = canonical(model.state_dict(), shape)
    back = megatron_to_hf(hf_to_megatron(hf, shape, fused_norms=fused_norms), shape, fused_norms=fused_norms)
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("family", sorted(TINY))
def test_megatron_shapes_for_gqa(family):
    model = hf_model(family)
    s = shape_from_hf_config(model.config.to_dict())
    mg = hf_to_megatron(model.state_dict(), s, vocab_padded=104)
    a, g, d, h = s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size
    assert mg["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((a + 2 * g) * d, h)
    assert mg["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * s.ffn_hidden_size, h)
    assert mg["decoder.layers.1.self_attention.linear_proj.weight"].shape == (h, a * d)
    assert mg["embedding.word_embeddings.weight"].shape == (104, h)  # padded rows are zero
    assert mg["embedding.word_embeddings.weight"][101:].abs().sum() == 0
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) == (family == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mg) == (family == "qwen3")
    assert ("output_layer.weight" in mg) == (not s.tie_embeddings)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_fused_qkv_read_as_megatron_reads_it_gives_hf_heads(family):
    """Megatron views the QKV output as [T, g, (a/g + 2)·d] and splits [a/g·d, d, d]; query head i must then
    attend with kv head i // (a/g), as HF's repeat_kv does."""
    model = hf_model(family)
    s = shape_from_hf_config(model.config.to_dict())
    attn = model.model.layers[0].self_attn
    x = torch.randn(5, s.hidden_size)
    mg = hf_to_megatron(model.state_dict(), s)
    w = mg["decoder.layers.0.self_attention.linear_qkv.weight"]
    b = mg.get("decoder.layers.0.self_attention.linear_qkv.bias")
    mixed = x @ w.T + (b if b is not None else 0)  # [T, (a + 2g)·d]
    a, g, d = s.num_heads, s.num_kv_heads, s.head_dim
    q, k, v = mixed.view(5, g, (a // g + 2) * d).split([a // g * d, d, d], dim=-1)
    q = q.reshape(5, a, d)  # [T, a, d]
    with torch.no_grad():
        q_hf = attn.q_proj(x).view(5, a, d)
        k_hf = attn.k_proj(x).view(5, g, d)
        v_hf = attn.v_proj(x).view(5, g, d)
    torch.testing.assert_close(q, q_hf)
    torch.testing.assert_close(k, k_hf)
    torch.testing.assert_close(v, v_hf)
    rep = a // g
    for i in range(a):  # the kv group Megatron pairs with query head i (its position in the group layout)
        torch.testing.assert_close(k[:, i // rep], k_hf.repeat_interleave(rep, dim=1)[:, i])


def test_split_qkv_inverts_fuse_qkv_for_biases_too():
    q, k, v = torch.randn(8 * 4), torch.randn(2 * 4), torch.randn(2 * 4)  # a = 8, g = 2, d = 4
    fused = fuse_qkv(q, k, v, 8, 2)
    assert fused[: 4 * 4].equal(q[: 4 * 4])  # group 0 starts with its 4 query heads …
    assert fused[16:20].equal(k[:4]) and fused[20:24].equal(v[:4])  # … then k_0, v_0
    for got, want in zip(split_qkv(fused, 8, 2, 4), (q, k, v)):
        assert got.equal(want)


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_shards_gather_back_and_hold_whole_kv_groups(tp):
    model = hf_model("qwen2")
    s = shape_from_hf_config(model.config.to_dict())
    hf = model.state_dict()
    mg = hf_to_megatron(hf, s, vocab_padded=padded_vocab(s.vocab_size, tp))
    for name, full in mg.items():
        shards = [tp_shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(tp_gather(name, shards), full), name
    a, g, d = s.num_heads, s.num_kv_heads, s.head_dim
    per = g // tp
    for r in range(tp):  # rank r holds kv groups r·g/p … (r+1)·g/p − 1 with their query heads, fused
        heads = slice(r * per * (a // g) * d, (r + 1) * per * (a // g) * d)
        groups = slice(r * per * d, (r + 1) * per * d)
        want = fuse_qkv(hf["model.layers.0.self_attn.q_proj.weight"][heads],
                        hf["model.layers.0.self_attn.k_proj.weight"][groups],
                        hf["model.layers.0.self_attn.v_proj.weight"][groups], a // tp, g // tp)
        assert torch.equal(tp_shard("decoder.layers.0.self_attention.linear_qkv.weight",
                                    mg["decoder.layers.0.self_attention.linear_qkv.weight"], r, tp), want)
        ffn = s.ffn_hidden_size // tp
        fc1 = tp_shard("decoder.layers.0.mlp.linear_fc1.weight", mg["decoder.layers.0.mlp.linear_fc1.weight"], r, tp)
        assert torch.equal(fc1[:ffn], hf["model.layers.0.mlp.gate_proj.weight"][r * ffn:(r + 1) * ffn])
        assert torch.equal(fc1[ffn:], hf["model.layers.0.mlp.up_proj.weight"][r * ffn:(r + 1) * ffn])


def test_tp_kinds():
    assert tp_kind("decoder.layers.3.self_attention.linear_qkv.bias") == "column"
    assert tp_kind("output_layer.weight") == "column"
    assert tp_kind("decoder.layers.3.mlp.linear_fc1.weight") == "gated"
    assert tp_kind("decoder.layers.3.mlp.linear_fc2.weight") == "row"
    assert tp_kind("decoder.layers.3.mlp.linear_fc1.layer_norm_weight") == "replicated"  # TE's fused norm
    assert tp_kind("decoder.layers.3.self_attention.q_layernorm.weight") == "replicated"


def test_padded_vocab_round_trips_without_the_padding():
    model = hf_model("qwen3")  # untied: the LM head is padded too
    s = shape_from_hf_config(model.config.to_dict())
    assert padded_vocab(101, 3) == 102 and padded_vocab(100, 4) == 100
    mg = hf_to_megatron(model.state_dict(), s, vocab_padded=102)
    assert mg["output_layer.weight"].shape[0] == 102
    back = megatron_to_hf(mg, s)
    assert torch.equal(back["lm_head.weight"], model.state_dict()["lm_head.weight"])


def test_check_tp_names_the_fix():
    s = shape_from_hf_config(TINY["qwen2"])
    check_tp(s, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by --tensor-model-parallel-size 4"):
        check_tp(s, 4)


def test_shape_reads_old_and_new_rope_keys_and_llama3_scaling():
    old = shape_from_hf_config({**TINY["qwen2"], "rope_theta": 1e6})
    new = shape_from_hf_config({**TINY["qwen2"], "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert old.rope_theta == new.rope_theta == 1e6 and old.qkv_bias and not old.qk_norm
    l3 = shape_from_hf_config({**TINY["llama"], "rope_parameters": {
        "rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert l3.rope_scaling_factor == 8.0 and l3.head_dim == 8 and not l3.qkv_bias
    with pytest.raises(NotImplementedError, match="yarn"):
        shape_from_hf_config({**TINY["llama"], "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(NotImplementedError, match="model_type 'gpt2'"):
        shape_from_hf_config({**TINY["llama"], "model_type": "gpt2"})


#: per family: the checkpoint's router, expert 3's gate projection, shared expert's gate weight (None: none), the
#: dense layers
MOE_NAMES = {"qwen3moe": ("mlp.gate.weight", "mlp.experts.3.gate_proj.weight", None, ()),
             "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.3.w1.weight", None, ()),
             "qwen2moe": ("mlp.gate.weight", "mlp.experts.3.gate_proj.weight", "mlp.shared_expert_gate.weight", (0,))}


@pytest.mark.parametrize("fused_norms", [False, True])
@pytest.mark.parametrize("family", MOE)
def test_a_mixture_of_experts_maps_its_router_and_experts_and_back_under_the_checkpoint_names(family, fused_norms):
    """Router = the checkpoint's gate, each expert's [gate; up] into its linear_fc1 and down into linear_fc2 of
    megatron-core's SequentialMLP (Qwen2-MoE: the shared expert's into mlp.shared_experts, its sigmoid gate's
    weight into gate_weight; its dense layer 0 into a dense MLP); back, the names are the checkpoint's (what
    save_pretrained writes and engines load), not transformers 5's fused in-memory ones."""
    from engine.weights.layout import checkpoint_state

    model = hf_model(family)
    s = shape_from_hf_config(model.config.to_dict())
    router, expert, shared_gate, dense = MOE_NAMES[family]
    f = 128 if family == "mixtral" else 32  # Mixtral's experts are intermediate_size wide
    assert (s.num_experts, s.moe_top_k, s.moe_expert_ffn, s.moe_dense_layers) == (4, 2, f, dense)
    assert s.moe_norm_topk == (family == "mixtral") and s.qk_norm == (family == "qwen3moe")
    assert (s.moe_shared_ffn, s.moe_shared_gate) == ((48, True) if shared_gate else (0, False))
    assert s.sliding_window == (6 if family == "mixtral" else 0) and s.qkv_bias == (family == "qwen2moe")
    hf = canonical(checkpoint_state(model, model.state_dict()), s)
    assert "model.layers.1." + router in hf and "model.layers.1." + expert in hf
    mg = hf_to_megatron(hf, s, fused_norms=fused_norms)
    assert mg["decoder.layers.1.mlp.router.weight"].shape == (4, s.hidden_size)
    fc1 = mg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.shape == (2 * f, s.hidden_size)
    assert torch.equal(fc1[:f], hf["model.layers.1." + expert])
    assert torch.equal(mg["decoder.layers.1.mlp.router.weight"], hf["model.layers.1." + router])
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mg  # its own module, TE or not
    assert {i for i in range(s.num_layers) if f"decoder.layers.{i}.mlp.linear_fc1.weight" in mg} == set(dense)
    if shared_gate:
        assert mg["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].shape == (2 * 48, s.hidden_size)
        assert torch.equal(mg["decoder.layers.1.mlp.shared_experts.gate_weight"], hf["model.layers.1." + shared_gate])
    assert not any("shared_experts" in k for k in mg) or shared_gate
    back = megatron_to_hf(mg, s, fused_norms=fused_norms)
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("config, match", [
    (dict(model_type="mixtral", router_jitter_noise=0.1), "router_jitter_noise 0.1"),
    (dict(model_type="qwen2_moe", shared_expert_intermediate_size=0), "without a shared expert")])
def test_mixture_of_experts_variants_that_are_not_mapped_are_refused_by_name(config, match):
    base = {**TINY["qwen2"], "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(NotImplementedError, match=match):
        shape_from_hf_config({**base, **config})


def test_dense_layers_of_a_mixture_of_experts_follow_transformers():
    """Qwen-MoE: a layer has experts unless listed in mlp_only_layers or (i + 1) is not a multiple of
    decoder_sparse_step; DeepSeek: the first first_k_dense_replace layers are dense."""
    base = dict(model_type="qwen3_moe", hidden_size=32, num_attention_heads=4, intermediate_size=48,
                num_hidden_layers=6, vocab_size=101, num_experts=4, num_experts_per_tok=2)
    for extra, dense in [({}, ()), ({"decoder_sparse_step": 2}, (0, 2, 4)), ({"mlp_only_layers": [1, 5]}, (1, 5)),
                         ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, (0, 1, 2, 3, 4)),
                         ({"first_k_dense_replace": 2, "model_type": "deepseek_v3"}, (0, 1))]:
        m = ModelShape.from_hf_config({**base, **extra})
        assert (m.moe_dense_layers, m.num_moe_layers) == (dense, 6 - len(dense)), extra


@pytest.mark.parametrize("family", MOE)
def test_a_mixture_of_experts_is_not_split_over_tp_ranks(family):
    """Under TP a mixture of experts needs sequence parallelism; its experts stay whole (replicated over TP)."""
    s = shape_from_hf_config(hf_model(family).config.to_dict())
    check_tp(s, 1)
    with pytest.raises(ValueError, match="mixture of experts.*--sequence-parallel"):
        check_tp(s, 2)
    check_tp(s, 2, sp=True)
    assert tp_kind("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight") == "replicated"
    assert tp_kind("decoder.layers.1.mlp.shared_experts.linear_fc1.weight") == "gated"
