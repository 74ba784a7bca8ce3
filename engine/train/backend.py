"""The interface every training backend implements (torch now, megatron on GPU)."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.packing.microbatch import MicroBatch


class TrainBackend(Protocol):
    def compute_log_probs(self, mbs: list[MicroBatch], *, ref: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs [T] of each micro-batch under the policy (or the frozen reference)."""

    def train_step(self, mbs: list[MicroBatch], old_log_probs: list[torch.Tensor],
                   ref_log_probs: list[torch.Tensor] | None, global_batch_size: int) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns partial sums for the step's metrics."""

    def model_state(self) -> dict[str, torch.Tensor]:
        """HF-named weights (for weight sync and HF export)."""

    def save(self, path: str, *, save_optim: bool = True) -> list[str]:
        """Write model/ (and optim/ unless save_optim=False) under `path`; return the files written."""

    def load(self, path: str, *, load_optim: bool = True) -> None:
        """Restore what `save` wrote."""

    def load_weights(self, path: str, *, ref: bool = False) -> None:
        """Policy (or reference) weights only, from a Hugging Face directory or a checkpoint iteration."""

    def export_hf(self, path: str) -> None:
        """Save a Hugging Face directory (config, weights, tokenizer) loadable by transformers."""


def reduce_metrics(parts: list[dict[str, Any]]) -> dict[str, float]:
    """Combine per-rank partial sums: `<name>_sum` / `<name>_count` pairs become means; others are maxed."""
    out: dict[str, float] = {}
    keys = {k for p in parts for k in p}
    for k in keys:
        if k.endswith("_sum"):
            name = k[: -len("_sum")]
            total = sum(p.get(k, 0.0) for p in parts)
            count = sum(p.get(name + "_count", 0.0) for p in parts)
            out[name] = total / count if count else 0.0
        elif not k.endswith("_count"):
            out[k] = max(float(p[k]) for p in parts if k in p)
    return out
