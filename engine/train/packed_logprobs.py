"""Per-token log-probs and entropy of a packed row from (possibly vocabulary-sharded) logits: pure tensor math.

A packed row holds S samples back to back (MicroBatch: tokens [T], cu_seqlens [S+1]). The model's output at
flat position t predicts tokens[t+1]; the MicroBatch contract wants entry t to describe tokens[t] given the
tokens before it *in the same sample*, and 0 at each sample's first token. So:

    targets[t]  = tokens[t+1]                  (the last position's target is a dummy)
    flat[t]     = pred[t-1], flat[cu[i]] = 0   (`align_to_tokens`)

With tensor parallelism each rank holds logits for vocabulary ids [start, start + V/p). The softmax needs two
sums over the whole vocabulary (Σ e^z and Σ p·z) and the target's logit, which lives on one rank: they are
combined with `reduce_sum` (forward all-reduce, backward identity: every TP rank computes the same loss, as
Megatron's `reduce_from_tensor_model_parallel_region`) and the running max with `reduce_max`. With p = 1 both
are the identity and this is log_softmax. Ids ≥ vocab_size (TP padding) get probability 0.
"""
from __future__ import annotations

from typing import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def shift_targets(tokens: torch.Tensor) -> torch.Tensor:
    """[T] → [T]: the token each flat position predicts (tokens[t+1]; the last entry repeats, never used)."""
    return torch.cat([tokens[1:], tokens[-1:]])


def align_to_tokens(pred: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] per-position values for tokens[t+1] → [T] per-token values for tokens[t]; 0 at sample starts."""
    flat = torch.cat([pred.new_zeros(1), pred[:-1]])
    starts = cu_seqlens[:-1].to(device=pred.device, dtype=torch.long)
    return flat.index_fill(0, starts, 0.0)


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                             vocab_size: int | None = None, reduce_sum: Reduce = _identity,
                             reduce_max: Reduce = _identity, entropy_grad: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets) [T], entropy [T]) from this rank's logits [T, V/p] (float32) over ids [start, start+V/p).

    entropy_grad=False computes the entropy without building its backward graph (a metric only).
    """
    T, Vl = logits.shape
    padding = None
    if vocab_size is not None and vocab_start + Vl > vocab_size:
        padding = torch.arange(vocab_start, vocab_start + Vl, device=logits.device) >= vocab_size  # [V/p]
        logits = logits.masked_fill(padding, float("-inf"))
    m = reduce_max(logits.detach().max(dim=-1).values)  # [T] global max, a constant for autograd
    z = logits - m[:, None]  # [T, V/p]
    e = z.exp()  # [T, V/p]
    sumexp = reduce_sum(e.sum(dim=-1))  # [T] Σ_v e^z over the whole vocabulary
    lse = sumexp.log()  # [T]
    local = targets - vocab_start  # [T]
    inside = (local >= 0) & (local < Vl)
    z_t = z.gather(-1, local.clamp(0, Vl - 1)[:, None]).squeeze(-1)  # [T]
    z_t = reduce_sum(torch.where(inside, z_t, torch.zeros_like(z_t)))  # [T] the target's logit, from its rank
    log_probs = z_t - lse  # [T]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # H = log Σe^z − Σ p·z = lse − (Σ e·z) / Σ e. Reduce the partial Σ e·z first and use only replicated
        # values afterwards: with an identity backward, a partial Σ p·z would miss the other ranks' share of
        # ∂H/∂(Σ e) (measured: wrong gradients at TP = 2 while the values matched).
        finite_z = z if padding is None else z.masked_fill(padding, 0.0)  # 0·(−∞) would be NaN, forward and back
        ez = reduce_sum((e * finite_z).sum(dim=-1))  # [T]
        entropy = lse - ez / sumexp  # [T]
    return log_probs, entropy


# ---- TP = 1, fused ----------------------------------------------------------------------------------------
def _log_probs_entropy(logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float, entropy_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The p = 1 case of `vocab_parallel_log_probs`, written for torch.compile: bf16 logits [T, V] are read
    in fused reductions instead of materialising fp32 [T, V] copies (each 2.5 GB at T = 4096, V = 151,936)."""
    x = logits.float() * inv_temperature  # [T, V]
    m = x.detach().amax(dim=-1, keepdim=True)  # [T, 1]
    z = x - m
    e = z.exp()
    s = e.sum(dim=-1)  # [T]
    lse = s.log()
    log_probs = z.gather(-1, targets[:, None]).squeeze(-1) - lse  # [T]
    if not entropy_grad:
        z, e, s, lse = z.detach(), e.detach(), s.detach(), lse.detach()
    entropy = lse - (e * z).sum(dim=-1) / s  # [T]
    return log_probs, entropy


_FUSED: dict = {"fn": None, "error": None}


def fused_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                    entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets) [T], entropy [T]) from unsharded logits [T, V] of any float dtype, compiled once per
    process (T dynamic). If compilation fails (no compiler or Triton on the node) it computes the same numbers with
    the eager formula, with more memory traffic, and says so once per process: a WARNING on the `rollflow` logger,
    with the reason (also kept in _FUSED)."""
    if _FUSED["error"] is None:
        if _FUSED["fn"] is None:
            _FUSED["fn"] = torch.compile(_log_probs_entropy, dynamic=False)
        torch._dynamo.mark_dynamic(logits, 0)
        torch._dynamo.mark_dynamic(targets, 0)
        try:
            return _FUSED["fn"](logits, targets, 1.0 / temperature, entropy_grad)
        except Exception as e:  # no compiler / Triton here: same numbers, more memory traffic
            import logging

            _FUSED["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            logging.getLogger("rollflow").warning(
                "the compiled log-prob kernel did not build (%s); the eager formula computes the same log-probs "
                "with fp32 [tokens, vocabulary] copies (more memory and time) for the rest of this process",
                _FUSED["error"])
    return _log_probs_entropy(logits, targets, 1.0 / temperature, entropy_grad)
