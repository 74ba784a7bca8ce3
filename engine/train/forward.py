"""Packed (varlen) forward of a transformers causal LM: log-probs and entropy of the trained tokens.

A MicroBatch is one row of S samples: `cu_seqlens` marks their boundaries and `position_ids` restart at 0 for
each, so rotary positions are per sample. Attention must never cross samples. `varlen_attention` (registered
with transformers as "rollflow_varlen") runs causal SDPA on each sample's slice of q/k/v: a row costs
Σ L_i² attention FLOPs, not the (Σ L_i)² of a dense block-diagonal mask, and no T×T mask is built (with this
implementation transformers skips its own mask creation: the name is not a mask interface). Calls pass
`use_cache=False`; note that on transformers' own sdpa path a cache disables its packed-sequence detection and
attention silently crosses samples (measured: logits off by 10 on the bundled model).

On CUDA in bf16/fp16 the row is one flash-attention varlen kernel (engine/train/attention.py). Elsewhere the
samples of similar length become padded rows and one SDPA call (`padded_is_cheaper`); a row of very different
lengths keeps one SDPA call per sample, whose cost stays Σ L_i². Sliding-window layers (where a sample is longer
than the window) take the flash kernel's own window on CUDA in bf16/fp16, else the same two layouts with an explicit
mask; attention-logit softcapping (Gemma 2) always takes the explicit mask and scores (`masked_rows_attention`).

Logits are computed only where a trained token is predicted (loss_mask > 0): entry t (token t given the
sample's tokens before it) comes from the hidden state at t − 1, via transformers' `logits_to_keep`. Entries
with loss_mask 0 are returned as 0. On CUDA the log-softmax and entropy read the model-precision logits in one
compiled kernel (engine/train/packed_logprobs.fused_log_probs) instead of several fp32 [K, V] copies.

Shared prompts (`share_prefix`, --train-share-prefix): the n samples of a GRPO group repeat one prompt. Samples
whose tokens before their first trained token are the same (the prompt) form a group, laid out as the prompt once,
then each sample's remaining tokens (positions continue after the prompt); a sample's tokens attend to the prompt
and to their own earlier tokens only (`shared_prefix_attention`). A causal model's hidden states of the prompt do
not depend on what follows, so the log-probs are the same function of the weights and the gradient is the same
sum; the prompt's forward and backward run once per group instead of once per sample (the CPU demo: 16 samples of
~28 tokens, 450 tokens per micro-batch, become ~100).

Invariant (tests/test_forward.py): packed log-probs equal a plain per-sample forward within 1e-5 in float32, with
and without shared prompts (values and gradients).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from engine.packing.microbatch import MicroBatch
from engine.train.attention import causal_band, masked_rows_attention

VARLEN = "rollflow_varlen"


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sample. query [1, H, T, D], key/value [1, Hkv, T, D] → [1, T, H, D].
    A sliding-window layer (`sliding_window` W: a token sees itself and the W − 1 before it, as transformers'
    masks) takes the flash kernel's window on CUDA, else `masked_rows_attention`, as softcapping (`softcap`, Gemma
    2) always does; a window longer than every sample changes nothing and is left out."""
    softcap = kwargs.get("softcap")
    shared = kwargs.get("rollflow_shared")
    if shared is not None:  # a micro-batch laid out with shared prompts (shared_layout)
        return shared_prefix_attention(query, key, value, shared, scaling, dropout, sliding_window, softcap), None
    if cu_seq_lens_q is None:
        raise ValueError("rollflow_varlen attention needs cu_seq_lens_q: call the model through packed_forward")
    max_len = kwargs.get("max_length_q") or int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    window = sliding_window if sliding_window and max_len > sliding_window else None
    plain = window is None and softcap is None
    if softcap is None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):  # one flash kernel
        from engine.train.attention import packed_causal_attention  # (a window: the kernel's own)

        out = packed_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                      cu_seq_lens_q, max_len, scaling, window)  # [T, H, D]
        return out[None], None
    lens_t = cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]
    lens = lens_t.tolist()
    if padded_is_cheaper(lens):
        mask = None if plain else causal_band(max(lens), window, query.device)[None, None]
        return padded_attention(query, key, value, cu_seq_lens_q, lens_t, scaling, dropout, mask, softcap), None
    # split (not slicing): its backward is one cat; slicing's backward writes a full-size zero gradient per
    # sample (3.5x slower fwd+bwd on 16 samples, measured). enable_gqa: no repeated k/v copies.
    outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout,
                                           enable_gqa=True) if plain  # [1, H, L_i, D]
            else masked_rows_attention(q, k, v, causal_band(q.shape[2], window, q.device)[None, None], scaling,
                                       dropout, softcap)
            for q, k, v in zip(query.split(lens, dim=2), key.split(lens, dim=2), value.split(lens, dim=2))]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


#: padded rows are used while S · L_max² ≤ PAD_FACTOR · Σ L_i² (their wasted attention FLOPs stay below this factor)
PAD_FACTOR = 2.0


def padded_is_cheaper(lens: list[int]) -> bool:
    """One SDPA call over padded rows beats one call per sample when the rows are of similar length: on the CPU
    demo's micro-batches (16 samples of 20–30 tokens) fwd+bwd of the model took 70 ms against 77 ms (1 thread,
    measured); a row of very different lengths would waste up to S× the attention FLOPs, so it keeps the loop."""
    if len(lens) < 2:
        return False
    return len(lens) * max(lens) ** 2 <= PAD_FACTOR * sum(n * n for n in lens)


def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
                     lens: torch.Tensor, scaling: float | None, dropout: float,
                     mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """The packed row's segments (cu, lens) as S padded rows [S, H, L_max, D], one SDPA call, back to [1, T, H, D].
    Causal without `mask` (padding sits after each segment's tokens, so it is never read for a real token); else
    `mask` [S or 1, 1, L_max, L_max] (True = attend) decides, and `softcap` caps the scores
    (`masked_rows_attention`)."""
    S, lmax, T = lens.numel(), int(lens.max()), query.shape[2]
    dev = query.device
    seg = torch.repeat_interleave(torch.arange(S, device=dev), lens.to(dev))  # [T] sample of each token
    flat = seg * lmax + (torch.arange(T, device=dev) - cu.to(dev).long()[seg])  # [T] its slot in [S·L_max]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] → [S, H, L_max, D]
        h, d = x.shape[1], x.shape[3]
        rows = x.new_zeros(S * lmax, h, d).index_copy(0, flat, x[0].transpose(0, 1))
        return rows.view(S, lmax, h, d).transpose(1, 2)

    if mask is None and softcap is None:
        out = F.scaled_dot_product_attention(pad(query), pad(key), pad(value), is_causal=True, scale=scaling,
                                             dropout_p=dropout, enable_gqa=True)  # [S, H, L_max, D]
    else:
        mask = causal_band(lmax, None, dev)[None, None] if mask is None else mask
        out = masked_rows_attention(pad(query), pad(key), pad(value), mask, scaling, dropout, softcap)
    out = out.transpose(1, 2).reshape(S * lmax, out.shape[1], out.shape[3])
    return out.index_select(0, flat)[None]  # [1, T, H, D]


@dataclass
class SharedLayout:
    """A micro-batch with each group's prompt laid out once: `rows` groups, each [prompt, suffix 1, suffix 2, …]."""
    tokens: torch.Tensor  # [T'] the compact row
    position_ids: torch.Tensor  # [T'] prompt 0..p-1, every suffix continuing at p
    src: torch.Tensor  # [K] compact index of the hidden state that predicts each kept entry (keep's order)
    cu: torch.Tensor  # [G+1] int32 group boundaries in the compact row
    seg: torch.Tensor  # [T'] 0 on a group's prompt, j + 1 on its j-th suffix
    original_tokens: int = 0  # T of the micro-batch it replaces
    origin: torch.Tensor | None = None  # [T'] each compact token's index in the micro-batch's row
    _mask: dict = field(default_factory=dict)  # (device, window) → [G, 1, L_max, L_max] bool, built once per forward

    def mask(self, device: torch.device, window: int | None = None) -> torch.Tensor:
        """allowed[g, a, b]: compact token b is visible to token a of group g (b ≤ a, and b on the prompt or on
        a's own suffix; with a sliding window W also position(b) > position(a) − W); padding rows see only
        themselves (no NaN rows in the softmax or its backward)."""
        if window and int(self.position_ids.max()) < window:
            window = None  # no token is W positions from another: the window changes nothing
        key = (str(device), window)
        if key not in self._mask:
            lens = (self.cu[1:] - self.cu[:-1]).long()
            G, lmax = lens.numel(), int(lens.max())
            seg = torch.full((G, lmax), -1, dtype=torch.long)
            pos = torch.zeros((G, lmax), dtype=torch.long)
            for g in range(G):
                a, b = int(self.cu[g]), int(self.cu[g + 1])
                seg[g, :b - a], pos[g, :b - a] = self.seg[a:b], self.position_ids[a:b]
            a = torch.arange(lmax)
            causal = a[None, :] <= a[:, None]  # [a, b]
            same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # [G, a, b]
            valid = seg >= 0  # [G, L]
            allowed = causal[None] & same & valid[:, None, :] & valid[:, :, None]
            if window:
                allowed &= pos[:, None, :] > pos[:, :, None] - window
            allowed |= torch.eye(lmax, dtype=torch.bool)[None] & ~valid[:, :, None]
            self._mask[key] = allowed[:, None].to(device)
        return self._mask[key]


#: shared prompts are used when the compact row is at most this share of the micro-batch's tokens
SHARE_MIN_SAVING = 0.8


def shared_layout(mb: MicroBatch, keep: torch.Tensor) -> SharedLayout | None:
    """The compact layout of `mb` (keep: its trained entries, sorted), or None when no two samples share a prompt.

    A sample's prompt is everything before its first trained token; samples with the same prompt tokens (and
    starting position) form a group. Samples without a trained token are left out (nothing of theirs is read).
    """
    if keep.numel() == 0:
        return None
    cu = mb.cu_seqlens.long()
    sample = torch.searchsorted(cu, keep, right=True) - 1  # [K] sample of each kept entry
    offset = keep - cu[sample]  # [K] its position in the sample
    S = cu.numel() - 1
    first = torch.full((S,), -1, dtype=torch.long)
    first.scatter_reduce_(0, sample, offset, reduce="amin", include_self=False)
    groups: dict[tuple, list[int]] = {}
    for i in sample.unique_consecutive().tolist():
        a, p = int(cu[i]), int(first[i])
        key = (p, int(mb.position_ids[a]), tuple(mb.tokens[a:a + p].tolist()))
        groups.setdefault(key, []).append(i)
    if len(groups) == sample.unique_consecutive().numel():
        return None  # no prompt is shared
    toks, pos, segs, cu_c, origin = [], [], [], [0], []
    base = torch.empty(S, dtype=torch.long)  # compact index of sample i's first suffix token
    last = torch.empty(S, dtype=torch.long)  # compact index of its prompt's last token
    prompt_len = torch.empty(S, dtype=torch.long)
    for (p, _, _), members in groups.items():
        a0 = int(cu[members[0]])
        start = cu_c[-1]
        toks.append(mb.tokens[a0:a0 + p])
        pos.append(mb.position_ids[a0:a0 + p])
        origin.append(torch.arange(a0, a0 + p))
        segs.append(torch.zeros(p, dtype=torch.long))
        n = p
        for j, i in enumerate(members):
            a, e = int(cu[i]), int(cu[i + 1])
            base[i], last[i], prompt_len[i] = start + n, start + p - 1, p
            toks.append(mb.tokens[a + p:e])
            pos.append(mb.position_ids[a + p:e])
            origin.append(torch.arange(a + p, e))
            segs.append(torch.full((e - a - p,), j + 1, dtype=torch.long))
            n += e - a - p
        cu_c.append(start + n)
    if cu_c[-1] > SHARE_MIN_SAVING * mb.num_tokens:
        return None
    # entry t of sample i is predicted by the hidden state at t - 1: the prompt's last token when t = p
    src = torch.where(offset == prompt_len[sample], last[sample], base[sample] + offset - 1 - prompt_len[sample])
    return SharedLayout(tokens=torch.cat(toks), position_ids=torch.cat(pos), src=src,
                        cu=torch.tensor(cu_c, dtype=torch.int32), seg=torch.cat(segs),
                        original_tokens=mb.num_tokens, origin=torch.cat(origin))


def shared_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SharedLayout,
                            scaling: float | None, dropout: float, sliding_window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Attention over a SharedLayout row: each group a padded row, one SDPA call with the layout's mask.
    query [1, H, T', D], key/value [1, Hkv, T', D] → [1, T', H, D]."""
    dev = query.device
    cu = layout.cu.to(dev).long()
    return padded_attention(query, key, value, cu, cu[1:] - cu[:-1], scaling, dropout,
                            mask=layout.mask(dev, sliding_window), softcap=softcap)


def use_varlen_attention(model) -> None:
    """Switch `model` to `varlen_attention`: rollflow's native model takes the function; a transformers
    PreTrainedModel gets it registered with transformers' AttentionInterface."""
    from engine.native_model import NativeCausalLM

    if isinstance(model, NativeCausalLM):
        model.set_attention(VARLEN, varlen_attention)
        return
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


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, fused: bool,
                    entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets) [K], entropy [K]) from logits [K, V] at the rollout temperature."""
    if fused:
        from engine.train.packed_logprobs import fused_log_probs

        return fused_log_probs(logits, targets, temperature=temperature, entropy_grad=entropy_grad)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [K, V]
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)  # [K], [K]


def recomputed_log_probs(logits: torch.Tensor, targets: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """--recompute-loss-function: token_log_probs (or any `fn=` of the same signature) whose backward keeps only
    the logits, recomputing the log-softmax and entropy from them there, instead of their [K, V] float32
    intermediates. The same numbers and gradients."""
    fn = kw.pop("fn", token_log_probs)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return fn(logits, targets, **kw)
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):  # the recomputation runs whole (a compiled kernel cannot stop early)
        return checkpoint(partial(fn, **kw), logits, targets, use_reentrant=False)


def check_recompute_loss(fused: bool) -> None:
    """--recompute-loss-function where the log-probs run in the fused kernel (CUDA at TP = 1): that kernel's backward
    already keeps only the logits and recomputes the rest, so the flag would change nothing — refused (measured: the
    same peak memory on both backends, bench/results/loss_memory_gpu.md)."""
    if fused:
        raise ValueError("--recompute-loss-function: on CUDA at tensor parallel size 1 the log-probs run in the fused "
                         "kernel (engine/train/packed_logprobs.py: fused_log_probs), whose backward already keeps only "
                         "the logits, so the flag would change nothing (bench/results/loss_memory_gpu.md); drop it, "
                         "or use --log-probs-chunk-size N, which does not keep the logits either")


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk: int,
                      temperature: float, fused: bool, entropy_grad: bool = True,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """--log-probs-chunk-size: (log p(targets) [K], entropy [K]) from the hidden states [K, H] and the LM head's
    weight [V, H], `chunk` positions at a time. The [chunk, V] logits of one chunk exist at a time: in a backward
    each chunk's are recomputed from its hidden states (activation checkpointing), so the [K, V] logits and their
    gradient are never held whole. Same numbers as the whole head up to the matrix product's rounding."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    def part(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_log_probs(F.linear(h, weight, bias), t, temperature=temperature, fused=fused,
                               entropy_grad=entropy_grad)

    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s:s + chunk], targets[s:s + chunk]  # [c, H], [c]
        if grad:  # the recomputation runs `part` whole: stopping it early raises through the compiled kernel
            with set_checkpoint_early_stop(False):
                lp, ent = checkpoint(part, h, t, use_reentrant=False)
        else:
            lp, ent = part(h, t)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


def check_chunkable(model) -> str | None:
    """Why --log-probs-chunk-size cannot run on this model (None: it can): the chunks apply the LM head's linear
    map themselves, so a model whose logits are more than that map (softcapping, a logit scale) is refused."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        return f"{type(model).__name__} has no linear lm_head"
    config = getattr(model, "config", None)
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"its config sets {key} = {getattr(config, key)!r}, which the LM head's linear map leaves out"
    return None


class _HeadAsLogProbs:
    """While active, the model's lm_head returns [1, K, 2]: (log p(targets), entropy) per kept position, computed
    chunk by chunk from its input (chunked_log_probs), instead of the [1, K, V] logits. It replaces the head's
    forward only (an instance attribute), inside the model's own forward, so FSDP2's root hooks have gathered the
    head's weight as for any forward."""

    def __init__(self, head: torch.nn.Linear, targets: torch.Tensor, **kw):
        self.head, self.targets, self.kw = head, targets, kw

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [1, K, H] → [1, K, 2]
        lp, ent = chunked_log_probs(hidden[0], self.head.weight, self.targets, bias=self.head.bias, **self.kw)
        return torch.stack([lp.float(), ent.float()], dim=-1)[None]

    def __enter__(self):
        self.head.forward = self.forward
        return self

    def __exit__(self, *exc):
        del self.head.forward  # the class's forward again


def forward_layout(mb: MicroBatch, share_prefix: bool) -> SharedLayout | None:
    """The shared-prompt layout packed_forward runs `mb` in (None: its own packed row)."""
    keep = (mb.loss_mask > 0).nonzero().squeeze(-1)
    return shared_layout(mb, keep) if share_prefix and keep.numel() else None


def packed_forward(model, mb: MicroBatch, *, temperature: float = 1.0, fused: bool = False,
                   entropy_grad: bool = True, share_prefix: bool = False, chunk: int = 0,
                   recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [T], entropy [T]) at the rollout temperature, on the model's device; 0 where loss_mask is 0.

    log π(tokens[t] | sample prefix) = log_softmax(logits[t−1] / temperature)[tokens[t]];
    entropy H_t = −Σ_v p_v log p_v of that same distribution. `fused` (CUDA): one compiled kernel over the
    model-precision logits; entropy_grad=False leaves the entropy out of the backward (a metric only).
    share_prefix: the samples' shared prompts run once (shared_layout), where any are shared.
    chunk > 0 (--log-probs-chunk-size): the LM head and the log-softmax run `chunk` trained positions at a time
    (chunked_log_probs), for memory; the model must pass check_chunkable. recompute (--recompute-loss-function):
    the log-softmax over the vocabulary is recomputed in the backward from the logits (recomputed_log_probs).
    """
    keep = (mb.loss_mask > 0).nonzero().squeeze(-1)  # [K] entries whose token is trained
    if keep.numel() and bool((mb.position_ids[keep] == 0).any()):
        raise ValueError("a sample's first token cannot be trained (nothing predicts it): fix the loss mask")
    dev = device_of(model)
    lp = torch.zeros(mb.num_tokens, device=dev)
    ent = torch.zeros(mb.num_tokens, device=dev)
    if keep.numel() == 0:
        return lp, ent
    layout = shared_layout(mb, keep) if share_prefix else None
    tokens = mb.tokens.to(dev)
    head = (_HeadAsLogProbs(model.lm_head, tokens[keep.to(dev)], chunk=chunk, temperature=temperature, fused=fused,
                            entropy_grad=entropy_grad) if chunk > 0 else nullcontext())
    with head:
        out = _run_model(model, mb, keep, layout, tokens, dev)
    keep = keep.to(dev)
    if chunk > 0:
        tok_lp, tok_ent = out.logits[0, :, 0], out.logits[0, :, 1]  # [K] each
    else:
        # [K] each: out.logits[0] predicts tokens[keep]
        tok_lp, tok_ent = (recomputed_log_probs if recompute else token_log_probs)(
            out.logits[0], tokens[keep], temperature=temperature, fused=fused, entropy_grad=entropy_grad)
    return lp.index_put((keep,), tok_lp.float()), ent.index_put((keep,), tok_ent.float())


def _run_model(model, mb: MicroBatch, keep: torch.Tensor, layout: SharedLayout | None, tokens: torch.Tensor,
               dev: torch.device):
    """The model's output at the positions that predict tokens[keep] (packed, or with shared prompts)."""
    if layout is not None:
        cu = layout.cu.to(device=dev)
        lmax = int((layout.cu[1:] - layout.cu[:-1]).max())
        return model(input_ids=layout.tokens[None].to(dev), position_ids=layout.position_ids[None].to(dev),
                     use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=lmax, max_length_k=lmax,
                     logits_to_keep=layout.src.to(dev), rollflow_shared=layout)
    cu = mb.cu_seqlens.to(device=dev, dtype=torch.int32)
    return model(input_ids=tokens[None], position_ids=mb.position_ids[None].to(dev), use_cache=False,
                 cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=mb.max_seqlen, max_length_k=mb.max_seqlen,
                 logits_to_keep=keep.to(dev) - 1)
