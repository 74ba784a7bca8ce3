"""Packed (varlen) forward of a transformers causal LM: log-probs and entropy of the trained tokens.

A MicroBatch is one row of S samples: `cu_seqlens` marks their boundaries and `position_ids` restart at 0 for
each, so rotary positions are per sample. Attention must never cross samples. `varlen_attention` (registered
with transformers as "rollflow_varlen") runs causal SDPA on each sample's slice of q/k/v: a row costs
Σ L_i² attention FLOPs, not the (Σ L_i)² of a dense block-diagonal mask, and no T×T mask is built (with this
implementation transformers skips its own mask creation: the name is not a mask interface). Calls pass
`use_cache=False`; note that on transformers' own sdpa path a cache disables its packed-sequence detection and
attention silently crosses samples (measured: logits off by 10 on the bundled model).

On CUDA in bf16/fp16 the per-sample loop is one flash-attention varlen kernel over the whole row
(engine/train/attention.py); fp32 and CPU keep the per-sample SDPA calls.

Logits are computed only where a trained token is predicted (loss_mask > 0): entry t (token t given the
sample's tokens before it) comes from the hidden state at t − 1, via transformers' `logits_to_keep`. Entries
with loss_mask 0 are returned as 0. On CUDA the log-softmax and entropy read the model-precision logits in one
compiled kernel (engine/train/packed_logprobs.fused_log_probs) instead of several fp32 [K, V] copies.

Invariant (tests/test_forward.py): packed log-probs equal a plain per-sample forward within 1e-5 in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.packing.microbatch import MicroBatch

VARLEN = "rollflow_varlen"


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sample. query [1, H, T, D], key/value [1, Hkv, T, D] → [1, T, H, D]."""
    if cu_seq_lens_q is None:
        raise ValueError("rollflow_varlen attention needs cu_seq_lens_q: call the model through packed_forward")
    if sliding_window:
        raise NotImplementedError("rollflow_varlen attention does not implement sliding-window layers")
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):  # one varlen flash kernel for the row
        from engine.train.attention import packed_causal_attention

        max_len = kwargs.get("max_length_q") or int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        out = packed_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                      cu_seq_lens_q, max_len, scaling)  # [T, H, D]
        return out[None], None
    # split (not slicing): its backward is one cat; slicing's backward writes a full-size zero gradient per
    # sample (3.5x slower fwd+bwd on 16 samples, measured). enable_gqa: no repeated k/v copies.
    lens = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout,
                                           enable_gqa=True)  # [1, H, L_i, D]
            for q, k, v in zip(query.split(lens, dim=2), key.split(lens, dim=2), value.split(lens, dim=2))]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def use_varlen_attention(model) -> None:
    """Register `varlen_attention` with transformers and switch `model` (a PreTrainedModel) to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    model.set_attn_implementation(VARLEN)
    if model.config._attn_implementation != VARLEN:
        raise RuntimeError(f"{type(model).__name__} cannot switch its attention implementation; packed training "
                           "needs a model that follows transformers' AttentionInterface")


def device_of(model) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def hidden_states(body, mb: MicroBatch) -> torch.Tensor:
    """[T, H] last hidden states of a packed micro-batch through a transformers base model (no LM head)."""
    dev = device_of(body)
    cu = mb.cu_seqlens.to(device=dev, dtype=torch.int32)
    out = body(input_ids=mb.tokens[None].to(dev), position_ids=mb.position_ids[None].to(dev), use_cache=False,
               cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=mb.max_seqlen, max_length_k=mb.max_seqlen)
    return out.last_hidden_state[0]


def packed_forward(model, mb: MicroBatch, *, temperature: float = 1.0, fused: bool = False,
                   entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [T], entropy [T]) at the rollout temperature, on the model's device; 0 where loss_mask is 0.

    log π(tokens[t] | sample prefix) = log_softmax(logits[t−1] / temperature)[tokens[t]];
    entropy H_t = −Σ_v p_v log p_v of that same distribution. `fused` (CUDA): one compiled kernel over the
    model-precision logits; entropy_grad=False leaves the entropy out of the backward (a metric only).
    """
    keep = (mb.loss_mask > 0).nonzero().squeeze(-1)  # [K] entries whose token is trained
    if keep.numel() and bool((mb.position_ids[keep] == 0).any()):
        raise ValueError("a sample's first token cannot be trained (nothing predicts it): fix the loss mask")
    dev = device_of(model)
    lp = torch.zeros(mb.num_tokens, device=dev)
    ent = torch.zeros(mb.num_tokens, device=dev)
    if keep.numel() == 0:
        return lp, ent
    cu = mb.cu_seqlens.to(device=dev, dtype=torch.int32)
    tokens = mb.tokens.to(dev)
    keep = keep.to(dev)
    out = model(input_ids=tokens[None], position_ids=mb.position_ids[None].to(dev), use_cache=False,
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=mb.max_seqlen, max_length_k=mb.max_seqlen,
                logits_to_keep=keep - 1)
    if fused:
        from engine.train.packed_logprobs import fused_log_probs

        tok_lp, tok_ent = fused_log_probs(out.logits[0], tokens[keep], temperature=temperature,
                                          entropy_grad=entropy_grad)  # [K] each
    else:
        logits = out.logits[0].float() / temperature  # [K, V] predicts tokens[keep]
        logp = torch.log_softmax(logits, dim=-1)  # [K, V]
        tok_lp = logp.gather(-1, tokens[keep, None]).squeeze(-1)  # [K]
        tok_ent = -(logp.exp() * logp).sum(-1)  # [K]
    return lp.index_put((keep,), tok_lp.float()), ent.index_put((keep,), tok_ent.float())
