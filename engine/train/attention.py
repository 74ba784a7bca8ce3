"""Causal attention over packed samples on the GPU: one flash-attention kernel over a flat row, no s×s mask.

A packed row holds S samples back to back; `cu_seqlens` [S+1] marks their boundaries. Attention must never cross
samples and must not build a [T, T] mask (16k tokens would be 1 GiB per head in fp32):

    CUDA, bf16/fp16   flash attention, variable length: one kernel over the flat [T, a, d] row (torch's own
                      aten flash kernels; grouped kv heads are read in place, not repeated).
    otherwise         (fp32 parity runs, CPU) scaled_dot_product_attention per sample, causal.

Used by both training backends: the torch backend's transformers attention (engine/train/forward.py) and the
Megatron backend's core attention (engine/train/megatron_attention.py). `masked_rows_attention` (attention under an
explicit mask, with Gemma 2's logit softcapping) serves the torch backend's sliding-window and softcapped layers and
the built-in engine's CUDA-graph decoder (engine/rollout/cuda_graphs.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, a, d], k/v [T, g, d] (g divides a), cu_seqlens [S+1] int32 → out [T, a, d], causal per sample; with
    `window` W a sliding window: each token sees itself and the W − 1 before it (transformers' sliding_window),
    in the flash kernel by its own window (left W − 1, right 0)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if FLASH["gqa_in_place"]:
            try:
                return _FlashVarlen.apply(q, k, v, cu, int(max_seqlen), scale, window)
            except RuntimeError as e:  # a torch whose flash kernel wants as many kv heads as q heads
                FLASH["gqa_in_place"], FLASH["error"] = False, str(e)[:200]
        rep = q.shape[1] // k.shape[1]
        return _FlashVarlen.apply(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), cu,
                                  int(max_seqlen), scale, window)
    return per_sample_attention(q, k, v, cu_seqlens, scale, window)


#: Which flash path this process uses (reported by the GPU benchmark).
FLASH: dict = {"gqa_in_place": True, "error": None}


def per_sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         scale: float, window: int | None = None) -> torch.Tensor:
    """Reference path: one causal SDPA call per sample (kv heads repeated as HF's repeat_kv), `window` as in
    packed_causal_attention (an explicit mask)."""
    rep = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qi = q[a:b].transpose(0, 1)  # [a, L, d]
        ki = k[a:b].transpose(0, 1).repeat_interleave(rep, dim=0)  # [a, L, d]
        vi = v[a:b].transpose(0, 1).repeat_interleave(rep, dim=0)  # [a, L, d]
        mask = causal_band(b - a, window, q.device) if window and b - a > window else None
        oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, is_causal=mask is None,
                                            scale=scale)[0]
        outs.append(oi.transpose(0, 1))  # [L, a, d]
    return torch.cat(outs, dim=0)


class _FlashVarlen(torch.autograd.Function):
    """aten's flash-attention varlen forward/backward (stable schema since torch 2.2; GQA native)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, scale, window=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ctx.sides = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale, **ctx.sides)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0, True, rng, unused,
            scale=ctx.scale, **ctx.sides)
        return dq, dk, dv, None, None, None, None


def causal_band(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[L, L] bool, True = key b is visible to query a: b ≤ a, and with a window W also b > a − W (transformers'
    `sliding_window_overlay`)."""
    i = torch.arange(length, device=device)
    allowed = i[None, :] <= i[:, None]
    if window:
        allowed &= i[None, :] > i[:, None] - window
    return allowed


def masked_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          scaling: float | None, dropout: float, softcap: float | None) -> torch.Tensor:
    """Attention of q [B, H, Q, D] over k/v [B, Hkv, K, D] under `mask` (bool, True = attend, broadcast to
    [B, H, Q, K]) → [B, H, Q, D]. Without `softcap` one SDPA call; with it
    the scores are capped as transformers' eager attention does (Gemma 2: softcap · tanh(scores / softcap)), which
    SDPA cannot."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, dropout_p=dropout,
                                              enable_gqa=True)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # kv head h // rep serves query head h (transformers' repeat_kv, SDPA's enable_gqa)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    # the dtype's lowest value, as transformers' eager masks: a query that sees nothing (a padding row) gets finite
    # weights, where -inf would give NaN that the next layer's K/V would carry into every row
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, v)
