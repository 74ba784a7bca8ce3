"""The torch training backend: a transformers causal LM trained on packed micro-batches with AdamW, on CPU or CUDA.

Per optimizer step (engine.algorithms.objective): each micro-batch's loss is its samples' share of the step's
loss (divided by the *global* G, or the global trained-token count with --calculate-per-token-loss); gradients
accumulate over micro-batches and are summed over DP ranks, so the update is the same whatever the DP layout.

Placement and precision:
- device: the GPU Ray gave the worker (CUDA_VISIBLE_DEVICES holds just that one, so `cuda:0`), else the CPU.
- DP > 1: FSDP2 (`fully_shard` per decoder layer and on the root) over the workers' process group — NCCL on GPUs,
  gloo on CPU. Each rank's loss is already its share of the global loss, so the gradient reduce-scatter SUMS
  (divide factor 1) instead of averaging. DP = 1 is the plain model.
- --bf16: bf16 weights and compute, fp32 master weights and optimizer state. The model holds bf16 weights (every
  one: embeddings and norms too, so its forward is a bf16 inference engine's forward, which keeps the
  train–inference mismatch small); AdamW updates fp32 masters, rounded into the model after each step. Without
  the fp32 masters an update below bf16's resolution (|lr·Δ| < 2⁻⁹·|w|) would round away every step. DP = 1:
  the masters are held here (`Fp32Masters`); DP > 1: FSDP2 shards fp32 parameters and casts them to bf16 for
  the forward (MixedPrecisionPolicy) — the same numbers.
- CUDA: fused AdamW, flash-attention varlen over the packed row, the log-softmax of the trained positions in one
  compiled kernel (engine/train/forward.py). CPU keeps the eager path, bit for bit as before.
- --recompute-activations: each decoder layer's forward is checkpointed (recomputed in the backward).
- --offload-train: weights, gradients and optimizer state move to host memory between train steps (`offload`).

The policy runs with dropout off (eval mode) in every forward: an RL ratio must be exactly 1 on unchanged
weights (RF01's runtime check relies on it). The reference model is frozen: --ref-load, else the initial
weights (--hf-checkpoint), loaded on first use.
"""
from __future__ import annotations

import math
import random
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.algorithms import LossSpec, step_objective
from engine.diagnosis import Diagnosis, DiagnosisError
from engine.packing.microbatch import MicroBatch
from engine.train.backend import step_hooks
from engine.train.checks import nan_diagnosis
from engine.train.forward import check_recompute_loss, forward_layout, packed_forward, use_varlen_attention
from engine.train.optim import gather_lists, make_optimizer, reset_state, sync_and_clip
from engine.train.routing import Routes, TorchRouters, rollout_indices

#: token sums reported by a train step, reduced as Σ over ranks / Σ tokens (engine.train.backend.reduce_metrics)
TOKEN_METRICS = ("pg_loss", "entropy", "kl", "clipfrac", "ratio", "tis_clipfrac")
#: token sums this backend reports: the policy loss's, --loss-type sft_loss's negative log-likelihood, the
#: tokens --use-opsm masked and those --use-rs rejected (keys starting "tis" are reported too)
SUMMED = (*TOKEN_METRICS, "nll", "opsm_masked", "rs_rejected", "rs_vetoed")


def create(cfg, *, rank: int, world_size: int, master: str | None, train_iters: int, device: str) -> "TorchBackend":
    """The torch backend of one rank: joins the process group (NCCL on CUDA, gloo on CPU) when DP > 1."""
    if world_size > 1:
        join_group(cfg, rank=rank, world_size=world_size, master=master, device=device)
    return TorchBackend(cfg, rank=rank, world_size=world_size, train_iters=train_iters, device=device)


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's tensor on this rank: its shard when FSDP2 made it a DTensor."""
    return p.to_local() if hasattr(p, "to_local") else p


def join_group(cfg, *, rank: int, world_size: int, master: str, device: str) -> None:
    """The DP ranks' process group at tcp://master; a collective waiting longer than --distributed-timeout-minutes
    for another rank fails."""
    from datetime import timedelta

    from engine.train.rendezvous import init_group

    init_group("nccl" if device == "cuda" else "gloo", master, rank, world_size,
               timedelta(minutes=cfg.distributed_timeout_minutes))


class TorchBackend:
    def __init__(self, cfg, *, rank: int = 0, world_size: int = 1, train_iters: int = 1, device: str = "cpu"):
        from engine.modeling import impl_of, load_causal_lm

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.spec = LossSpec.of(cfg)
        self.hooks = step_hooks(cfg)  # the custom loss / TIS / pg-loss reducer functions the flags name
        torch.manual_seed(cfg.seed + rank)
        random.seed(cfg.seed + rank)  # unseeded, these RNG states made optim/state.pt differ between identical runs
        np.random.seed(cfg.seed + rank)
        self.dtype = torch.bfloat16 if cfg.bf16 else torch.float32  # of the forward's weights
        model = load_causal_lm(cfg.hf_checkpoint, device=str(self.device), impl=cfg.model_impl)  # fp32
        self.model_impl = impl_of(model)  # native or transformers (the run's summary: placement.train)
        use_varlen_attention(model)
        self.chunk = max(int(getattr(cfg, "log_probs_chunk_size", -1)), 0)  # 0: the whole head at once
        self.recompute_loss = bool(cfg.recompute_loss_function)
        if self.recompute_loss:
            check_recompute_loss(fused=self.cuda)  # the CUDA formula is the fused kernel
        self._check_chunkable(model, "the policy")
        if cfg.recompute_activations:
            recompute_decoder_layers(model)
        self.frozen = freeze_parameters(model, cfg.freeze_params_name_list, cfg.only_train_params_name_list)
        if self.frozen and rank == 0:
            import logging

            total = sum(p.numel() for p in model.parameters())
            left = sum(p.numel() for p in model.parameters() if p.requires_grad)
            logging.getLogger("rollflow").warning(
                "rollflow: %d parameter tensors frozen (%s%s); %s of %s parameters train", len(self.frozen),
                ", ".join(self.frozen[:4]), " …" if len(self.frozen) > 4 else "", f"{left:,}", f"{total:,}")
        self.sharded = world_size > 1
        self.masters = None
        if self.sharded:
            shard(model, compute_dtype=self.dtype)
        elif cfg.bf16:
            self.masters = Fp32Masters(model)  # takes the fp32 weights, then the model holds their bf16 rounding
        self.model = model.eval()  # dropout off: see the module docstring
        # --use-routing-replay: the old policy's experts, recorded in compute_log_probs, replayed in train_step;
        # --use-rollout-routing-replay: the engine's, carried by the micro-batches, replayed in both
        self.routes = Routes()
        self.rollout_routing = cfg.use_rollout_routing_replay
        self.ref_router_hooks: TorchRouters | None = None  # the reference's (_ref_model)
        flag = "--use-rollout-routing-replay" if self.rollout_routing else "--use-routing-replay"
        self.router_hooks = TorchRouters(model, flag) if cfg.use_routing_replay or self.rollout_routing else None
        if self.router_hooks is not None and rank == 0:
            import logging

            logging.getLogger("rollflow").info(
                "rollflow: %s: %s replay the experts of %d routers, %s", flag,
                "the policy's forwards" if self.rollout_routing else "the steps", len(self.router_hooks.routers),
                "the engine's" if self.rollout_routing else "recorded in the forward before them")
        self.ref = None
        self.teacher = None  # --use-opd --opd-type megatron: frozen, loaded at its first use (_teacher_model)
        self.last_log_probs: list[torch.Tensor] | None = None  # the last train step's forward, per micro-batch
        self.temperature = cfg.rollout_temperature if cfg.rollout_temperature > 0 else 1.0
        # shared prompts run once (engine/train/forward.py); auto leaves CUDA half precision to the flash kernel
        self.share_prefix = cfg.train_share_prefix == "on" or (cfg.train_share_prefix == "auto"
                                                              and not (self.cuda and cfg.bf16))
        trained = self.masters.masters if self.masters else self.model.parameters()
        self.optimizer, self.scheduler = make_optimizer(trained, cfg, lr=cfg.lr, train_iters=train_iters,
                                                        fused=self.cuda)
        self.steps_done = 0
        self.skipped_steps = 0
        self.offloaded = False

    @property
    def collective(self) -> bool:
        """Sharded weights: model_state / save / export are collectives every rank must join."""
        return self.sharded

    #: every rank is one DP replica: each rank's sums count
    reports_metrics = True

    def dp_all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Σ (or max) of a CPU tensor over the data-parallel ranks (the whole world: FSDP2 shards, nothing else)."""
        import torch.distributed as dist

        if self.world_size <= 1:
            return x
        y = x.to(self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return y.cpu()

    # ---- reference model (frozen, for KL) -----------------------------------------------------------------
    @property
    def ref_source(self) -> str:
        return self.cfg.ref_load or self.cfg.hf_checkpoint

    def _ref_model(self):
        if self.ref is None:
            self._set_ref(load_reference(self.cfg.ref_load, self.cfg.hf_checkpoint, self.cfg.model_impl))
        return self.ref

    def _set_ref(self, model) -> None:
        self.ref = self._placed_ref(model)
        if self.rollout_routing:  # the reference replays the engine's routing too: RF01 and the KL compare one
            self.ref_router_hooks = TorchRouters(self.ref, "--use-rollout-routing-replay")

    def _teacher_model(self):
        """--opd-teacher-load: an HF directory, or a --save directory's latest iteration (or
        --opd-teacher-ckpt-step's), frozen and in the forward's dtype like the reference."""
        if self.teacher is None:
            self.teacher = self._placed_ref(load_teacher(self.cfg, int(self.model.config.vocab_size)))
        return self.teacher

    def _check_chunkable(self, model, what: str) -> None:
        from engine.train.forward import check_chunkable

        if self.chunk and (why := check_chunkable(model)):
            raise ValueError(f"--log-probs-chunk-size {self.chunk} cannot run on {what}: {why}; "
                             "use --log-probs-chunk-size -1")

    def _placed_ref(self, model):
        """In the forward's dtype: the bf16 rounding of the same initial weights is what the policy computes with
        on the first step, so KL = 0 exactly there."""
        self._check_chunkable(model, "the reference or teacher model")
        use_varlen_attention(model)
        cast_parameters(model.to(self.device), self.dtype)
        return model

    # ---- kept weights (--keep-old-actor) -------------------------------------------------------------------
    def snapshot_weights(self) -> list[torch.Tensor]:
        """The policy's weights as they are now (this rank's shards under FSDP2), copied to the host."""
        return [_local(p).detach().to("cpu", copy=True) for p in self.model.parameters()]

    @contextmanager
    def _swapped_in(self, weights: list[torch.Tensor] | None):
        """`weights` (a snapshot_weights copy) in the policy for the duration, then its own again."""
        if weights is None:
            yield
            return
        params = [_local(p) for p in self.model.parameters()]
        current = [p.detach().to("cpu", copy=True) for p in params]
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(params, current):
                    p.copy_(w)

    def _rollout_routes(self, mb: MicroBatch, model: torch.nn.Module | None = None):
        """--use-rollout-routing-replay: the policy (model None or self.model) and the reference route `mb` to the
        engine's experts (a micro-batch without them, e.g. a probe's, and the --use-opd teacher route on their
        own)."""
        hooks = self.router_hooks if model is None or model is self.model else \
            self.ref_router_hooks if model is self.ref else None
        if not self.rollout_routing or hooks is None:
            return nullcontext()
        indices = rollout_indices(mb, len(hooks.routers))
        if indices is None:
            return nullcontext()
        if (layout := forward_layout(mb, self.share_prefix)) is not None:  # the forward's row: shared prompts once
            indices = [i[layout.origin] for i in indices]
        return hooks.replaying(indices, rollout=True)

    # ---- forward ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, mbs: list[MicroBatch], *, ref: bool = False, teacher: bool = False,
                          with_entropy: bool = False, weights: list[torch.Tensor] | None = None,
                          record_routing: bool = False):
        """Per-token log-probs [T] of each micro-batch (0 where loss_mask is 0) under the policy, the reference or
        the --use-opd teacher, on the CPU; with_entropy: (those, the per-token entropies [T] of the same forward).
        weights: a snapshot_weights copy the policy computes with instead of its own (--keep-old-actor).
        record_routing (--use-routing-replay, the policy): keep each micro-batch's experts for train_step."""
        model = self._teacher_model() if teacher else self._ref_model() if ref else self.model
        record = record_routing and model is self.model and self.router_hooks is not None
        outs = []
        with self._swapped_in(weights if model is self.model else None):
            for mb in mbs:
                with self.router_hooks.recording() if record else self._rollout_routes(mb, model) as indices:
                    outs.append(packed_forward(model, mb, temperature=self.temperature, fused=self.cuda,
                                               share_prefix=self.share_prefix, chunk=self.chunk))
                if record:
                    self.routes.record(mb, indices)
        lps = [lp.cpu() for lp, _ in outs]
        return (lps, [ent.detach().float().cpu() * mb.loss_mask for (_, ent), mb in zip(outs, mbs)]) \
            if with_entropy else lps

    # ---- one optimizer step -------------------------------------------------------------------------------
    def train_step(self, mbs: list[MicroBatch], old_log_probs: list[torch.Tensor] | None,
                   ref_log_probs: list[torch.Tensor] | None, global_batch_size: int, *,
                   global_tokens: float | None = None) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches (advantages already in mb.advantages).

        old_log_probs None: the step's own forward, detached, is the old policy (exact when these weights are the
        ones that scored the rollout: its only step, no update before it). `last_log_probs` keeps that forward's
        log-probs [T] per micro-batch (on the CPU) for the worker's mismatch metric.

        Returns partial sums: `<metric>_sum` / `<metric>_count` token sums, a custom loss's metrics as
        `custom_<key>_stepsum` (this rank's share), `loss_total` (this rank's share of the step loss), and the
        step's facts (grad_norm, lr, skipped, ratio_maxdev).
        """
        spec, dev = self.spec, self.device
        if spec.per_token_loss and global_tokens is None:
            raise ValueError("--calculate-per-token-loss needs the step's global trained-token count")
        denom = max(global_tokens, 1.0) if spec.per_token_loss else global_batch_size
        self.optimizer.zero_grad(set_to_none=False)
        if self.masters:
            self.model.zero_grad(set_to_none=False)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        sums: dict[str, torch.Tensor] = {}  # what the loss reports: token sums, and a custom loss's step shares
        tokens, loss_total, ratio_maxdev, per_sample_losses = zero.clone(), zero.clone(), zero.clone(), []
        entropy_grad = spec.entropy_coef != 0 or self.hooks.custom_loss is not None  # a custom loss may use it
        seen: list[torch.Tensor] = []
        replay = self.router_hooks is not None and self.routes.replaying
        if self.rollout_routing:
            self.router_hooks.take_differing()  # counted over this step's forwards only
        for j, mb in enumerate(mbs):
            # a replayed routing lasts through the backward, which recomputes layers under --recompute-activations
            with self.router_hooks.replaying(self.routes.of(mb)) if replay else self._rollout_routes(mb):
                lp, ent = packed_forward(self.model, mb, temperature=self.temperature, fused=self.cuda,
                                         entropy_grad=entropy_grad, share_prefix=self.share_prefix,
                                         chunk=self.chunk, recompute=self.recompute_loss)  # [T], [T]
                mask = mb.loss_mask.to(dev)
                old = old_log_probs[j].to(dev) if old_log_probs is not None else lp.detach()
                seen.append(lp.detach())
                loss, stats, per_sample = self._objective(
                    mb, lp, ent, old, ref_log_probs[j].to(dev) if ref_log_probs is not None else None, mask, denom)
                loss.backward()
            with torch.no_grad():
                for k, v in stats.items():
                    if k in SUMMED or k.startswith(("custom_", "tis")):
                        sums[k] = sums.get(k, zero) + v.to(dev).double()
                tokens += stats["tokens"].double()
                loss_total += loss.detach().double()
                per_sample_losses.append(per_sample)
                if mb.num_tokens:
                    ratio_maxdev = torch.maximum(ratio_maxdev, ((torch.exp(lp - old) - 1).abs() * mask).max().double())
        self.last_log_probs = [x.float().cpu() for x in seen]
        # one device → host transfer for the whole step's numbers
        host = torch.stack([*sums.values(), tokens, loss_total, ratio_maxdev]).tolist()
        sums = dict(zip(sums, host[:len(sums)]))
        tokens, loss_total, ratio_maxdev = host[len(sums):]
        per_sample_all = torch.cat(per_sample_losses).tolist() if per_sample_losses else []
        ids = [i for mb in mbs for i in mb.sample_ids]
        bad_ids = [i for i, x in zip(ids, per_sample_all) if not math.isfinite(x)]
        if self.masters:
            self.masters.grads_to_masters()
        trained = self.masters.masters if self.masters else list(self.model.parameters())
        grad_norm, finite = sync_and_clip(trained, world_size=self.world_size, clip_grad=self.cfg.clip_grad,
                                          reduce=not self.sharded,
                                          loss_finite=math.isfinite(loss_total) and not bad_ids)
        lr = self.scheduler.get_last_lr()[0]
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            if self.masters:
                self.masters.masters_to_model()
        else:
            self._non_finite_step(mbs, bad_ids, loss_total, grad_norm)
        self.steps_done += 1
        out: dict[str, Any] = {}
        for k, v in sums.items():  # token sums → means over the step's tokens; a custom loss's shares → step sums
            out.update({f"{k}_stepsum": v} if k.startswith("custom_") else {f"{k}_sum": v, f"{k}_count": tokens})
        out.update(loss_total=loss_total, grad_norm=grad_norm, lr=lr, skipped=0.0 if finite else 1.0,
                   skipped_steps_total=float(self.skipped_steps), ratio_maxdev=ratio_maxdev)
        if self.rollout_routing:  # the share of routings where the trainer's routers alone disagree with the engine
            out["routing_replay_diff_sum"], out["routing_replay_diff_count"] = self.router_hooks.take_differing()
        return out

    def _objective(self, mb: MicroBatch, lp: torch.Tensor, ent: torch.Tensor, old: torch.Tensor,
                   ref: torch.Tensor | None, mask: torch.Tensor, denom: float):
        """The --loss-type's (loss share, stats, per-sample losses) of one micro-batch."""
        dev = self.device
        return step_objective(self.spec, hooks=self.hooks, sample_ids=mb.sample_ids, log_probs=lp,
                              entropy=ent, old_log_probs=old, ref_log_probs=ref,
                              rollout_log_probs=mb.rollout_log_probs.to(dev), advantages=mb.advantages.to(dev),
                              loss_mask=mask, cu_seqlens=mb.cu_seqlens.to(dev), denominator=denom,
                              response_lengths=mb.response_lengths, tis_scale=mb.tis_scale)

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

    # ---- memory (colocated runs) --------------------------------------------------------------------------
    def offload(self) -> None:
        """--offload-train: weights, gradients, optimizer state and the reference to host memory."""
        self._move(torch.device("cpu"))
        self.offloaded = True

    def onload(self) -> None:
        if self.offloaded:
            self._move(self.device)
            self.offloaded = False

    def _move(self, dev: torch.device) -> None:
        if not self.cuda:
            return
        if self.sharded:  # FSDP2 keeps its own references to the shards
            raise NotImplementedError("--offload-train with DP > 1 (FSDP2) is not supported; drop --offload-train")
        self.model.to(dev)  # parameters and their gradients, in place (the optimizer keeps the same objects)
        if self.masters:
            self.masters.to(dev)
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.to(dev)
        for frozen in (self.ref, self.teacher):
            if frozen is not None:
                frozen.to(dev)
        if dev.type == "cpu":
            torch.cuda.empty_cache()

    # ---- state --------------------------------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on this rank's device (a collective when sharded); a tied tensor once, under its
        first name."""
        from torch.distributed.tensor import DTensor

        master = self.masters.of() if self.masters else {}
        seen, out = set(), {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) in seen:  # tied (lm_head ≡ embedding): the same parameter under a second name
                continue
            seen.add(id(v))
            v = master.get(id(v), v)  # --bf16: the fp32 master, not its rounding
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        return out

    def engine_state(self) -> dict[str, torch.Tensor]:
        """`model_state` under the checkpoint's names (engine/weights/layout.py): what SGLang and the built-in
        engine load; the same dict for a model that transformers does not convert."""
        from engine.weights.layout import checkpoint_state

        return checkpoint_state(self.model, self.model_state())

    def ipc_export(self, dtype: str, bucket_bytes: int, *, export: bool = True):
        """The weights as CUDA IPC buckets in the engine's dtype (engine/weights/ipc.py), or None when this rank
        does not `export` (it still joins the gather of sharded weights)."""
        from engine.weights import ipc

        state = self.engine_state()
        return ipc.export(state, getattr(torch, dtype), bucket_bytes) if export else None

    def save(self, path: str, *, save_optim: bool = True) -> list[str]:
        """model/ and optim/state.pt under `path` (full, layout-free tensors) on rank 0; a collective when sharded."""
        from engine.weights import save_weights_dir

        root = Path(path)
        state = self.model_state()
        optim = self._optimizer_state() if save_optim else None
        if self.rank != 0:
            return []
        save_weights_dir(state, root / "model")
        if self.cfg.ref_update_interval:  # the reference moves: a resume must find the one it had
            save_weights_dir(self._ref_state(), root / "ref" / "model")
        if save_optim:
            (root / "optim").mkdir(parents=True, exist_ok=True)
            torch.save({"optimizer": optim, "scheduler": self.scheduler.state_dict(),
                        "steps_done": self.steps_done, "skipped_steps": self.skipped_steps,
                        "rng": rng_state()}, root / "optim" / "state.pt")
        return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]

    def _optimizer_state(self) -> dict:
        if not self.sharded:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load(self, path: str, *, load_optim: bool = True) -> None:
        from engine.weights import load_weights_dir

        self._load_full(load_weights_dir(Path(path) / "model"), path)
        if self.cfg.ref_update_interval and (Path(path) / "ref" / "model").is_dir():
            self.load_weights(str(Path(path) / "ref"), ref=True)
        if load_optim and (Path(path) / "optim" / "state.pt").is_file():
            st = torch.load(Path(path) / "optim" / "state.pt", weights_only=False, map_location="cpu")
            if self.sharded:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                set_optimizer_state_dict(self.model, self.optimizer, self._by_name(st["optimizer"]),
                                         options=StateDictOptions(full_state_dict=True))
            else:
                self.optimizer.load_state_dict(st["optimizer"])
            self.scheduler.load_state_dict(st["scheduler"])
            self.steps_done, self.skipped_steps = st["steps_done"], st["skipped_steps"]
            set_rng_state(st["rng"])

    def _by_name(self, optim: dict) -> dict:
        """An optimizer state dict keyed by parameter names (as sharded runs save it); one saved by an unsharded run
        numbers the parameters in `model.parameters()` order, which is `named_parameters()` order."""
        ids = [i for g in optim["param_groups"] for i in g["params"]]
        if all(isinstance(i, str) for i in ids):
            return optim
        name = dict(zip(ids, (n for n, _ in self.model.named_parameters())))
        return {"state": {name[i]: v for i, v in optim["state"].items()},
                "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in optim["param_groups"]]}

    def _load_full(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Full HF-named weights into the (possibly sharded) policy; names are checked first."""
        check_state_names(self.model, state, source)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            self.model.load_state_dict(state, strict=False)  # (cast to bf16 with --bf16)
            if self.masters:
                self.masters.load(self.model, state)

    def load_weights(self, path: str, *, ref: bool = False) -> None:
        """Policy (or reference) weights from a Hugging Face directory or a checkpoint iteration's model/, as the
        driver resolved and verified them (engine/checkpoint/resolve.py: local copies of S3 paths included)."""
        from engine.modeling import load_causal_lm
        from engine.weights import load_weights_dir

        if (Path(path) / "config.json").is_file():  # HF dir: from_pretrained handles shards and key renames
            state = load_causal_lm(path, impl=self.cfg.model_impl).state_dict()
        else:
            state = load_weights_dir(Path(path) / "model")
        if not ref:
            self._load_full(state, path)
            return
        if self.ref is None:  # the frozen architecture; its weights are replaced just below
            self._set_ref(load_reference(None, self.cfg.hf_checkpoint, self.cfg.model_impl))
        load_state_strict(self.ref, state, path)

    def reset_optimizer(self) -> None:
        reset_state(self.optimizer)

    def update_ref(self) -> None:
        """--ref-update-interval: the reference takes the policy's current weights (in the forward's dtype, as the
        initial reference does); a collective when the policy is sharded."""
        state = self.model_state()
        load_state_strict(self._ref_model(), state, "the policy")

    def _ref_state(self) -> dict[str, torch.Tensor]:
        """The reference's HF-named weights, a tied tensor once (as model_state)."""
        seen, out = set(), {}
        for k, v in self._ref_model().state_dict(keep_vars=True).items():
            if id(v) not in seen:  # tied (lm_head ≡ embedding): once, under its first name
                seen.add(id(v))
                out[k] = v.detach()
        return out

    def export_hf(self, path: str) -> None:
        from engine.modeling import load_causal_lm, load_tokenizer

        state = self.model_state()
        if self.rank != 0:
            return
        if self.sharded or self.masters:  # the full fp32 weights, through a plain copy of the architecture
            model = load_causal_lm(self.cfg.hf_checkpoint, impl=self.cfg.model_impl)
            load_state_strict(model, state, "the trainer")
            model.save_pretrained(path)
        else:
            self.model.save_pretrained(path)
        load_tokenizer(self.cfg.hf_checkpoint).save_pretrained(path)
        src = Path(self.cfg.hf_checkpoint) / "generation_config.json"
        if src.is_file():
            shutil.copy(src, Path(path) / "generation_config.json")

    def named_parameters_full(self) -> dict[str, torch.Tensor]:
        """Full parameters by name on the CPU (a collective when sharded); tests compare DP layouts with it."""
        from torch.distributed.tensor import DTensor

        master = self.masters.of() if self.masters else {}
        return {k: (v.full_tensor() if isinstance(v, DTensor) else master.get(id(v), v)).detach().cpu().clone()
                for k, v in self.model.named_parameters()}


class Fp32Masters:
    """--bf16 with one replica: the optimizer's fp32 copies of the model's (bf16) parameters.

    step: the bf16 gradients go to the masters (as fp32), the optimizer updates the masters, and the model gets
    their bf16 rounding. e.g. w = 1.0, lr·Δ = 1e-3 per step: bf16 (spacing 2⁻⁷ = 0.0078 at 1.0) rounds every step
    back to 1.0; the fp32 master reaches 1.004 after 4 steps and the model then reads 1.0 → 1.0078 once it crosses.
    """

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.parameters())
        self.masters = [torch.nn.Parameter(p.detach().clone()) for p in self.params]  # fp32, before the cast
        cast_parameters(model, torch.bfloat16)

    def of(self) -> dict[int, torch.Tensor]:
        """id(model parameter) → its master."""
        return {id(p): m for p, m in zip(self.params, self.masters)}

    def grads_to_masters(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_model(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
            m.grad = None  # 4 bytes a parameter, not needed until the next backward

    @torch.no_grad()
    def load(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Masters from full-precision named weights (the model already holds their rounding)."""
        by_id = {id(p): n for n, p in model.named_parameters()}
        for p, m in zip(self.params, self.masters):
            m.copy_(state[by_id[id(p)]])

    def to(self, dev: torch.device) -> None:
        for m in self.masters:
            m.data = m.data.to(dev)


def freeze_parameters(model: torch.nn.Module, freeze: list[str], only_train: list[str]) -> list[str]:
    """--freeze-params-name-list / --only-train-params-name-list (re.search on every name of a parameter, a tied
    one's both): requires_grad off for the frozen ones, which then get no gradient, so neither AdamW nor its weight
    decay touches them. Returns the frozen names; a pattern that matches no name, or freezing every parameter, is
    a ConfigError."""
    import re

    from engine.diagnosis import ConfigError, Diagnosis

    if not (freeze or only_train):
        return []
    names: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    every = [n for ns in names.values() for n in ns]
    for flag, patterns in (("--freeze-params-name-list", freeze), ("--only-train-params-name-list", only_train)):
        for pat in patterns:
            if not any(re.search(pat, n) for n in every):
                raise ConfigError(Diagnosis(
                    code="CONFIG", severity="error",
                    what=f"{flag} {pat!r} matches no parameter of the model (e.g. {', '.join(every[:3])})",
                    fix=f"a regular expression of these names (re.search), or drop {pat!r}",
                    facts={"field": flag[2:].replace("-", "_"), "value": pat}))
    frozen = []
    for key, ns in names.items():
        hit = any(re.search(pat, n) for pat in freeze for n in ns)
        kept = not only_train or any(re.search(pat, n) for pat in only_train for n in ns)
        if hit or not kept:
            params[key].requires_grad_(False)
            frozen += ns
    if len(frozen) == len(every):
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error", what="--freeze-params-name-list / --only-train-params-name-list "
                                                  "freeze every parameter of the model: nothing would train",
            fix="freeze fewer parameters", facts={"field": "freeze_params_name_list"}))
    return frozen


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters only: buffers such as RoPE's inv_freq stay fp32, as `from_pretrained(dtype=bf16)` keeps them (the
    engine's model), and as FSDP2's mixed precision leaves them."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def shard(model, *, compute_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 over the default process group: every decoder layer, then the root (embeddings, norm, LM head); the
    parameters stay fp32 (sharded masters), the forward computes in `compute_dtype` and gradients are reduced in
    fp32. Gradients are SUMMED over ranks (divide factor 1): each rank's loss is already its share of the
    global loss."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    units = decoder_layers(model) + [model]
    for unit in units:
        fully_shard(unit, mp_policy=mp)
    for unit in units:  # per FSDP unit; plain SUM collectives (gloo has no pre-multiplied sum)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a transformers causal LM (`model.<base>.layers`)."""
    body = getattr(model, model.base_model_prefix, model)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no `{model.base_model_prefix}.layers` to shard or checkpoint")
    return list(layers)


def recompute_decoder_layers(model) -> None:
    """--recompute-activations: each decoder layer's forward runs under torch.utils.checkpoint when gradients are
    recorded (non-reentrant: keyword arguments and no-grad inputs are fine). Parameter names do not change.
    transformers' own gradient checkpointing works only in train mode, and the policy runs in eval mode."""
    from torch.utils.checkpoint import checkpoint

    for layer in decoder_layers(model):
        def run(*args, _forward=layer.forward, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        layer.forward = run


def check_state_names(model, state: dict[str, torch.Tensor], source: str) -> None:
    """HF-named weights must cover the model: anything missing (but a tied lm_head) or unexpected is an error."""
    names = set(model.state_dict())
    tied = {k for k in names if k.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    missing = sorted(names - set(state) - tied)
    unexpected = sorted(set(state) - names)
    if missing or unexpected:
        raise ValueError(f"checkpoint {source} does not match the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")


def load_state_strict(model, state: dict[str, torch.Tensor], source: str) -> None:
    """Load HF-named weights into a plain (unsharded) model; anything missing (but a tied lm_head) or unexpected
    is an error."""
    check_state_names(model, state, source)
    model.load_state_dict(state, strict=False)


def load_reference(ref_load: str | None, hf_checkpoint: str, impl: str = "auto", step: int | None = None):
    """The frozen reference: an HF directory, or a checkpoint directory's latest iteration (or `step`'s); RF01 if
    neither."""
    from engine import checkpoint
    from engine.modeling import load_causal_lm
    from engine.weights import load_weights_dir

    src = Path(ref_load or hf_checkpoint)
    if step is None and (src / "config.json").is_file():
        model = load_causal_lm(str(src), impl=impl)
    elif (it := step if step is not None else checkpoint.read_marker(src)) is not None:
        model = load_causal_lm(hf_checkpoint, impl=impl)  # architecture from the policy's HF config, weights from src
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


def teacher_source(cfg) -> tuple[Path, int | None]:
    """The --use-opd teacher's weights: (--opd-teacher-load, None) when it is a Hugging Face directory, else (the
    --save directory, its iteration: the latest, or --opd-teacher-ckpt-step's); a CONFIG error if neither."""
    from engine import checkpoint

    src, step = Path(cfg.opd_teacher_load), cfg.opd_teacher_ckpt_step
    if step is None and (src / "config.json").is_file():
        return src, None
    it = step if step is not None else checkpoint.read_marker(src)
    if it is None or not checkpoint.iter_dir(src, it).is_dir():
        raise DiagnosisError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"--opd-teacher-load {src}: " + (
                f"--opd-teacher-ckpt-step {step}: it has no iteration {step} ({checkpoint.iter_dir(src, step).name} "
                "is not a directory)" if step is not None else
                f"neither a Hugging Face directory (config.json) nor a checkpoint directory with {checkpoint.MARKER}"),
            fix="an iteration the directory holds, or drop --opd-teacher-ckpt-step (its latest)" if step is not None
                else "--opd-teacher-load a Hugging Face model directory or a directory written by --save",
            facts={"field": "opd_teacher_load", "value": str(src), "step": step}))
    return src, it


def load_teacher(cfg, vocab_size: int):
    """The --use-opd teacher (teacher_source's weights; an iteration's in the policy's architecture), checked to
    share the policy's vocabulary: the samples' token ids must mean the same."""
    src, it = teacher_source(cfg)
    model = load_reference(str(src), cfg.hf_checkpoint, cfg.model_impl, step=it)
    if int(model.config.vocab_size) != vocab_size:
        raise DiagnosisError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"--opd-teacher-load {cfg.opd_teacher_load} has a vocabulary of {model.config.vocab_size} tokens "
                 f"and the student (--hf-checkpoint) {vocab_size}: the teacher would score other tokens than the "
                 "samples'",
            fix="a teacher with the student's tokenizer (the same model family)",
            facts={"field": "opd_teacher_load", "value": str(cfg.opd_teacher_load)}))
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
