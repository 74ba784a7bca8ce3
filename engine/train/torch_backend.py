"""The torch training backend: a transformers causal LM trained on packed micro-batches with AdamW.

Per optimizer step (engine.algorithms.objective): each micro-batch's loss is its samples' share of the step's
loss (divided by the *global* G, or the global trained-token count with --calculate-per-token-loss); gradients
accumulate over micro-batches and are summed over DP ranks (engine.train.optim.sync_and_clip), so the update
is the same whatever the DP layout.

The policy runs with dropout off (eval mode) in every forward: an RL ratio must be exactly 1 on unchanged
weights (RF01's runtime check relies on it). The reference model is frozen: --ref-load, else the initial
weights (--hf-checkpoint), loaded on first use.
"""
from __future__ import annotations

import math
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.algorithms import LossSpec, policy_objective
from engine.doctor.diagnosis import Diagnosis, DiagnosisError
from engine.packing.microbatch import MicroBatch
from engine.train.checks import nan_diagnosis
from engine.train.forward import packed_forward, use_varlen_attention
from engine.train.optim import gather_lists, make_optimizer, sync_and_clip

#: token sums reported by a train step, reduced as Σ over ranks / Σ tokens (engine.train.backend.reduce_metrics)
TOKEN_METRICS = ("pg_loss", "entropy", "kl", "clipfrac", "ratio", "mismatch", "tis_clipfrac")


class TorchBackend:
    def __init__(self, cfg, *, rank: int = 0, world_size: int = 1, train_iters: int = 1):
        from engine.modeling import load_causal_lm

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.spec = LossSpec.of(cfg)
        torch.manual_seed(cfg.seed + rank)
        random.seed(cfg.seed + rank)  # unseeded, these RNG states made optim/state.pt differ between identical runs
        np.random.seed(cfg.seed + rank)
        self.model = load_causal_lm(cfg.hf_checkpoint)
        use_varlen_attention(self.model)
        self.model.eval()  # dropout off: see the module docstring
        self.ref = None
        self.temperature = cfg.rollout_temperature if cfg.rollout_temperature > 0 else 1.0
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), cfg, lr=cfg.lr,
                                                        train_iters=train_iters)
        self.steps_done = 0
        self.skipped_steps = 0

    # ---- reference model (frozen, for KL) -----------------------------------------------------------------
    @property
    def ref_source(self) -> str:
        return self.cfg.ref_load or self.cfg.hf_checkpoint

    def _ref_model(self):
        if self.ref is None:
            self.ref = load_reference(self.cfg.ref_load, self.cfg.hf_checkpoint)
            use_varlen_attention(self.ref)
        return self.ref

    # ---- forward ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, mbs: list[MicroBatch], *, ref: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs [T] of each micro-batch (0 where loss_mask is 0) under the policy or the reference."""
        model = self._ref_model() if ref else self.model
        return [packed_forward(model, mb, temperature=self.temperature)[0] for mb in mbs]

    # ---- one optimizer step -------------------------------------------------------------------------------
    def train_step(self, mbs: list[MicroBatch], old_log_probs: list[torch.Tensor],
                   ref_log_probs: list[torch.Tensor] | None, global_batch_size: int, *,
                   global_tokens: float | None = None) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches (advantages already in mb.advantages).

        Returns partial sums: `<metric>_sum` / `<metric>_count` token sums, `loss_total` (this rank's share of
        the step loss), and the step's facts (grad_norm, lr, skipped, ratio_maxdev).
        """
        spec = self.spec
        if spec.per_token_loss and global_tokens is None:
            raise ValueError("--calculate-per-token-loss needs the step's global trained-token count")
        denom = max(global_tokens, 1.0) if spec.per_token_loss else global_batch_size
        self.optimizer.zero_grad(set_to_none=False)
        sums = {k: 0.0 for k in TOKEN_METRICS}
        tokens, loss_total, ratio_maxdev, bad_ids = 0.0, 0.0, 0.0, []
        for j, mb in enumerate(mbs):
            lp, ent = packed_forward(self.model, mb, temperature=self.temperature)  # [T], [T]
            loss, stats, per_sample = policy_objective(
                spec, log_probs=lp, entropy=ent, old_log_probs=old_log_probs[j],
                ref_log_probs=ref_log_probs[j] if ref_log_probs is not None else None,
                rollout_log_probs=mb.rollout_log_probs, advantages=mb.advantages, loss_mask=mb.loss_mask,
                cu_seqlens=mb.cu_seqlens, denominator=denom)
            loss.backward()
            for k, v in stats.items():
                if k in sums:
                    sums[k] += float(v)
            tokens += float(stats["tokens"])
            loss_total += float(loss.detach())
            bad_ids += [i for i, x in zip(mb.sample_ids, per_sample.tolist()) if not math.isfinite(x)]
            with torch.no_grad():
                dev = ((torch.exp(lp - old_log_probs[j]) - 1).abs() * mb.loss_mask).max() if mb.num_tokens else 0
                ratio_maxdev = max(ratio_maxdev, float(dev))
        grad_norm, finite = sync_and_clip(list(self.model.parameters()), world_size=self.world_size,
                                          clip_grad=self.cfg.clip_grad,
                                          loss_finite=math.isfinite(loss_total) and not bad_ids)
        lr = self.scheduler.get_last_lr()[0]
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            self._non_finite_step(mbs, bad_ids, loss_total, grad_norm)
        self.steps_done += 1
        out: dict[str, Any] = {f"{k}_sum": v for k, v in sums.items()}
        out.update({f"{k}_count": tokens for k in TOKEN_METRICS})
        if not spec.use_tis:
            del out["tis_clipfrac_sum"], out["tis_clipfrac_count"]
        out.update(loss_total=loss_total, grad_norm=grad_norm, lr=lr, skipped=0.0 if finite else 1.0,
                   skipped_steps_total=float(self.skipped_steps), ratio_maxdev=ratio_maxdev)
        return out

    def _non_finite_step(self, mbs: list[MicroBatch], bad_ids: list[int], loss_total: float,
                         grad_norm: float) -> None:
        """RF13: fail naming the samples (default), or skip the update and count it (--no-check-…)."""
        if self.cfg.check_for_nan_in_loss_and_grad:
            all_bad = gather_lists(bad_ids, self.world_size)
            all_ids = gather_lists([i for mb in mbs for i in mb.sample_ids], self.world_size)
            raise DiagnosisError(nan_diagnosis(step=self.steps_done, rank_losses=loss_total, grad_norm=grad_norm,
                                               bad_sample_ids=sorted(all_bad), step_sample_ids=sorted(all_ids)))
        # no optimizer or scheduler step (as Megatron: a skipped iteration does not advance the LR schedule)
        self.optimizer.zero_grad(set_to_none=False)
        self.skipped_steps += 1

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

        load_state_strict(self.model, load_weights_dir(Path(path) / "model"), path)
        if load_optim and (Path(path) / "optim" / "state.pt").is_file():
            st = torch.load(Path(path) / "optim" / "state.pt", weights_only=False)
            self.optimizer.load_state_dict(st["optimizer"])
            self.scheduler.load_state_dict(st["scheduler"])
            self.steps_done, self.skipped_steps = st["steps_done"], st["skipped_steps"]
            set_rng_state(st["rng"])

    def load_weights(self, path: str, *, ref: bool = False) -> None:
        """Policy (or reference) weights from a Hugging Face directory or a checkpoint iteration's model/, as the
        driver resolved and verified them (engine/checkpoint/resolve.py: local copies of S3 paths included)."""
        from engine.modeling import load_causal_lm
        from engine.weights import load_weights_dir

        if (Path(path) / "config.json").is_file():  # HF dir: from_pretrained handles shards and key renames
            state = load_causal_lm(path).state_dict()
        else:
            state = load_weights_dir(Path(path) / "model")
        if ref and self.ref is None:  # the frozen architecture; its weights are replaced just below
            self.ref = load_reference(None, self.cfg.hf_checkpoint)
            use_varlen_attention(self.ref)
        load_state_strict(self.ref if ref else self.model, state, path)

    def export_hf(self, path: str) -> None:
        from engine.modeling import load_tokenizer

        self.model.save_pretrained(path)
        load_tokenizer(self.cfg.hf_checkpoint).save_pretrained(path)
        src = Path(self.cfg.hf_checkpoint) / "generation_config.json"
        if src.is_file():
            shutil.copy(src, Path(path) / "generation_config.json")


def load_state_strict(model, state: dict[str, torch.Tensor], source: str) -> None:
    """Load HF-named weights; anything missing (but a tied lm_head) or unexpected is an error."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not k.endswith("lm_head.weight")]
    if bad or unexpected:
        raise ValueError(f"checkpoint {source} does not match the model: missing {bad[:5]}, unexpected "
                         f"{unexpected[:5]}")


def load_reference(ref_load: str | None, hf_checkpoint: str):
    """The frozen reference: an HF directory, or a checkpoint directory's latest iteration (RF01 if neither)."""
    from engine import checkpoint
    from engine.modeling import load_causal_lm
    from engine.weights import load_weights_dir

    src = Path(ref_load or hf_checkpoint)
    if (src / "config.json").is_file():
        model = load_causal_lm(str(src))
    elif (it := checkpoint.read_marker(src)) is not None:
        model = load_causal_lm(hf_checkpoint)  # architecture from the policy's HF config, weights from src
        load_state_strict(model, load_weights_dir(checkpoint.iter_dir(src, it) / "model"), str(src))
    else:
        raise DiagnosisError(Diagnosis(
            code="RF01", severity="error",
            what=f"--ref-load {src} is neither a Hugging Face directory (config.json) nor a checkpoint directory "
                 f"with {checkpoint.MARKER}",
            fix="--ref-load a directory written by --save, or a Hugging Face model directory; drop --ref-load to "
                "use the initial weights (--hf-checkpoint)", facts={"path": str(src)}))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


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
