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

import numpy as np

from engine.model_shape import ModelShape

__all__ = ["ModelShape", "flops_per_sample", "sequence_flops"]


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
