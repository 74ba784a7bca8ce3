"""Training flags: backend, batch sizes, optimizer."""
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from engine.config.base import Section
from engine.diagnosis import ConfigError, Diagnosis


class TrainArgs(Section):
    train_backend: Literal["torch", "megatron"] = "torch"
    """Training backend: torch (a Hugging Face model in PyTorch, gloo/NCCL; --model-impl) or megatron (megatron-core, GPU only)."""

    model_impl: Literal["auto", "native", "transformers"] = "auto"
    """The model code of the torch backend and the built-in engine. native: rollflow's own Llama-family code (Qwen2,
    Qwen3, Llama with default RoPE, on the CPU; transformers' parameter names and, in float32, its numbers bit for
    bit; engine/native_model.py), which starts without importing transformers' modeling tree (the bundled model
    loads in ~0.2 s of CPU instead of ~2 s in a process that has torch). transformers: transformers' classes. auto: native where the model and the device allow it, else
    transformers; each process logs which it loaded and why. The megatron backend and an SGLang engine have their
    own model code (SGLang: --sglang-model-impl)."""

    tensor_model_parallel_size: int = Field(1, ge=1)
    """Megatron tensor parallelism (TP): GPUs that split each layer's matrices (megatron backend only)."""

    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Megatron pipeline parallelism (PP): stages that split the layers (megatron backend only)."""

    expert_model_parallel_size: int = Field(1, ge=1)
    """Megatron expert parallelism (EP) for a mixture of experts: each expert lives on one of EP data-parallel ranks
    (num_experts / EP experts per rank), and every MoE layer sends each token to its experts' ranks and back (an
    all-to-all over the EP group). Everything else stays replicated over the data-parallel ranks. Experts are never
    split by TP: under --tensor-model-parallel-size (with --sequence-parallel) an EP group also takes the
    tensor-parallel ranks, so EP must divide data-parallel × tensor-parallel ranks (the GPUs of a pipeline stage),
    and the number of experts (megatron backend only)."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (slime's / Megatron-LM's flag; needs TP > 1): the layers outside the
    tensor-parallel matrices (norms, residuals, dropout-free activations between them) hold 1/TP of each micro-batch's
    tokens, gathered before the column-parallel matrices and reduce-scattered after the row-parallel ones, in place of
    TP's all-reduces. Activation memory outside the matrices drops by TP; the math is unchanged. A micro-batch is
    padded to a multiple of TP tokens (a segment of its own, outside every loss). Megatron backend only."""

    megatron_cuda_graphs: bool = True
    """Megatron backend: replay the decoder from CUDA graphs, one per micro-batch shape (bf16/fp16, TP = PP = 1,
    without Transformer Engine; micro-batches are padded to 1,024-token buckets). --no-megatron-cuda-graphs runs
    every layer eagerly."""

    custom_megatron_init_path: Optional[str] = None
    """Megatron backend (slime's hook): fn(args), called on every train rank once the model, its DDP wrapper and the optimizer are built and the weights loaded. module:function or path/to/file.py:function."""

    custom_megatron_before_log_prob_hook_path: Optional[str] = None
    """Megatron backend (slime's hook): fn(args, model, store_prefix) before every no-grad log-prob forward, on every train rank: model is the list of Megatron model chunks, store_prefix "" for the policy, "ref_" for the reference, "teacher_" for the --use-opd teacher."""

    custom_megatron_before_train_step_hook_path: Optional[str] = None
    """Megatron backend (slime's hook): fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before every optimizer step, on every train rank (step_id: the step within the rollout). opt_param_scheduler is None: the backend sets the learning rate itself each step (--lr-decay-style)."""

    bf16: bool = False
    """Train in bf16: bf16 matrix products and activations, fp32 master weights, gradients and optimizer state (torch:
    autocast over fp32 parameters; megatron: bf16 parameters with the distributed optimizer's fp32 main copy). The fp32
    master copy keeps small updates (lr·Δ below bf16's 8-bit mantissa) from rounding away. Off: fp32 throughout."""

    recompute_activations: bool = False
    """Activation checkpointing: keep only each decoder layer's input and recompute the layer in the backward pass
    (~1/3 more compute, activation memory of one layer instead of all). On the megatron backend it is slime's
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1."""

    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Megatron's activation recompute (slime's / Megatron-LM's flag; megatron backend): full recomputes whole
    decoder layers (with --recompute-method and --recompute-num-layers), selective only each layer's core attention
    (the softmax of the attention, whose activations grow with the square of the length; little compute). The math
    is unchanged. --recompute-activations is the full, uniform, 1-layer case."""

    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With --recompute-granularity full: uniform recomputes chunks of --recompute-num-layers layers, each chunk's
    input kept; block recomputes only the first --recompute-num-layers layers of each pipeline stage whole (the
    others keep their activations)."""

    recompute_num_layers: Optional[int] = Field(None, ge=1)
    """With --recompute-granularity full: the chunk size (uniform) or the number of recomputed layers per pipeline
    stage (block)."""

    recompute_loss_function: bool = False
    """Recompute the log-softmax and entropy over the vocabulary in the backward from the logits (slime's flag, as it checkpoints its loss function): the step keeps the logits for the backward instead of the float32 [tokens, vocabulary] intermediates (two per micro-batch in the torch backend's CPU formula), for one more log-softmax per micro-batch and the same gradients. Where the formula is the fused CUDA kernel (the torch backend on a GPU, Megatron at TP = 1), whose backward keeps only the logits already, the flag is refused: it would change nothing (bench/results/loss_memory_gpu.md); it applies on the CPU and to Megatron's vocabulary-parallel formula (TP > 1). Not with --log-probs-chunk-size, whose chunks already recompute it."""

    log_probs_chunk_size: int = -1
    """Compute the LM head and the log-softmax this many trained positions at a time (slime's flag; -1 = all at
    once), for memory: the [tokens, vocabulary] logits and their gradient are never held whole, each chunk's are
    recomputed in the backward (one more LM-head product per chunk). Same log-probs and gradients up to the
    matrix product's rounding. On a 151,936-token vocabulary a 16k-token micro-batch's bf16 logits alone are
    4.9 GB. Torch backend; megatron backend with TP = 1."""

    train_share_prefix: Literal["auto", "on", "off"] = "auto"
    """Torch backend: samples of a micro-batch that share their prompt (a GRPO group) run it once — the prompt's forward
    and backward once per group, each response attending to it (the same log-probs and gradients up to float
    rounding; engine/train/forward.py). auto: on where the attention is SDPA (CPU; fp32 on CUDA), off where it is the
    flash-attention varlen kernel (CUDA with --bf16), which takes no such mask. on: everywhere (CUDA through SDPA with
    a mask). The megatron backend does not share prompts (auto is off there; on is refused)."""

    offload_train: bool = False
    """Move the trainer's weights, gradients and optimizer state to CPU memory while the engines generate, and back
    for the train step (colocated runs on one GPU; torch backend)."""

    global_batch_size: Optional[int] = Field(None, ge=1)
    """Samples (not prompts) per optimizer step (G). Default: B·n / num_steps_per_rollout."""

    num_steps_per_rollout: Optional[int] = Field(None, ge=1)
    """Optimizer steps per rollout (k); sets G = B·n / k and must agree with an explicit --global-batch-size."""

    micro_batch_size: int = Field(1, ge=1)
    """Samples per micro-batch in static mode (gradient accumulation over micro-batches)."""

    lr: float = Field(1e-6, gt=0)
    """Peak learning rate (AdamW)."""

    min_lr: float = Field(0.0, ge=0)
    """Final learning rate of the cosine schedule (with --lr-decay-style cosine; an error with constant, where it would do nothing)."""

    lr_decay_style: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up, sized by train_iters."""

    lr_warmup_iters: int = Field(0, ge=0)
    """Linear warm-up steps."""

    lr_warmup_fraction: Optional[float] = Field(None, gt=0, le=1)
    """Linear warm-up over this fraction of the run's optimizer steps (Megatron-LM's flag, in slime's scripts): the warm-up ends after fraction × train_iters steps, whatever --num-rollout makes of them. Not with --lr-warmup-iters (pick one)."""

    def warmup_steps(self, train_iters: int) -> float:
        """The warm-up's length in optimizer steps: --lr-warmup-iters, or --lr-warmup-fraction of train_iters (as
        Megatron-LM, a fraction of a step counts)."""
        return self.lr_warmup_fraction * train_iters if self.lr_warmup_fraction else float(self.lr_warmup_iters)

    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""

    adam_beta1: float = Field(0.9, gt=0, lt=1)
    """AdamW beta1 (not with --use-stateless-adam, whose update does not depend on the betas)."""

    adam_beta2: float = Field(0.98, gt=0, lt=1)
    """AdamW beta2 (not with --use-stateless-adam, whose update does not depend on the betas)."""

    freeze_params_name_list: list[str] = []
    """Regular expressions (Python `re.search`) of the policy's parameter names (Hugging Face names, e.g. `embed_tokens` or `layers\\.[0-3]\\.`) to freeze (slime's flag): they get no gradient and no update; the others train. A tied embedding / LM head is one parameter: frozen when either name matches. A pattern that matches no parameter is an error. Torch backend; the critic is not affected."""

    only_train_params_name_list: list[str] = []
    """Regular expressions of the policy's parameter names to train (slime's flag); every other parameter is frozen. With --freeze-params-name-list, a parameter matching both is frozen."""

    reset_optimizer_states: bool = False
    """Zero the optimizer's state at the start of every rollout's training (slime's flag): Adam's moments and step counts (so its bias correction restarts); the learning-rate schedule goes on. Policy and critic. Torch backend."""

    use_stateless_adam: bool = False
    """AdamW with its moments started from zero at every optimizer step, so none are kept (slime's flag): the update is lr·g / (|g| + ε) after weight decay, exactly AdamW's first step, and the optimizer holds no state — two float32 copies of the trained weights less memory. The same training as --reset-optimizer-states when each rollout takes one optimizer step (--num-steps-per-rollout 1). Policy and critic. Torch backend. Checkpoints still carry the schedule and RNG state (slime requires --no-save-optim; rollflow does not)."""

    clip_grad: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 = off)."""

    check_for_nan_in_loss_and_grad: bool = True
    """Fail a step whose loss or gradients are NaN/Inf, naming its samples (RF13); --no-… skips such steps instead."""

    ci_save_grad_norm: Optional[str] = None
    """Write every optimizer step's global gradient norm to this path (slime's flag, for regression gates), `{rollout_id}`, `{step_id}` and `{role}` (actor, or critic for PPO's critic) filled in, e.g. `runs/ref/gn_{role}_{rollout_id}_{step_id}.json`; a later run with --ci-load-grad-norm checks it reproduces them. JSON, on the driver's filesystem."""

    ci_load_grad_norm: Optional[str] = None
    """Check every optimizer step's global gradient norm against the one --ci-save-grad-norm wrote at this path (slime's flag and tolerance: relative 1% or absolute 0.01); a step that differs, or whose file is missing, stops the run with a REPRODUCE error naming both numbers. E.g. the same seed and data after an upgrade, or on another backend."""

    distributed_timeout_minutes: float = Field(10.0, gt=0)
    """Timeout of the train ranks' process groups (slime's flag and default): a collective that waits longer for a rank (e.g. one rank saving or stuck) fails instead of hanging (torch.distributed's `timeout`, both backends and Megatron's model-parallel groups). Raise it when a rank may legitimately lag, e.g. a slow checkpoint write on rank 0. DP > 1 or Megatron only."""

    train_step_timeout: float = Field(1800.0, gt=0)
    """Seconds one train call (log-probs or an optimizer step) may take on the workers before it fails."""

    seed: int = 1234
    """Seed for data order, sampling and initialisation (data order and sampling: --rollout-seed when set)."""

    rollout_seed: Optional[int] = None
    """Seed of the data order and of the engines' sampling only (slime's flag), e.g. to draw other samples from the same initial weights; --seed still seeds the trainer. Default: --seed. Kept on resume, like --seed."""

    train_threads: int = Field(0, ge=0)
    """torch CPU threads per train worker (0 = the cores shared by the processes running at once: (cores - 1) / max(workers, engines) in a synchronous run, whose trainer and engines take turns while the driver keeps one core for its bookkeeping; cores / (workers + engines) with --async-mode)."""

    deterministic_mode: bool = False
    """Run-to-run reproducible training on a GPU (Megatron-LM's flag, which slime's scripts/run-qwen2.5-0.5B-reproducibility.sh sets): every train worker calls torch.use_deterministic_algorithms(True) (an op without a deterministic CUDA kernel is then an error naming it, not a silent difference), turns cuDNN's autotuning off, and sets CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring where --train-env-vars or the environment does not; the Megatron backend also sets megatron-core's deterministic_mode. The same command then trains to the same weights; with the built-in engine or SGLang, --sglang-enable-deterministic-inference makes the rollouts reproducible too. Slower; on CPU the kernels are deterministic already."""

    train_env_vars: dict[str, str] = {}
    """Extra environment variables of every train worker process (slime's flag), a JSON object, e.g. '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}' or NCCL settings; set when Ray starts the process, before torch is imported. OMP_NUM_THREADS and MKL_NUM_THREADS are refused (--train-threads sets them). The run's summary lists what each rank saw (placement.train[].env, secret-looking values redacted)."""

    @field_validator("train_env_vars", mode="before")
    @classmethod
    def _env_json(cls, v):
        """The flag's JSON text → {name: value as text}; names must be environment variable names."""
        import re

        from engine.config.base import json_object

        v = json_object(v, '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}')
        out = {}
        for k, x in v.items():
            if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{k!r} is not an environment variable name (letters, digits and _, not starting "
                                 "with a digit)")
            if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                raise ValueError(f"{k} is set per process from --train-threads; use --train-threads N instead")
            if isinstance(x, (dict, list)) or x is None:
                raise ValueError(f"{k}: a value is text or a number, got {type(x).__name__}")
            out[k] = str(x).lower() if isinstance(x, bool) else str(x)
        return out

    @field_validator("freeze_params_name_list", "only_train_params_name_list")
    @classmethod
    def _patterns_compile(cls, v: list[str]) -> list[str]:
        import re

        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regular expression ({e})") from None
        return v

    @model_validator(mode="after")
    def _one_warmup(self) -> "TrainArgs":
        """--lr-warmup-fraction or --lr-warmup-iters, not both (Megatron-LM refuses both too)."""
        from engine.config.base import config_error

        if self.lr_warmup_fraction and self.lr_warmup_iters:
            raise config_error(f"--lr-warmup-fraction {self.lr_warmup_fraction} and --lr-warmup-iters "
                               f"{self.lr_warmup_iters} both set the warm-up's length", "keep one of them",
                               field="lr_warmup_fraction", value=self.lr_warmup_fraction)
        return self

    @model_validator(mode="after")
    def _log_probs_chunk(self) -> "TrainArgs":
        from engine.config.base import config_error

        n = self.log_probs_chunk_size
        if n == 0 or n < -1:
            raise config_error(f"--log-probs-chunk-size {n}: a chunk has ≥ 1 positions",
                               "a positive number of positions per chunk (e.g. 4096), or -1 for the whole "
                               "micro-batch at once", field="log_probs_chunk_size", value=n)
        if n > 0 and self.recompute_loss_function:
            raise config_error(f"--recompute-loss-function with --log-probs-chunk-size {n}: the chunks already "
                               "recompute their log-softmax in the backward, so the flag would change nothing",
                               "drop one of them (chunks save more memory: not even the logits are kept)",
                               field="recompute_loss_function", value=True)
        if n > 0 and self.train_backend == "megatron" and self.tensor_model_parallel_size > 1:
            raise config_error(f"--log-probs-chunk-size {n} with --train-backend megatron and "
                               f"--tensor-model-parallel-size {self.tensor_model_parallel_size}: chunks are computed "
                               "at TP = 1 only (each rank's vocabulary shard would need the sequence-parallel gather "
                               "of the output layer)", "--log-probs-chunk-size -1, or --tensor-model-parallel-size 1",
                               field="log_probs_chunk_size", value=n)
        return self

    @model_validator(mode="after")
    def _stateless_adam(self) -> "TrainArgs":
        from engine.config.base import config_error, flags, given

        if self.use_stateless_adam and self.train_backend == "megatron":
            raise config_error("--use-stateless-adam with --train-backend megatron: rollflow's stateless AdamW runs in "
                               "the torch backend only (Megatron's distributed optimizer shards and saves Adam's "
                               "moments)", "--train-backend torch, or --reset-optimizer-states with "
                               "--num-steps-per-rollout 1 (the same updates, with the moments' memory)",
                               field="use_stateless_adam", value=True)
        if self.use_stateless_adam and (betas := self.changed("adam_beta1", "adam_beta2")):
            raise config_error(f"{given(betas)} with --use-stateless-adam would do nothing: its moments restart at "
                               "every step, where the bias-corrected update is lr·g / (|g| + ε) whatever the betas",
                               f"drop {flags(betas)}, or drop --use-stateless-adam", field=next(iter(betas)),
                               value=betas)
        if self.min_lr > 0 and self.lr_decay_style == "constant":
            raise config_error(f"--min-lr {self.min_lr} is where the cosine schedule ends, and --lr-decay-style "
                               "constant keeps --lr after the warm-up: it would do nothing",
                               "add --lr-decay-style cosine, or drop --min-lr", field="min_lr", value=self.min_lr)
        if self.use_stateless_adam and self.reset_optimizer_states:
            raise config_error("--reset-optimizer-states with --use-stateless-adam: a stateless AdamW keeps no "
                               "moments, so there is nothing to reset", "drop --reset-optimizer-states",
                               field="reset_optimizer_states", value=True)
        return self

    @property
    def recompute(self) -> tuple[str, str | None, int | None] | None:
        """The megatron backend's (granularity, method, num_layers), None without recompute."""
        if self.recompute_activations:
            return "full", "uniform", 1
        if self.recompute_granularity is None:
            return None
        return self.recompute_granularity, self.recompute_method, self.recompute_num_layers

    @model_validator(mode="after")
    def _recompute(self) -> "TrainArgs":
        from engine.config.base import config_error

        given = [f"--{k.replace('_', '-')} {getattr(self, k)}" for k in
                 ("recompute_granularity", "recompute_method", "recompute_num_layers") if getattr(self, k) is not None]
        if not given:
            return self
        field = next(k for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")
                     if getattr(self, k) is not None)
        if self.train_backend != "megatron":
            raise config_error(f"{', '.join(given)} with --train-backend {self.train_backend}: Megatron's recompute "
                               "settings", "--recompute-activations (the torch backend recomputes whole layers)",
                               field=field, value=getattr(self, field))
        if self.recompute_activations:
            raise config_error(f"--recompute-activations with {', '.join(given)}: it is --recompute-granularity "
                               "full --recompute-method uniform --recompute-num-layers 1 already",
                               "one of the two", field=field, value=getattr(self, field))
        if self.recompute_granularity is None:
            raise config_error(f"{', '.join(given)} without --recompute-granularity would do nothing",
                               "add --recompute-granularity full", field=field, value=getattr(self, field))
        full = (self.recompute_method, self.recompute_num_layers)
        if self.recompute_granularity == "full" and None in full:
            raise config_error("--recompute-granularity full needs --recompute-method (uniform or block) and "
                               "--recompute-num-layers N", "e.g. --recompute-method uniform --recompute-num-layers 1",
                               field="recompute_granularity", value="full")
        if self.recompute_granularity == "selective" and full != (None, None):
            raise config_error("--recompute-granularity selective recomputes each layer's core attention: "
                               "--recompute-method and --recompute-num-layers choose whole layers and would do "
                               "nothing", "drop them, or --recompute-granularity full",
                               field="recompute_granularity", value="selective")
        return self

    @model_validator(mode="after")
    def _sequence_parallel(self) -> "TrainArgs":
        from engine.config.base import config_error

        if self.sequence_parallel and self.train_backend != "megatron":
            raise config_error(f"--sequence-parallel with --train-backend {self.train_backend}: only the megatron "
                               "backend splits a layer over tensor-parallel GPUs", "--train-backend megatron with "
                               "--tensor-model-parallel-size > 1, or drop --sequence-parallel",
                               field="sequence_parallel", value=True)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise config_error("--sequence-parallel with --tensor-model-parallel-size 1: it splits tokens over the "
                               "tensor-parallel group, so alone it would do nothing",
                               "--tensor-model-parallel-size 2 (or more), or drop --sequence-parallel",
                               field="sequence_parallel", value=True)
        return self

    @model_validator(mode="after")
    def _megatron_hooks(self) -> "TrainArgs":
        on = [f"--{f.replace('_', '-')}" for f in ("custom_megatron_init_path",
                                                   "custom_megatron_before_log_prob_hook_path",
                                                   "custom_megatron_before_train_step_hook_path") if getattr(self, f)]
        if on and self.train_backend != "megatron":
            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"{', '.join(on)} hook into the megatron backend, and --train-backend is {self.train_backend}: "
                     "they would never be called", fix="--train-backend megatron, or drop " + ", ".join(on),
                facts={"field": on[0][2:].replace("-", "_"), "value": self.train_backend}))
        return self
