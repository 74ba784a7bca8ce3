"""Train workers: one Ray actor per DP rank in one torch.distributed group (gloo on CPU, NCCL on GPU).

Per rollout (`set_rollout`), before any update: old log-probs, reference log-probs and (PPO) the critic's values
for every micro-batch of every step, then the advantages — computed here, once per rollout, because PPO and
REINFORCE++ need the log-probs and values — written into each micro-batch. Every rank receives the rewards of the
whole rollout, so a GRPO group split over ranks is normalised identically everywhere. Then `train_step(k)` runs
optimizer step k (policy, then critic).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from engine.packing.microbatch import MicroBatch


class TrainWorker:
    """Holds a backend (and PPO's critic) and the current rollout's micro-batches with their log-probs."""

    def __init__(self, cfg_dict: dict[str, Any], *, rank: int, world_size: int, master: str | None,
                 train_iters: int, threads: int):
        import torch.distributed as dist

        from engine.config import RunConfig
        from engine.train.torch_backend import TorchBackend, configure_threads

        configure_threads(threads)
        self.cfg = RunConfig(**cfg_dict)
        self.rank, self.world_size = rank, world_size
        # Megatron shards the model over ranks: saving and gathering weights are collectives every rank joins.
        self.collective = self.cfg.train_backend == "megatron"
        if self.collective:
            from engine.train.megatron_backend import MegatronBackend
            from engine.train.megatron_model import Kernels

            self.backend = MegatronBackend(self.cfg, rank=rank, world_size=world_size, train_iters=train_iters,
                                           master=master, kernels=Kernels(cuda_graphs=self.cfg.megatron_cuda_graphs))
        else:
            if world_size > 1:
                dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world_size)
            self.backend = TorchBackend(self.cfg, rank=rank, world_size=world_size, train_iters=train_iters)
        self.critic = None
        if self.cfg.advantage_estimator == "ppo":  # preflight: the critic runs on the torch backend only
            from engine.train.critic import TorchCritic

            self.critic = TorchCritic(self.cfg, rank=rank, world_size=world_size, train_iters=train_iters)
        self.steps: list[list[MicroBatch]] = []
        self.old: list[list[torch.Tensor]] = []
        self.ref: list[list[torch.Tensor]] | None = None
        self.values: list[list[torch.Tensor]] = []
        self.returns: list[list[torch.Tensor]] = []
        self.step_tokens: list[float] = []

    def _all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Σ (or max) over the data-parallel ranks: the whole gloo world for torch, the DP group for megatron."""
        import torch.distributed as dist

        if self.collective:
            return self.backend.dp_all_reduce(x, op)
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return x

    def set_rollout(self, steps: list[list[MicroBatch]], rewards: list[float], need_ref: bool) -> dict[str, float]:
        """Store this rank's micro-batches (per step); compute log-probs, values and advantages before any update.

        rewards: [N] the scalar reward of every sample of the rollout, indexed by Sample.index.
        Returns facts for the driver: `ref_logp_maxdiff` (max |log π_old − log π_ref| on trained tokens, RF01)
        and this rank's token count.
        """
        from engine.algorithms import compute_advantages, kl, masked_whiten, whiten_stats

        cfg = self.cfg
        self.steps = steps
        self.old = [self.backend.compute_log_probs(mbs) for mbs in steps]
        need_ref = need_ref or cfg.use_kl_loss or cfg.kl_coef > 0
        self.ref = [self.backend.compute_log_probs(mbs, ref=True) for mbs in steps] if need_ref else None
        self.values = [self.critic.compute_values(mbs) for mbs in steps] if self.critic else []
        reward_t = torch.tensor(rewards, dtype=torch.float32)  # [N]
        self.returns = []
        for k, mbs in enumerate(steps):
            rets = []
            for j, mb in enumerate(mbs):
                kl_t = kl(self.old[k][j], self.ref[k][j], cfg.kl_loss_type) if self.ref else torch.zeros(
                    mb.num_tokens)
                adv, ret = compute_advantages(
                    cfg.advantage_estimator, rewards=reward_t, n_samples_per_prompt=cfg.n_samples_per_prompt,
                    sample_ids=mb.sample_ids, cu_seqlens=mb.cu_seqlens, loss_mask=mb.loss_mask, kl=kl_t,
                    values=self.values[k][j] if self.critic else None, gamma=cfg.gamma, lambd=cfg.lambd,
                    kl_coef=cfg.kl_coef, std_normalization=not cfg.disable_grpo_std_normalization)
                mb.advantages = adv
                rets.append(ret)
            self.returns.append(rets)
        if cfg.normalize_advantages:  # whiten over the trained tokens of the whole rollout, all ranks
            stats = self._all_reduce(sum((whiten_stats(mb.advantages, mb.loss_mask) for mbs in steps for mb in mbs),
                                         torch.zeros(3, dtype=torch.float64)))
            for mb in (mb for mbs in steps for mb in mbs):
                mb.advantages = masked_whiten(mb.advantages, stats) * mb.loss_mask
        local_tokens = torch.tensor([float(sum(mb.loss_mask.sum() for mb in mbs)) for mbs in steps],
                                    dtype=torch.float64)
        self.step_tokens = self._all_reduce(local_tokens).tolist()
        maxdiff = 0.0
        if self.ref:
            for k, mbs in enumerate(steps):
                for j, mb in enumerate(mbs):
                    d = ((self.old[k][j] - self.ref[k][j]).abs() * mb.loss_mask).max() if mb.num_tokens else 0.0
                    maxdiff = max(maxdiff, float(d))
        counted = getattr(self.backend, "reports_metrics", True)  # TP / PP peers of a replica count once
        tokens = float(sum(mb.num_tokens for mbs in steps for mb in mbs)) if counted else 0.0
        return {"tokens": tokens, "ref_logp_maxdiff": maxdiff}

    def train_step(self, k: int, global_batch_size: int) -> dict[str, Any]:
        out = self.backend.train_step(self.steps[k], self.old[k], self.ref[k] if self.ref else None,
                                      global_batch_size, global_tokens=self.step_tokens[k])
        if self.critic:
            out.update(self.critic.train_step(self.steps[k], self.values[k], self.returns[k], global_batch_size,
                                              global_tokens=self.step_tokens[k]))
        return out

    def save(self, path: str, save_optim: bool = True) -> list[str]:
        if self.rank != 0 and not self.collective:
            return []
        if save_optim:
            files = self.backend.save(path)
        elif "save_optim" in inspect.signature(self.backend.save).parameters:
            files = self.backend.save(path, save_optim=False)
        else:
            raise NotImplementedError(f"--no-save-optim: the {self.cfg.train_backend} backend always saves its "
                                      "optimizer state; drop --no-save-optim")
        if self.critic:
            files += [f"critic/{f}" for f in self.critic.save(f"{path}/critic")]
        return files

    def load(self, path: str, load_optim: bool = True) -> None:
        self.backend.load(path, load_optim=load_optim)
        if self.critic:
            self.critic.load(f"{path}/critic", load_optim=load_optim)

    def load_weights(self, path: str, ref: bool = False) -> None:
        self.backend.load_weights(path, ref=ref)

    def save_weights(self, path: str) -> str:
        from engine.weights import save_weights_dir

        state = self.backend.model_state() if self.rank == 0 or self.collective else {}
        if self.rank == 0:
            save_weights_dir(state, path)
        return path

    def numpy_state(self) -> tuple[Any, float]:
        """(the policy's weights as HostWeights, their MB): returned into Ray's object store for the engines."""
        from engine.weights import numpy_state

        state = numpy_state(self.backend.model_state())
        return state, state.nbytes / 2**20

    def export_hf(self, path: str) -> None:
        if self.rank == 0 or self.collective:
            self.backend.export_hf(path)

    def param_checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.backend.model.parameters()))

    def parameters(self) -> dict[str, torch.Tensor]:
        """The policy's parameters by name (tests compare DP layouts with it)."""
        return {k: v.detach().clone() for k, v in self.backend.model.named_parameters()}
