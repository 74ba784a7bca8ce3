"""Forward FLOPs of one sequence, from the model's shape (design.md, "Batch arithmetic").

Per layer, for a sequence of L tokens (h hidden, a heads, g kv-groups, d head dim, f MLP width):
    QKV          2·L·h·(a·d) + 4·L·h·(g·d)       (Q, then K and V)
    attention    2·a·L²·d                        (QKᵀ and A·V, each 2·a·L²·d halved by the causal mask)
    output proj  2·L·(a·d)·h                     (design.md writes 2·L·h²: the same when a·d = h, as in
                                                  Llama/Qwen2; Qwen3 has a·d ≠ h, so the product is kept)
    gated MLP    6·L·h·f                         (gate, up, down); an MoE layer uses f = top_k·f_expert + f_shared
plus the LM head 2·L·h·V once. Packed (varlen) attention never crosses samples, so a micro-batch's FLOPs are
the sum of its samples' FLOPs: the L² term is what makes two micro-batches of equal token count unequal work.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.doctor.diagnosis import ConfigError, Diagnosis


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int  # h
    num_heads: int  # a
    num_kv_heads: int  # g
    head_dim: int  # d
    ffn_hidden_size: int  # f of a dense layer
    vocab_size: int  # V
    num_moe_layers: int = 0  # layers whose MLP is a mixture of experts (the rest are dense)
    moe_ffn_hidden_size: int = 0  # active MLP width of an MoE layer: top_k·f_expert + f_shared

    @staticmethod
    def from_hf_config(config: dict[str, Any] | str | Path) -> "ModelShape":
        """Read a Hugging Face config.json (a dict, the file, or the model directory)."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            config = json.loads(path.read_text())
        c = config.get("text_config", config)  # multimodal configs nest the language model's
        required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if not c.get(k)]
        if missing:
            raise ConfigError(Diagnosis(
                code="MODEL", severity="error",
                what=f"the model config lacks {', '.join(missing)}: the FLOPs estimate used to balance DP ranks "
                     "cannot be computed", fix=f"--hf-checkpoint a Hugging Face decoder model (config.json with "
                                              f"{', '.join(required)})",
                facts={"missing": missing}))
        h, a, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
        top_k = c.get("num_experts_per_tok") or c.get("moe_router_topk") or 0
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
        moe_layers, moe_f = 0, 0
        if top_k and experts:  # Qwen-MoE / DeepSeek name the expert width; Mixtral's experts are intermediate_size
            f_expert = c.get("moe_intermediate_size") or c["intermediate_size"]
            dense = len(c.get("mlp_only_layers") or []) or int(c.get("first_k_dense_replace") or 0)
            moe_layers = layers - dense
            shared = c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * f_expert
            moe_f = top_k * f_expert + shared
        # transformers' own defaults: no num_key_value_heads = multi-head attention, no head_dim = h / a
        return ModelShape(num_layers=layers, hidden_size=h, num_heads=a,
                          num_kv_heads=c.get("num_key_value_heads") or a, head_dim=c.get("head_dim") or h // a,
                          ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"],
                          num_moe_layers=moe_layers, moe_ffn_hidden_size=moe_f)


def sequence_flops(length, m: ModelShape):
    """Forward FLOPs of a sequence of `length` tokens (the module docstring's formula); length may be an array."""
    L, h = length * 1.0, m.hidden_size
    ad, gd = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attn = 2 * L * h * ad + 4 * L * h * gd + 2 * m.num_heads * L * L * m.head_dim + 2 * L * ad * h
    dense = m.num_layers - m.num_moe_layers
    mlp = dense * 6 * L * h * m.ffn_hidden_size + m.num_moe_layers * 6 * L * h * m.moe_ffn_hidden_size
    return m.num_layers * attn + mlp + 2 * L * h * m.vocab_size


def flops_per_sample(lengths: list[int], m: ModelShape) -> list[float]:
    """[N] forward FLOPs of each sample, for build_dp_schedule(flops=...): sequence_flops on an array."""
    return sequence_flops(np.asarray(lengths, dtype=np.float64), m).tolist()
