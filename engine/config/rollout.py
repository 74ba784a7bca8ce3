"""Rollout flags: how many samples, how they are generated, by which engine."""
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from engine.config.base import Section, flags, given
from engine.diagnosis import ConfigError, Diagnosis


def _with_id(pattern: str) -> str:
    """`pattern` with `_{rollout_id}` before its .json / .json.gz / .pt suffix (else at its end)."""
    for suffix in (".json.gz", ".json", ".pt"):
        if pattern.endswith(suffix):
            return pattern[: -len(suffix)] + "_{rollout_id}" + suffix
    return pattern + "_{rollout_id}.json"


def fill_pattern(pattern: str, rollout_id: int, rank: int | None = None) -> str:
    """A --save/--load-debug-*-data path: {rollout_id} (and {rank}) replaced."""
    out = pattern.replace("{rollout_id}", str(rollout_id))
    return out.replace("{rank}", str(rank)) if rank is not None else out


class RolloutArgs(Section):
    rollout_batch_size: int = Field(8, ge=1)
    """Prompts per rollout (B). One rollout yields B × n samples."""

    n_samples_per_prompt: int = Field(8, ge=1)
    """Samples generated per prompt (n); GRPO normalises rewards within each group of n."""

    num_rollout: int = Field(30, ge=1)
    """Number of rollouts (RL iterations) in the run; rollout ids are 0..num_rollout-1."""

    num_epoch: Optional[int] = Field(None, ge=1)
    """Train for this many passes over --prompt-data instead of a number of rollouts (slime's flag): --num-rollout becomes num_epoch × (rows of --prompt-data // --rollout-batch-size), counted when the config is read. The rows are counted as the file holds them: rows --rollout-max-prompt-len drops later still count, so the data source wraps into the next pass that much sooner. Setting --num-rollout to another value beside it is an error."""

    rollout_max_response_len: int = Field(1024, ge=1)
    """Maximum new tokens per sample; a sample that reaches it is TRUNCATED."""

    rollout_temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy). Log-probs are computed at this temperature."""

    rollout_top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold."""

    rollout_top_k: int = -1
    """Top-k sampling (-1 = off)."""

    rollout_stop: list[str] = []
    """Stop strings sent to the engine as `stop` (RF10)."""

    rollout_stop_token_ids: list[int] = []
    """Stop token ids sent to the engine as `stop_token_ids`, added to the model's EOS (RF10)."""

    rollout_skip_special_tokens: bool = True
    """Decode responses without the tokenizer's special tokens: SGLang's `skip_special_tokens` sampling param, sent with every rollout and evaluation request. The text is what rewards, filters and hooks read; the trained tokens are the same either way. --no-rollout-skip-special-tokens keeps them in the text (slime's default; rollflow keeps SGLang's). Either way the stop token that ended a response is not in its text, as SGLang trims it."""

    rollout_engine: Literal["builtin", "sglang"] = "builtin"
    """Rollout server kind: builtin (rollflow's engine over a Hugging Face model, CPU or GPU, SGLang's HTTP API; --model-impl) or sglang (python -m sglang.launch_server)."""

    rollout_engine_process: Literal["auto", "own", "trainer"] = "auto"
    """Where the built-in engine runs: own (a Ray actor process of its own) or trainer (a thread of train rank 0's process, serving the same HTTP API: one process fewer imports torch and transformers at start, and a weight sync is an in-memory copy instead of a trip through Ray's object store). trainer needs one CPU engine, one train rank, --async-mode off and no --use-fault-tolerance (an engine failure takes the trainer with it); auto = trainer where that holds, else own."""

    rollout_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and compute of the built-in engine: auto = bfloat16 on a GPU when the trainer trains in bf16 (--bf16), else
    float32, so the engine serves the trainer's weights in the precision they are trained in (CPU: float32)."""

    logprob_mismatch_threshold: Optional[float] = Field(None, gt=0)
    """RF14: stop the run when the mean |log π_engine − log π_trainer| over a rollout's trained tokens (or over the probe
    scored after a weight sync) is above this. Default: 0.05 when the trainer or the engine runs bf16, else 1e-3."""

    rollout_num_gpus_per_engine: int = Field(1, ge=1)
    """GPUs per rollout engine (its tensor-parallel size)."""

    rollout_num_engines: int = Field(1, ge=1)
    """Rollout engines on a cluster without GPUs (or with --rollout-num-gpus 0); decoupled on GPUs without --rollout-num-gpus, they take engines × GPUs-per-engine GPUs."""

    rollout_concurrency: int = Field(64, ge=1)
    """Most samples being generated at once across all engines: a rollout keeps this ÷ --n-samples-per-prompt
    groups in flight (one /generate per group; to a built-in CPU engine, the groups that start together in one)."""

    rollout_timeout: float = Field(600.0, gt=0)
    """Seconds a whole rollout may take before it fails (and may be retried)."""

    over_sampling_batch_size: Optional[int] = Field(None, ge=1)
    """Prompts drawn per sampling round when a dynamic filter is set (≥ --rollout-batch-size); rounds repeat until B groups pass. Needs --dynamic-sampling-filter-path."""

    dynamic_sampling_filter_path: Optional[str] = None
    """Group filter (slime's hook): fn(args, samples) or fn(samples) -> bool | DynamicFilterOutput, e.g. engine.rollout.filters:check_reward_nonzero_std (drop groups whose rewards all agree)."""

    rollout_function_path: Optional[str] = None
    """A whole custom rollout (slime's hook): fn(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput | list of B groups of n Samples (engine/rollout/hooks.py). Default: the built-in rollout."""

    custom_generate_function_path: Optional[str] = None
    """Per-sample generation (slime's hook), e.g. multi-turn with tools: async fn(args, sample, sampling_params) -> Sample; may call args.engine several times; tool tokens get loss_mask 0."""

    rollout_sample_hook_path: list[str] = []
    """Per-sample hooks after generation, before the reward (slime's flag; repeatable, applied in order): fn(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None, sync or async. A Sample replaces the one passed; None keeps it (changed in place or not). rollout_id and evaluation are passed when the function takes them. Runs in the built-in rollout, after --custom-generate-function-path, and in the built-in evaluation (evaluation=True); what comes back is checked as a generate hook's Sample is."""

    custom_reward_post_process_path: Optional[str] = None
    """Reward post-processing (slime's hook): fn(args, samples) -> (raw_rewards, rewards); the rewards replace GRPO's group normalisation as the advantage estimator's input."""

    rollout_sample_filter_path: Optional[str] = None
    """After the rollout (slime's hook): fn(args, groups) sets sample.remove_sample = True on samples to keep out of the loss (they still count in the group's reward normalisation)."""

    rollout_all_samples_process_path: Optional[str] = None
    """After the rollout (slime's hook): fn(args, all_samples, data_source) sees every finished group of the rollout, the ones --dynamic-sampling-filter-path dropped included (in draw order; a kept group's samples are the ones trained on), e.g. to log or analyse them or to return prompts to a custom data source; its return value is ignored. Called after --rollout-sample-filter-path, before --custom-reward-post-process-path; with --rollout-function-path it sees the function's groups."""

    custom_rollout_log_function_path: Optional[str] = None
    """Your own logging of each rollout (slime's hook): fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool, called once the rollout's samples are scored; rollout_extra_metrics is every metric rollflow computed for the rollout (a superset of slime's). True skips rollflow's default logging of the rollout to MLflow and its mirrors (its metrics and samples table; they are still kept in the run's history, which the summary and checkpoints carry); args.tracker.log_metrics({...}, step=rollout_id) logs metrics of your own."""

    custom_eval_rollout_log_function_path: Optional[str] = None
    """Your own logging of each evaluation (slime's hook): fn(rollout_id, args, data, extra_metrics) -> bool with data = {set name: {"rewards": [...], "truncated": [...], "samples": [...]}} and extra_metrics the eval/* metrics rollflow computed; rollout_id is the number of rollouts trained before it. True skips their logging to MLflow and its mirrors (they stay in the run's history)."""

    eval_function_path: Optional[str] = None
    """Evaluation written by hand (slime's hook): fn(args, rollout_id, None, evaluation=True) ->
    RolloutFnEvalOutput(data={name: {"rewards": [...], "truncated": [...]}}) or that dict, called where the built-in
    evaluation would run (args.eval_sets: --eval-prompt-data's rows by name; args.engine: the engines); logged as
    eval/<name>_accuracy (the mean reward) and eval/<name>_truncated_share. slime defaults it to
    --rollout-function-path; here it is set explicitly (it may be the same function). Default: the built-in
    evaluation."""

    data_source_path: Optional[str] = None
    """Where prompts come from (slime's hook): a class built as cls(args) with get_samples(num_prompts) -> list of groups of n Samples; state_dict() / load_state_dict(d) make it resumable. Default: --prompt-data."""

    custom_config_path: Optional[str] = None
    """A YAML file of arguments for your own functions (slime's flag): each top-level key becomes an attribute of the `args` every hook gets (rollout hooks, reward, loss, advantage and Megatron hooks), e.g. `max_turns: 4` → args.max_turns. Read once when the run's flags are, on the driver; the values travel in the run's config (--custom-config). A key that is a rollflow flag sets that flag, as slime's does (slime's examples/train_infer_mismatch_helper/mis.yaml sets --use-tis, --tis-mode, --use-rs …; its tis_lower_bound / tis_upper_bound set --tis-clip-low / --tis-clip and stay arguments too); the flag given elsewhere with another value is an error."""

    custom_config: dict[str, Any] = {}
    """The same arguments given inline as a JSON object (or filled from --custom-config-path); recorded with the run's flags, so a resume or another node sees the values the run started with."""

    @field_validator("custom_config", mode="before")
    @classmethod
    def _custom_config_json(cls, v: Any) -> Any:
        from engine.config.base import json_object

        v = json_object(v, '{"max_turns": 4}')
        if not all(isinstance(k, str) and k.isidentifier() for k in v):
            raise ValueError("a mapping whose keys are Python identifiers is needed (they become attributes: "
                             "args.<key>)")
        return v

    rollout_max_truncated_share: float = Field(0.9, ge=0.0, le=1.0)
    """A rollout where more than this share of samples hit --rollout-max-response-len fails with RF10 (1 = never)."""

    rollout_engine_python: Optional[str] = None
    """Python executable that runs `-m sglang.launch_server` (default: this interpreter), so SGLang can live in its own environment. With --rollout-engine sglang only (the built-in engine would not use it: an error)."""

    rollout_engine_start_timeout: float = Field(600.0, gt=0)
    """Seconds an engine may take to answer /health_generate after it is started (RF08 when it does not); with --rollout-external-engine-addrs, how long each external engine is waited for."""

    rollout_external_engine_addrs: list[str] = []
    """Use SGLang-API servers that already run at these addresses (host:port or http(s)://host:port; slime's flag) instead of starting engines: SGLang (--rollout-engine sglang) or the built-in engine (`rollflow serve`), here or on other machines. rollflow never starts, restarts or stops them; it checks each at start (it answers, it is the --rollout-engine kind, it takes --sglang-api-key), sends the trainer's weights before the first rollout and after every step, and leaves them serving the last ones. Weights: --weight-sync-method disk (the server loads <work_dir>/weights/vN, so it must see that path; the built-in engine also needs --weight-dir <work_dir>/weights) or tensor (built-in engine only: safetensors buckets over HTTP). An engine that stops answering is waited for before a retried rollout and given the weights again. Not with --colocate, --use-fault-tolerance or engine-free runs; the --sglang-* launch flags, --rollout-num-gpus(-per-engine) and --rollout-dtype belong to the servers' own command lines. docs/engines.md, "External engines"."""

    use_fault_tolerance: bool = False
    """Health-check the engines; restart a dead one on its bundle, re-sync its weights, and resend its requests."""

    rollout_health_check_interval: float = Field(30.0, gt=0)
    """Seconds between /health_generate checks of every engine (with --use-fault-tolerance)."""

    rollout_health_check_timeout: float = Field(30.0, gt=0)
    """Seconds an engine may take to answer /health_generate before it is restarted (with --use-fault-tolerance)."""

    rollout_health_check_first_wait: float = Field(0.0, ge=0)
    """Seconds before the first health check (time for compilation and warm-up; with --use-fault-tolerance)."""

    weight_sync_method: Literal["tensor", "disk", "distributed"] = "tensor"
    """Trainer → engines: tensor (in memory, built-in engine: CUDA IPC handles in buckets when colocated on a GPU, else rank 0's weights through Ray's object store; to external built-in engines, safetensors buckets over HTTP), disk (versioned safetensors dir, /update_weights_from_disk) or distributed (slime's way for engines on GPUs of their own: train rank 0 and every engine form a process group — SGLang's /init_weights_update_group — and each sync broadcasts the weights, NCCL where trainer and engines are on GPUs, else gloo through CPU memory; SGLang engines need NCCL; not with --colocate or the engine in the trainer's process)."""

    update_weight_buffer_size: int = Field(512 * 2**20, ge=2**20)
    """Bytes per bucket of a weight sync in memory (CUDA IPC between colocated trainer and engine, HTTP tensor pushes)."""

    weight_sync_timeout: float = Field(600.0, gt=0)
    """Seconds one weight sync (all engines) may take before it fails."""

    custom_update_weight_post_write_path: Optional[str] = None
    """Called on train rank 0 after a disk weight sync has written <work_dir>/weights/vN, before the engines load it (slime's flag and contract): `fn(args, version_dir, rollout_engines)`, the engines' URLs last, e.g. to publish the directory where engines on other machines read it (a copy to a shared or object store, an explicit sync of a non-POSIX filesystem). An exception fails the sync (retried like any sync failure). `module:function` or `path/to/file.py:function`. Needs --weight-sync-method disk."""

    check_weight_update_equal: bool = False
    """Before the first rollout, prove that the weight sync writes every weight of every engine bit for bit (slime's flag): each engine snapshots what it serves, overwrites all of it with random values and takes the trainer's weights through the run's own --weight-sync-method; every weight must then equal the snapshot, or the run stops (RF14) listing the ones that differ. On a fresh start the snapshot is --hf-checkpoint's weights as the engines loaded them (so the trainer's load is checked too); on a resume or another --load the engines get the trainer's weights once first. Uses SGLang's /weights_checker (the built-in engine serves it). Costs one extra sync and a host copy of the engine's weights, once."""

    save_debug_rollout_data: Optional[str] = None
    """Also write each rollout's scored samples (tokens, rewards, the engine's log-probs, loss masks, metadata) and
    its metrics to this path, `{rollout_id}` replaced by the rollout id (slime's flag), e.g.
    `runs/debug/rollout_{rollout_id}.json` (`.json.gz`: compressed). --load-debug-rollout-data replays them."""

    save_debug_train_data: Optional[str] = None
    """Also write what each train rank trained on, per rollout (slime's flag): a torch.save file at this path, `{rollout_id}` and `{rank}` replaced, holding per-sample lists over the response tokens — tokens, loss masks, advantages, returns, old / reference / engine log-probs, critic values — plus the sample ids, rewards and response lengths (engine/train/worker.py: save_train_data). Written on the rank's own node after the rollout's steps. `{rank}` is needed when there is more than one train rank."""

    dump_details: Optional[str] = None
    """Dump everything for post-hoc analysis into this directory (slime's flag): each rollout's samples and metrics
    (--save-debug-rollout-data DIR/rollout_data/{rollout_id}.json.gz), what each train rank trained on
    (--save-debug-train-data DIR/train_data/{rollout_id}_{rank}.pt), the tokenizer (DIR/tokenizer) and the run's
    flags (DIR/config.yaml, secrets redacted). Not with those two flags set to other paths. With
    --debug-rollout-only no train data is written; with --load-debug-rollout-data no rollout data."""

    @model_validator(mode="before")
    @classmethod
    def _dump_details_paths(cls, data: Any) -> Any:
        """--dump-details DIR sets the two debug patterns under DIR (a config dump that already holds them, e.g. a
        resumed run's, passes as it is)."""
        if not isinstance(data, dict) or not data.get("dump_details"):
            return data
        d = str(data["dump_details"]).rstrip("/") or "/"
        want = {}
        if not data.get("load_debug_rollout_data"):
            want["save_debug_rollout_data"] = f"{d}/rollout_data/{{rollout_id}}.json.gz"
        if not data.get("debug_rollout_only"):
            want["save_debug_train_data"] = f"{d}/train_data/{{rollout_id}}_{{rank}}.pt"
        clash = [k for k, v in want.items() if data.get(k) not in (None, "", v)]
        if clash:
            from engine.config.base import config_error

            flag = "--" + clash[0].replace("_", "-")
            raise config_error(f"--dump-details {d} writes {flag} {want[clash[0]]!r}, and {flag} "
                               f"{data[clash[0]]!r} is set too: one of them would be ignored",
                               f"drop {flag} (--dump-details sets it), or drop --dump-details", field=clash[0],
                               value=data[clash[0]])
        return {**data, **want}

    load_debug_rollout_data: Optional[str] = None
    """Train on the rollouts --save-debug-rollout-data wrote, `{rollout_id}` replaced by the rollout id (slime's
    flag), instead of generating: no rollout engine starts and no weight sync or evaluation runs, so the trainer
    sees fixed inputs (e.g. to compare settings or backends on the same samples). Every rollout id of the run must
    have its file (preflight checks). train/mismatch then measures how far this trainer is from the engine that
    recorded the samples (0 up to float noise when nothing changed); RF14 does not stop a replay."""

    load_debug_rollout_data_subsample: Optional[float] = Field(None, gt=0, le=1)
    """--load-debug-rollout-data: replay this share of each saved rollout, for faster debugging (slime's flag):
    k = int(recorded groups × share) whole groups (a group's samples stay together, as the advantages need), the
    first ⌊k/2⌋ and the last ⌈k/2⌉ as slime takes them. --rollout-batch-size must then be k (the batch arithmetic
    is the run's; the load names k otherwise). The recorded rollout metrics describe the whole recording, so a
    subsampled replay publishes only its own reward mean and std beside rollout/replayed."""

    debug_rollout_only: bool = False
    """Generate rollouts without training (slime's flag): no train worker starts, and the engines serve
    --hf-checkpoint's weights for the whole run. Rewards and rollout metrics are logged as in any run (samples
    saved with --save-debug-rollout-data), and the evaluation before the loop runs; no checkpoint is read or
    written (so --save, --load and --ref-load are errors with it)."""

    debug_train_only: bool = False
    """Train without rollout engines (slime's flag): no engine starts, no weight sync and no evaluation runs. The rollouts come from --rollout-function-path, a function that makes its samples without generating (e.g. engine.rollout.sft:generate_rollout for SFT; its args.engine is then None), or from --load-debug-rollout-data (which implies this)."""

    sglang_args: dict[str, str | bool | list[str]] = {}
    """Verbatim `--sglang-*` flags for the SGLang launcher (filled from the command line; key without the prefix). The built-in engine reads only --sglang-api-key, --sglang-max-running-requests, --sglang-max-total-tokens, --sglang-enable-deterministic-inference, --sglang-disable-cuda-graph and --sglang-enable-torch-compile; another SGLang flag is an error with it (it would do nothing), as is any with --load-debug-rollout-data / --debug-train-only (no engine starts)."""

    @field_validator("rollout_external_engine_addrs")
    @classmethod
    def _external_urls(cls, addrs: list[str]) -> list[str]:
        """Each address as its base URL (http://host:port), named once."""
        from engine.rollout.external import normalize_addr

        urls, errors = [], []
        for addr in addrs:
            try:
                urls.append(normalize_addr(addr))
            except ValueError as e:
                errors.append(Diagnosis(code="CONFIG", severity="error", what=f"--rollout-external-engine-addrs: {e}",
                                        fix="give each engine as host:port, e.g. 10.0.0.5:30000",
                                        facts={"field": "rollout_external_engine_addrs", "value": addr}))
        if twice := sorted({u for u in urls if urls.count(u) > 1}):
            errors.append(Diagnosis(code="CONFIG", severity="error",
                                    what=f"--rollout-external-engine-addrs names {', '.join(twice)} more than once",
                                    fix="name each engine once",
                                    facts={"field": "rollout_external_engine_addrs", "value": twice}))
        if errors:
            raise ConfigError(errors)
        return urls

    @model_validator(mode="after")
    def _rollout_consistent(self) -> "RolloutArgs":
        errors = []
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.rollout_batch_size:
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--over-sampling-batch-size {self.over_sampling_batch_size} is below --rollout-batch-size "
                     f"{self.rollout_batch_size}: a sampling round must draw at least B prompts",
                fix=f"--over-sampling-batch-size {2 * self.rollout_batch_size} (or drop it)"))
        health = self.changed("rollout_health_check_interval", "rollout_health_check_timeout",
                              "rollout_health_check_first_wait")
        if health and not self.use_fault_tolerance:
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what=f"{given(health)} without --use-fault-tolerance would do nothing: the engines' health is "
                     "checked (and a dead engine restarted) only with it",
                fix=f"add --use-fault-tolerance, or drop {flags(health)}",
                facts={"field": next(iter(health)), "value": health}))
        if self.over_sampling_batch_size is not None and not self.dynamic_sampling_filter_path \
                and not self.rollout_function_path:
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--over-sampling-batch-size {self.over_sampling_batch_size} sizes the sampling rounds of a "
                     "dynamic filter, and no --dynamic-sampling-filter-path is set: every rollout draws "
                     f"--rollout-batch-size {self.rollout_batch_size} prompts, so it would do nothing",
                fix="add --dynamic-sampling-filter-path (e.g. engine.rollout.filters:check_reward_nonzero_std), or "
                    "drop --over-sampling-batch-size",
                facts={"field": "over_sampling_batch_size", "value": self.over_sampling_batch_size}))
        if self.rollout_function_path:
            unused = [f for f, v in (("--custom-generate-function-path", self.custom_generate_function_path),
                                     ("--rollout-sample-hook-path", self.rollout_sample_hook_path),
                                     ("--dynamic-sampling-filter-path", self.dynamic_sampling_filter_path),
                                     ("--over-sampling-batch-size", self.over_sampling_batch_size)) if v]
            if unused:
                errors.append(Diagnosis(
                    code="CONFIG", severity="error",
                    what=f"--rollout-function-path {self.rollout_function_path!r} replaces the built-in rollout, which is "
                         f"what reads {', '.join(unused)}: they would do nothing",
                    fix=f"drop {', '.join(unused)} (your rollout function can read its own settings from args), or "
                        "drop --rollout-function-path"))
        if self.weight_sync_method == "tensor" and self.rollout_engine == "sglang":
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what="--weight-sync-method tensor hands the weights to the built-in engine's actor through Ray's object "
                     "store; a SGLang server cannot take them that way (its /update_weights_from_tensor takes CUDA IPC "
                     "handles of the same host)",
                fix="--weight-sync-method disk with --rollout-engine sglang"))
        errors += self._debug_rollout_errors()
        if self.debug_train_only and not (self.rollout_function_path or self.load_debug_rollout_data):
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what="--debug-train-only starts no rollout engine, and the built-in rollout generates on one",
                fix="--rollout-function-path a function that makes samples without generating (e.g. "
                    "engine.rollout.sft:generate_rollout), or --load-debug-rollout-data saved rollouts",
                facts={"field": "debug_train_only", "value": True}))
        if self.debug_train_only and self.debug_rollout_only:
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what="--debug-train-only with --debug-rollout-only: one starts no engine, the other no trainer",
                fix="drop one of them", facts={"field": "debug_train_only", "value": True}))
        if errors:
            raise ConfigError(errors)
        return self

    def _debug_rollout_errors(self) -> list[Diagnosis]:
        """--save/--load-debug-rollout-data: a pattern with `{rollout_id}` on this machine's filesystem, and no
        rollout flag that a replay (which generates nothing) would ignore."""
        errors = []
        for flag, pattern in (("--save-debug-rollout-data", self.save_debug_rollout_data),
                              ("--load-debug-rollout-data", self.load_debug_rollout_data),
                              ("--save-debug-train-data", self.save_debug_train_data)):
            if pattern is None:
                continue
            if "{rollout_id}" not in pattern:
                errors.append(Diagnosis(
                    code="CONFIG", severity="error",
                    what=f"{flag} {pattern!r} has no {{rollout_id}}: every rollout would use the same file",
                    fix=f"{flag} '{_with_id(pattern)}'",
                    facts={"field": flag[2:].replace("-", "_"), "value": pattern}))
            elif "://" in pattern:
                errors.append(Diagnosis(
                    code="CONFIG", severity="error",
                    what=f"{flag} {pattern!r}: debug rollout data is read and written on the driver's filesystem "
                         "only",
                    fix=f"a local path, e.g. {flag} runs/debug/rollout_{{rollout_id}}.json",
                    facts={"field": flag[2:].replace("-", "_"), "value": pattern}))
        if self.load_debug_rollout_data_subsample is not None and not self.load_debug_rollout_data:
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--load-debug-rollout-data-subsample {self.load_debug_rollout_data_subsample} without "
                     "--load-debug-rollout-data: there is no saved rollout to subsample",
                fix="add --load-debug-rollout-data PATTERN, or drop --load-debug-rollout-data-subsample",
                facts={"field": "load_debug_rollout_data_subsample",
                       "value": self.load_debug_rollout_data_subsample}))
        if self.load_debug_rollout_data:
            ignored = [f"--{f.replace('_', '-')}" for f in (
                "rollout_function_path", "custom_generate_function_path", "rollout_sample_hook_path",
                "dynamic_sampling_filter_path", "over_sampling_batch_size", "custom_reward_post_process_path", "rollout_sample_filter_path",
                "rollout_all_samples_process_path", "data_source_path", "save_debug_rollout_data", "eval_function_path",
                "custom_rollout_log_function_path", "custom_eval_rollout_log_function_path") if getattr(self, f)]
            ignored += ["--use-fault-tolerance"] if self.use_fault_tolerance else []
            if ignored:
                errors.append(Diagnosis(
                    code="CONFIG", severity="error",
                    what=f"--load-debug-rollout-data replays saved samples and generates nothing, so "
                         f"{', '.join(ignored)} would do nothing (the saved samples already went through the "
                         "recording run's hooks)",
                    fix=f"drop {', '.join(ignored)}, or drop --load-debug-rollout-data",
                    facts={"field": "load_debug_rollout_data", "value": self.load_debug_rollout_data,
                           "ignored": ignored}))
        return errors
