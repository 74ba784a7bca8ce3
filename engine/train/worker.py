"""Train workers: one Ray actor per DP rank in one torch.distributed group (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

from typing import Any

import torch

from engine.packing.microbatch import MicroBatch


class TrainWorker:
    """Holds a backend and the current rollout's micro-batches with their old / ref log-probs."""

    def __init__(self, cfg_dict: dict[str, Any], *, rank: int, world_size: int, master: str | None,
                 train_iters: int, threads: int):
        import torch.distributed as dist

        from engine.config import RunConfig
        from engine.train.torch_backend import TorchBackend, configure_threads

        configure_threads(threads)
        self.cfg = RunConfig(**cfg_dict)
        self.rank, self.world_size = rank, world_size
        if world_size > 1:
            dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world_size)
        self.backend = TorchBackend(self.cfg, rank=rank, world_size=world_size, train_iters=train_iters)
        self.steps: list[list[MicroBatch]] = []
        self.old: list[list[torch.Tensor]] = []
        self.ref: list[list[torch.Tensor]] | None = None

    def set_rollout(self, steps: list[list[MicroBatch]], need_ref: bool) -> dict[str, float]:
        """Store this rank's micro-batches (per step) and compute old (and ref) log-probs before any update."""
        self.steps = steps
        self.old = [self.backend.compute_log_probs(mbs) for mbs in steps]
        self.ref = [self.backend.compute_log_probs(mbs, ref=True) for mbs in steps] if need_ref else None
        return {"tokens": float(sum(mb.num_tokens for mbs in steps for mb in mbs))}

    def train_step(self, k: int, global_batch_size: int) -> dict[str, Any]:
        return self.backend.train_step(self.steps[k], self.old[k], self.ref[k] if self.ref else None,
                                       global_batch_size)

    def save(self, path: str, save_optim: bool = True) -> list[str]:
        return self.backend.save(path, save_optim=save_optim) if self.rank == 0 else []

    def load(self, path: str, load_optim: bool = True) -> None:
        self.backend.load(path, load_optim=load_optim)

    def load_weights(self, path: str, ref: bool = False) -> None:
        self.backend.load_weights(path, ref=ref)

    def save_weights(self, path: str) -> str:
        from engine.weights import save_weights_dir

        if self.rank == 0:
            save_weights_dir(self.backend.model_state(), path)
        return path

    def export_hf(self, path: str) -> None:
        if self.rank == 0:
            self.backend.export_hf(path)

    def param_checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.backend.model.parameters()))
