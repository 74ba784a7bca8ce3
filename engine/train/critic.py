"""PPO's critic on the torch backend: the policy's transformer body + a linear value head, trained on packed
micro-batches with the same aggregation and DP sync as the policy (engine.algorithms.objective).

Initialisation (as slime): the body from --hf-checkpoint, the head zero-initialised, so the first values are 0
and the first advantages are the plain discounted returns. Value alignment: entry t of a micro-batch is the
state before token t (the sample's tokens < t), so V_t = head(h_{t−1}) — the same hidden state that predicts
token t; a sample's first entry has no state and gets 0.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from engine.algorithms import LossSpec, value_objective
from engine.diagnosis import DiagnosisError
from engine.packing.microbatch import MicroBatch
from engine.train.checks import nan_diagnosis
from engine.train.forward import hidden_states, use_varlen_attention
from engine.train.optim import gather_lists, make_optimizer, sync_and_clip


class ValueModel(torch.nn.Module):
    def __init__(self, body, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """[T] V_t for every entry (0 at each sample's first entry)."""
        v = self.head(hidden_states(self.body, mb)).squeeze(-1)  # [T] value after token t = V_{t+1}
        shifted = torch.cat([v.new_zeros(1), v[:-1]])  # [T] V_t = head(h_{t−1})
        return shifted * (mb.position_ids > 0).to(v.device)


class TorchCritic:
    def __init__(self, cfg, *, rank: int = 0, world_size: int = 1, train_iters: int = 1, device: str = "cpu"):
        from engine.modeling import load_causal_lm

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = torch.device(device)
        self.spec = LossSpec.of(cfg)
        lm = load_causal_lm(cfg.hf_checkpoint, impl=cfg.model_impl)
        use_varlen_attention(lm)
        # dropout off, as the policy; the critic stays fp32 and replicated (its gradients are all-reduced)
        self.model = ValueModel(lm.base_model, lm.config.hidden_size).to(self.device).eval()
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), cfg, lr=cfg.critic_lr or cfg.lr,
                                                        train_iters=train_iters, fused=self.device.type == "cuda")
        self.steps_done = 0

    @torch.no_grad()
    def compute_values(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        return [self.model(mb).cpu() for mb in mbs]

    def train_step(self, mbs: list[MicroBatch], old_values: list[torch.Tensor], returns: list[torch.Tensor],
                   global_batch_size: int, *, global_tokens: float | None = None) -> dict[str, Any]:
        """One critic optimizer step; returns `value_loss` / `value_clipfrac` token sums and `critic_grad_norm`."""
        denom = max(global_tokens or 0.0, 1.0) if self.spec.per_token_loss else global_batch_size
        self.optimizer.zero_grad(set_to_none=False)
        sums = {"value_loss_sum": 0.0, "value_clipfrac_sum": 0.0}
        tokens, loss_total, bad_ids = 0.0, 0.0, []
        for j, mb in enumerate(mbs):
            dev = self.device
            loss, stats, per_sample = value_objective(self.spec, values=self.model(mb), old_values=old_values[j].to(dev),
                                                      returns=returns[j].to(dev), loss_mask=mb.loss_mask.to(dev),
                                                      cu_seqlens=mb.cu_seqlens.to(dev), denominator=denom)
            loss.backward()
            sums["value_loss_sum"] += float(stats["value_loss"])
            sums["value_clipfrac_sum"] += float(stats["value_clipfrac"])
            tokens += float(stats["tokens"])
            loss_total += float(loss.detach())
            bad_ids += [i for i, x in zip(mb.sample_ids, per_sample.tolist()) if not math.isfinite(x)]
        grad_norm, finite = sync_and_clip(list(self.model.parameters()), world_size=self.world_size,
                                          clip_grad=self.cfg.clip_grad,
                                          loss_finite=math.isfinite(loss_total) and not bad_ids)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        elif self.cfg.check_for_nan_in_loss_and_grad:
            raise DiagnosisError(nan_diagnosis(
                step=self.steps_done, rank_losses=loss_total, grad_norm=grad_norm,
                bad_sample_ids=sorted(gather_lists(bad_ids, self.world_size)),
                step_sample_ids=sorted(gather_lists([i for mb in mbs for i in mb.sample_ids], self.world_size))))
        else:
            self.optimizer.zero_grad(set_to_none=False)
        self.steps_done += 1
        return {**sums, "value_loss_count": tokens, "value_clipfrac_count": tokens, "critic_grad_norm": grad_norm}

    def save(self, path: str) -> list[str]:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        from engine.weights import save_weights_dir

        save_weights_dir({k: v.detach() for k, v in self.model.state_dict().items()}, root / "model")
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "steps_done": self.steps_done}, root / "optim.pt")
        return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]

    def load(self, path: str, *, load_optim: bool = True) -> None:
        from engine.weights import load_weights_dir

        state = load_weights_dir(Path(path) / "model")
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"critic checkpoint {path} does not match: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}")
        if load_optim and (Path(path) / "optim.pt").is_file():
            st = torch.load(Path(path) / "optim.pt", weights_only=False)
            self.optimizer.load_state_dict(st["optimizer"])
            self.scheduler.load_state_dict(st["scheduler"])
            self.steps_done = st["steps_done"]
