"""Causal attention over packed samples, for Megatron's core-attention slot when Transformer Engine is absent.

Megatron's own `DotProductAttention` materialises the [b·a, s, s] score matrix and rejects packed (THD) input;
in our probe it ran a 1.5B shape at 23.5% MFU. This module keeps Megatron's QKV / RoPE / output projection
and replaces only the softmax(QKᵀ)V core:

    CUDA, bf16/fp16   flash attention, variable length: one kernel over the flat [T, a, d] row, cu_seqlens
                      marks the samples, so attention never crosses a sample and nothing s×s is stored.
                      (torch's own aten flash kernels; grouped kv heads are read in place, not repeated.)
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


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float | None = None) -> torch.Tensor:
    """q [T, a, d], k/v [T, g, d] (g divides a), cu_seqlens [S+1] int32 → out [T, a, d], causal per sample."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if FLASH["gqa_in_place"]:
            try:
                return _FlashVarlen.apply(q, k, v, cu, int(max_seqlen), scale)
            except RuntimeError as e:  # a torch whose flash kernel wants as many kv heads as q heads
                FLASH["gqa_in_place"], FLASH["error"] = False, str(e)[:200]
        rep = q.shape[1] // k.shape[1]
        return _FlashVarlen.apply(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), cu,
                                  int(max_seqlen), scale)
    return per_sample_attention(q, k, v, cu_seqlens, scale)


#: Which flash path this process uses (reported by the GPU benchmark).
FLASH: dict = {"gqa_in_place": True, "error": None}


def per_sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Reference path: one causal SDPA call per sample (kv heads repeated as HF's repeat_kv)."""
    rep = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qi = q[a:b].transpose(0, 1)  # [a, L, d]
        ki = k[a:b].transpose(0, 1).repeat_interleave(rep, dim=0)  # [a, L, d]
        vi = v[a:b].transpose(0, 1).repeat_interleave(rep, dim=0)  # [a, L, d]
        oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True, scale=scale)[0]
        outs.append(oi.transpose(0, 1))  # [L, a, d]
    return torch.cat(outs, dim=0)


class _FlashVarlen(torch.autograd.Function):
    """aten's flash-attention varlen forward/backward (stable schema since torch 2.2; GQA native)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0, True, rng, unused,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


class PackedCoreAttention(torch.nn.Module):
    """Drop-in for megatron-core's `core_attention` submodule (same constructor and forward signature)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None, rope: Rope | None = None, **_unused):
        super().__init__()
        if getattr(config, "context_parallel_size", 1) != 1:
            raise NotImplementedError("context parallelism needs Transformer Engine's attention")
        if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
            raise NotImplementedError("attention dropout is not supported by the packed attention (RL uses 0)")
        self.config = config
        self.softmax_scale = softmax_scale
        self.rope = rope

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
                                          packed_seq_params.max_seqlen_q, self.softmax_scale)
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
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)  # [b, a, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, a/p·d]
