"""Building a megatron-core GPTModel for an HF Qwen2 / Qwen3 / Llama / Mistral / Qwen2-MoE / Qwen3-MoE / Mixtral
checkpoint, and moving HF weights in and out.

`model_kwargs` is pure (CPU-testable); everything else needs megatron-core, a CUDA device and an initialised
`parallel_state`. The layer spec is Transformer Engine's when TE is installed, else megatron-core's local
modules with the packed flash attention of `megatron_attention` in the core-attention slot.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from engine.train.megatron_mapping import ModelShape, hf_to_megatron, megatron_to_hf, moe_layer, tp_gather, tp_shard


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@dataclass(frozen=True)
class Kernels:
    """Speed choices that leave the math unchanged (bench/gpu_megatron.py measures each one)."""

    fused_log_probs: bool = True  # TP = 1: log-softmax / entropy on bf16 logits, torch.compile'd (packed_logprobs)
    rope_in_attention: bool = True  # without TE: RoPE in the packed core attention, no per-layer host sync
    # Megatron's compiled SwiGLU (bias_activation_fusion). None = with the decoder CUDA graphs only: eager, each
    # call pays torch.compile's guard checks on the CPU and measured slower (32.7% vs 36.4% MFU); replayed from a
    # graph only its fused kernels remain (54.4% vs 49.1%). bench/results/gpu_megatron.md.
    fused_swiglu: bool | None = None
    fused_adam: bool = True  # torch's single-kernel AdamW for Megatron's fallback optimizer (no TE / apex)
    wgrad_fusion: bool = True  # weight grads accumulated into the fp32 main grad by the GEMM itself (no apex)
    hf_rms_norm: bool = False  # without TE: RMSNorm in transformers' rounding order (bf16 parity with HF;
    #                            several kernels instead of torch's one fused RMSNorm)
    cuda_graphs: bool = True  # without TE, bf16/fp16, TP = PP = 1: the decoder replayed from CUDA graphs
    #                           (megatron_graphs; needs rope_in_attention)
    # Megatron's activation recompute, (granularity, method, num_layers) (not a speed choice: it trades compute for
    # activation memory; the math is unchanged): --recompute-activations is ("full", "uniform", 1)
    recompute: tuple[str, str | None, int | None] | None = None

    @classmethod
    def of(cls, cfg) -> "Kernels":
        """The run's choices: --megatron-cuda-graphs, the recompute flags (the rest keep their defaults)."""
        return cls(cuda_graphs=cfg.megatron_cuda_graphs, recompute=cfg.recompute)


class HFRMSNorm(torch.nn.Module):
    """RMSNorm as transformers computes it: normalise in fp32, round to the input dtype, then × weight (in
    that dtype). torch's fused RMSNorm rounds once, after the weight; in bf16 the two differ by an ulp."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        # sequence parallelism: each TP rank sees its share of the tokens, so the weight's gradient is a partial sum
        # that megatron-core's finalize_model_grads all-reduces over TP (for the params it finds marked)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class SPRMSNorm(HFRMSNorm):
    """torch's fused RMSNorm (megatron-core's local layers' WrappedTorchNorm, which refuses sequence parallelism)
    with the weight marked for finalize_model_grads' all-reduce over TP (--sequence-parallel)."""

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32: main_grad [out, in] += gᵀ·x in one GEMM with
    an fp32 output (torch's addmm out_dtype), instead of a bf16 weight grad and a separate fp32 add per
    micro-batch (measured 1,584 such adds, 47 ms, per 8×4,096-token step of the 1.5B shape)."""
    x = total_input.reshape(-1, total_input.shape[-1])  # [N, in]
    g = grad_output.reshape(-1, grad_output.shape[-1])  # [N, out]
    if x.dtype == torch.float32:
        main_grad.addmm_(g.t(), x)
    else:
        torch.ops.aten.addmm.dtype_out(main_grad, g.t(), x, torch.float32, out=main_grad)


def enable_wgrad_fusion() -> bool:
    """Let Megatron's linear layers use gradient_accumulation_fusion without apex; True when it is active.
    Checked once on the GPU against the unfused sum (a torch without addmm out_dtype keeps it off)."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:  # apex's extension is installed
        return True
    if not torch.cuda.is_available() or "dtype_out" not in torch.ops.aten.addmm.overloads():
        return False
    try:
        g = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
        acc = torch.randn(48, 32, device="cuda")
        want = acc + g.float().t() @ x.float()
        _wgrad_gemm_accum_fp32(x, g, acc)
        if not torch.allclose(acc, want, atol=1e-3, rtol=1e-3):
            return False
    except Exception:  # the op exists but not for this device / dtype
        return False
    layers.fused_weight_gradient_mlp_cuda = SimpleNamespace(wgrad_gemm_accum_fp32=_wgrad_gemm_accum_fp32)
    layers._grad_accum_fusion_available = True
    return True


def static_swiglu_kernels() -> None:
    """Megatron compiles its SwiGLU forward / backward with torch.compile's default automatic-dynamic shapes:
    after a second micro-batch length they are recompiled for any length, and that kernel ran 3× slower on the
    H200 (90 vs 31 ms a step for the backward; bench/results/gpu_megatron.md). Recompile per shape instead:
    with CUDA graphs the shapes are the few graph buckets."""
    from megatron.core.fusions import fused_bias_swiglu as f

    for name in ("swiglu", "swiglu_back"):
        fn = getattr(f, name)
        orig = getattr(fn, "_torchdynamo_orig_callable", None)
        if orig is None or getattr(fn, "_rollflow_static", False):
            continue  # not compiled (jit_fuser disabled), or done already
        static = torch.compile(orig, dynamic=False)
        static._rollflow_static = True
        setattr(f, name, static)


def router_without_te() -> None:
    """megatron-core 0.16.1's router reads `te_general_gemm`, which its moe_utils defines only when Transformer
    Engine imports: without TE every MoE forward raised NameError. None is what that code expects then (it takes
    its torch.mm path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def rope_in_attention(kernels: Kernels) -> bool:
    return kernels.rope_in_attention and not have_transformer_engine()


def swiglu_fusion(kernels: Kernels, *, tp: int, pp: int, dtype: torch.dtype, moe: bool = False) -> bool:
    if kernels.fused_swiglu is None:
        return use_cuda_graphs(kernels, tp=tp, pp=pp, dtype=dtype, moe=moe)
    return kernels.fused_swiglu


def cuda_graphs_off_reason(kernels: Kernels, *, tp: int, pp: int, dtype: torch.dtype, moe: bool = False
                           ) -> str | None:
    """Why the decoder runs eagerly (None: it is replayed from CUDA graphs). Graphs apply to the local layers
    with RoPE in the packed attention, one GPU per model (no TP / PP collectives inside a graph), the flash
    path (fp32 attention splits samples on the host) and dense MLPs (routing counts each expert's tokens on the
    host)."""
    if not kernels.cuda_graphs:
        return "--no-megatron-cuda-graphs"
    if moe:
        return "a mixture of experts (the router's token counts per expert are read on the host)"
    if kernels.recompute:
        return f"{kernels.recompute[0]} recompute (the recomputed layers run inside the backward)"
    if have_transformer_engine():
        return "Transformer Engine layers (Megatron's own graph support is for those)"
    if not rope_in_attention(kernels):
        return "Megatron's RoPE (rope_in_attention off) splits samples on the host"
    if tp != 1 or pp != 1:
        return f"TP={tp}, PP={pp}: the decoder's collectives cannot be captured"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype}: the fp32 attention splits samples on the host"
    return None


def use_cuda_graphs(kernels: Kernels, *, tp: int, pp: int, dtype: torch.dtype, moe: bool = False) -> bool:
    return cuda_graphs_off_reason(kernels, tp=tp, pp=pp, dtype=dtype, moe=moe) is None


def model_kwargs(shape: ModelShape, *, tp: int, pp: int, dtype: torch.dtype, kernels: Kernels = Kernels(),
                 ep: int = 1, sp: bool = False) -> tuple[dict, dict]:
    """(TransformerConfig kwargs, GPTModel kwargs) of an HF architecture: RMSNorm, SwiGLU, RoPE, no dropout.
    ep: expert parallelism (a mixture of experts: num_experts / ep local experts per rank); sp: sequence
    parallelism (--sequence-parallel, TP > 1)."""
    import torch.nn.functional as F

    s = shape
    config = dict(
        num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_heads,
        num_query_groups=s.num_kv_heads, kv_channels=s.head_dim, ffn_hidden_size=s.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=s.norm_eps, add_bias_linear=False, add_qkv_bias=s.qkv_bias,
        gated_linear_unit=True, activation_func=F.silu, qk_layernorm=s.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # Packed micro-batches differ in length: PP sends shapes first. (Megatron then refuses the MoE
        # `allgather` dispatcher, so the dense model names alltoall; it has no experts to dispatch.)
        pipeline_dtype=dtype, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        # Each micro-batch's loss is already Σ_samples mean / G (engine.train.torch_backend); no rescaling.
        calculate_per_token_loss=True,
        # Every weight is overwritten from the HF checkpoint right after construction, but initialisation stays
        # on: it is what tags TP-sharded weights (`tensor_model_parallel`); without the tag the grad norm counts
        # them once instead of per shard (measured: TP=2 norm 0.352 vs 0.424 at TP=1, same gradients).
        perform_initialization=True,
        # Fusions that need apex / TE stay off; torch's RMSNorm and our attention are used instead.
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        bias_activation_fusion=swiglu_fusion(kernels, tp=tp, pp=pp, dtype=dtype, moe=s.num_experts > 0),
    )
    if s.sliding_window and have_transformer_engine():  # TE's attention window: (left, right) tokens besides itself
        config.update(window_size=(s.sliding_window - 1, 0))
    if s.num_experts:  # HF's routing: softmax over the router's logits, the top k, renormalised with norm_topk_prob
        # (Megatron's softmax over the top k logits is that renormalisation; without it the probabilities are taken
        # from the softmax over all experts: pre-softmax). No load-balancing loss (an RL step trains the policy's
        # loss only), no token dropping, one SequentialMLP of local experts (no grouped GEMM without TE).
        config.update(num_moe_experts=s.num_experts, moe_router_topk=s.moe_top_k,
                      moe_ffn_hidden_size=s.moe_expert_ffn, moe_router_pre_softmax=not s.moe_norm_topk,
                      moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                      # 1: experts, 0: a dense MLP (Qwen's mlp_only_layers / decoder_sparse_step)
                      moe_layer_freq=[int(moe_layer(s, i)) for i in range(s.num_layers)],
                      # experts are never split by TP (ETP = 1: megatron-core's default is ETP = TP)
                      expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        if s.moe_shared_ffn:  # Qwen2-MoE: + sigmoid(x · w_gate) · shared_expert(x)
            config.update(moe_shared_expert_intermediate_size=s.moe_shared_ffn,
                          moe_shared_expert_gate=s.moe_shared_gate)
    if kernels.recompute:  # slime's --recompute-granularity / --recompute-method / --recompute-num-layers
        granularity, method, layers = kernels.recompute
        config.update(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=layers)
    gpt = dict(
        max_sequence_length=s.max_position_embeddings,
        # RoPE applied by PackedCoreAttention instead: GPTModel must not rotate a second time.
        position_embedding_type="none" if rope_in_attention(kernels) else "rope",
        rotary_base=int(s.rope_theta), rotary_percent=1.0, share_embeddings_and_output_weights=s.tie_embeddings,
        rope_scaling=s.rope_scaling_factor is not None, rope_scaling_factor=s.rope_scaling_factor or 8.0,
    )
    return config, gpt


def layer_spec(shape: ModelShape, kernels: Kernels = Kernels(), *, moe: bool | None = None, sp: bool = False):
    """TE layers when installed; else local layers with the packed flash core attention. `moe`: whether the layer
    has experts (default: whether the model has); sp: sequence parallelism (norms that support it)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    experts = (shape.num_experts or None) if moe in (None, True) else None
    if have_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm)
    from engine.train.megatron_attention import PackedCoreAttention, Rope

    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                    qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    rope = Rope(shape.rope_theta, shape.rope_scaling_factor) if rope_in_attention(kernels) else None
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = ModuleSpec(module=PackedCoreAttention,
                                     params={"rope": rope, "window": shape.sliding_window or None})
    norm = HFRMSNorm if kernels.hf_rms_norm else SPRMSNorm if sp else None
    if norm is not None:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        if shape.qk_norm:
            attn.q_layernorm = attn.k_layernorm = norm
    return spec


def block_spec(shape: ModelShape, config, kernels: Kernels = Kernels()):
    """This stage's layers (a mixture of experts with dense layers: each its own kind), and the final norm (with
    hf_rms_norm, HF's, and with sequence parallelism one that supports it: a layer spec cannot set it)."""
    own = not have_transformer_engine()
    sp = bool(config.sequence_parallel)
    final = HFRMSNorm if kernels.hf_rms_norm and own else SPRMSNorm if sp and own else None
    if final is None and not shape.moe_dense_layers:
        return layer_spec(shape, kernels, sp=sp)
    from megatron.core.transformer.transformer_block import (LayerNormImpl, TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    first = layer_offset(config)
    kinds = {moe: layer_spec(shape, kernels, moe=moe, sp=sp)
             for moe in {moe_layer(shape, i) for i in range(shape.num_layers)}}
    specs = [kinds[moe_layer(shape, first + i)] for i in range(get_num_layers_to_build(config))]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final or LayerNormImpl)


def build_model(shape: ModelShape, *, vocab_padded: int, dtype: torch.dtype, tp: int, pp: int, ep: int = 1,
                kernels: Kernels = Kernels(), routing_replay: bool = False, sp: bool = False,
                deterministic: bool = False):
    """A GPTModel stage for this rank (pre/post-process by pipeline stage) and its TransformerConfig.
    routing_replay (--use-routing-replay): each router gets megatron-core's RouterReplay (megatron_backend drives
    it); sp: --sequence-parallel; deterministic: --deterministic-mode (megatron-core's deterministic_mode)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg_kw, gpt_kw = model_kwargs(shape, tp=tp, pp=pp, dtype=dtype, kernels=kernels, ep=ep, sp=sp)
    if shape.num_experts:
        router_without_te()
    cfg_kw["gradient_accumulation_fusion"] = kernels.wgrad_fusion and enable_wgrad_fusion()
    if routing_replay:
        cfg_kw["moe_enable_routing_replay"] = True
    if deterministic:
        cfg_kw["deterministic_mode"] = True
    if cfg_kw["bias_activation_fusion"]:
        static_swiglu_kernels()
    config = TransformerConfig(**cfg_kw)
    model = GPTModel(config=config, transformer_layer_spec=block_spec(shape, config, kernels),
                     vocab_size=vocab_padded,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), **gpt_kw)
    return model, config


def fused_norms() -> bool:
    """TE's LayerNormLinear holds the pre-attention / pre-MLP norms inside linear_qkv / linear_fc1."""
    return have_transformer_engine()


def _global_name(name: str, offset: int, expert_offset: int = 0) -> str:
    """decoder.layers.<local>.… → decoder.layers.<local + this stage's first layer>.…, and (expert parallelism)
    ….local_experts.<local>.… → ….local_experts.<local + this EP rank's first expert>.…"""
    parts = name.split(".")
    if name.startswith("decoder.layers.") and offset:
        parts[2] = str(int(parts[2]) + offset)
    if expert_offset and ".local_experts." in name:
        i = parts.index("local_experts") + 1
        parts[i] = str(int(parts[i]) + expert_offset)
    return ".".join(parts)


def expert_offset(shape: ModelShape) -> int:
    """This rank's first expert, as megatron-core's MoELayer places them: EP rank × experts per EP rank (0 without
    EP or experts)."""
    from megatron.core import parallel_state

    if not shape.num_experts:
        return 0
    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (shape.num_experts // ep)


def layer_offset(config) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config)


@torch.no_grad()
def load_hf_into(model, config, hf: dict[str, torch.Tensor], shape: ModelShape, *, vocab_padded: int) -> None:
    """Copy HF weights into this rank's GPTModel (unwrapped) parameters: map, shard by TP, by PP stage, and (EP)
    this rank's experts only."""
    from megatron.core import parallel_state

    full = hf_to_megatron(hf, shape, fused_norms=fused_norms(), vocab_padded=vocab_padded)
    if shape.tie_embeddings:  # a last stage without the embedding holds its own copy of the tied LM head
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    offset, first_expert = layer_offset(config), expert_offset(shape)
    missing = []
    for name, p in model.named_parameters():
        src = full.get(_global_name(name, offset, first_expert))
        if src is None:
            missing.append(name)
            continue
        part = tp_shard(name, src, rank, size)
        if part.shape != p.shape:
            raise ValueError(f"{name}: mapped HF shape {tuple(part.shape)} != Megatron shape {tuple(p.shape)}")
        p.copy_(part.to(device=p.device, dtype=p.dtype))
    if missing:
        raise ValueError(f"HF checkpoint has no weights for Megatron parameters {missing[:6]}")


@torch.no_grad()
def gather_hf_state(model, config, shape: ModelShape, *, dst_rank: int = 0, to_cpu: bool = True
                    ) -> dict[str, torch.Tensor]:
    """HF-named full weights on global rank `dst_rank` ({} elsewhere): CPU tensors, or (to_cpu=False, PP = 1) on the
    GPU. Collective over TP, EP and PP."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size() if shape.num_experts else 1
    offset, per_rank = layer_offset(config), shape.num_experts // ep
    local: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name == "output_layer.weight" and shape.tie_embeddings:
            continue
        if ep > 1 and ".local_experts." in name:  # (experts are never TP-split: check_tp) EP rank j holds
            owners = [torch.empty_like(p) for _ in range(ep)]  # experts j·per_rank … (j+1)·per_rank − 1
            dist.all_gather(owners, p.data.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            for j, w in enumerate(owners):
                local[_global_name(name, offset, j * per_rank)] = w
            continue
        shards = [torch.empty_like(p) for _ in range(tp)] if tp > 1 else [p.data]
        if tp > 1:
            dist.all_gather(shards, p.data.contiguous(), group=tp_group)
        local[_global_name(name, offset)] = tp_gather(name, shards)
    # Pipeline stages hold different layers: each stage's TP rank 0 sends its part to dst_rank.
    full: dict[str, torch.Tensor] = {}
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 or not dist.is_initialized():
        # (a copy even where the parameters live on the host, as in tests/test_megatron_cpu_backend.py: the
        # weights as they are now, not views that later steps move)
        full = {k: v.to("cpu", copy=True) if to_cpu else v for k, v in local.items()} \
            if dist.get_rank() == dst_rank else {}
    else:
        parts: list[Any] = [None] * dist.get_world_size()
        mine = {k: v.cpu() for k, v in local.items()} if parallel_state.get_tensor_model_parallel_rank() == 0 else {}
        dist.gather_object(mine, parts if dist.get_rank() == dst_rank else None, dst=dst_rank)
        if dist.get_rank() == dst_rank:
            for part in parts:
                full.update(part)
    if not full:
        return {}
    return megatron_to_hf(full, shape, fused_norms=fused_norms())
