"""Causal attention over packed samples, for Megatron's core-attention slot when Transformer Engine is absent.

Megatron's own `DotProductAttention` materialises the [b·a, s, s] score matrix and rejects packed (THD) input;
in our probe it ran a 1.5B shape at 23.5% MFU. This module keeps Megatron's QKV / RoPE / output projection
and replaces only the softmax(QKᵀ)V core:

    CUDA, bf16/fp16   flash attention, variable length (engine/train/attention.py): one kernel over the
                      flat row, so attention never crosses a sample and nothing s×s is stored.
    otherwise         (fp32 parity runs, CPU) scaled_dot_product_attention per sample, causal.

RoPE: either Megatron rotated q and k already (its THD path restarts positions at every cu_seqlens boundary,
but splits the row per sample with a host sync in every layer), or `rope` is given and this module rotates
them itself from positions derived on the GPU once per micro-batch (`packed_positions`): same formula,
no sync, two fewer kernels per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.train.attention import causal_band, packed_causal_attention


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of the HF families (rotate-half layout), optionally with Llama-3 frequency scaling."""

    theta: float
    scaling_factor: float | None = None  # llama3: low/high frequency factors 1 / 4, 8192 original positions

    def inv_freq(self, dim: int, device=None) -> torch.Tensor:
        """[d/2] 1/θ^(2i/d), Llama-3 scaled where asked (the formula of Megatron's and HF's llama3 RoPE)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        if self.scaling_factor is None:
            return inv
        factor, low, high, orig = self.scaling_factor, 1.0, 4.0, 8192
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= orig / high) & (wavelen <= orig / low)
        return torch.where(is_mid, mid, scaled)


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] position of each flat token inside its own sample (0 at every cu_seqlens start); no host sync."""
    cu = cu_seqlens.long()
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, d] in `dtype` (computed in fp32 and cast, as Megatron and HF do)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]: x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class PackedCoreAttention(torch.nn.Module):
    """Drop-in for megatron-core's `core_attention` submodule (same constructor and forward signature)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None, rope: Rope | None = None, window: int | None = None, **_unused):
        super().__init__()
        if getattr(config, "context_parallel_size", 1) != 1:
            raise NotImplementedError("context parallelism needs Transformer Engine's attention")
        if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
            raise NotImplementedError("attention dropout is not supported by the packed attention (RL uses 0)")
        self.config = config
        self.softmax_scale = softmax_scale
        self.rope = rope
        self.window = window  # a sliding window (Mistral): each token sees itself and the W − 1 before it

    def _rotate(self, query, key, cu_seqlens, holder):
        """RoPE on q [T, a, d] and k [T, g, d]; cos/sin are built once per micro-batch and kept on `holder`
        (the PackedSeqParams every layer of this forward receives)."""
        cache = getattr(holder, "_rollflow_rope", None)
        if cache is None or cache[0] != query.dtype or cache[1].shape[0] != query.shape[0]:
            pos = packed_positions(cu_seqlens.to(query.device), query.shape[0])
            cos, sin = rope_cos_sin(pos, self.rope.inv_freq(query.shape[-1], query.device), query.dtype)
            cache = (query.dtype, cos, sin)
            holder._rollflow_rope = cache
        return apply_rope(query, cache[1], cache[2]), apply_rope(key, cache[1], cache[2])

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by the packed attention")
        if packed_seq_params is not None:  # THD: query [T, a/p, d], key/value [T, g/p, d]
            if self.rope is not None:
                query, key = self._rotate(query, key, packed_seq_params.cu_seqlens_q, packed_seq_params)
            out = packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          packed_seq_params.max_seqlen_q, self.softmax_scale, self.window)
            return out.reshape(out.shape[0], -1)  # [T, a/p·d]
        # SBHD (one unpacked sequence per batch row): query [s, b, a/p, d]
        s, b = query.shape[:2]
        if self.rope is not None:
            pos = torch.arange(s, device=query.device)
            cos, sin = rope_cos_sin(pos, self.rope.inv_freq(query.shape[-1], query.device), query.dtype)
            query = apply_rope(query.reshape(s, -1, query.shape[-1]), cos, sin).reshape(query.shape)  # [s, b·a, d]
            key = apply_rope(key.reshape(s, -1, key.shape[-1]), cos, sin).reshape(key.shape)
        rep = query.shape[2] // key.shape[2]
        q = query.permute(1, 2, 0, 3)  # [b, a, s, d]
        k = key.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        mask = causal_band(s, self.window, q.device) if self.window and s > self.window else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.softmax_scale)  # [b, a, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, a/p·d]
