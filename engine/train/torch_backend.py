"""The torch training backend: a transformers causal LM, AdamW, exact per-sample loss aggregation.

Loss of one optimizer step over G samples (the default aggregation, as slime):
    L = (1/G) Σ_i mean_{t ∈ resp(i)} ℓ_t,   ℓ_t = pg_t − entropy_coef·H_t + kl_loss_coef·KL_t
Each DP rank sums its own samples' terms divided by the *global* G; summing gradients over ranks
(all-reduce SUM) then gives exactly ∇L, whatever the DP layout.
"""
from __future__ import annotations

import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.algorithms import kl, policy_loss
from engine.doctor.diagnosis import Diagnosis, DiagnosisError
from engine.packing.microbatch import MicroBatch


def lr_lambda(step: int, *, warmup: int, total: int, style: str, min_ratio: float) -> float:
    """Multiplier of the peak LR: linear warm-up, then constant or cosine down to min_lr/lr over train_iters."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the sample each flat token belongs to."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lens.numel()), lens)


def per_sample_mean(x: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    """[S] masked mean of x over each sample's tokens (0 for a sample with no trained token)."""
    sums = torch.zeros(num, dtype=x.dtype).index_add(0, seg, x * mask)
    cnts = torch.zeros(num, dtype=x.dtype).index_add(0, seg, mask)
    return sums / cnts.clamp(min=1)


class TorchBackend:
    def __init__(self, cfg, *, rank: int = 0, world_size: int = 1, train_iters: int = 1):
        from engine.modeling import load_causal_lm

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        torch.manual_seed(cfg.seed + rank)
        random.seed(cfg.seed + rank)  # unseeded, these RNG states made optim/state.pt differ between identical runs
        np.random.seed(cfg.seed + rank)
        self.model = load_causal_lm(cfg.hf_checkpoint)
        self.model.train()
        self.ref = None
        self.temperature = cfg.rollout_temperature if cfg.rollout_temperature > 0 else 1.0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           weight_decay=cfg.weight_decay, eps=1e-8)
        min_ratio = cfg.min_lr / cfg.lr
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, warmup=cfg.lr_warmup_iters, total=train_iters,
                                                style=cfg.lr_decay_style, min_ratio=min_ratio))
        self.steps_done = 0
        self.skipped_steps = 0

    # ---- reference model (frozen initial weights, for KL) -------------------------------------------------
    def _ref_model(self):
        if self.ref is None:
            from engine.modeling import load_causal_lm

            self.ref = load_causal_lm(self.cfg.hf_checkpoint).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        return self.ref

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, model, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [T], entropy [T]) of each flat token given its own sample's prefix, at the rollout T.

        Samples are unpacked into right-padded rows, so attention never crosses samples.
        """
        cu = mb.cu_seqlens.tolist()
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        S, Lmax = len(lens), max(lens)
        ids = torch.zeros((S, Lmax), dtype=torch.long)
        att = torch.zeros((S, Lmax), dtype=torch.long)
        for i, (a, L) in enumerate(zip(cu[:-1], lens)):
            ids[i, :L] = mb.tokens[a:a + L]
            att[i, :L] = 1
        logits = model(input_ids=ids, attention_mask=att).logits.float() / self.temperature  # [S, Lmax, V]
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # [S, Lmax-1, V] predicts tokens 1..Lmax-1
        tok_lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [S, Lmax-1]
        ent = -(logp.exp() * logp).sum(-1)  # [S, Lmax-1]
        lp_flat = torch.zeros(mb.num_tokens)
        ent_flat = torch.zeros(mb.num_tokens)
        for i, (a, L) in enumerate(zip(cu[:-1], lens)):
            lp_flat = lp_flat.index_put((torch.arange(a + 1, a + L),), tok_lp[i, : L - 1])
            ent_flat = ent_flat.index_put((torch.arange(a + 1, a + L),), ent[i, : L - 1])
        return lp_flat, ent_flat

    @torch.no_grad()
    def compute_log_probs(self, mbs: list[MicroBatch], *, ref: bool = False) -> list[torch.Tensor]:
        model = self._ref_model() if ref else self.model
        was_training = model.training
        model.eval()
        out = [self.forward(model, mb)[0] for mb in mbs]
        model.train(was_training)
        return out

    # ---- one optimizer step -------------------------------------------------------------------------------
    def train_step(self, mbs: list[MicroBatch], old_log_probs: list[torch.Tensor],
                   ref_log_probs: list[torch.Tensor] | None, global_batch_size: int) -> dict[str, Any]:
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=False)
        m: dict[str, float] = {k: 0.0 for k in ("pg_loss_sum", "entropy_sum", "kl_sum", "clipfrac_sum",
                                                "ratio_sum", "mismatch_sum", "tokens_count", "loss_total")}
        for j, mb in enumerate(mbs):
            lp, ent = self.forward(self.model, mb)  # [T], [T]
            old, mask = old_log_probs[j], mb.loss_mask  # [T], [T]
            pg, clipped = policy_loss(lp, old, mb.advantages, eps_clip=cfg.eps_clip)  # [T], [T]
            tok_loss = pg - cfg.entropy_coef * ent
            kl_t = kl(lp, ref_log_probs[j], cfg.kl_loss_type) if ref_log_probs is not None else torch.zeros_like(lp)
            if cfg.use_kl_loss:
                tok_loss = tok_loss + cfg.kl_loss_coef * kl_t
            seg = segment_ids(mb.cu_seqlens)
            loss = per_sample_mean(tok_loss, mask, seg, mb.cu_seqlens.numel() - 1).sum() / global_batch_size
            loss.backward()
            with torch.no_grad():
                m["loss_total"] += float(loss)
                m["pg_loss_sum"] += float((pg * mask).sum())
                m["entropy_sum"] += float((ent * mask).sum())
                m["kl_sum"] += float((kl_t * mask).sum())
                m["clipfrac_sum"] += float((clipped * mask).sum())
                m["ratio_sum"] += float((torch.exp(lp - old) * mask).sum())
                m["mismatch_sum"] += float(((mb.rollout_log_probs - old).abs() * mask).sum())
                m["tokens_count"] += float(mask.sum())
        for name in ("pg_loss", "entropy", "kl", "clipfrac", "ratio", "mismatch"):
            m[name + "_count"] = m["tokens_count"]
        if self.world_size > 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        ids = [i for mb in mbs for i in mb.sample_ids]
        if not (math.isfinite(grad_norm) and math.isfinite(m["loss_total"])):
            if cfg.check_for_nan_in_loss_and_grad:
                raise DiagnosisError(Diagnosis(
                    code="RF13", severity="error",
                    what=f"NaN/Inf at optimizer step {self.steps_done}: loss {m['loss_total']}, grad norm "
                         f"{grad_norm} (rank {self.rank}, samples {ids[:32]})",
                    fix="check these samples and the learning rate (--lr); --no-check-for-nan-in-loss-and-grad "
                        "skips such steps instead, without fixing the cause",
                    facts={"step": self.steps_done, "sample_ids": ids, "grad_norm": grad_norm}))
            self.optimizer.zero_grad(set_to_none=False)
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.steps_done += 1
        m.update(grad_norm=grad_norm, lr=lr, skipped_steps=float(self.skipped_steps))
        return m

    # ---- state --------------------------------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save(self, path: str, *, save_optim: bool = True) -> list[str]:
        from engine.weights import save_weights_dir

        root = Path(path)
        save_weights_dir(self.model_state(), root / "model")
        if not save_optim:
            return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]
        (root / "optim").mkdir(parents=True, exist_ok=True)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "steps_done": self.steps_done, "skipped_steps": self.skipped_steps,
                    "rng": rng_state()}, root / "optim" / "state.pt")
        return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]

    def load(self, path: str, *, load_optim: bool = True) -> None:
        from engine.weights import load_weights_dir

        state = load_weights_dir(Path(path) / "model")
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        bad = [k for k in missing if not k.endswith("lm_head.weight")]
        if bad or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {bad[:5]}, unexpected "
                             f"{unexpected[:5]}")
        if load_optim and (Path(path) / "optim" / "state.pt").is_file():
            st = torch.load(Path(path) / "optim" / "state.pt", weights_only=False)
            self.optimizer.load_state_dict(st["optimizer"])
            self.scheduler.load_state_dict(st["scheduler"])
            self.steps_done, self.skipped_steps = st["steps_done"], st["skipped_steps"]
            set_rng_state(st["rng"])

    def load_weights(self, path: str, *, ref: bool = False) -> None:
        """Policy (or reference) weights from a Hugging Face directory or a checkpoint iteration's model/."""
        from engine.modeling import load_causal_lm
        from engine.weights import load_weights_dir

        if (Path(path) / "config.json").is_file():  # HF dir: from_pretrained handles shards and key renames
            state = load_causal_lm(path).state_dict()
        else:
            state = load_weights_dir(Path(path) / "model")
        model = self._ref_model() if ref else self.model
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in missing if not k.endswith("lm_head.weight")]
        if bad or unexpected:
            raise ValueError(f"weights in {path} do not match the model of --hf-checkpoint {self.cfg.hf_checkpoint}:"
                             f" missing {bad[:5]}, unexpected {unexpected[:5]}")

    def export_hf(self, path: str) -> None:
        from engine.modeling import load_tokenizer

        self.model.save_pretrained(path)
        load_tokenizer(self.cfg.hf_checkpoint).save_pretrained(path)
        src = Path(self.cfg.hf_checkpoint) / "generation_config.json"
        if src.is_file():
            shutil.copy(src, Path(path) / "generation_config.json")


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])


def configure_threads(threads: int) -> None:
    # Only when it changes: re-setting the same count re-created the OpenMP pool and made tiny ops 1000x slower
    # (torch 2.13 CPU, measured).
    if torch.get_num_threads() != max(1, threads):
        torch.set_num_threads(max(1, threads))
