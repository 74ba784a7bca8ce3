"""AdamW with Megatron's LR schedule, and the DP gradient sync shared by the policy and the critic.

Schedule (step n = 1, 2, … is the optimizer step being taken, as Megatron counts it):
  warm-up   n ≤ W:  lr·n/W
  constant         lr
  cosine           min_lr + (lr − min_lr)·½(1 + cos(π·(n − W)/(train_iters − W)))
                   (→ min_lr at n = train_iters)
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def lr_lambda(step: int, *, warmup: float, total: int, style: str, min_ratio: float) -> float:
    """Multiplier of the peak LR for the 0-based scheduler step `step` (n = step + 1, see the module docstring)."""
    n = step + 1
    if warmup and n <= warmup:
        return n / warmup
    if style == "constant":
        return 1.0
    progress = min(1.0, (n - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(params, cfg, *, lr: float, train_iters: int, fused: bool = False):
    """AdamW over `params` at peak `lr` with the run's betas, weight decay and schedule (sized by train_iters).
    fused: one CUDA kernel for the whole update (GPU only; the CPU keeps torch's default implementation)."""
    if cfg.use_stateless_adam:
        optimizer = StatelessAdamW(params, lr=lr, weight_decay=cfg.weight_decay, eps=1e-8)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      weight_decay=cfg.weight_decay, eps=1e-8, **({"fused": True} if fused else {}))
    min_ratio = cfg.min_lr / cfg.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup=cfg.warmup_steps(train_iters), total=train_iters,
                                       style=cfg.lr_decay_style, min_ratio=min_ratio))
    return optimizer, scheduler


class StatelessAdamW(torch.optim.Optimizer):
    """--use-stateless-adam (slime's StatelessAdam): AdamW whose moments start from zero at every step. Then
    m̂ = g and v̂ = g² after bias correction, whatever the betas, so the update is p ← p·(1 − lr·wd) − lr·g / (|g| + ε)
    and nothing is kept between steps (no exp_avg / exp_avg_sq: two fp32 copies of the trained weights less)."""

    def __init__(self, params, *, lr: float, weight_decay: float = 0.0, eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.addcdiv_(p.grad, p.grad.abs().add_(eps), value=-lr)
        return loss


def reset_state(optimizer: torch.optim.Optimizer) -> None:
    """--reset-optimizer-states (slime's): Adam's moments and step counts to zero, in place (the same tensors, so
    a sharded or offloaded state stays where it is); the LR schedule goes on."""
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = 0
    for state in optimizer.state.values():
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            v = state.get(key)
            if isinstance(v, torch.Tensor):
                v.zero_()
            elif v is not None:
                state[key] = 0


def sync_and_clip(params: list[torch.nn.Parameter], *, world_size: int, clip_grad: float, loss_finite: bool,
                  reduce: bool = True) -> tuple[float, bool]:
    """Sum gradients over the DP group, clip them, and agree on whether the step is finite.

    Each rank's gradient is its own samples' share of ∇L (divided by the global batch), so the SUM is ∇L.
    Returns (global grad norm before clipping, finite on every rank). One flat buffer → one all-reduce.
    reduce=False: the gradients are already summed (FSDP2 reduce-scattered them; they are sharded DTensors, and
    the norm of DTensors is reduced over the ranks by clip_grad_norm_ itself).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if world_size > 1:
        if reduce:
            flat = torch.cat([g.reshape(-1) for g in grads])  # [P]
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        flag = torch.tensor([0.0 if loss_finite else 1.0], device=_local(grads[0]).device if grads else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        loss_finite = flag.item() == 0.0
    max_norm = clip_grad if clip_grad > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return grad_norm, loss_finite and math.isfinite(grad_norm)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its device is the rank's); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def gather_lists(items: list[int], world_size: int) -> list[int]:
    """Concatenate a small list of ints from every DP rank (used only on the failure path)."""
    if world_size == 1:
        return list(items)
    out: list[list[int]] = [[] for _ in range(world_size)]
    dist.all_gather_object(out, list(items))
    return [i for part in out for i in part]
