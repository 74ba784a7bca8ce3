"""Per-sample views of a packed row: flat [T] token tensors ⇄ [S, Lmax] rows, per-sample sums and means.

A packed micro-batch concatenates S samples into T tokens; `cu_seqlens` [S+1] holds the boundaries
(sample i is tokens cu[i]..cu[i+1]-1). Rows are right-padded with zeros: for every sequence recursion
used here (discounted returns, GAE) a zero reward and a zero value past a row's end is exactly the
terminal state, so padding never changes a real token's result.
"""
from __future__ import annotations

import torch


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the sample each flat token belongs to. cu = [0, 3, 5] → [0, 0, 0, 1, 1]."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)


def sample_sums(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[S] Σ of x over each sample's tokens (differentiable in x)."""
    num = cu_seqlens.numel() - 1
    return torch.zeros(num, dtype=x.dtype, device=x.device).index_add(0, segment_ids(cu_seqlens), x)


def per_sample_mean(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[S] masked mean of x over each sample's tokens; 0 for a sample without a trained token."""
    return sample_sums(x * mask, cu_seqlens) / sample_sums(mask, cu_seqlens).clamp(min=1)


def to_rows(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] → [S, Lmax], sample i in row i from column 0, zeros after its end."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
    S, L = lens.numel(), int(lens.max()) if lens.numel() else 0
    col = torch.arange(x.numel(), device=x.device) - cu_seqlens[:-1].long()[segment_ids(cu_seqlens)]  # [T]
    out = torch.zeros((S, L), dtype=x.dtype, device=x.device)
    return out.index_put((segment_ids(cu_seqlens), col), x)


def from_rows(rows: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[S, Lmax] → [T], the inverse of `to_rows` (padding dropped)."""
    seg = segment_ids(cu_seqlens)
    col = torch.arange(seg.numel(), device=rows.device) - cu_seqlens[:-1].long()[seg]  # [T]
    return rows[seg, col]


def response_spans(cu_seqlens: torch.Tensor, response_lengths: list[int]) -> list[tuple[int, int]]:
    """Each sample's response tokens, (start, end) in the flat row: its last R_i tokens. cu = [0, 3, 5], R = [2, 1]
    → [(1, 3), (4, 5)]."""
    return [(int(e) - r, int(e)) for e, r in zip(cu_seqlens[1:].tolist(), response_lengths)]
