"""slime's flags that rollflow does not take, each with what rollflow does instead (or that it lacks the capability).

`rollflow train` names them on the command line and in a --config file instead of suggesting a near-miss flag,
and docs/flags.md lists them (generated from NOT_TAKEN, like the rest of that page). A slime script ported to
rollflow then fails at once, naming every such flag (and every other unknown one) with the reason and the
replacement.
"""
from __future__ import annotations

_CI = ("rollflow runs these checks on every run: on the first step the policy equals the reference and the ratio is 1 "
       "(RF01), the train–inference log-prob mismatch stays under --logprob-mismatch-threshold (RF14, also after each "
       "weight sync), and every engine reports the synced weight version")
_MTP = ("rollflow implements none of slime's MTP and FP8-kernel features (MTP heads, DeepGEMM forwards)")
_DELTA = ("rollflow syncs full weights: in memory (--weight-sync-method tensor), over a process group "
          "(distributed) or through <work_dir>/weights/vN (disk); there is no delta encoding")
_BUFFER = ("slime's external rollout buffer service is not part of rollflow: a --rollout-function-path hook makes "
           "the rollout, from any source it likes")

_ARCH = ("the model's architecture comes from --hf-checkpoint's config.json: the Megatron backend maps it into "
         "megatron-core's GPTModel itself (engine/train/megatron_mapping.py; an architecture it cannot map is a MODEL "
         "error of the preflight), with its tokenizer and vocabulary padding")
#: Megatron-LM's architecture flags of slime's scripts/models/*.sh (MODEL_ARGS)
_ARCH_FLAGS = (
    "spec", "num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "group-query-attention",
    "num-query-groups", "kv-channels", "swiglu", "disable-bias-linear", "add-qkv-bias", "qk-layernorm",
    "normalization", "norm-epsilon", "apply-layernorm-1p", "position-embedding-type", "use-rotary-position-embeddings",
    "rotary-base", "rotary-percent", "use-rope-scaling", "rope-scaling-factor", "untie-embeddings-and-output-weights",
    "vocab-size", "make-vocab-size-divisible-by", "max-position-embeddings", "seq-length", "tokenizer-type",
    "tokenizer-model", "num-experts", "moe-ffn-hidden-size", "moe-router-topk", "moe-layer-freq",
    "moe-shared-expert-intermediate-size", "moe-shared-expert-gate", "moe-router-score-function",
    "moe-router-pre-softmax", "moe-router-topk-scaling-factor", "moe-router-num-groups", "moe-router-group-topk",
    "moe-router-enable-expert-bias", "moe-router-bias-update-rate", "use-gated-attention", "attention-output-gate",
    "multi-latent-attention", "q-lora-rank", "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim",
    "rotary-scaling-factor", "rotary-interleaved", "mscale", "mscale-all-dim", "no-position-embedding",
    "post-self-attn-layernorm", "post-mlp-layernorm")
_KERNELS = ("the Megatron backend chooses its layers and kernels itself: Transformer Engine's when installed, else "
            "megatron-core's local layers with PyTorch's flash attention over packed samples, its fused kernels "
            "each leaving the math unchanged, experts as a SequentialMLP with the alltoall dispatcher (docs/gpu.md)")
#: Megatron-LM's kernel and implementation switches of slime's scripts (PERF_ARGS, MISC_ARGS)
_KERNEL_FLAGS = ("transformer-impl", "attention-backend", "use-flash-attn", "use-mcore-models",
                 "no-masked-softmax-fusion", "no-rope-fusion", "no-bias-swiglu-fusion", "no-bias-dropout-fusion",
                 "no-bias-gelu-fusion", "no-gradient-accumulation-fusion", "moe-grouped-gemm", "moe-permute-fusion",
                 "moe-enable-deepep", "enable-experimental")
_OVERLAP = ("the Megatron backend reduces gradients and gathers parameters after the backward pass, not overlapped "
            "with it")
_DROPOUT = "rollflow trains without dropout (slime's scripts set it to 0.0 too)"
_CPU_ADAM = ("Megatron's CPU optimizer (HybridDeviceOptimizer) is not wired into rollflow's Megatron backend, whose "
             "Adam state stays on the GPUs, sharded over the data-parallel ranks; the torch backend's --offload-train "
             "moves its weights, gradients and Adam's moments to the host while the engines generate")
_CPU_ADAM_FIX = "drop it (more data-parallel GPUs shard Adam's state thinner)"
_FP8 = ("rollflow trains in bf16 (--bf16) or fp32; FP8 training (Transformer Engine's FP8 recipes) is not wired into "
        "its Megatron backend")
_UNEVEN_PP = ("the Megatron backend splits the decoder layers evenly over the --pipeline-model-parallel-size stages "
              "(megatron-core's default split)")
_NO_AUX = ("rollflow's Megatron backend trains a mixture of experts without the load-balancing loss (an RL step "
           "trains the policy's loss only)")

#: flag (without --) → (why rollflow does not take it, what to do instead)
NOT_TAKEN: dict[str, tuple[str, str]] = {
    "ci-test": (_CI, "drop it (the checks are always on)"),
    "ci-disable-kl-checker": (_CI + "; RF01 cannot be turned off: a first step whose policy is not the reference "
                              "means the weights or the reference were not the ones intended",
                              "drop it; --ref-load names a different reference on purpose"),
    "ci-train-rollout-logprob-abs-diff-threshold": (_CI, "--logprob-mismatch-threshold X"),
    "start-rollout-id": ("a run starts where its checkpoint ends (the marker's iteration + 1, or --ckpt-step's), with "
                         "that checkpoint's data position, schedule and RNG state, or at 0 from Hugging Face weights",
                         "--load DIR (--ckpt-step N) to start after iteration N"),
    "num-gpus-per-node": ("placement reads each node's GPUs from Ray, so nothing needs the count",
                          "--actor-num-gpus-per-node for the trainer, --rollout-num-gpus(-per-engine) for engines"),
    "offload": ("colocated engines always release their memory while the trainer trains (--colocate)",
                "--offload-train (the trainer's half)"),
    "offload-rollout": ("colocated engines always release their memory while the trainer trains (--colocate); "
                        "engines on their own GPUs keep it", "drop it"),
    "release-train": ("rollflow keeps its train workers for the run (--offload-train moves their state to the host "
                      "instead)", "--offload-train"),
    "distributed-backend": ("the backend follows the device: NCCL between GPUs, gloo on the CPU", "drop it"),
    "update-weight-mode": (_DELTA, "drop it"),
    "update-weight-transport": (_DELTA, "--weight-sync-method distributed (slime's nccl) or disk"),
    "update-weight-disk-dir": (_DELTA, "--weight-sync-method disk with a --work-dir every engine sees"),
    "update-weight-disk-keep-files": (_DELTA, "drop it"),
    "update-weight-local-checkpoint-dir": (_DELTA, "drop it"),
    "update-weight-delta-encoding": (_DELTA, "drop it"),
    "update-weight-delta-checksum": (_DELTA, "drop it"),
    "rollout-data-transport": ("rollout data reaches the trainer through Ray's object store; there is no NIXL "
                               "transport", "drop it"),
    "custom-convert-samples-to-train-data-path": ("the trainer's inputs are built from the Samples by the pack "
                                                  "stage (engine/stages.py: pack), with no hook",
                                                  "shape the Samples in a --rollout-function-path or "
                                                  "--custom-generate-function-path hook; "
                                                  "--rollout-data-postprocess-path edits the per-token data"),
    "disable-rollout-global-dataset": ("a --rollout-function-path hook gets the data source and may ignore it",
                                       "drop it and make the prompts in the hook"),
    "loss-mask-type": ("SFT loss masks come from the model's own chat template, rendered turn by turn "
                       "(engine/rollout/sft.py), for any template that renders each conversation prefix as a prefix",
                       "drop it"),
    "data-pad-size-multiplier": ("micro-batches are packed without padding (varlen); under --sequence-parallel the "
                                 "Megatron backend pads each to a multiple of the TP size itself, and a micro-batch "
                                 "replayed from a CUDA graph is padded to the graph's shape", "drop it"),
    "min-batch-collection-ratio": (_BUFFER, "--rollout-function-path"),
    "rollout-task-type": (_BUFFER, "--rollout-function-path"),
    "rollout-buffer-url": (_BUFFER, "--rollout-function-path"),
    "buffer-filter-path": (_BUFFER, "--rollout-function-path"),
    "fetch-trajectory-retry-times": (_BUFFER, "--rollout-function-path"),
    "load-forge-rollout-data": ("rollflow replays its own recordings", "--save-debug-rollout-data, then "
                                                                       "--load-debug-rollout-data"),
    "http-proxy": ("rollflow's HTTP clients (httpx) take a proxy from the environment",
                   "set HTTP_PROXY / HTTPS_PROXY, and NO_PROXY for the engines' own addresses"),
    "use-distributed-post": ("the rollout client keeps one connection pool in the driver", "drop it"),
    "custom-model-provider-path": ("the Megatron backend builds GPTModel from the Hugging Face config",
                                   "--custom-megatron-init-path to change the built model"),
    "megatron-config-path": ("Megatron's settings are rollflow flags (docs/flags.md, train section)", "drop it"),
    "padded-vocab-size": ("the Megatron backend pads the vocabulary for its tensor-parallel size itself",
                          "drop it"),
    "allgather-cp": ("no rollflow backend runs context parallelism yet (--context-parallel-size > 1 is refused)",
                     "drop it"),
    "multimodal-keys": ("rollflow trains text-only models", "drop it"),
    "enable-mtp-training": (_MTP, "drop it"),
    "mtp-num-layers": (_MTP, "drop it"),
    "mtp-loss-scaling-factor": (_MTP, "drop it"),
    "megatron-deepgemm-forward-layers": (_MTP, "drop it"),
    "megatron-deepgemm-forward-modules": (_MTP, "drop it"),
    "megatron-deepgemm-moe-forward-layers": (_MTP, "drop it"),
    "megatron-deepgemm-moe-forward-modules": (_MTP, "drop it"),
    "freeze-indexer": (_MTP + "; --freeze-params-name-list freezes parameters by name", "--freeze-params-name-list"),
    "expert-tensor-parallel-size": ("rollflow's Megatron backend never splits an expert by TP: each expert runs "
                                    "whole, on one of --expert-model-parallel-size ranks, and on every TP rank "
                                    "under --tensor-model-parallel-size with --sequence-parallel",
                                    "drop it (slime's usual 1 is what rollflow does)"),
    "qwen-gdn-backend": ("rollflow's backends have no linear-attention (Gated DeltaNet) layers", "drop it"),
    # Megatron-LM's flags, which slime passes through (its scripts' MODEL_ARGS, PERF_ARGS, OPTIMIZER_ARGS, MISC_ARGS)
    **{flag: (_ARCH, "drop it (slime's MODEL_ARGS, scripts/models/*.sh, are not needed)") for flag in _ARCH_FLAGS},
    **{flag: (_KERNELS, "drop it") for flag in _KERNEL_FLAGS},
    "use-distributed-optimizer": ("the Megatron backend always runs megatron-core's distributed optimizer (ZeRO-1: "
                                  "Adam's state sharded over the data-parallel ranks)", "drop it"),
    "overlap-grad-reduce": (_OVERLAP, "drop it"),
    "overlap-param-gather": (_OVERLAP, "drop it"),
    "accumulate-allreduce-grads-in-fp32": ("the Megatron backend always accumulates and reduces gradients in fp32 "
                                           "(main grads, grad_reduce_in_fp32)", "drop it"),
    "attention-softmax-in-fp32": ("the attention kernels (PyTorch's flash SDPA, or Transformer Engine's) compute "
                                  "the softmax in fp32", "drop it"),
    "attention-dropout": (_DROPOUT, "drop it"),
    "hidden-dropout": (_DROPOUT, "drop it"),
    "optimizer": ("rollflow trains with AdamW (Megatron's adam: decoupled weight decay, --adam-beta1/2, "
                  "--weight-decay); there is no other optimizer", "drop it (--optimizer adam is what rollflow does)"),
    "optimizer-cpu-offload": (_CPU_ADAM, _CPU_ADAM_FIX),
    "optimizer-offload-fraction": (_CPU_ADAM, _CPU_ADAM_FIX),
    "overlap-cpu-optimizer-d2h-h2d": (_CPU_ADAM, _CPU_ADAM_FIX),
    "use-precision-aware-optimizer": (_CPU_ADAM + "; Adam's moments stay in fp32", "drop it"),
    "moe-aux-loss-coeff": (_NO_AUX, "drop it"),
    "moe-router-load-balancing-type": (_NO_AUX, "drop it"),
    "moe-token-drop-policy": ("rollflow's mixtures of experts drop no token (no expert capacity)", "drop it"),
    "moe-expert-capacity-factor": ("rollflow's mixtures of experts drop no token (no expert capacity)", "drop it"),
    "moe-router-dtype": ("the router computes in the parameters' dtype (megatron-core's default); an fp32 router "
                         "is not wired into rollflow's Megatron backend", "drop it"),
    "ckpt-format": ("the Megatron backend's checkpoints are megatron-core's dist_checkpointing (torch_dist) in "
                    "rollflow's iter_%07d layout", "drop it"),
    "log-interval": ("every rollout's metrics are logged (the log, MLflow, Prefect's artifacts)", "drop it"),
    "fp8-format": (_FP8, "drop it"),
    "fp8-recipe": (_FP8, "drop it"),
    "fp8-param-gather": (_FP8, "drop it"),
    "decoder-first-pipeline-num-layers": (_UNEVEN_PP, "drop it, with a --pipeline-model-parallel-size that divides "
                                                      "the model's layer count"),
    "decoder-last-pipeline-num-layers": (_UNEVEN_PP, "drop it, with a --pipeline-model-parallel-size that divides "
                                                     "the model's layer count"),
    "no-offload-rollout": ("engines on their own GPUs keep their memory; colocated ones always release it while the "
                           "trainer trains", "drop it"),
    "prefill-num-servers": ("rollflow's engines serve prefill and decode together; prefill–decode disaggregation is "
                            "not wired into its launcher", "drop it"),
    "ref-micro-batch-size": ("the reference's no-grad forward packs its micro-batches by tokens, as the other "
                             "no-grad forwards do", "--log-probs-max-tokens-per-gpu N (with --use-dynamic-batch-size)"),
}


_ROUTER = ("rollflow's rollout client sends each request to the engine with the fewest outstanding samples itself; "
           "there is no router process between them")
#: slime's own flags under the --sglang- prefix (slime/backends/sglang_utils/arguments.py), which rollflow would
#: otherwise pass to `sglang.launch_server` (slime's --sglang-config is no SGLang --config file)
NOT_TAKEN_SGLANG: dict[str, tuple[str, str]] = {
    "router-ip": (_ROUTER, "drop it; engines you started yourself: --rollout-external-engine-addrs HOST:PORT …"),
    "router-port": (_ROUTER, "drop it; engines you started yourself: --rollout-external-engine-addrs HOST:PORT …"),
    "router-request-timeout-secs": (_ROUTER, "--rollout-timeout S (the whole rollout's deadline)"),
    "server-concurrency": ("the rollout client caps the samples in flight over all engines, not per server",
                           "--rollout-concurrency N"),
    "config": ("slime's YAML of SGLang server groups (prefill / decode / regular, with per-group overrides) has no "
               "counterpart: rollflow launches one kind of engine, each with the same --sglang-* flags (SGLang's own "
               "--config file would read other keys)", "drop it; set the engines with --rollout-num-gpus-per-engine "
                                                        "and --sglang-* flags (also the keys of an SGLang --config "
                                                        "file, one --sglang-<key> each)"),
}


def not_taken(name: str) -> tuple[str, str] | None:
    """(why, instead) for slime's flag `name` (`--x-y`, `x-y` or `x_y`), None for any other name."""
    return NOT_TAKEN.get(name.lstrip("-").split("=")[0].replace("_", "-"))


def markdown() -> str:
    """docs/flags.md's table of them."""
    rows = ["**slime's flags that rollflow does not take** — `rollflow train` stops on them with the reason "
            "(engine/config/slime_flags.py).\n", "| flag | why | instead |", "|---|---|---|"]
    taken = {**NOT_TAKEN, **{f"sglang-{k}": v for k, v in NOT_TAKEN_SGLANG.items()}}
    for name, (why, instead) in sorted(taken.items()):
        rows.append(f"| `--{name}` | {why.replace('|', chr(92) + '|')} | {instead.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


#: slime's functions a --custom-*-path may name whose work rollflow builds in: (module prefix, what to do instead)
SLIME_FUNCTIONS = (
    ("examples.train_infer_mismatch_helper", "slime's MIS helper (examples/train_infer_mismatch_helper/mis.py) is "
     "built into rollflow: drop --custom-tis-function-path and keep --custom-config-path mis.yaml, whose keys are "
     "rollflow's flags (--use-tis, --tis-mode, --tis-level, --use-rs, --rs-level, --rs-veto-threshold, "
     "--tis-batch-normalize; tis_lower_bound / tis_upper_bound set --tis-clip-low / --tis-clip); docs/algorithms.md"),
)


def slime_import_fix(exc: BaseException, path: str = "") -> str | None:
    """The fix for a --custom-*-path function that needs slime itself (a ModuleNotFoundError naming a slime module,
    e.g. slime's MIS helper importing slime.backends.megatron_utils.cp_utils), or None for any other error."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    missing = exc.name or ""
    dotted = path.replace("/", ".").replace(".py:", ".")
    for prefix, fix in SLIME_FUNCTIONS:
        if prefix in dotted or missing.startswith(prefix):
            return fix
    if missing != "slime" and not missing.startswith("slime."):
        return None
    return (f"the function needs slime's module {missing}, which rollflow does not ship: copy what it uses from "
            "slime into your module (rollflow's contracts for these hooks are slime's; docs/hooks.md)")
