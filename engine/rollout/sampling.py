"""Batched sampling on the device, reproducible per row: counter-based noise instead of one RNG per row.

Each row has its own seed (a rollout sample's sha256 seed), and a row's draw at decode step t must not depend on
what else is in the batch — that is what makes a redone rollout return the same samples. A torch.Generator per
row gives that, but draws one row at a time on the host (5.5 ms per row per token on an H200, measured). Here
every row's draw is one uniform number u = splitmix64(seed, t) / 2⁶⁴, computed for the whole batch with integer
ops on the device, and the token is the inverse CDF of the row's (filtered) distribution at u (`draw`):

    token = min{ v : Σ_{w ≤ v} p_w > u · Σ_w p_w }        (p over the vocabulary in a fixed order)

Same seed, step and logits → same token, whatever the batch. Filters: top-k keeps the k largest logits (ties at
the k-th kept), top-p keeps the smallest prefix of the sorted distribution whose mass reaches p; greedy rows
(temperature 0) take the argmax. The CPU engine draws this way too (since 2026-12-03; before, it kept a
torch.Generator per row, and CPU runs sampled other tokens for the same seeds).
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_OFFSET = _signed(0x632BE59BD9B4E019)  # any odd constant: keeps small seeds and steps away from splitmix64's fixed point


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping multiplication = arithmetic mod 2⁶⁴)."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def counter_uniform(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """[b] float64 uniforms in [0, 1), one per row: a function of (seed, step) only. `step` may be a [1] int64
    device tensor (a CUDA graph's step counter): int64 products wrap mod 2⁶⁴, the same bits as the int path."""
    mix = step.long() * _signed(0xD1B54A32D192ED03) if torch.is_tensor(step) else _signed(step * 0xD1B54A32D192ED03)
    # + _OFFSET: splitmix64's finaliser maps 0 to 0, so (seed 0, step 0) drew u = 0 (the first token of non-zero
    # probability, however unlikely) without it
    z = splitmix64(seeds.long() * _GOLDEN + mix + _OFFSET)
    return _shr(z, 11).double() * 2.0 ** -53  # the top 53 bits


#: the inverse CDF runs in two levels: block sums, then the chosen block (no full-vocabulary fp64 cumsum)
BLOCK = 2048


def draw(logits: torch.Tensor, *, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
         uniforms: torch.Tensor, filters: tuple[bool, int, bool] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [b] drawn from fp32 logits [b, V], and their log-probs [b] = log softmax(logits / T) at the drawn
    token (T = 1 when greedy; before any filter, as SGLang returns them). Per row: temperature [b] (0 = greedy),
    top_p [b] (1 = off), top_k [b] (≤ 0 = off), uniforms [b] in [0, 1). `filters` = (any row uses top-k, the
    largest such k, any row uses top-p) when the caller knows them (a CUDA graph: no host reads inside); else they
    are read from the tensors.

    The filters only zero probabilities; the inverse CDF always runs in vocabulary order, so a row's token never
    depends on whether another row of the batch asked for a filter (sorting would reorder every row). It runs in
    two levels, both in float64: the sums of blocks of `BLOCK` tokens, then the cumulative sum inside the block the
    target falls in; a token of zero probability (filtered out) is never drawn. The unnormalised exp(x - max)
    serves both the draw and the log-probs: a few passes over [b, V] instead of a softmax, a full fp64 cumsum and
    a separate log-softmax (measured at 512 rows on an H200: bench/results/gpu_engine_profile.md).
    """
    b, V = logits.shape
    greedy = temperature <= 0  # [b]
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]  # [b, V]
    m, arg = x.max(-1)  # [b]; arg: the greedy token (x = logits on greedy rows)
    e = torch.exp(x - m[:, None])  # [b, V] in (0, 1]
    use_k = (top_k > 0) & (top_k < V)  # [b]
    any_k, kmax, any_p = filters if filters is not None else (bool(use_k.any()), None, bool((top_p < 1).any()))
    full = V - V % BLOCK  # whole blocks; the rest is one short block
    nb = full // BLOCK + (full < V)

    def block_sums(w: torch.Tensor) -> torch.Tensor:  # [b, nb] float64
        s = w[:, :full].view(b, full // BLOCK, BLOCK).sum(-1, dtype=torch.float64)
        return torch.cat([s, w[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], 1) if full < V else s

    sums = block_sums(e)
    lse = m.double() + sums.sum(-1).log()  # [b] log Σ exp(x): the unfiltered normaliser
    if any_k:  # keep logits ≥ the row's k-th largest (ties at it are kept)
        kmax = kmax or int(top_k[use_k].max())
        k = torch.where(use_k, top_k, torch.ones_like(top_k)).clamp(max=kmax)  # [b]
        kth = x.topk(kmax, dim=-1).values.gather(-1, (k - 1)[:, None])  # [b, 1]
        e = e.masked_fill(use_k[:, None] & (x < kth), 0.0)
    use_p = top_p < 1  # [b]
    if any_p:  # keep p ≥ the smallest probability of the smallest prefix (sorted) with mass ≥ top_p
        se = e.sort(dim=-1, descending=True).values  # [b, V]
        kept = ((se.cumsum(-1) - se) <= top_p[:, None] * se.sum(-1, keepdim=True)).sum(-1)  # [b] ≥ 1
        cut = se.gather(-1, (kept - 1)[:, None])  # [b, 1]
        e = e.masked_fill(use_p[:, None] & (e < cut), 0.0)
    if any_k or any_p:
        sums = block_sums(e)
    cum = sums.cumsum(-1)  # [b, nb]
    target = uniforms.double() * cum[:, -1]  # [b] in [0, total)
    blk = torch.searchsorted(cum, target[:, None], right=True).clamp(max=nb - 1)  # [b, 1]: first cum > target
    before = cum.gather(-1, (blk - 1).clamp(min=0)).masked_fill(blk == 0, 0.0)  # [b, 1] mass of earlier blocks
    rem = target[:, None] - before
    idx = blk * BLOCK + torch.arange(BLOCK, device=logits.device)  # [b, BLOCK]
    w = e.gather(-1, idx.clamp(max=V - 1)).masked_fill(idx >= V, 0.0)  # [b, BLOCK] the chosen block
    j = torch.searchsorted(w.double().cumsum(-1), rem, right=True)  # [b, 1]
    last = torch.where(w > 0, torch.arange(BLOCK, device=logits.device), 0).amax(-1, keepdim=True)
    tokens = torch.where(greedy, arg, (blk * BLOCK + torch.minimum(j, last)).squeeze(-1))  # rounding: never p = 0
    logprobs = (x.gather(-1, tokens[:, None]).squeeze(-1).double() - lse).float()
    return tokens, logprobs


def sample_tokens(logits: torch.Tensor, *, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  uniforms: torch.Tensor, filters: tuple[bool, int, bool] | None = None) -> torch.Tensor:
    """The tokens of `draw` alone."""
    return draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, uniforms=uniforms, filters=filters)[0]
