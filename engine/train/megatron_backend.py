"""The megatron training backend: megatron-core GPTModel with TP / PP / DP and the distributed optimizer (GPU only).

Same interface and the same loss as the torch backend (engine.train.torch_backend):
    L = (1/G) Σ_i mean_{t ∈ resp(i)} ℓ_t,   ℓ_t = pg_t − entropy_coef·H_t + kl_loss_coef·KL_t
Each micro-batch contributes Σ_{its samples} mean / G (global G); Megatron's DDP is told not to rescale
(calculate_per_token_loss, and a finalize step that ignores token counts), so reduce-scattering the gradient
SUM over DP ranks gives exactly ∇L whatever the DP / TP / PP layout.

Packed micro-batches run as one THD row: cu_seqlens bound the samples for attention and RoPE (positions
restart at every boundary; megatron_attention). The reference model for KL is the initial weights, kept on the
host and swapped in for `compute_log_probs(ref=True)` (as slime does) instead of a second model. Speed choices
that leave the math unchanged are `megatron_model.Kernels` (measured in bench/results/gpu_megatron.md); with
TP = PP = 1 in bf16 the decoder is replayed from CUDA graphs (megatron_graphs), and the backend then runs on its
own CUDA stream.
One difference from the torch backend: Megatron exempts biases and norm weights from weight decay (the
default --weight-decay 0 makes the two identical).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import shutil
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.algorithms import LossSpec, step_objective
from engine.config import MEGATRON_OPTIM_LAYOUT
from engine.packing.microbatch import MicroBatch
from engine.train.forward import check_recompute_loss, recomputed_log_probs
from engine.train.megatron_mapping import check_tp, padded_vocab, shape_from_hf_config
from engine.train.megatron_model import Kernels, cuda_graphs_off_reason
from engine.train.packed_logprobs import align_to_tokens, fused_log_probs, shift_targets, vocab_parallel_log_probs
from engine.train.routing import RouteLayout, Routes, rollout_indices
from engine.train.optim import lr_lambda
from engine.train.backend import step_hooks
from engine.train.torch_backend import SUMMED, rng_state, set_rng_state

log = logging.getLogger("rollflow.megatron")

INSTALL_HINT = ("install it on a CUDA machine with `pip install 'rollflow[megatron]'` (megatron-core==0.16.1; "
                "Transformer Engine optional), or use --train-backend torch")

# The distributed optimizer's checkpoint formats (megatron-core's `distrib_optim_sharding_type`): dp_reshardable, one
# shard per DP rank with a parallel save and load (Megatron-LM's default), loads only into the TP / PP / EP layout it
# was saved from; fully_reshardable (--dist-ckpt-optim-fully-reshardable) gathers each parameter's state in model
# space and loads into any layout. The model-space format 'fully_sharded_model_space' is refused by 0.16's torch_dist
# writer ("ShardedTensor.flattened_range is not supported", seen on the H200). A checkpoint without a recorded format
# (written before the flag) is dp_reshardable.
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"


def optim_format(cfg) -> str:
    """The format this run saves its optimizer state in."""
    return FULLY_RESHARDABLE if getattr(cfg, "dist_ckpt_optim_fully_reshardable", False) else DP_RESHARDABLE


def _format_metadata(fmt: str, cfg) -> dict:
    """megatron-core's sharded_state_dict metadata for `fmt` (with --distrib-optim-fully-reshardable-mem-efficient:
    gathered over gloo onto data-parallel rank 0 instead of onto every rank)."""
    out = {"distrib_optim_sharding_type": fmt}
    if fmt == FULLY_RESHARDABLE:  # (and its keys without the chained optimizer's chained_<i>. prefix: the same
        out.update(chained_optim_avoid_prefix=True,  # names whether the experts have an optimizer of their own)
                   distrib_optim_fully_reshardable_mem_efficient=bool(
                       getattr(cfg, "distrib_optim_fully_reshardable_mem_efficient", False)))
    return out



def require_megatron() -> None:
    """Fail early, with the fix, where the backend cannot run."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"--train-backend megatron needs CUDA GPUs and none is visible here; {INSTALL_HINT}")
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"--train-backend megatron needs megatron-core ({e}); {INSTALL_HINT}") from None


def init_distributed(rank: int, world_size: int, master: str | None, timeout_minutes: float = 10.0) -> None:
    """One NCCL process group over all train ranks; one GPU per rank (LOCAL_RANK, else rank mod GPUs);
    collectives time out after `timeout_minutes` (--distributed-timeout-minutes)."""
    from datetime import timedelta

    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    if dist.is_initialized():
        return
    from engine.train.rendezvous import host_group, init_group

    if master is None and "MASTER_ADDR" in os.environ:  # torchrun's MASTER_ADDR / MASTER_PORT
        dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(minutes=timeout_minutes))
        return
    if master is None:  # a lone rank: its own store on a loopback port the OS picks
        from engine.rollout.ports import free_loopback_port

        master = host_group("127.0.0.1", world_size, free_loopback_port, timeout_minutes)
    init_group("nccl", master, rank, world_size, timedelta(minutes=timeout_minutes))


def _on_own_stream(method):
    """Run a public method on the backend's own CUDA stream when it has one (decoder CUDA graphs), whichever
    stream the calling thread has current: its kernels stay ordered after the previous call's."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._on_stream():
            return method(self, *args, **kwargs)

    return run


def _finalize_grads_sum(model, num_tokens=None, **kw):
    """Megatron's grad finalisation (DP reduce-scatter, tied-embedding all-reduce) without 1/num_tokens."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kw)


def create(cfg, *, rank: int, world_size: int, master: str | None, train_iters: int, device: str
           ) -> "MegatronBackend":
    """The Megatron backend of one rank (CUDA only: preflight refuses it elsewhere); joins TP / PP / DP groups."""
    return MegatronBackend(cfg, rank=rank, world_size=world_size, train_iters=train_iters, master=master,
                           params_dtype="bfloat16" if cfg.bf16 else "float32", kernels=Kernels.of(cfg))


class _OutputAsHidden:
    """--log-probs-chunk-size: the GPTModel's output layer returns its input (the final hidden states) and keeps the
    weight it was given (the embedding's, when tied), so the loss applies the head chunk by chunk. Autograd reaches
    that weight through the chunks' products, and DDP's gradient hook adds its .grad into main_grad as for any
    parameter that is not wgrad-fused."""

    def __init__(self, layer: torch.nn.Module):
        self.layer, self.weight = layer, layer.weight
        layer.forward = self.forward

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None,
                **_: Any) -> tuple[torch.Tensor, None]:
        self.weight = self.layer.weight if weight is None else weight
        return hidden, None


class MegatronBackend:
    def __init__(self, cfg, *, rank: int | None = None, world_size: int | None = None, train_iters: int = 1,
                 master: str | None = None, params_dtype: str = "bfloat16", kernels: Kernels = Kernels()):
        require_megatron()
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        from engine.train.megatron_model import build_model, load_hf_into
        from engine.weights import load_weights_dir

        self.cfg, self.train_iters = cfg, train_iters
        self.spec = LossSpec.of(cfg)
        self.hooks = step_hooks(cfg)  # the custom loss / TIS / pg-loss reducer functions the flags name
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self.tp = getattr(cfg, "tensor_model_parallel_size", 1)
        self.pp = getattr(cfg, "pipeline_model_parallel_size", 1)
        self.ep = getattr(cfg, "expert_model_parallel_size", 1)
        self.sp = bool(getattr(cfg, "sequence_parallel", False)) and self.tp > 1
        minutes = getattr(cfg, "distributed_timeout_minutes", 10.0)
        init_distributed(self.rank, self.world_size, master, minutes)
        self.dtype = getattr(torch, params_dtype)
        self.shape = shape_from_hf_config(json.loads((Path(cfg.hf_checkpoint) / "config.json").read_text()))
        check_tp(self.shape, self.tp, self.ep, sp=self.sp)
        # Decoder CUDA graphs are captured on this backend's own stream, and DDP's gradient accumulators must
        # be made on it (megatron_graphs): everything from here on runs there.
        self.stream = None
        off = cuda_graphs_off_reason(kernels, tp=self.tp, pp=self.pp, dtype=self.dtype,
                                     moe=self.shape.num_experts > 0)
        if off is None:
            self.stream = torch.cuda.Stream()
            torch.cuda.set_stream(self.stream)
        if self.rank == 0:
            log.info("megatron backend: decoder CUDA graphs %s", "on" if off is None else f"off ({off})")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(self.tp, self.pp, expert_model_parallel_size=self.ep,
                                                     expert_tensor_parallel_size=1,  # (experts are never TP-split)
                                                     distributed_timeout_minutes=max(1, math.ceil(minutes)))
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed + self.rank)

        self.vocab_padded = padded_vocab(self.shape.vocab_size, self.tp)
        self.temperature = cfg.rollout_temperature if cfg.rollout_temperature > 0 else 1.0

        self.kernels = kernels
        gpt, self.config = build_model(self.shape, vocab_padded=self.vocab_padded, dtype=self.dtype, tp=self.tp,
                                       pp=self.pp, ep=self.ep, kernels=kernels, sp=self.sp,
                                       routing_replay=cfg.use_routing_replay or cfg.use_rollout_routing_replay,
                                       deterministic=cfg.deterministic_mode)
        # --use-routing-replay: megatron-core's RouterReplay of each router, in module order; the recorded routing
        # (--use-rollout-routing-replay: the engine's, carried by the micro-batches)
        self.replays = [m.router_replay for m in gpt.modules() if getattr(m, "router_replay", None) is not None]
        # which of the model's MoE layers each of this pipeline stage's routers is (the engine's routing lists them all)
        self.replay_rows = self._stage_moe_rows(gpt) if self.replays else []
        self.routes = Routes()
        self.rollout_routing = cfg.use_rollout_routing_replay
        if cfg.use_routing_replay and self.rank == 0:
            log.info("megatron backend: --use-routing-replay: the steps replay the experts of %d routers, recorded in "
                     "the forward before them", len(self.replays))
        # (token, router) routings of the replayed forwards where the router alone picks other experts, and all
        # of them (train/routing_replay_diff; rows the engine did not route are left out)
        self._differing: list[Any] = [0, 0]
        if self.rollout_routing:
            for r in self.replays:
                self._count_differing(r)
        if self.rollout_routing and self.rank == 0:
            log.info("megatron backend: --use-rollout-routing-replay: the policy's forwards replay the engine's "
                     "experts at %d routers", len(self.replays))
        load_hf_into(gpt, self.config, load_weights_dir(cfg.hf_checkpoint), self.shape,
                     vocab_padded=self.vocab_padded)
        self.gpt = gpt  # unwrapped: its parameter names are the mapping's
        if self.tp > 1 and self.ep == 1 and self.shape.num_experts:
            # TP with --sequence-parallel: every TP rank runs the whole experts (ETP = 1) on its share of the
            # tokens, so their gradients are partial sums over the TP ranks. megatron-core 0.16 marks experts for
            # the expert-data-parallel reduce (which spans the TP ranks at ETP = 1) only at EP > 1; at EP = 1 they
            # would be reduced over the data-parallel ranks alone and the TP ranks' copies would drift apart.
            for n, p in gpt.named_parameters():
                if ".mlp.experts." in n:
                    p.allreduce = False
        self.config.finalize_model_grads_func = _finalize_grads_sum
        wrapped = gpt if self.dtype == torch.float32 else Float16Module(self.config, gpt)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=True)
        self.model = [DistributedDataParallel(config=self.config, ddp_config=ddp, module=wrapped)]
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=1e-8,
                            clip_grad=cfg.clip_grad, bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                            use_distributed_optimizer=True),
            self.model)
        if kernels.fused_adam:  # torch.optim.AdamW reads `fused` per group at every step
            for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                inner = getattr(o, "optimizer", None)
                if isinstance(inner, torch.optim.AdamW):
                    for g in inner.param_groups:
                        g["fused"], g["foreach"] = True, False
        # After DDP and the optimizer: the parameters and their main_grad buffers are in their final place.
        self.graphs = None
        if self.stream is not None:
            from engine.train.megatron_graphs import DecoderGraphs, fused_wgrad_weights

            self.graphs = DecoderGraphs(gpt.decoder, dtype=self.dtype, hidden_size=self.shape.hidden_size,
                                        fused_weights=fused_wgrad_weights(gpt.decoder))
        # --log-probs-chunk-size (TP = 1, checked by the config): the output layer hands back its input, and the
        # loss runs the head on it chunk by chunk (engine.train.forward.chunked_log_probs)
        self.chunk = max(int(getattr(cfg, "log_probs_chunk_size", -1)), 0)
        self.recompute_loss = bool(cfg.recompute_loss_function)  # the log-softmax recomputed in the backward
        if self.recompute_loss:
            check_recompute_loss(fused=self.kernels.fused_log_probs and self.tp == 1)
        self.head = _OutputAsHidden(gpt.output_layer) if self.chunk and getattr(gpt, "post_process", True) else None
        # The frozen reference policy: the initial weights of this rank's shards, on the host.
        self.ref_weights = self._host_copy()
        self.teacher_weights = None  # --use-opd --opd-type megatron: the teacher's shards, read at first use
        self.steps_done = 0
        self.skipped_steps = 0
        # slime's Megatron hooks (--custom-megatron-*-path): {flag: (function, path)}
        self.megatron_hooks = {}
        for field in ("custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
                      "custom_megatron_before_train_step_hook_path"):
            if path := getattr(cfg, field, None):
                from engine.rewards import load_function

                flag = "--" + field.replace("_", "-")
                self.megatron_hooks[flag] = (load_function(path, flag), path)
        self._megatron_hook("--custom-megatron-init-path", cfg)

    def _megatron_hook(self, flag: str, *args: Any) -> None:
        """Call a --custom-megatron-*-path function where its flag is set (a failure is a HookError naming it)."""
        if flag in self.megatron_hooks:
            from engine.rollout.hooks import call_hook

            fn, path = self.megatron_hooks[flag]
            call_hook(flag, path, fn, *args)

    def before_train_step(self, rollout_id: int, step_id: int) -> None:
        """--custom-megatron-before-train-step-hook-path, before optimizer step `step_id` of rollout `rollout_id`
        (the worker calls it; the learning-rate schedule is the backend's own, so opt_param_scheduler is None)."""
        self._megatron_hook("--custom-megatron-before-train-step-hook-path", self.cfg, rollout_id, step_id,
                            self.model, self.optimizer, None)

    # ---- parallel layout -----------------------------------------------------------------------------------
    #: the weights are sharded over ranks: model_state / save / export are collectives every rank joins
    collective = True

    @property
    def is_last_stage(self) -> bool:
        from megatron.core import parallel_state

        return parallel_state.is_pipeline_last_stage()

    @property
    def reports_metrics(self) -> bool:
        """One rank per DP replica reports the step's sums (TP ranks and earlier PP stages would double count)."""
        from megatron.core import parallel_state

        return self.is_last_stage and parallel_state.get_tensor_model_parallel_rank() == 0

    def _vocab_reducers(self) -> dict[str, Any]:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        kw: dict[str, Any] = dict(vocab_start=tp_rank * (self.vocab_padded // self.tp),
                                  vocab_size=self.shape.vocab_size)
        if self.tp > 1:
            group = parallel_state.get_tensor_model_parallel_group()

            def reduce_max(x):
                dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
                return x

            kw.update(reduce_sum=reduce_from_tensor_model_parallel_region, reduce_max=reduce_max)
        return kw

    # ---- forward over micro-batches (Megatron's schedule: no pipelining, or 1F1B across PP stages) ---------
    def _run(self, mbs: list[MicroBatch], loss_fn: Callable, *, forward_only: bool, entropy_grad: bool,
             routing: str | None = None) -> list[dict[str, torch.Tensor]]:
        """Run `loss_fn(j, mb, log_probs [T], entropy [T]) -> (loss, {stats})` on every micro-batch; returns the
        stats dicts on the last pipeline stage ([] elsewhere). Gradients are finalised when not forward_only.
        routing (--use-routing-replay): "record" each micro-batch's experts into self.routes, or "replay" them; or
        "rollout" (--use-rollout-routing-replay): the engine's. Set before each forward, on every pipeline stage
        for its own routers; a recompute in the backward would replay them only without pipelining (the config
        refuses PP > 1 with --recompute-activations)."""
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        dev = torch.cuda.current_device()
        # Inputs go to the GPU before the first kernel: a pageable host→device copy waits for the stream, so
        # copying per micro-batch would drain the GPU between micro-batches. A micro-batch with a captured
        # decoder graph is padded to the graph's shape (megatron_graphs); the loss sees its real tokens only.
        inputs = []
        for mb, key in zip(mbs, self._graph_keys(mbs)):
            tokens, cu, pos = mb.tokens, mb.cu_seqlens.to(torch.int32), mb.position_ids  # [T], [S+1], [T]
            run_cu, longest = cu, int((cu[1:] - cu[:-1]).max()) if mb.num_samples else 0
            if key is not None and key in self.graphs.graphs:
                from engine.train.megatron_graphs import pad_micro_batch

                tokens, run_cu, pos = pad_micro_batch(tokens, cu, pos, key)
                longest = key[0]
            elif self.sp and tokens.numel() % self.tp:  # each TP rank takes 1/TP of the tokens: a pad segment
                from engine.train.megatron_graphs import pad_micro_batch

                t_pad = -(-tokens.numel() // self.tp) * self.tp
                tokens, run_cu, pos = pad_micro_batch(tokens, cu, pos, (t_pad, mb.num_samples + 1))
                longest = max(longest, t_pad - mb.num_tokens)
            inputs.append((tokens.to(dev), run_cu.to(dev), pos.to(dev), cu.to(dev), longest))
        reducers = self._vocab_reducers()
        # TP = 1 reads the model-precision logits in fused kernels; TP > 1 combines the vocabulary shards.
        fused = self.kernels.fused_log_probs and self.tp == 1
        # Float16Module's upcast: the fused kernels read bf16 logits, the chunks the bf16 hidden states
        extra = {"fp32_output": False} if (fused or self.head) and self.dtype != torch.float32 else {}

        def loss_on_logits(j, mb, tokens, cu, logits):  # logits [1, T, V/p]; position t predicts tokens[t+1]
            n = mb.num_tokens
            tokens, logits = tokens[:n], logits[:, :n]  # without a graph's padding
            if self.head is not None:  # logits are the output layer's input here: hidden states [1, T, h]
                from engine.train.forward import chunked_log_probs

                lp, ent = chunked_log_probs(logits[0], self.head.weight, shift_targets(tokens), chunk=self.chunk,
                                            temperature=self.temperature, fused=fused, entropy_grad=entropy_grad)
            else:  # fused: one compiled kernel on the model-precision logits; else fp32 over the vocabulary shards
                fn, kw = (fused_log_probs, {"temperature": self.temperature}) if fused else \
                    (self._sharded_log_probs, {"reducers": reducers})
                if self.recompute_loss:  # --recompute-loss-function: only the logits kept for the backward
                    fn, kw = recomputed_log_probs, {"fn": fn, **kw}
                lp, ent = fn(logits[0], shift_targets(tokens), entropy_grad=entropy_grad, **kw)  # [T] each
            loss, stats = loss_fn(j, mb, align_to_tokens(lp, cu), align_to_tokens(ent, cu))
            return loss, torch.ones((), dtype=torch.int, device=dev), stats

        def step(data_iterator, model):
            j = next(data_iterator)
            mb = mbs[j]
            tokens, run_cu, pos, cu, longest = inputs[j]  # longest: from the host tensors, no sync
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=run_cu, cu_seqlens_kv=run_cu,
                                  max_seqlen_q=longest, max_seqlen_kv=longest)
            if routing is not None:
                self._route(routing, mb, dev, tokens.numel())
            out = model(input_ids=tokens[None], position_ids=pos[None], attention_mask=None,
                        packed_seq_params=psp, **extra)  # last stage: logits [1, T, V/p]; else hidden [T, 1, h]
            if routing == "record":
                self.routes.record(mb, [r.get_recorded_indices() for r in self.replays])
            return out, partial(loss_on_logits, j, mb, tokens, cu)

        try:
            return get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(range(len(mbs))), model=self.model,
                num_microbatches=len(mbs), seq_length=max(mb.num_tokens for mb in mbs), micro_batch_size=1,
                forward_only=forward_only) or []
        finally:
            for r in self.replays:  # other forwards (reference, teacher, scoring) route on their own
                r.clear_router_replay_action()
                r.clear_indices()

    def _count_differing(self, replay) -> None:
        """Wrap a RouterReplay's top-k so that a replayed forward also counts where the router's own top k (its
        default computation on the same scores) differs from the replayed one."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replayed = replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, idx = replayed(scores, topk, num_groups, group_topk, default_compute_topk)
            given = getattr(replay, "rollflow_given", None)
            if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD and given is not None \
                    and default_compute_topk is not None:
                with torch.no_grad():
                    _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
                    differ = (own.sort(-1).values != idx.sort(-1).values).any(-1) & given
                    self._differing[0] = self._differing[0] + differ.sum()
                    self._differing[1] = self._differing[1] + given.sum()
            return probs, idx

        replay.get_replay_topk = get_replay_topk

    def _stage_moe_rows(self, gpt) -> list[int]:
        """This pipeline stage's routers (in module order), each as its index among the model's MoE layers."""
        from engine.train.megatron_model import layer_offset

        moe = RouteLayout.of_shape(self.shape).moe_layers
        offset = layer_offset(self.config)
        rows = []
        for name, m in gpt.named_modules():
            if getattr(m, "router_replay", None) is not None:
                rows.append(moe.index(offset + int(re.match(r"decoder\.layers\.(\d+)\.", name).group(1))))
        return rows

    def _route(self, routing: str, mb: MicroBatch, dev, run_tokens: int) -> None:
        """run_tokens: the micro-batch's tokens as the model runs them (with --sequence-parallel's padding). Under
        sequence parallelism each TP rank routes its 1/TP of them: it records, and replays, its own share (the
        engine's routing: padded with rows it did not route, then this rank's share)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routing == "record":
            for r in self.replays:
                r.clear_indices()
                r.set_router_replay_action(RouterReplayAction.RECORD)
            return
        if routing == "rollout":  # the engine's routing of every MoE layer: this pipeline stage's
            every = rollout_indices(mb, len(RouteLayout.of_shape(self.shape).moe_layers))
            indices = None if every is None else [every[i] for i in self.replay_rows]
        else:
            indices = self.routes.of(mb)
        if indices is None:  # a micro-batch without the engine's routing (a probe's): it routes on its own
            for r in self.replays:
                r.clear_indices()
                r.clear_router_replay_action()
            return
        if len(indices) != len(self.replays):
            raise RuntimeError(f"--use-routing-replay: {len(indices)} recorded routers for {len(self.replays)}")
        for r, idx in zip(self.replays, indices):
            r.clear_indices()
            idx = idx.to(device=dev, dtype=torch.long)
            if self.sp and routing == "rollout":
                from megatron.core import parallel_state

                idx = torch.cat([idx, idx.new_full((run_tokens - idx.shape[0], idx.shape[1]), -1)])
                share = run_tokens // self.tp
                at = parallel_state.get_tensor_model_parallel_rank() * share
                idx = idx[at:at + share]
            if routing == "rollout":  # a token the engine did not route (a sample's last; in no loss): experts 0..k-1
                r.rollflow_given = idx[:, 0] >= 0
                idx = torch.where(r.rollflow_given[:, None], idx, torch.arange(idx.shape[1], device=dev))
            r.set_target_indices(idx)
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _sharded_log_probs(self, logits: torch.Tensor, targets: torch.Tensor, *, entropy_grad: bool,
                           reducers: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [T], entropy [T]) from this rank's vocabulary shard of the logits [T, V/p], in fp32."""
        logits = logits.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return vocab_parallel_log_probs(logits, targets, entropy_grad=entropy_grad, **reducers)

    def _graph_keys(self, mbs: list[MicroBatch]) -> list[tuple[int, int] | None]:
        """Each micro-batch's decoder-graph shape (None: eager)."""
        if self.graphs is None:
            return [None] * len(mbs)
        return [self.graphs.key(mb.num_tokens, mb.num_samples) if mb.num_tokens else None for mb in mbs]

    def _prepare_graphs(self, mbs: list[MicroBatch]) -> None:
        """Capture the decoder graphs these micro-batches need. Only between steps: the capture's warm-up
        passes write the fp32 main grads, which the next train step zeroes first."""
        if self.graphs is not None:
            self.graphs.prepare(self._graph_keys(mbs))

    def _host_copy(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards as they are now, copied to the host."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.gpt.named_parameters()}

    @contextmanager
    def _swapped_in(self, weights: dict[str, torch.Tensor]):
        """Other weights of this rank's shards (the reference's, the teacher's) in the model for the duration,
        then the policy's again (as slime's weights backuper switches models)."""
        params = dict(self.gpt.named_parameters())
        current = self._host_copy()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n], non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(current[n], non_blocking=True)

    def _teacher(self) -> dict[str, torch.Tensor]:
        """--opd-teacher-load (an HF directory, or a --save directory's iteration), read into the student's
        model once and kept as this rank's shards on the host: the teacher has the student's architecture, as in
        slime's Megatron backend (a different model is --opd-type sglang)."""
        if self.teacher_weights is None:
            from engine import checkpoint
            from engine.train.torch_backend import teacher_source

            src, it = teacher_source(self.cfg)
            current = self._host_copy()
            self._read_weights(src if it is None else checkpoint.iter_dir(src, it), what="--opd-teacher-load")
            self.teacher_weights = self._host_copy()
            with torch.no_grad():
                for n, p in self.gpt.named_parameters():
                    p.copy_(current[n], non_blocking=True)
        return self.teacher_weights

    def _on_stream(self):
        """The backend's own stream (with decoder graphs), whatever stream the caller left current."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def snapshot_weights(self) -> dict[str, torch.Tensor]:
        """--keep-old-actor: this rank's shards as they are now, on the host."""
        return self._host_copy()

    @_on_own_stream
    @torch.no_grad()
    def compute_log_probs(self, mbs: list[MicroBatch], *, ref: bool = False, teacher: bool = False,
                          with_entropy: bool = False, weights: dict[str, torch.Tensor] | None = None,
                          record_routing: bool = False):
        with torch.enable_grad():  # a capture records the backward too
            self._prepare_graphs(mbs)
        for m in self.model:
            m.eval()
        self._megatron_hook("--custom-megatron-before-log-prob-hook-path", self.cfg, self.model,
                            "teacher_" if teacher else "ref_" if ref else "")
        other = self._teacher() if teacher else self.ref_weights if ref else weights  # weights: --keep-old-actor
        with self._swapped_in(other) if other is not None else nullcontext():
            record = record_routing and self.replays and not (ref or teacher)
            # --use-rollout-routing-replay: the reference replays the engine's routing as the policy does (RF01 and
            # the KL compare one routing); the teacher routes on its own
            routing = "record" if record else "rollout" if self.rollout_routing and not teacher else None
            outs = self._run(self._even(mbs), lambda j, mb, lp, ent: (lp.sum() * 0, {"log_probs": lp,
                                                                                     "entropy": ent.detach()}),
                             forward_only=True, entropy_grad=False, routing=routing)[:len(mbs)]
        for m in self.model:
            m.train()
        if not self.is_last_stage:  # only the last stage computes the loss; it is the only user of these
            zeros = [torch.zeros(mb.num_tokens) for mb in mbs]
            return (zeros, [z.clone() for z in zeros]) if with_entropy else zeros
        # 0 where loss_mask is 0, as the torch backend (engine.train.forward.packed_forward)
        lps = [o["log_probs"].float().cpu() * mb.loss_mask for o, mb in zip(outs, mbs)]
        return (lps, [o["entropy"].float().cpu() * mb.loss_mask for o, mb in zip(outs, mbs)]) if with_entropy else lps

    def _ep_counts(self, n: int) -> tuple[int, int]:
        """(fewest, most) micro-batches a rank of this rank's EP group runs in this call."""
        from megatron.core import parallel_state

        t = torch.tensor([n, -n], device=torch.cuda.current_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
        return -int(t[1]), int(t[0])

    def _even(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """Expert parallelism: every MoE layer's forward is an all-to-all over the EP group, so each of its ranks
        must run as many forwards. A no-grad call whose micro-batches were packed per rank
        (--log-probs-max-tokens-per-gpu) may have fewer here: the last one runs again, its results dropped."""
        if self.ep == 1:
            return mbs
        _, most = self._ep_counts(len(mbs))
        if most > len(mbs) and not mbs:
            raise RuntimeError(f"expert parallelism: this rank has no micro-batch to forward while an EP peer runs "
                               f"{most}; every rank of an EP group must run the same number of forwards")
        return mbs + [mbs[-1]] * (most - len(mbs))

    @_on_own_stream
    def dp_all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce a CPU tensor over this rank's data-parallel group (TP / PP peers hold the same data)."""
        from megatron.core import parallel_state

        t = x.to(torch.cuda.current_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                        group=parallel_state.get_data_parallel_group())
        return t.cpu()

    # ---- one optimizer step --------------------------------------------------------------------------------
    @_on_own_stream
    def train_step(self, mbs: list[MicroBatch], old_log_probs: list[torch.Tensor],
                   ref_log_probs: list[torch.Tensor] | None, global_batch_size: int, *,
                   global_tokens: float | None = None) -> dict[str, Any]:
        """One optimizer step; the loss is engine.algorithms.step_objective (the --loss-type's), exactly as the
        torch backend's. old_log_probs is None only for --loss-type sft_loss."""
        cfg, spec = self.cfg, self.spec
        if spec.per_token_loss and global_tokens is None:
            raise ValueError("--calculate-per-token-loss needs the step's global trained-token count")
        denom = max(global_tokens, 1.0) if spec.per_token_loss else global_batch_size
        dev = torch.cuda.current_device()
        if self.ep > 1 and (counts := self._ep_counts(len(mbs)))[0] != counts[1]:  # the schedule's invariant I1
            raise RuntimeError(f"expert parallelism: the ranks of an EP group have {counts[0]} to {counts[1]} "
                               "micro-batches in this step; each must run the same number (engine/packing/schedule)")
        self._prepare_graphs(mbs)  # before zero_grad_buffer (see _prepare_graphs)
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = cfg.lr * lr_lambda(self.steps_done, warmup=cfg.warmup_steps(self.train_iters),
                                total=self.train_iters, style=cfg.lr_decay_style, min_ratio=cfg.min_lr / cfg.lr)
        for g in self.optimizer.param_groups:
            g["lr"] = lr

        # Every per-token input on the GPU up front (see _run): [T] each.
        aux = [{"old": old_log_probs[j].to(dev) if old_log_probs is not None else None,
                "mask": mb.loss_mask.to(dev), "adv": mb.advantages.to(dev),
                "rollout": mb.rollout_log_probs.to(dev), "cu": mb.cu_seqlens.to(dev),
                "ref": ref_log_probs[j].to(dev) if ref_log_probs is not None else None}
               for j, mb in enumerate(mbs)]

        def loss_fn(j, mb, lp, ent):  # lp, ent [T] aligned with mb.tokens
            a = aux[j]
            loss, stats, _ = step_objective(spec, hooks=self.hooks, sample_ids=mb.sample_ids, log_probs=lp,
                                            entropy=ent, old_log_probs=a["old"], ref_log_probs=a["ref"],
                                            rollout_log_probs=a["rollout"], advantages=a["adv"],
                                            loss_mask=a["mask"], cu_seqlens=a["cu"], denominator=denom,
                                            response_lengths=mb.response_lengths, tis_scale=mb.tis_scale)
            with torch.no_grad():
                zero = torch.zeros((), device=lp.device)
                dev_ratio = ((torch.exp(lp - a["old"]) - 1).abs() * a["mask"]).max() \
                    if mb.num_tokens and a["old"] is not None else zero
                row = {k: v.detach().float() for k, v in stats.items()
                       if k in SUMMED or k.startswith(("custom_", "tis"))}
                row.update(tokens=stats["tokens"].float(), loss_total=loss.detach().float(), ratio_maxdev=dev_ratio)
            return loss, {"stats": row}

        self._differing = [0, 0]  # train/routing_replay_diff: this step's forwards only
        # a custom loss may use the entropy's gradient
        outs = self._run(mbs, loss_fn, forward_only=False,
                         entropy_grad=spec.entropy_coef != 0 or self.hooks.custom_loss is not None,
                         routing="rollout" if self.rollout_routing else
                         "replay" if self.replays and self.routes.replaying else None)
        # one device → host transfer for the step's numbers: Σ over micro-batches (the ratio check: max)
        keys = sorted({k for o in outs for k in o["stats"]})
        zero = torch.zeros((), device=dev)
        col = {}
        if outs:
            vals = torch.stack([torch.stack([o["stats"].get(k, zero) for k in keys]) for o in outs])  # [M, K]
            total = vals.sum(0)
            total[keys.index("ratio_maxdev")] = vals[:, keys.index("ratio_maxdev")].max()
            col = dict(zip(keys, total.tolist()))
        tokens = col.pop("tokens", 0.0)
        loss_total, ratio_maxdev = col.pop("loss_total", 0.0), col.pop("ratio_maxdev", 0.0)
        out: dict[str, Any] = {}
        for k, v in col.items():  # token sums → means over the step's tokens; a custom loss's shares → step sums
            out.update({f"{k}_stepsum": v} if k.startswith("custom_") else {f"{k}_sum": v, f"{k}_count": tokens})
        if self.rollout_routing:
            diff = torch.tensor([float(x) for x in self._differing], device=dev)
            if self.sp or self.pp > 1:  # each TP rank routed its share of the tokens (MoE under TP: sequence
                from megatron.core import parallel_state  # parallel), each pipeline stage its own layers

                dist.all_reduce(diff, group=parallel_state.get_model_parallel_group())
            out["routing_replay_diff_sum"], out["routing_replay_diff_count"] = diff.tolist()
        if not self.reports_metrics:  # TP / PP peers of a replica report nothing, so sums count once
            out = {k: 0.0 for k in out}
            loss_total, ratio_maxdev = 0.0, 0.0
        skipped_before = self.skipped_steps
        grad_norm = self._optimizer_step(loss_total, mbs)
        self.steps_done += 1
        out.update(loss_total=loss_total, grad_norm=grad_norm, lr=lr,
                   skipped=float(self.skipped_steps > skipped_before),
                   skipped_steps_total=float(self.skipped_steps), ratio_maxdev=ratio_maxdev)
        return out

    def _optimizer_step(self, local_loss: float, mbs: list[MicroBatch]) -> float:
        """Megatron's ChainedOptimizer.step, split so a NaN/Inf gradient can be refused before the update."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm())
        bad = torch.tensor(float(not (math.isfinite(grad_norm) and math.isfinite(local_loss))),
                           device=torch.cuda.current_device())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank skips, or none does
        if bad.item():
            if self.cfg.check_for_nan_in_loss_and_grad:
                from engine.diagnosis import DiagnosisError
                from engine.train.checks import nan_diagnosis

                # the fused log-prob pass gives no per-sample loss: this rank's samples are named
                raise DiagnosisError(nan_diagnosis(step=self.steps_done, rank_losses=local_loss, grad_norm=grad_norm,
                                                   bad_sample_ids=None,
                                                   step_sample_ids=[i for mb in mbs for i in mb.sample_ids]))
            self.skipped_steps += 1
            return grad_norm
        if self.cfg.clip_grad > 0:
            for o in getattr(opt, "chained_optimizers", [opt]):
                params = o.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(
                        params, max_norm=self.cfg.clip_grad, total_norm=grad_norm,
                        use_decoupled_grad=getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                                                   False))
        opt.step_with_ready_grads()
        return grad_norm

    # ---- memory (colocated runs) ------------------------------------------------------------------------------
    def onload(self) -> None:
        """Nothing to do: this backend never offloads (see `offload`)."""

    def offload(self) -> None:
        raise NotImplementedError("--offload-train is not supported by the megatron backend (its decoder CUDA graphs "
                                  "hold fixed addresses); drop --offload-train or use --train-backend torch")

    # ---- state ---------------------------------------------------------------------------------------------
    @_on_own_stream
    def model_state(self, *, to_cpu: bool = True, dst_rank: int = 0) -> dict[str, torch.Tensor]:
        """HF-named full weights on global rank `dst_rank` ({} elsewhere), on the host or (to_cpu=False) on this
        GPU. Collective: every rank must call it."""
        from engine.train.megatron_model import gather_hf_state

        return gather_hf_state(self.gpt, self.config, self.shape, dst_rank=dst_rank, to_cpu=to_cpu)

    def engine_state(self) -> dict[str, torch.Tensor]:
        """`model_state`: the mapping already writes the checkpoint's names."""
        return self.model_state()

    @_on_own_stream
    def ipc_export(self, dtype: str, bucket_bytes: int, *, export: bool = True):
        """The HF-named weights as CUDA IPC buckets in the engine's dtype (engine/weights/ipc.py) on an exporting
        rank (None elsewhere). Every rank gathers for itself, so exporting ranks need PP = 1 (the place stage
        checks; a pipeline gathers to one rank only)."""
        from engine.weights import ipc

        if self.pp > 1 and self.world_size > 1:
            raise NotImplementedError("CUDA IPC weight sync with pipeline parallelism: use --weight-sync-method disk")
        state = self.model_state(to_cpu=False, dst_rank=self.rank)
        return ipc.export(state, getattr(torch, dtype), bucket_bytes) if export else None

    def named_parameters_full(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards by Megatron name, on the host."""
        return {n: p.detach().float().cpu() for n, p in self.gpt.named_parameters()}

    @_on_own_stream
    def save(self, path: str, *, save_optim: bool = True) -> list[str]:
        """dist_checkpointing: model/ (sharded weights) and optim/ (distributed optimizer + step counters; not with
        save_optim=False). Collective; returns the files (relative to `path`) on rank 0."""
        from megatron.core import dist_checkpointing

        root = Path(path)
        subs = ("model", "optim") if save_optim else ("model",)
        if self.rank == 0:
            for sub in subs:
                shutil.rmtree(root / sub, ignore_errors=True)
                (root / sub).mkdir(parents=True)
        if self.cfg.ref_update_interval and self.rank == 0:
            shutil.rmtree(root / "ref", ignore_errors=True)
            (root / "ref" / "model").mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(self.gpt.sharded_state_dict(), str(root / "model"))
        if self.cfg.ref_update_interval:  # the reference moves: a resume must find the one it had
            with self._swapped_in(self.ref_weights):
                dist_checkpointing.save(self.gpt.sharded_state_dict(), str(root / "ref" / "model"))
        fmt = optim_format(self.cfg)
        if save_optim:
            dist_checkpointing.save({"optimizer": self.optimizer.sharded_state_dict(
                self.gpt.sharded_state_dict(), metadata=_format_metadata(fmt, self.cfg))}, str(root / "optim"))
        if self.rank == 0 and save_optim:
            torch.save({"steps_done": self.steps_done, "skipped_steps": self.skipped_steps, "rng": rng_state(),
                        "adam_steps": self._adam_steps(), "layout": self._layout(), "format": fmt},
                       root / "optim" / "backend.pt")
        dist.barrier()
        if self.rank != 0:
            return []
        return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]

    @_on_own_stream
    def load(self, path: str, *, load_optim: bool = True) -> None:
        from megatron.core import dist_checkpointing

        root = Path(path)
        state = dist_checkpointing.load(self.gpt.sharded_state_dict(), str(root / "model"))
        self.gpt.load_state_dict(state)
        if self.cfg.ref_update_interval and (root / "ref" / "model").is_dir():
            self.load_weights(str(root / "ref"), ref=True)
        if load_optim and (root / "optim" / "backend.pt").is_file():
            st = torch.load(root / "optim" / "backend.pt", weights_only=False)
            fmt = st.get("format", DP_RESHARDABLE)  # the format it was written in, whatever this run's flag says
            saved = st.get("layout")  # (None: a checkpoint from before the layout was recorded)
            if fmt == DP_RESHARDABLE and saved is not None and saved != self._layout():
                raise RuntimeError(self._layout_error(root, ", ".join(
                    f"{k} {saved[k]} in the checkpoint, {v} now" for k, v in self._layout().items() if saved[k] != v)))
            self._ensure_adam_state()
            tmpl = {"optimizer": self.optimizer.sharded_state_dict(self.gpt.sharded_state_dict(), is_loading=True,
                                                                   metadata=_format_metadata(fmt, self.cfg))}
            try:
                state = dist_checkpointing.load(tmpl, str(root / "optim"))["optimizer"]
            except Exception as e:  # noqa: BLE001 — megatron-core's KeyError / CheckpointingException: say why
                if fmt != DP_RESHARDABLE:
                    raise
                raise RuntimeError(self._layout_error(root, f"the state does not fit this layout ({self._layout()})"
                                                      f": {type(e).__name__}: {' '.join(str(e).split())[:300]}")) from e
            with torch.no_grad(), self._keeping_adam_steps(fmt):  # it copies into the fp32 main params, leaves that
                if fmt == FULLY_RESHARDABLE:  # require grad
                    self._load_model_space(state)
                else:
                    self.optimizer.load_state_dict(state)
            self.steps_done, self.skipped_steps = st["steps_done"], st["skipped_steps"]
            if "adam_steps" in st:  # (checkpoints before it: the step counts megatron-core's load left)
                self._set_adam_steps(st["adam_steps"])
            set_rng_state(st["rng"])
        else:
            self.optimizer.reload_model_params()  # the fp32 main copy follows the loaded weights

    def _layout(self) -> dict[str, int]:
        """What shards the optimizer checkpoint (megatron-core's dp_reshardable format: only the data-parallel size
        may change between a save and its load)."""
        return {k: int(getattr(self.cfg, k)) for k in MEGATRON_OPTIM_LAYOUT}

    @staticmethod
    def _layout_error(root: Path, why: str) -> str:
        return (f"the Megatron optimizer state in {root / 'optim'} cannot be loaded: {why}. Its format "
                f"({DP_RESHARDABLE}) shards it by tensor, pipeline and expert parallelism (only the data-parallel size "
                "may change): resume with the sizes it was saved with, or with --no-load-optim (the weights reshard "
                "to any layout; Adam's moments start over). Checkpoints saved with --dist-ckpt-optim-fully-reshardable "
                "load into any layout")

    def _load_model_space(self, state: dict) -> None:
        """A fully_reshardable optimizer state into this layout's distributed optimizers. Its tensors come in this
        layout's structure; its other entries (param groups, their step) in the saving layout's, which differs when
        the number of optimizers does: megatron-core gives the experts an optimizer of their own only at EP > 1.
        So each optimizer keeps its own param groups (the learning rate is set at every step, the rest comes from
        the flags) and takes the saved step count (all groups step together)."""
        opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        mine = [state] if len(opts) == 1 else [state[i] for i in range(len(opts))]
        saved = [state] if "optimizer" in state else [v for k, v in state.items() if isinstance(k, int)]
        steps = {float(g["step"]) for c in saved if "optimizer" in c for g in c["optimizer"]["param_groups"]
                 if "step" in g}
        if len(steps) > 1:
            raise RuntimeError(f"the optimizer state's param groups hold different step counts {sorted(steps)}; "
                               "resume with --no-load-optim")
        for opt, own in zip(opts, mine, strict=True):
            common = opt.state_dict()
            for g in common["optimizer"]["param_groups"]:
                if "step" in g and steps:
                    g["step"] = type(g["step"])(next(iter(steps)))
            opt.load_state_dict({**common, "param_state": own["param_state"],
                                 "param_state_sharding_type": FULLY_RESHARDABLE})

    @contextmanager
    def _keeping_adam_steps(self, fmt: str):
        """megatron-core 0.16's fully_reshardable load copies each parameter's optimizer state key by key from the
        checkpoint, which holds no step count, and torch's AdamW (no Apex / TE) keeps one per parameter: a KeyError
        ('step'). Each parameter keeps the step it has for that copy (a copy onto itself); backend.pt's adam_steps
        then set them (_set_adam_steps)."""
        if fmt != FULLY_RESHARDABLE:
            yield
            return
        dist_opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])

        def keeping_step(opt, copy):
            def set_states(model_param, tensors):
                group, order = opt.model_param_group_index_map[model_param]
                st = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
                copy(model_param, {**tensors, "step": st["step"]} if "step" in st and "step" not in tensors
                     else tensors)
            return set_states

        for opt in dist_opts:
            opt._set_main_param_and_optimizer_states = keeping_step(opt, opt._set_main_param_and_optimizer_states)
        try:
            yield
        finally:
            for opt in dist_opts:
                del opt._set_main_param_and_optimizer_states  # (the class's method again)

    def _inner_optimizers(self) -> list:
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def _adam_steps(self) -> list[float | None]:
        """Each inner optimizer's Adam step count (its parameters step together), None before its first step."""
        out = []
        for o in self._inner_optimizers():
            steps = {float(st["step"]) for st in o.state.values() if "step" in st}
            out.append(max(steps) if steps else None)
        return out

    def _ensure_adam_state(self) -> None:
        """torch's AdamW has no state before its first step, and megatron-core 0.16's optimizer checkpoint template
        (DistributedOptimizer.state_dict, without Apex / TE) asserts one step count over the states: a backend that
        had not stepped yet (a resumed run's) could not load its checkpoint. Each parameter gets the state AdamW's
        first step would make, zero moments at step 0, which the load then overwrites (the steps: _set_adam_steps)."""
        for o in self._inner_optimizers():
            if not isinstance(o, (torch.optim.Adam, torch.optim.AdamW)):
                continue  # (TE's / Apex's FusedAdam keep their step in the param groups)
            for g in o.param_groups:
                on_device = bool(g.get("fused") or g.get("capturable"))
                for p in g["params"]:
                    if p.numel() and not o.state.get(p):
                        o.state[p] = {"step": torch.zeros((), dtype=torch.float32,
                                                          device=p.device if on_device else "cpu"),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def _set_adam_steps(self, steps: list[float | None]) -> None:
        """torch's AdamW (megatron-core's optimizer without Apex / TE) keeps the step of its bias correction per
        parameter; megatron-core 0.16's dp_reshardable load restores the moments but leaves those steps as they
        were (a backend that trained past the checkpoint went on with its later count: measured on the CPU
        harness, tests/test_megatron_cpu_backend.py). Each parameter gets its own tensor: torch's step increments
        it in place. A fully_reshardable checkpoint loaded with another number of optimizers (the experts' has its
        own only at EP > 1) gives them all its one count."""
        inner = self._inner_optimizers()
        if len(steps) != len(inner) and len(set(steps) - {None}) == 1:
            steps = [next(iter(set(steps) - {None}))] * len(inner)
        for o, step in zip(inner, steps, strict=True):
            if step is None:
                continue
            for st in o.state.values():
                if "step" in st:
                    st["step"] = torch.tensor(step, dtype=st["step"].dtype, device=st["step"].device)

    @_on_own_stream
    def load_weights(self, path: str, *, ref: bool = False) -> None:
        """Policy (or reference) weights only: a Hugging Face directory (mapped and sharded as at start-up), or a
        checkpoint iteration (this backend's dist_checkpointing model/, or the torch backend's HF-named one). The
        reference is kept as this rank's shards on the host, like the initial weights it replaces; the policy's
        fp32 main copy follows."""
        current = self._host_copy() if ref else None
        self._read_weights(Path(path), what="--ref-load" if ref else "the weights")
        if ref:
            self.ref_weights = self._host_copy()
            with torch.no_grad():
                for n, p in self.gpt.named_parameters():
                    p.copy_(current[n], non_blocking=True)
        else:
            self.optimizer.reload_model_params()

    def _read_weights(self, root: Path, *, what: str) -> None:
        """Weights into the model's parameters (not the optimizer's fp32 copy): an HF directory, or an iteration
        directory whose model/ is a dist_checkpointing save (this backend) or HF-named safetensors (torch's)."""
        from megatron.core import dist_checkpointing

        from engine.train.megatron_model import load_hf_into
        from engine.weights import load_weights_dir

        if (root / "config.json").is_file():
            hf_config = json.loads((root / "config.json").read_text())
            theirs = dataclasses.replace(shape_from_hf_config(hf_config), max_position_embeddings=0)
            if theirs != dataclasses.replace(self.shape, max_position_embeddings=0):  # (the limit changes no weight)
                from engine.diagnosis import ConfigError, Diagnosis

                raise ConfigError(Diagnosis(
                    code="CONFIG", severity="error",
                    what=f"{what} {root}: its architecture ({theirs}) is not the policy's ({self.shape}); the "
                         "megatron backend loads it into the policy's model",
                    fix="weights of the policy's architecture" + (
                        ", or --opd-type sglang for a teacher of another size" if what.startswith("--opd") else ""),
                    facts={"field": what.lstrip("-").replace("-", "_"), "value": str(root)}))
        with torch.no_grad():
            if (root / "config.json").is_file():
                load_hf_into(self.gpt, self.config, load_weights_dir(root), self.shape, vocab_padded=self.vocab_padded)
            elif (root / "model" / "metadata.json").is_file():  # dist_checkpointing's
                self.gpt.load_state_dict(dist_checkpointing.load(self.gpt.sharded_state_dict(), str(root / "model")))
            else:
                load_hf_into(self.gpt, self.config, load_weights_dir(root / "model"), self.shape,
                             vocab_padded=self.vocab_padded)

    @_on_own_stream
    def update_ref(self) -> None:
        """--ref-update-interval: the reference becomes the policy's current weights (this rank's shards)."""
        self.ref_weights = self._host_copy()

    def reset_optimizer(self) -> None:
        """--reset-optimizer-states: the inner optimizers' Adam moments and steps to zero, in place."""
        from engine.train.optim import reset_state

        for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            reset_state(o.optimizer)

    @_on_own_stream
    def export_hf(self, path: str) -> None:
        """HF directory on rank 0: model.safetensors from the gathered weights, config/tokenizer files copied."""
        from engine.weights import save_weights_dir

        state = self.model_state()
        if self.rank != 0:
            return
        out = save_weights_dir(state, path)
        for f in Path(self.cfg.hf_checkpoint).iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt", ".safetensors.index.json")) \
                    and not f.name.startswith("."):
                shutil.copy(f, out / f.name)
