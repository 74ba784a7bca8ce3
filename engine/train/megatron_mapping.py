"""HF ⇄ Megatron weight mapping for the Qwen2, Qwen3, Llama and Mistral families and the mixtures of experts Qwen2-MoE,
Qwen3-MoE and Mixtral: pure tensor code (CPU).

Megatron layouts (megatron-core GPTModel, names without the DDP / Float16Module `module.` prefixes):

    linear_qkv.weight  [(a + 2g)·d, h]   per kv group j: a/g query heads, then k_j, then v_j
                                          (q head i reads kv group i // (a/g), as HF's repeat_kv)
    linear_fc1.weight  [2·ffn, h]        [gate; up]; Megatron's SwiGLU is silu(x[:ffn]) · x[ffn:]
    norms              input_layernorm / pre_mlp_layernorm, or, with Transformer Engine's fused
                       LayerNormLinear, linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight
    tied embeddings    no output_layer.weight: the LM head reads embedding.word_embeddings.weight
    experts (MoE)      mlp.router.weight [E, h] (HF mlp.gate.weight); per expert e
                       mlp.experts.local_experts.<e>.linear_fc1.weight [2·f_e, h] ([gate; up]) and .linear_fc2.weight
                       (megatron-core's SequentialMLP; the HF side is the checkpoint's per-expert names: Qwen's
                       mlp.experts.<e>.gate_proj / up_proj / down_proj, Mixtral's block_sparse_moe.experts.<e>.w1 / w3
                       / w2); Qwen2-MoE's shared expert mlp.shared_experts.linear_fc1 / linear_fc2 and its sigmoid
                       gate mlp.shared_experts.gate_weight [1, h] (HF mlp.shared_expert.*, mlp.shared_expert_gate);
                       a layer listed in ModelShape.moe_dense_layers has a dense MLP (linear_fc1 / linear_fc2)

Tensor parallelism (TP = p ranks) then splits each full tensor: column-parallel ones (qkv, fc1, embedding,
output layer) along rows, row-parallel ones (linear_proj, fc2) along columns, norms replicated. Because the
fused QKV keeps each kv group contiguous, rank r's QKV shard is simply rows chunk r (groups r·g/p … (r+1)·g/p
− 1); fc1 needs gate and up chunked separately. The vocabulary is padded with zero rows up to a multiple of
p (the padded logits are masked in the loss, see `vocab_parallel`).

Invariants (tests/test_megatron_mapping.py): megatron_to_hf(hf_to_megatron(w)) == w for every family;
tp_gather(tp_shard(x, r, p) for r) == x; shapes for GQA configs as above.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from engine.model_shape import ModelShape

# Mistral: Llama's weights, sliding windows; Mixtral: Mistral's attention, experts; Qwen2-MoE: Qwen2's attention,
# experts and a gated shared expert
FAMILIES = ("qwen2", "qwen3", "llama", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")
#: an MoE layer's HF names (checkpoint files): the block, then an expert's gate, up and down projections
_MOE_HF = {"mixtral": ("block_sparse_moe.", "w1", "w3", "w2")}
_MOE_HF_DEFAULT = ("mlp.", "gate_proj", "up_proj", "down_proj")


def shape_from_hf_config(cfg: dict[str, Any]) -> ModelShape:
    """The ModelShape (engine.model_shape) of an HF config dict, old (`rope_theta`) or transformers-5
    (`rope_parameters`), refused with NotImplementedError where this mapping cannot build the model."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise NotImplementedError(f"model_type {family!r}: the Megatron mapping covers {', '.join(FAMILIES)}")
    if cfg.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention (use_sliding_window: true) is not mapped")
    if family == "qwen2_moe" and not cfg.get("shared_expert_intermediate_size", 1):
        raise NotImplementedError("Qwen2-MoE without a shared expert (shared_expert_intermediate_size 0) is not mapped")
    if family == "mixtral" and float(cfg.get("router_jitter_noise") or 0.0):
        # transformers scales the experts' input too; Megatron's moe_input_jitter_eps only the router's
        raise NotImplementedError(f"Mixtral's router_jitter_noise {cfg['router_jitter_noise']} is not mapped "
                                  "(Megatron's jitter scales the router's input only): set it to 0.0 in config.json")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise NotImplementedError("only SwiGLU MLPs without bias are mapped (hidden_act silu, mlp_bias false)")
    shape = ModelShape.from_hf_config(cfg)
    if shape.rope_type == "llama3":
        # Megatron's Llama-3 scaling hard-codes low/high frequency factors 1 / 4 and 8192 original positions.
        rope = dict(shape.rope_scaling)
        want = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        got = {k: rope.get(k) for k in want}
        if any(got[k] is not None and float(got[k]) != v for k, v in want.items()):
            raise NotImplementedError(f"llama3 RoPE scaling with {got}: Megatron supports only {want}")
    elif shape.rope_type != "default":
        raise NotImplementedError(f"RoPE scaling {shape.rope_type!r} is not mapped (default and llama3 are)")
    return shape


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Smallest multiple of tp ≥ V: each TP rank holds the same number of vocabulary rows."""
    return -(-vocab_size // tp) * tp


# ---- fused QKV and gate/up -------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """q [a·d, …], k/v [g·d, …] → [(a + 2g)·d, …] in Megatron's per-group order (works for weights and biases)."""
    g = num_kv_heads
    d = k.shape[0] // g
    rest = q.shape[1:]
    qg = q.reshape(g, num_heads // g * d, *rest)  # [g, a/g·d, …]
    kg = k.reshape(g, d, *rest)  # [g, d, …]
    vg = v.reshape(g, d, *rest)  # [g, d, …]
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)  # [(a + 2g)·d, …]


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: [(a + 2g)·d, …] → q [a·d, …], k [g·d, …], v [g·d, …]."""
    g, d = num_kv_heads, head_dim
    per = num_heads // g * d
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, per + 2 * d, *rest)  # [g, a/g·d + 2d, …]
    q, k, v = grouped.split([per, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# ---- HF ⇄ Megatron (full tensors, TP = 1) ----------------------------------------------------------------
def moe_layer(shape: ModelShape, i: int) -> bool:
    """Whether layer i's MLP is a mixture of experts."""
    return shape.num_experts > 0 and i not in shape.moe_dense_layers


def _layer_map(shape: ModelShape, i: int, fused_norms: bool
               ) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """Layer i's weights: {Megatron suffix: HF suffix} of the one-to-one ones, and (Megatron linear_fc1, HF gate, HF
    up) of each fused [gate; up]. An MoE layer's MLP norm stays its own module under Transformer Engine too (no dense
    linear_fc1 to fuse it into)."""
    moe = moe_layer(shape, i)
    names = {"self_attention.linear_proj.weight": "self_attn.o_proj.weight"}
    if moe:
        block, gate, up, down = _MOE_HF.get(shape.family, _MOE_HF_DEFAULT)
        names["mlp.router.weight"] = block + "gate.weight"
        gated = []
        for e in range(shape.num_experts):
            x, y = f"{block}experts.{e}.", f"mlp.experts.local_experts.{e}."
            gated.append((y + "linear_fc1.weight", f"{x}{gate}.weight", f"{x}{up}.weight"))
            names[y + "linear_fc2.weight"] = f"{x}{down}.weight"
        if shape.moe_shared_ffn:
            gated.append(("mlp.shared_experts.linear_fc1.weight", "mlp.shared_expert.gate_proj.weight",
                          "mlp.shared_expert.up_proj.weight"))
            names["mlp.shared_experts.linear_fc2.weight"] = "mlp.shared_expert.down_proj.weight"
            if shape.moe_shared_gate:
                names["mlp.shared_experts.gate_weight"] = "mlp.shared_expert_gate.weight"
    else:
        gated = [("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")]  # [2·ffn, h]
        names["mlp.linear_fc2.weight"] = "mlp.down_proj.weight"
    if shape.qk_norm:
        names["self_attention.q_layernorm.weight"] = "self_attn.q_norm.weight"
        names["self_attention.k_layernorm.weight"] = "self_attn.k_norm.weight"
    if fused_norms:
        names["self_attention.linear_qkv.layer_norm_weight"] = "input_layernorm.weight"
        names["pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight"] = \
            "post_attention_layernorm.weight"
    else:
        names["input_layernorm.weight"] = "input_layernorm.weight"
        names["pre_mlp_layernorm.weight"] = "post_attention_layernorm.weight"
    return names, gated


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: ModelShape, *, fused_norms: bool = False,
                   vocab_padded: int | None = None) -> dict[str, torch.Tensor]:
    """HF state dict (model.layers.i…) → full Megatron GPTModel state dict (decoder.layers.i…)."""
    s = shape
    vp = vocab_padded or s.vocab_size
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], vp),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not s.tie_embeddings:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vp)
    for i in range(s.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], s.num_heads, s.num_kv_heads)
        if s.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], s.num_heads, s.num_kv_heads)
        names, gated = _layer_map(s, i, fused_norms)
        for fc1, gate, up in gated:
            out[dst + fc1] = torch.cat([hf[src + gate], hf[src + up]], dim=0)
        for mg_name, hf_name in names.items():
            out[dst + mg_name] = hf[src + hf_name]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], shape: ModelShape, *, fused_norms: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Full Megatron state dict → HF names (what weight sync and the HF export write). Drops vocab padding."""
    s = shape
    V = s.vocab_size
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:V],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
    }
    if not s.tie_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"][:V]
    for i in range(s.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv(mg[src + "self_attention.linear_qkv.weight"], s.num_heads, s.num_kv_heads, s.head_dim)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v})
        if s.qkv_bias:
            qb, kb, vb = split_qkv(mg[src + "self_attention.linear_qkv.bias"], s.num_heads, s.num_kv_heads,
                                   s.head_dim)
            out.update({dst + "self_attn.q_proj.bias": qb, dst + "self_attn.k_proj.bias": kb,
                        dst + "self_attn.v_proj.bias": vb})
        names, gated = _layer_map(s, i, fused_norms)
        for fc1, gate, up in gated:
            out[dst + gate], out[dst + up] = mg[src + fc1].chunk(2, dim=0)
        for mg_name, hf_name in names.items():
            out[dst + hf_name] = mg[src + mg_name]
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


# ---- tensor parallelism ----------------------------------------------------------------------------------
_COLUMN = re.compile(r"(linear_qkv\.(weight|bias)|word_embeddings\.weight|output_layer\.weight)$")
_GATED = re.compile(r"linear_fc1\.weight$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")


def tp_kind(name: str) -> str:
    """How a Megatron weight is split over TP ranks: column (rows), gated (gate and up rows), row, replicated. An
    expert's weights are replicated: the backend runs experts whole on every TP rank (expert_tensor_parallel_size
    1; a shared expert is an ordinary MLP, split by TP)."""
    if ".local_experts." in name or ".experts.experts." in name:
        return "replicated"
    if _GATED.search(name):
        return "gated"
    if _COLUMN.search(name):
        return "column"
    if _ROW.search(name):
        return "row"
    return "replicated"


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of a full Megatron tensor under TP = `size` (a view where possible)."""
    kind = tp_kind(name)
    if size == 1 or kind == "replicated":
        return full
    if kind == "column":
        return full.chunk(size, dim=0)[rank]
    if kind == "row":
        return full.chunk(size, dim=1)[rank]
    gate, up = full.chunk(2, dim=0)  # [ffn, h] each
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)  # [2·ffn/p, h]


def tp_gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `tp_shard` over all ranks' shards (in rank order)."""
    kind = tp_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "column":
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def check_tp(shape: ModelShape, tp: int, ep: int = 1, *, sp: bool = False) -> None:
    """Megatron splits heads, kv groups and the FFN evenly over TP ranks, and the experts over EP ranks."""
    if shape.num_experts and tp > 1 and not sp:
        raise ValueError(f"--tensor-model-parallel-size {tp} with a mixture of experts: megatron-core trains one "
                         "under TP only with sequence parallelism; add --sequence-parallel, or use TP = 1 with "
                         f"--expert-model-parallel-size {tp}, or --train-backend torch")
    if ep > 1 and not shape.num_experts:
        raise ValueError(f"--expert-model-parallel-size {ep}: a dense model has no experts to place; use 1")
    if ep > 1 and shape.num_experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the model's {shape.num_experts} experts: "
                         f"choose an EP size that divides {shape.num_experts}")
    for what, n in (("num_attention_heads", shape.num_heads), ("num_key_value_heads", shape.num_kv_heads),
                    ("intermediate_size", shape.ffn_hidden_size)):
        if n % tp:
            raise ValueError(f"{what}={n} is not divisible by --tensor-model-parallel-size {tp}: choose a TP "
                             f"size that divides {n}")
