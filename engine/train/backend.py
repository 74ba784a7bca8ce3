"""The interface every training backend implements (torch now, megatron on GPU), and the metric reduction.

Division of work (engine.train.worker drives it, one worker per DP rank):
  worker   old / ref log-probs (backend.compute_log_probs) and critic values, then the advantages
           (engine.algorithms.compute_advantages: the one estimator dispatch) written into mb.advantages,
           whitening over all ranks, the global trained-token count of each step
  backend  the forward, `engine.algorithms.step_objective` (the --loss-type's) per micro-batch, gradient sync
           over DP, clipping, the RF13 NaN policy, the optimizer step; state save / load / HF export
Log-prob tensors are [T], aligned with the micro-batch's flat tokens; entries with loss_mask 0 are not used by
anything (the torch backend leaves them 0).
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from engine.algorithms import StepHooks
from engine.packing.microbatch import MicroBatch


#: --train-backend → the module whose `create(cfg, *, rank, world_size, master, train_iters, device)` builds it;
#: a third backend is one module implementing TrainBackend, and one line here.
BACKENDS = {"torch": "engine.train.torch_backend", "megatron": "engine.train.megatron_backend"}


def create_backend(cfg, *, rank: int, world_size: int, master: str | None, train_iters: int,
                   device: str) -> "TrainBackend":
    """The --train-backend's backend for one rank (the one place the backend's name is looked at)."""
    return importlib.import_module(BACKENDS[cfg.train_backend]).create(
        cfg, rank=rank, world_size=world_size, master=master, train_iters=train_iters, device=device)


def step_hooks(cfg) -> StepHooks:
    """The train step's user functions (engine.algorithms.StepHooks), each (the function, its path, the run's
    config as its args) where its flag is set: --custom-loss-function-path (set exactly with --loss-type
    custom_loss: the config checks), --custom-tis-function-path, --custom-pg-loss-reducer-function-path."""
    from engine.rewards import load_function

    def hook(field: str):
        path = getattr(cfg, field)
        return (load_function(path, "--" + field.replace("_", "-")), path, cfg) if path else None

    return StepHooks(custom_loss=hook("custom_loss_function_path"), tis=hook("custom_tis_function_path"),
                     pg_reducer=hook("custom_pg_loss_reducer_function_path"))


class TrainBackend(Protocol):
    #: the weights are sharded over ranks: model_state / save / export / ipc_export are collectives every rank joins
    collective: bool
    #: whether this rank's metric sums count (TP peers and earlier PP stages of a replica would count twice)
    reports_metrics: bool

    def dp_all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Σ ("sum") or max ("max") of a CPU tensor over the data-parallel ranks, returned on the CPU."""

    def compute_log_probs(self, mbs: list[MicroBatch], *, ref: bool = False, teacher: bool = False,
                          with_entropy: bool = False):
        """Per-token log-probs [T] of each micro-batch under the policy (or the frozen reference, or the
        --use-opd --opd-type megatron teacher), no grad, at the rollout temperature; with_entropy
        (--use-rollout-entropy): (those, the per-token entropies [T] of the same forward), 0 off the loss mask."""

    def train_step(self, mbs: list[MicroBatch], old_log_probs: list[torch.Tensor],
                   ref_log_probs: list[torch.Tensor] | None, global_batch_size: int, *,
                   global_tokens: float | None = None) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches (advantages in mb.advantages). global_batch_size is
        G (samples of the step over all ranks); global_tokens the step's trained tokens over all ranks (needed by
        --calculate-per-token-loss). Returns partial sums for `reduce_metrics` plus `loss_total` (this rank's
        share of the step loss), `grad_norm`, `lr`, `skipped` (0/1), `skipped_steps_total`, `ratio_maxdev`."""

    def model_state(self) -> dict[str, torch.Tensor]:
        """HF-named weights (for weight sync and HF export)."""

    def engine_state(self) -> dict[str, torch.Tensor]:
        """`model_state` under the names of the model's checkpoint files, as the engines load it (weight sync;
        engine/weights/layout.py: transformers 5 fuses a mixture of experts in memory, SGLang loads per expert)."""

    def save(self, path: str, *, save_optim: bool = True) -> list[str]:
        """Write model/ (and optim/ unless save_optim=False) under `path`; return the files written."""

    def load(self, path: str, *, load_optim: bool = True) -> None:
        """Restore what `save` wrote."""

    def load_weights(self, path: str, *, ref: bool = False) -> None:
        """Policy (or reference) weights only, from a Hugging Face directory or a checkpoint iteration."""

    def update_ref(self) -> None:
        """--ref-update-interval: the reference takes the policy's current weights."""

    def reset_optimizer(self) -> None:
        """--reset-optimizer-states: Adam's moments and step counts to zero (the LR schedule goes on)."""

    def export_hf(self, path: str) -> None:
        """Save a Hugging Face directory (config, weights, tokenizer) loadable by transformers."""

    def onload(self) -> None:
        """Back to the GPU after `offload` (a no-op when nothing was offloaded)."""

    def offload(self) -> None:
        """--offload-train: weights, gradients and optimizer state to host memory until `onload`."""

    def ipc_export(self, dtype: str, bucket_bytes: int, *, export: bool):
        """This rank's share of the HF-named weights as CUDA IPC buckets (engine.weights.ipc) when `export`, else
        None; a collective when `collective`."""

    def named_parameters_full(self) -> dict[str, torch.Tensor]:
        """Parameters by name on the host (full for the torch backend; this rank's shards for Megatron)."""


class CriticBackend(Protocol):
    """PPO's value model (--advantage-estimator ppo)."""

    def compute_values(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """V_t [T] per micro-batch (the value of the state before token t), no grad."""

    def train_step(self, mbs: list[MicroBatch], old_values: list[torch.Tensor], returns: list[torch.Tensor],
                   global_batch_size: int, *, global_tokens: float | None = None) -> dict[str, Any]:
        """One optimizer step of the clipped value loss; returns value_loss / value_clipfrac partial sums and
        critic_grad_norm."""

    def save(self, path: str) -> list[str]: ...

    def load(self, path: str, *, load_optim: bool = True) -> None: ...


def reduce_metrics(parts: list[dict[str, Any]]) -> dict[str, float]:
    """Combine per-rank partial sums: `<name>_sum` / `<name>_count` pairs become means, `<name>_stepsum` shares
    (already divided by the step's denominator) are added up; others are maxed."""
    out: dict[str, float] = {}
    keys = {k for p in parts for k in p}
    for k in keys:
        if k.endswith("_stepsum"):
            out[k[: -len("_stepsum")]] = sum(float(p.get(k, 0.0)) for p in parts)
        elif k.endswith("_sum"):
            name = k[: -len("_sum")]
            total = sum(p.get(k, 0.0) for p in parts)
            count = sum(p.get(name + "_count", 0.0) for p in parts)
            out[name] = total / count if count else 0.0
        elif not k.endswith("_count"):
            out[k] = max(float(p[k]) for p in parts if k in p)
    return out
