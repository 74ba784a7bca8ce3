"""One typed RunConfig whose field names are slime's flags (`rollout_batch_size` ⇄ `--rollout-batch-size`).

Sections live in their own modules; RunConfig is their union. Derived numbers (samples per rollout, G, k,
train_iters) are computed in one place: `RunConfig.batch`.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationInfo, model_validator

from engine.config.algorithm import AlgorithmArgs
from engine.config.base import config_error
from engine.config.base import flag as flag_of
from engine.config.checkpoint import CheckpointArgs
from engine.config.cluster import ClusterArgs
from engine.config.data import DataArgs
from engine.config.orchestration import OrchestrationArgs
from engine.config.packing import PackingArgs
from engine.config.rollout import RolloutArgs
from engine.config.tracking import TrackingArgs
from engine.config.train import TrainArgs
from engine.packing.arithmetic import BatchPlan, batch_plan

def prompt_rows(spec: str, **keys: Any) -> int:
    """Rows of a prompt file (its `@[a:b]` slice applied), cached by the file's path, size and mtime: a config is
    read several times per run."""
    import os

    from engine.data import _SLICE

    m = _SLICE.match(spec)
    path = m["path"] if m else spec
    try:
        st = os.stat(path)
        stamp = (st.st_size, st.st_mtime_ns)
    except OSError:  # s3:// or missing: load_prompts says which
        stamp = None
    key = (spec, stamp, tuple(sorted(keys.items())))
    if stamp is None or key not in _ROWS:
        from engine.data import load_prompts

        _ROWS[key] = len(load_prompts(spec, **keys))
    return _ROWS[key]


_ROWS: dict = {}

SECTIONS = [DataArgs, RolloutArgs, TrainArgs, PackingArgs, AlgorithmArgs, CheckpointArgs, ClusterArgs,
            OrchestrationArgs, TrackingArgs]

#: Fields that do not change what is trained (left out of the config hash).
NON_SEMANTIC = {"summary_json", "progress", "debug", "run_name", "work_dir", "mlflow_tracking_uri", "ray_address",
                "ray_code", "save", "load", "experiment_name", "num_cpus", "train_threads", "mlflow_timeout",
                "mlflow_retry_interval", "mlflow_send_interval", "log_samples_interval", "system_metrics_interval",
                "placement_timeout", "placement_retries", "placement_retry_delay", "rollout_retries", "flow_retries", "flow_retry_delay",
                "megatron_cuda_graphs", "offload_train", "recompute_activations", "recompute_granularity",
                "recompute_method", "recompute_num_layers",
                "recompute_loss_function", "train_share_prefix",
                "log_probs_chunk_size", "log_probs_max_tokens_per_gpu", "train_env_vars", "async_save",
                "check_weight_update_equal",
                "update_weight_buffer_size", "rollout_engine_process", "ray_services", "model_impl",
                "logprob_mismatch_threshold", "wait_for_save_lock", "allow_config_change", "save_debug_rollout_data",
                "save_debug_train_data", "dump_details", "custom_config_path",
                "distributed_timeout_minutes", "ci_save_grad_norm", "ci_load_grad_norm",
                "use_wandb", "wandb_project", "wandb_team", "wandb_group", "wandb_mode", "wandb_dir", "wandb_key",
                "wandb_host", "wandb_run_id", "disable_wandb_random_suffix",
                "wandb_always_use_train_step", "log_passrate", "log_multi_turn",
                "log_correct_samples",
                "use_tensorboard", "tb_project_name", "tb_experiment_name", "use_pytorch_profiler",
                "profile_step_start", "profile_step_end", "profile_ranks", "profile_target", "record_memory_history",
                "memory_snapshot_dir", "memory_snapshot_num_steps", "memory_snapshot_path", "memory_recorder"}


#: Settings a resume keeps: the checkpoint's manifest records them, and a resume that changes one fails with the
#: differences (--allow-config-change FIELD… accepts named ones). Each changes what the resumed run means: another
#: model or dataset, another batch arithmetic (data position, steps, lr schedule), other sampling seeds or an
#: optimizer state another backend or estimator wrote.
RESUME_FIXED = ("hf_checkpoint", "prompt_data", "input_key", "label_key", "tool_key", "rollout_batch_size",
                "n_samples_per_prompt", "global_batch_size", "num_steps_per_rollout", "rollout_shuffle", "seed",
                "train_backend", "advantage_estimator", "rollout_max_prompt_len", "rollout_seed",
                "rollout_max_context_len")
#: --custom-config-path keys of slime's MIS helper (examples/train_infer_mismatch_helper/mis.yaml) that are
#: rollflow's flags under another name: they set the flag and stay custom arguments (its functions read them)
CUSTOM_CONFIG_FLAG_ALIASES = {"tis_lower_bound": "tis_clip_low", "tis_upper_bound": "tis_clip"}

#: what shards the Megatron backend's optimizer checkpoint (megatron-core's dp_reshardable format): a resume that
#: changes one loads the weights (they reshard) only with --no-load-optim, unless the checkpoint was saved with
#: --dist-ckpt-optim-fully-reshardable
MEGATRON_OPTIM_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


class RunConfig(DataArgs, RolloutArgs, TrainArgs, PackingArgs, AlgorithmArgs, CheckpointArgs, ClusterArgs,
                OrchestrationArgs, TrackingArgs):
    """Everything a user can set for one training run."""

    def dict_reward_sources(self) -> list[str]:
        """The flags through which a sample's reward can be a dict: f1's {"score", "precision", "recall"}, a row's
        metadata rm_type (f1 too), a custom reward, the --rm-url service, a rollout function's own rewards."""
        return [flag for flag, on in (("--custom-rm-path", self.custom_rm_path), ("--rm-type remote_rm", self.rm_url),
                                      (f"--rm-type {self.rm_type}", self.rm_type in ("f1", "boxed_f1")),
                                      ("--metadata-key (a row's rm_type)", self.metadata_key),
                                      ("--rollout-function-path", self.rollout_function_path),
                                      ("--load-debug-rollout-data (the recorded rewards)",
                                       self.load_debug_rollout_data)) if on]

    def eval_dict_reward_sources(self) -> list[str]:
        """dict_reward_sources, plus --eval-config sets whose own rm_type can give a dict."""
        if not self.eval_config:
            return self.dict_reward_sources()
        return self.dict_reward_sources() + [f"--eval-config {d.name}'s rm_type {d.rm_type}"
                                             for d in self.eval_datasets() if d.rm_type in ("f1", "boxed_f1",
                                                                                            "remote_rm")]

    def has_eval(self) -> bool:
        """Eval sets are given (--eval-prompt-data or --eval-config)."""
        return bool(self.eval_config or self.eval_prompt_data)

    def _eval_config_consistent(self) -> None:
        """--eval-config replaces --eval-prompt-data: both set is ambiguous; its file is read now (a CONFIG error
        naming the field before anything starts). --skip-eval-before-train needs an evaluation to skip,
        --eval-interval one to repeat."""
        from engine.diagnosis import ConfigError, Diagnosis

        if self.skip_eval_before_train and not self.has_eval():
            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what="--skip-eval-before-train with no eval sets (--eval-prompt-data '' and no --eval-config): there "
                     "is no evaluation to skip", fix="drop --skip-eval-before-train",
                facts={"field": "skip_eval_before_train", "value": True}))
        if self.eval_interval is not None and not self.has_eval():
            raise config_error(f"--eval-interval {self.eval_interval} with no eval sets (--eval-prompt-data '' and no "
                               "--eval-config): there is no evaluation to repeat",
                               "drop --eval-interval, or name eval sets (--eval-prompt-data PATH or --eval-config)",
                               field="eval_interval", value=self.eval_interval)
        if self.eval_config and self.eval_prompt_data and self.changed("eval_prompt_data"):
            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--eval-config {self.eval_config} and --eval-prompt-data {' '.join(self.eval_prompt_data)} "
                     "both name eval sets",
                fix="keep one: list every set in the --eval-config file, or drop --eval-config",
                facts={"field": "eval_config", "value": self.eval_config}))
        sets = self.eval_datasets() if self.has_eval() else []  # --eval-config's file: read once, here
        if over := [d for d in sets if (d.min_new_tokens or 0) > d.max_response_len]:
            d = over[0]
            src = f"--eval-config {self.eval_config}" if self.eval_config else \
                f"--eval-min-new-tokens {self.eval_min_new_tokens}"
            raise config_error(f"{src}: eval set {d.name!r}'s min_new_tokens {d.min_new_tokens} is more than its "
                               f"answer length {d.max_response_len}", "a min_new_tokens (--eval-min-new-tokens, or "
                               "--eval-config's per set) at most the answer length (--eval-max-response-len)",
                               field="eval_config" if self.eval_config else "eval_min_new_tokens",
                               value=d.min_new_tokens)
        if not self.eval_config:
            return
        named = [d.name for d in sets if d.rm_type is not None]
        if named and self.custom_rm_path:
            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--eval-config {self.eval_config} names an rm_type for {', '.join(named)}, but --custom-rm-path "
                     f"{self.custom_rm_path} scores every sample",
                fix="drop rm_type from those datasets (your reward may read sample.metadata), or drop --custom-rm-path",
                facts={"field": "eval_config", "value": self.eval_config, "datasets": named}))

    def _reward_key_consistent(self) -> None:
        """--reward-key / --eval-reward-key select from a dict reward: with none possible they would do nothing."""
        from engine.diagnosis import ConfigError, Diagnosis

        for field, key in (("reward_key", self.reward_key), ("eval_reward_key", self.eval_reward_key)):
            if key is None:
                continue
            flag = "--" + field.replace("_", "-")
            if not key.strip():
                what, fix = f"{flag} is empty", f"{flag} NAME (a key of the reward dict), or drop it"
            elif field == "eval_reward_key" and self.eval_function_path:
                what = f"{flag} {key!r} with --eval-function-path: that function computes the evaluation's rewards"
                fix = f"drop {flag} (the function picks its own rewards)"
            elif field == "eval_reward_key" and not self.has_eval():
                what, fix = f"{flag} {key!r} with no --eval-prompt-data: no evaluation runs", f"drop {flag}"
            elif not (self.eval_dict_reward_sources() if field == "eval_reward_key" else self.dict_reward_sources()):
                what = (f"{flag} {key!r}: the rewards of this run are numbers (--rm-type {self.rm_type}), so there is "
                        "no dict to select from")
                fix = (f"drop {flag}, or return a dict of rewards from --custom-rm-path (or the --rm-url service, "
                       "--rollout-function-path)")
            else:
                continue
            raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=what, fix=fix,
                                        facts={"field": field, "value": key}))
        key = self.log_reward_category
        if key is not None and not (key.strip() and (self.custom_rm_path or self.rm_url or self.rollout_function_path
                                                     or self.replay)):
            raise config_error(f"--log-reward-category {key!r}: " + (
                "is empty" if not key.strip() else f"the rewards of this run come from --rm-type {self.rm_type}, "
                                                   "which names no category"),
                "drop --log-reward-category, or return {'score': …, " + repr(key or "why") + ": …} from "
                "--custom-rm-path (or the --rm-url service, --rollout-function-path)",
                field="log_reward_category", value=key)

    @classmethod
    def from_dump(cls, data: dict[str, Any]) -> "RunConfig":
        """A config `model_dump()` wrote, read again where the run's files may not be (a train worker on another
        node): what was resolved from files then (--num-epoch's --num-rollout, --eval-config's sets) is not
        re-read from them."""
        return cls.model_validate(data, context={"dumped": True})

    @model_validator(mode="before")
    @classmethod
    def _read_custom_config(cls, data: Any, info: ValidationInfo) -> Any:
        """--custom-config-path: its YAML mapping into --custom-config (read once, on the driver; a dumped config
        carries the values). A key that is a rollflow flag sets that flag, as slime's setattr does (slime's MIS
        helper's mis.yaml sets use_tis, tis_level, tis_mode, use_rs …; its tis_lower_bound / tis_upper_bound set
        --tis-clip-low / --tis-clip and stay custom arguments too); the same flag given elsewhere with another
        value is an error. Keys that are `args`' own attributes are refused (_custom_config_keys)."""
        if not isinstance(data, dict):
            return data
        data = cls._read_custom_config_file(data, info)
        custom = data.get("custom_config")
        if isinstance(custom, str):  # the inline JSON (its errors are the field's own validator's)
            try:
                custom = json.loads(custom)
            except ValueError:
                return data
        if not isinstance(custom, dict) or (info.context or {}).get("dumped"):
            return data
        src = f"--custom-config-path {data['custom_config_path']}" if data.get("custom_config_path") \
            else "--custom-config"
        fields, flags_set, kept = cls.model_fields, {}, {}
        for key, value in custom.items():
            target = key if key in fields else CUSTOM_CONFIG_FLAG_ALIASES.get(key)
            if target is None or (key not in fields and value is None):
                kept[key] = value
                continue
            if key not in fields:  # slime's own name, which its functions read: kept as a custom argument too
                kept[key] = value
            if target in data and data[target] != value or target in flags_set and flags_set[target] != value:
                raise config_error(f"{src} sets {key}: {value!r}, and {flag_of(target)} is also given as "
                                   f"{data.get(target, flags_set.get(target))!r}", f"give {flag_of(target)} once",
                                   field=target, value=value)
            flags_set[target] = value
        return {**data, **flags_set, "custom_config": kept}

    @classmethod
    def _read_custom_config_file(cls, data: dict, info: ValidationInfo) -> dict:
        path = data.get("custom_config_path")

        def error(what: str, fix: str):
            return config_error(what, fix, field="custom_config_path", value=path)

        if path and not (info.context or {}).get("dumped"):
            if data.get("custom_config"):
                raise error(f"--custom-config-path {path} and --custom-config both give custom arguments",
                            "keep one: the file, or the inline JSON")
            import yaml
            from pathlib import Path

            p = Path(path)
            if not p.is_file():
                raise error(f"--custom-config-path {path}: no such file", "pass the path of a YAML file of "
                            "arguments for your functions, e.g. `max_turns: 4`")
            try:
                loaded = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as e:
                raise error(f"--custom-config-path {path}: invalid YAML: {e}", "fix the YAML syntax") from None
            if not isinstance(loaded, dict):
                raise error(f"--custom-config-path {path} holds a {type(loaded).__name__}, not a mapping",
                            "top-level `key: value` lines, one per argument")
            data = {**data, "custom_config": loaded}
        return data

    @model_validator(mode="after")
    def _keep_old_actor(self) -> "RunConfig":
        """--keep-old-actor changes something only where a rollout can come from older weights, and only where the
        trainer computes the old log-probs."""
        if not self.keep_old_actor:
            return self
        why = fix = None
        if self.staleness_bound == 0:
            why = "every rollout is generated by the trainer's current weights (--async-mode off, " \
                  "--update-weights-interval 1): there are no older weights to keep"
            fix = "--async-mode one-step (or bounded), or --update-weights-interval N > 1; or drop --keep-old-actor"
        elif self.partial_rollout:
            why = "--partial-rollout continues samples under newer weights, so a sample has no one generating version"
            fix = "drop --partial-rollout or --keep-old-actor"
        elif self.use_rollout_logprobs:
            why = "--use-rollout-logprobs takes the engine's log-probs as the old ones: no trainer forward to run " \
                  "with the kept weights"
            fix = "drop --use-rollout-logprobs or --keep-old-actor"
        elif self.loss_type == "sft_loss" or self.disable_compute_advantages_and_returns:
            why = ("--loss-type sft_loss" if self.loss_type == "sft_loss" else
                   "--disable-compute-advantages-and-returns") + " uses no old log-probs"
            fix = "drop --keep-old-actor"
        elif self.load_debug_rollout_data:
            why = "a replay trains on recorded samples whose generating weights this run never had"
            fix = "drop --keep-old-actor (or --load-debug-rollout-data)"
        if why:
            raise config_error(f"--keep-old-actor: {why}", fix, field="keep_old_actor", value=True)
        return self

    @model_validator(mode="after")
    def _post_write_hook(self) -> "RunConfig":
        if self.custom_update_weight_post_write_path and self.weight_sync_method != "disk":
            raise config_error(f"--custom-update-weight-post-write-path {self.custom_update_weight_post_write_path!r} "
                               f"runs after a disk weight sync writes its files, and --weight-sync-method is "
                               f"{self.weight_sync_method}: it would never be called",
                               "--weight-sync-method disk, or drop the flag",
                               field="custom_update_weight_post_write_path",
                               value=self.custom_update_weight_post_write_path)
        return self

    @model_validator(mode="after")
    def _check_weight_update(self) -> "RunConfig":
        if self.check_weight_update_equal and (self.no_engines or not self.trains):
            why = "--debug-rollout-only has no trainer to sync from" if not self.trains else \
                "this run starts no rollout engine (--load-debug-rollout-data / --debug-train-only)"
            raise config_error(f"--check-weight-update-equal checks the trainer → engine weight sync, but {why}",
                               "drop --check-weight-update-equal", field="check_weight_update_equal", value=True)
        return self

    @model_validator(mode="after")
    def _profiling_run(self) -> "RunConfig":
        """--use-pytorch-profiler / --record-memory-history against the run: a trainer, a window and ranks that
        exist."""
        on = [f for f in ("use_pytorch_profiler", "record_memory_history") if getattr(self, f)]
        if on and not self.trains:
            raise config_error(f"--{on[0].replace('_', '-')} profiles the train ranks, and --debug-rollout-only "
                               "starts none", f"drop --{on[0].replace('_', '-')}", field=on[0], value=True)
        if self.use_pytorch_profiler:
            if self.profile_step_start >= self.num_rollout:
                raise config_error(f"--profile-step-start {self.profile_step_start}: the run's rollout ids are "
                                   f"0..{self.num_rollout - 1} (--num-rollout {self.num_rollout}), so nothing would be "
                                   "profiled", f"e.g. --profile-step-start {max(0, self.num_rollout - 2)} "
                                   f"--profile-step-end {self.num_rollout}", field="profile_step_start",
                                   value=self.profile_step_start)
            if (bad := [r for r in self.profile_ranks if r >= self.train_world_size]):
                raise config_error(f"--profile-ranks {' '.join(map(str, self.profile_ranks))}: rank(s) "
                                   f"{', '.join(map(str, bad))} do not exist; the run has {self.train_world_size} "
                                   f"train rank(s), 0..{self.train_world_size - 1}", "e.g. --profile-ranks 0",
                                   field="profile_ranks", value=self.profile_ranks)
        if self.record_memory_history and self.memory_snapshot_num_steps is not None and \
                self.memory_snapshot_num_steps > self.num_rollout:
            raise config_error(f"--memory-snapshot-num-steps {self.memory_snapshot_num_steps}: the run trains "
                               f"{self.num_rollout} rollouts (--num-rollout), so the snapshot would only be written "
                               "on an out-of-memory error", f"a value ≤ {self.num_rollout}, or leave it unset (the "
                               "snapshot on out-of-memory only)", field="memory_snapshot_num_steps",
                               value=self.memory_snapshot_num_steps)
        return self

    @model_validator(mode="after")
    def _ci_grad_norm(self) -> "RunConfig":
        """--ci-save-grad-norm / --ci-load-grad-norm: one of them, a local pattern with a file per step."""
        if self.ci_save_grad_norm and self.ci_load_grad_norm:
            raise config_error("--ci-save-grad-norm and --ci-load-grad-norm both set: a run either records the "
                               "reference gradient norms or checks against them", "drop one of them",
                               field="ci_load_grad_norm", value=self.ci_load_grad_norm)
        for field in ("ci_save_grad_norm", "ci_load_grad_norm"):
            pattern = getattr(self, field)
            if not pattern:
                continue
            flag = "--" + field.replace("_", "-")
            need = ["{rollout_id}", "{step_id}"] + (["{role}"] if self.advantage_estimator == "ppo" else [])
            if (missing := [k for k in need if k not in pattern]) or "://" in pattern:
                raise config_error(
                    f"{flag} {pattern!r}: " + (f"has no {', '.join(missing)}, so steps would share a file" if missing
                                                else "the files are read and written on the driver's filesystem"),
                    f"e.g. {flag} runs/ref/gn_{{role}}_{{rollout_id}}_{{step_id}}.json", field=field, value=pattern)
            try:
                pattern.format(role="actor", rollout_id=0, step_id=0)
            except (KeyError, IndexError, ValueError) as e:
                raise config_error(f"{flag} {pattern!r}: only {{role}}, {{rollout_id}} and {{step_id}} are filled in "
                                   f"({type(e).__name__}: {e})",
                                   f"e.g. {flag} runs/ref/gn_{{role}}_{{rollout_id}}_{{step_id}}.json", field=field,
                                   value=pattern) from None
            if not self.trains:
                raise config_error(f"{flag}: --debug-rollout-only runs no optimizer step", f"drop {flag}",
                                   field=field, value=pattern)
        return self

    @model_validator(mode="after")
    def _log_probs_cap(self) -> "RunConfig":
        if self.log_probs_max_tokens_per_gpu is not None and not self.use_dynamic_batch_size:
            raise config_error(f"--log-probs-max-tokens-per-gpu {self.log_probs_max_tokens_per_gpu} caps the tokens of "
                               "the no-grad forwards' micro-batches in dynamic mode, and --use-dynamic-batch-size is "
                               "off: the forwards run the step's --micro-batch-size micro-batches",
                               "--use-dynamic-batch-size --max-tokens-per-gpu N, or drop the flag",
                               field="log_probs_max_tokens_per_gpu", value=self.log_probs_max_tokens_per_gpu)
        return self

    @model_validator(mode="after")
    def _routing_replay(self) -> "RunConfig":
        if self.use_rollout_routing_replay:
            return self._rollout_routing_replay()
        if not self.use_routing_replay:
            return self
        if self.loss_type == "sft_loss" or self.disable_compute_advantages_and_returns:
            flag = "--loss-type sft_loss" if self.loss_type == "sft_loss" else "--disable-compute-advantages-and-returns"
            raise config_error(f"--use-routing-replay with {flag}: there is no old policy's forward to record the "
                               "routing in, so nothing would be replayed", "drop --use-routing-replay",
                               field="use_routing_replay", value=True)
        if self.log_probs_max_tokens_per_gpu is not None:
            raise config_error("--use-routing-replay with --log-probs-max-tokens-per-gpu: the no-grad forward that "
                               "records the routing packs other micro-batches than the steps, so its routing cannot "
                               "be replayed token for token", "drop --log-probs-max-tokens-per-gpu",
                               field="log_probs_max_tokens_per_gpu", value=self.log_probs_max_tokens_per_gpu)
        self._refuse_pipelined_recompute("--use-routing-replay")
        return self

    def _refuse_pipelined_recompute(self, flag: str) -> None:
        """A routing replay with Megatron's pipeline parallelism and a recompute of whole layers (their routers too):
        the recomputed forward of a micro-batch runs in its backward, after later micro-batches set their routing."""
        if self.train_backend != "megatron" or self.pipeline_model_parallel_size == 1:
            return
        recompute = "--recompute-activations" if self.recompute_activations else \
            "--recompute-granularity full" if self.recompute_granularity == "full" else None
        if recompute:
            raise config_error(f"{flag} with --pipeline-model-parallel-size {self.pipeline_model_parallel_size} and "
                               f"{recompute}: the recomputed forward of a micro-batch runs in its backward, after the "
                               "pipeline schedule has started later micro-batches, and would not replay its own "
                               "routing", f"drop {recompute} (--recompute-granularity selective recomputes no "
                               "router), or --pipeline-model-parallel-size 1",
                               field="recompute_activations" if self.recompute_activations else "recompute_granularity",
                               value=True if self.recompute_activations else "full")

    def _rollout_routing_replay(self) -> "RunConfig":
        if self.use_routing_replay:
            raise config_error("--use-rollout-routing-replay with --use-routing-replay: the steps replay one routing, "
                               "the engine's (rollout) or the trainer's own no-grad forward's",
                               "drop one of the two", field="use_routing_replay", value=True)
        if self.loss_type == "sft_loss":
            raise config_error("--use-rollout-routing-replay with --loss-type sft_loss: supervised data has no "
                               "rollout engine's routing to replay", "drop --use-rollout-routing-replay",
                               field="use_rollout_routing_replay", value=True)
        self._refuse_pipelined_recompute("--use-rollout-routing-replay")
        return self

    @model_validator(mode="after")
    def _async_save(self) -> "RunConfig":
        if self.async_save and not self.save:
            raise config_error("--async-save with no --save: there is no checkpoint to commit in the background",
                               "--save DIR (or s3://bucket/prefix), or drop --async-save", field="async_save",
                               value=True)
        idle = {field: text for field, text, on in (
            ("keep_last_n", f"--keep-last-n {self.keep_last_n}", self.keep_last_n is not None),
            ("save_hf", "--save-hf", self.save_hf), ("save_optim", "--no-save-optim", not self.save_optim),
            ("dist_ckpt_optim_fully_reshardable", "--dist-ckpt-optim-fully-reshardable",
             self.dist_ckpt_optim_fully_reshardable),
            ("wait_for_save_lock", f"--wait-for-save-lock {self.wait_for_save_lock:g}", self.wait_for_save_lock > 0))
            if on}
        if idle and not self.save:
            raise config_error(f"{', '.join(idle.values())} with no --save: no checkpoint is written, so "
                               f"{'it' if len(idle) == 1 else 'they'} would do nothing",
                               "--save DIR (or s3://bucket/prefix), or drop "
                               + ", ".join(t.split(" ")[0] for t in idle.values()),
                               field=next(iter(idle)), value=list(idle.values()))
        return self

    @model_validator(mode="after")
    def _optim_format(self) -> "RunConfig":
        """--dist-ckpt-optim-fully-reshardable sets the format of the Megatron optimizer state a save writes."""
        if self.distrib_optim_fully_reshardable_mem_efficient and not self.dist_ckpt_optim_fully_reshardable:
            raise config_error("--distrib-optim-fully-reshardable-mem-efficient without "
                               "--dist-ckpt-optim-fully-reshardable: it changes how that format is gathered, so alone "
                               "it would do nothing", "add --dist-ckpt-optim-fully-reshardable, or drop it",
                               field="distrib_optim_fully_reshardable_mem_efficient", value=True)
        if not self.dist_ckpt_optim_fully_reshardable:
            return self
        if self.train_backend != "megatron":
            raise config_error(f"--dist-ckpt-optim-fully-reshardable with --train-backend {self.train_backend}: it "
                               "sets the format of Megatron's distributed optimizer state; the torch backend saves "
                               "full, layout-free tensors already", "drop --dist-ckpt-optim-fully-reshardable",
                               field="dist_ckpt_optim_fully_reshardable", value=True)
        if not self.save_optim:
            raise config_error("--dist-ckpt-optim-fully-reshardable with --no-save-optim: no optimizer state is saved, "
                               "so its format would not matter", "drop one of the two",
                               field="dist_ckpt_optim_fully_reshardable", value=True)
        return self

    @model_validator(mode="after")
    def _custom_config_keys(self) -> "RunConfig":
        """A --custom-config key may not shadow a flag or what hooks' args hold besides the flags."""
        from engine.rollout.hooks import HOOK_ARGS_OWN

        taken = sorted(k for k in self.custom_config if k in type(self).model_fields or k in HOOK_ARGS_OWN)
        if taken:  # (a flag's key became the flag in _read_custom_config: one left here came from a dump)
            src = f"--custom-config-path {self.custom_config_path}" if self.custom_config_path else "--custom-config"
            raise config_error(f"{src} sets {', '.join(taken)}, which " + (
                "are rollflow flags" if taken[0] in type(self).model_fields
                else "hooks' args already hold (engine, tokenizer, …)"),
                "rename them, or set flags in --config / on the command line", field="custom_config",
                value=taken)
        return self

    def __getattr__(self, name: str) -> Any:
        """--custom-config's arguments as attributes (`cfg.max_turns`), as slime's args carry them: the train-side
        hooks get the config itself as `args`."""
        custom = self.__dict__.get("custom_config") or {}
        if name in custom:
            return custom[name]
        return super().__getattr__(name)

    @model_validator(mode="before")
    @classmethod
    def _epochs_to_rollouts(cls, data: Any, info: ValidationInfo) -> Any:
        """--num-epoch: --num-rollout from the rows of --prompt-data (slime's get_num_rollout_per_epoch: rows //
        --rollout-batch-size, times the epochs). A --num-rollout given beside it must be that number (a config
        dumped and read again carries both; `from_dump` keeps it without reading the data)."""
        if not isinstance(data, dict) or data.get("num_epoch") in (None, ""):
            return data
        if (info.context or {}).get("dumped"):
            return data
        from engine.diagnosis import ConfigError, Diagnosis

        epochs = int(data["num_epoch"])
        fields = cls.model_fields

        def given(name: str) -> Any:
            return data.get(name, fields[name].default)

        def error(what: str, fix: str) -> ConfigError:
            return ConfigError(Diagnosis(code="CONFIG", severity="error", what=what, fix=fix,
                                         facts={"field": "num_epoch", "value": epochs}))

        if given("data_source_path"):
            raise error(f"--num-epoch {epochs} with --data-source-path {given('data_source_path')}: a data source "
                        "has no number of rows to make epochs of", "--num-rollout N instead of --num-epoch")
        if epochs < 1:
            raise error(f"--num-epoch {epochs} is below 1", "--num-epoch 1 or more")
        rows = prompt_rows(str(given("prompt_data")), input_key=given("input_key"), label_key=given("label_key"),
                           metadata_key=given("metadata_key"))
        batch = int(given("rollout_batch_size"))
        per_epoch = rows // batch
        if per_epoch == 0:
            raise error(f"--num-epoch {epochs}: --prompt-data {given('prompt_data')} has {rows} rows, fewer than one "
                        f"rollout's --rollout-batch-size {batch}", f"--rollout-batch-size {rows} or less, or more data")
        n = per_epoch * epochs
        if data.get("num_rollout") not in (None, "") and int(data["num_rollout"]) != n:
            raise error(f"--num-epoch {epochs} makes --num-rollout {n} ({rows} rows // --rollout-batch-size {batch} × "
                        f"{epochs}), but --num-rollout {data['num_rollout']} is set too",
                        "drop one of --num-epoch and --num-rollout")
        return {**data, "num_rollout": n}

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "RunConfig":
        self.batch  # raises an RF06 ConfigError with the working values
        self._async_consistent()
        self._replay_consistent()
        self._rollout_only_consistent()
        self._external_consistent()
        self._engine_flags_consistent()
        if not (info.context or {}).get("dumped"):  # these read --eval-config's file: checked where it was read
            self._reward_key_consistent()
            self._eval_config_consistent()
        if self.custom_eval_rollout_log_function_path and not (self.has_eval() and not self.no_engines):
            raise config_error(f"--custom-eval-rollout-log-function-path {self.custom_eval_rollout_log_function_path!r}"
                               " with no evaluation: it would never be called",
                               "--eval-prompt-data PATH (or --eval-config), or drop the flag",
                               field="custom_eval_rollout_log_function_path")
        if self.eval_function_path and not self.has_eval():
            from engine.diagnosis import ConfigError, Diagnosis

            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--eval-function-path {self.eval_function_path!r} with no --eval-prompt-data: the evaluation it "
                     "replaces never runs",
                fix="--eval-prompt-data PATH (or NAME PATH pairs; the function reads them as args.eval_sets), or "
                    "drop --eval-function-path",
                facts={"field": "eval_function_path", "value": self.eval_function_path}))
        if self.rollout_engine_process == "trainer" and (why := self.engine_in_trainer_blockers()):
            from engine.diagnosis import ConfigError, Diagnosis

            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--rollout-engine-process trainer: the engine cannot run in train rank 0's process with "
                     f"{'; '.join(why)}",
                fix="--rollout-engine-process auto (own where it cannot) or own, or change the settings named",
                facts={"field": "rollout_engine_process", "value": "trainer", "blockers": why}))
        if self.save_debug_train_data and "{rank}" not in self.save_debug_train_data and self.train_world_size > 1:
            raise config_error(f"--save-debug-train-data {self.save_debug_train_data!r} has no {{rank}}: the "
                                f"{self.train_world_size} train ranks would write one file",
                                "put {rank} in the path, e.g. runs/debug/train_{rollout_id}_{rank}.pt",
                                field="save_debug_train_data", value=self.save_debug_train_data)
        if self.update_weights_interval > 1:
            n = self.update_weights_interval
            why = [w for w, on in (
                (f"--async-mode {self.async_mode} (it schedules its own syncs)", self.async_mode != "off"),
                ("--colocate (colocated engines release their weights while the trainer trains)", self.colocate),
                ("no rollout engine (--load-debug-rollout-data / --debug-train-only)", self.no_engines),
                ("--debug-rollout-only (no trainer)", self.debug_rollout_only),
                (f"--save-interval {self.save_interval}, not a multiple of {n} (a checkpoint between two syncs "
                 "holds weights the engines never had, so a resume would generate with other ones)",
                 bool(self.save and self.save_interval and self.save_interval % n))) if on]
            if why:
                raise config_error(f"--update-weights-interval {n} with {'; '.join(why)}",
                                    "drop --update-weights-interval, or change the settings named",
                                    field="update_weights_interval", value=n, blockers=why)
        if self.weight_sync_method == "distributed" and self.colocate:
            raise config_error("--weight-sync-method distributed with --colocate: a process group cannot join two "
                               "ranks on one GPU (each engine shares its GPU with a train rank)",
                               "--weight-sync-method tensor (CUDA IPC between the colocated trainer and engine)",
                               field="weight_sync_method", value="distributed")
        if self.num_critic_only_steps >= self.num_rollout:
            raise config_error(f"--num-critic-only-steps {self.num_critic_only_steps} with --num-rollout "
                                f"{self.num_rollout}: the policy would never train",
                                f"--num-critic-only-steps below {self.num_rollout}", field="num_critic_only_steps",
                                value=self.num_critic_only_steps)
        for prompt_flag, prompt_len, ctx_flag, ctx in (
                ("--rollout-max-prompt-len", self.rollout_max_prompt_len, "--rollout-max-context-len",
                 self.rollout_max_context_len),
                ("--eval-max-prompt-len", self.eval_max_prompt_len,
                 "--eval-max-context-len" if self.eval_max_context_len else "--rollout-max-context-len",
                 self.eval_context_len)):
            if prompt_len and ctx and prompt_len >= ctx:
                raise config_error(f"{prompt_flag} {prompt_len} is not below {ctx_flag} {ctx}: a prompt that long "
                                    "leaves no token to generate", f"{prompt_flag} {ctx - 1} or less",
                                    field=prompt_flag[2:].replace("-", "_"), value=prompt_len)
        if self.disable_rewards_normalization and self.custom_reward_post_process_path:
            raise config_error("--disable-rewards-normalization with --custom-reward-post-process-path: the hook's "
                                "rewards already replace the normalisation (they are used as they are)",
                                "drop --disable-rewards-normalization", field="disable_rewards_normalization")
        for flag, on in (("--freeze-params-name-list", self.freeze_params_name_list),
                         ("--only-train-params-name-list", self.only_train_params_name_list)):
            if on and self.train_backend != "torch":
                raise config_error(f"{flag} with --train-backend {self.train_backend}: only the torch backend has "
                                    "it (its patterns are Hugging Face parameter names, and Megatron fuses some of "
                                    "them, e.g. q/k/v_proj into one linear_qkv)",
                                    f"--train-backend torch (on a GPU too), or drop {flag}",
                                    field=flag[2:].replace("-", "_"))
        if self.train_share_prefix == "on" and self.train_backend != "torch":
            from engine.diagnosis import ConfigError, Diagnosis

            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--train-share-prefix on with --train-backend {self.train_backend}: only the torch backend "
                     "runs a shared prompt once",
                fix="--train-share-prefix auto (off on this backend) or --train-backend torch",
                facts={"field": "train_share_prefix", "value": "on"}))
        if self.ray_services == "full" and self.ray_address:
            from engine.diagnosis import ConfigError, Diagnosis

            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--ray-services full with --ray-address {self.ray_address}: the services are chosen when a "
                     "cluster starts, and a joined cluster runs the ones it was started with",
                fix="drop --ray-services (`ray start` starts Ray's defaults), or drop --ray-address for a local "
                    "cluster with Ray's full services",
                facts={"field": "ray_services", "value": "full"}))
        if self.ray_code == "image" and not self.ray_address:
            raise config_error("--ray-code image without --ray-address: it says how rollflow's code reaches the nodes "
                               "of a joined cluster, and the local cluster a run starts sees the driver's files",
                               "drop --ray-code, or join a cluster with --ray-address", field="ray_code",
                               value="image")
        if self.model_impl != "auto" and self.train_backend != "torch" and self.rollout_engine != "builtin":
            from engine.diagnosis import ConfigError, Diagnosis

            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--model-impl {self.model_impl} with --train-backend {self.train_backend} and --rollout-engine "
                     f"{self.rollout_engine}: neither loads rollflow's model code (Megatron and SGLang have their own)",
                fix="drop --model-impl (SGLang's own flag is --sglang-model-impl)",
                facts={"field": "model_impl", "value": self.model_impl}))
        unknown = [f for f in self.allow_config_change if f.replace("-", "_") not in RESUME_FIXED]
        if unknown:
            from engine.diagnosis import ConfigError, Diagnosis

            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--allow-config-change {' '.join(unknown)}: not a setting a resume keeps",
                fix=f"name fields of {', '.join(RESUME_FIXED)} (other flags may change on resume anyway)",
                facts={"field": "allow_config_change", "value": unknown}))
        return self

    def _async_consistent(self) -> None:
        from engine.diagnosis import ConfigError, Diagnosis

        errors = []
        if self.async_mode != "off" and self.colocate:
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--async-mode {self.async_mode} with --colocate: the engines and the trainer share the GPUs and "
                     "take turns on them (the engines release their memory while the trainer trains), so rollout "
                     "and training cannot overlap",
                fix="drop --colocate and give the engines their own GPUs (--rollout-num-gpus), or --async-mode off",
                facts={"field": "async_mode", "value": self.async_mode}))
        if self.async_mode != "off" and self.offload_train:
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--async-mode {self.async_mode} with --offload-train: offloading frees the trainer's GPU for "
                     "colocated engines between steps, but an asynchronous trainer trains while the engines generate",
                fix="drop --offload-train (the engines have GPUs of their own), or --async-mode off",
                facts={"field": "offload_train", "value": True}))
        if self.max_staleness is not None and self.async_mode != "bounded":
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--max-staleness {self.max_staleness} bounds --async-mode bounded; with --async-mode "
                     f"{self.async_mode} it would do nothing (off: 0, one-step: 1)",
                fix=f"--async-mode bounded --max-staleness {self.max_staleness}, or drop --max-staleness",
                facts={"field": "max_staleness", "value": self.max_staleness}))
        if self.partial_rollout and self.async_mode == "off":
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what="--partial-rollout pauses rollouts in flight at a weight sync; with --async-mode off no rollout "
                     "is in flight at a sync",
                fix="--async-mode one-step (or bounded) --partial-rollout, or drop --partial-rollout",
                facts={"field": "partial_rollout", "value": True}))
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what="--mask-offpolicy-in-partial-rollout masks the segments older weights generated in samples "
                     "that --partial-rollout continued; without --partial-rollout no sample has them",
                fix="--partial-rollout --mask-offpolicy-in-partial-rollout (with --async-mode), or drop "
                    "--mask-offpolicy-in-partial-rollout",
                facts={"field": "mask_offpolicy_in_partial_rollout", "value": True}))
        hooked = [f for f in ("rollout_function_path", "custom_generate_function_path") if getattr(self, f)]
        if self.partial_rollout and hooked:
            flag = "--" + hooked[0].replace("_", "-")
            errors.append(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--partial-rollout with {flag}: partial samples are continued by the built-in rollout loop; "
                     "a custom rollout or generate function makes its own engine calls and would get the paused "
                     "requests back as aborted",
                fix=f"drop --partial-rollout (async modes work without it), or drop {flag}",
                facts={"field": "partial_rollout", "value": True}))
        if errors:
            raise ConfigError(errors)

    @property
    def eval_context_len(self) -> int | None:
        """--eval-max-context-len, else --rollout-max-context-len (slime's default)."""
        return self.eval_max_context_len or self.rollout_max_context_len

    def prompt_cap(self, evaluation: bool = False) -> tuple[int | None, str]:
        """(the longest prompt kept when the data is loaded, the flag that set it): --rollout-max-prompt-len
        (--eval-max-prompt-len), else the context length − 1 (slime's default), else (None, "")."""
        if evaluation:
            ctx_flag = "--eval-max-context-len" if self.eval_max_context_len else "--rollout-max-context-len"
            if self.eval_max_prompt_len:
                return self.eval_max_prompt_len, "--eval-max-prompt-len"
            return (self.eval_context_len - 1, ctx_flag) if self.eval_context_len else (None, "")
        if self.rollout_max_prompt_len:
            return self.rollout_max_prompt_len, "--rollout-max-prompt-len"
        if self.rollout_max_context_len:
            return self.rollout_max_context_len - 1, "--rollout-max-context-len"
        return None, ""

    @property
    def replay(self) -> bool:
        """--load-debug-rollout-data: the rollouts are read from files; no engine starts."""
        return bool(self.load_debug_rollout_data)

    @property
    def no_engines(self) -> bool:
        """No rollout engine starts: a replay, or --debug-train-only (a rollout function that does not generate)."""
        return self.replay or self.debug_train_only

    def _replay_consistent(self) -> None:
        """--load-debug-rollout-data / --debug-train-only start no engine: what needs one would do nothing (the
        default eval set, the bundled one, is left out and the run says so; another one is an error)."""
        from engine.diagnosis import ConfigError, Diagnosis

        if not self.no_engines:
            return
        which = "--load-debug-rollout-data" if self.replay else "--debug-train-only"
        source = "saved rollouts" if self.replay else "the rollout function's samples"
        needs = []
        if self.async_mode != "off":
            needs.append(f"--async-mode {self.async_mode} (it overlaps generation with training)")
        if self.colocate:
            needs.append("--colocate (it shares the GPUs with engines)")
        if self.eval_interval is not None:
            needs.append(f"--eval-interval {self.eval_interval} (evaluation generates on the engines)")
        if self.eval_prompt_data and self.changed("eval_prompt_data"):
            needs.append("--eval-prompt-data (evaluation generates on the engines)")
        if self.eval_config:
            needs.append("--eval-config (evaluation generates on the engines)")
        if self.rollout_engine_process != "auto":
            needs.append(f"--rollout-engine-process {self.rollout_engine_process}")
        if self.use_fault_tolerance and self.debug_train_only:
            needs.append("--use-fault-tolerance (it restarts failed engines)")
        if self.sglang_args:
            needs.append(f"{', '.join('--sglang-' + k for k in self.sglang_args)} (they configure the engines)")
        if needs:
            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"{which} trains on {source} and starts no rollout engine: {'; '.join(needs)} would do nothing",
                fix="drop " + ", ".join(n.split(" (")[0].split(" ")[0] for n in needs) +
                    (" (--eval-prompt-data '' for a YAML file's)" if any("eval-prompt" in n for n in needs) else "")
                    + f", or drop {which}",
                facts={"field": which[2:].replace("-", "_"), "value": self.load_debug_rollout_data or True,
                       "needs_engines": needs}))

    @property
    def external_engines(self) -> bool:
        """--rollout-external-engine-addrs: the run uses servers it did not start (engine/rollout/external.py)."""
        return bool(self.rollout_external_engine_addrs)

    def _external_consistent(self) -> None:
        """External engines are started, sized and restarted by their owner: what would configure that here would
        do nothing."""
        if not self.external_engines:
            return
        n = len(self.rollout_external_engine_addrs)
        launch = [f"--sglang-{k}" for k in self.sglang_args if k != "api-key"]
        needs = [w for w, on in (
            ("--colocate (each server holds its own GPUs)", self.colocate),
            ("--use-fault-tolerance (rollflow cannot restart a server it did not start; a dead one is waited for "
             "before a retried rollout)", self.use_fault_tolerance),
            ("--load-debug-rollout-data / --debug-train-only (they use no engine)", self.no_engines),
            (f"--rollout-engine-process {self.rollout_engine_process}", self.rollout_engine_process != "auto"),
            (f"--rollout-num-gpus {self.rollout_num_gpus}", self.rollout_num_gpus is not None),
            (f"--rollout-num-gpus-per-engine {self.rollout_num_gpus_per_engine}",
             self.rollout_num_gpus_per_engine != 1),
            (f"--rollout-num-engines {self.rollout_num_engines} (the {n} address(es) are the engines)",
             self.rollout_num_engines not in (1, n)),
            (f"--rollout-dtype {self.rollout_dtype}", self.rollout_dtype != "auto"),
            ("--rollout-engine-python", bool(self.rollout_engine_python)),
            (f"{', '.join(launch)} (SGLang launch flags)", bool(launch))) if on]
        if needs:
            raise config_error(
                f"--rollout-external-engine-addrs attaches to servers that run already: {'; '.join(needs)} would do "
                "nothing here", "drop them (a server's own command line sets its GPUs, dtype and flags; "
                "--sglang-api-key stays: it is the key rollflow sends), or drop --rollout-external-engine-addrs",
                field="rollout_external_engine_addrs", value=self.rollout_external_engine_addrs, conflicts=needs)
        if self.rollout_engine == "builtin" and self.trains and not self.sglang_args.get("api-key"):
            raise config_error(
                "--rollout-external-engine-addrs with the built-in engine and no --sglang-api-key: it takes weights "
                "only from a client with the --api-key it was started with",
                "start it with --api-key KEY and pass --sglang-api-key KEY (kept out of logs and MLflow)",
                field="sglang_args", value="api-key")

    def _engine_flags_consistent(self) -> None:
        """--rollout-engine-python and the `--sglang-*` flags configure the engines the run starts: the built-in
        engine runs no interpreter of its own and reads only a few SGLang flags (engine/config/sglang_args.py
        `BUILTIN_READS`); any other would do nothing there. A name that is not SGLang's at all is left to the
        doctor's check, which names the nearest flag. slime's own --sglang-* flags are refused with any engine."""
        from engine.config.slime_flags import NOT_TAKEN_SGLANG
        from engine.diagnosis import ConfigError, Diagnosis

        if slime := [k for k in self.sglang_args if k in NOT_TAKEN_SGLANG]:
            raise ConfigError([Diagnosis(code="CONFIG", severity="error", what=f"--sglang-{k} is slime's flag, which "
                                         f"rollflow does not take: {NOT_TAKEN_SGLANG[k][0]}",
                                         fix=NOT_TAKEN_SGLANG[k][1], facts={"field": "sglang_args", "value": k})
                               for k in slime])
        if self.rollout_engine != "builtin" or self.external_engines or self.no_engines:
            return  # SGLang takes them all; external engines and engine-free runs have checks of their own
        if self.rollout_engine_python:
            raise config_error(f"--rollout-engine-python {self.rollout_engine_python} runs `-m sglang.launch_server`; "
                               "the built-in engine (--rollout-engine builtin) would not use it",
                               "add --rollout-engine sglang, or drop --rollout-engine-python",
                               field="rollout_engine_python", value=self.rollout_engine_python)
        from engine.config.sglang_args import BUILTIN_READS, OWNED, ROLLFLOW_FLAG_FOR, known_flags

        _, known = known_flags()
        unread = [k for k in self.sglang_args if k in known and k not in BUILTIN_READS]
        if not unread:
            return

        def flags(names) -> str:
            return ", ".join("--sglang-" + k for k in names)

        instead = [f"{ROLLFLOW_FLAG_FOR[k]} for --sglang-{k}" for k in unread if k in ROLLFLOW_FLAG_FOR]
        owned = [k for k in unread if k in OWNED]
        launch = [k for k in unread if k not in OWNED]
        fix = "drop them" + (f" (use {'; '.join(instead)})" if instead else "")
        if launch:
            fix += f", or launch SGLang with {'them' if not owned else flags(launch)}: --rollout-engine sglang"
        if owned:
            fix += f"; rollflow sets {flags(owned)} itself (placement and the port allocator)"
        raise config_error(
            f"--rollout-engine builtin: {flags(unread)} would do nothing (SGLang launch flags; the built-in engine "
            f"reads only {flags(BUILTIN_READS)})", fix,
            field="sglang_args", value={k: self.sglang_args[k] for k in unread})

    def _rollout_only_consistent(self) -> None:
        """--debug-rollout-only starts no trainer: what needs one would do nothing."""
        from engine.diagnosis import ConfigError, Diagnosis

        if not self.debug_rollout_only:
            return
        needs = [f"{flag} {value}" for flag, value in (
            ("--load-debug-rollout-data", self.load_debug_rollout_data), ("--save", self.save),
            ("--load", self.load), ("--ref-load", self.ref_load), ("--eval-interval", self.eval_interval)) if value]
        needs += [f for f, on in (("--async-mode " + self.async_mode, self.async_mode != "off"),
                                  ("--colocate", self.colocate), ("--offload-train", self.offload_train),
                                  ("--rollout-engine-process trainer", self.rollout_engine_process == "trainer"))
                  if on]
        if needs:
            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--debug-rollout-only generates with the starting weights and trains nothing: "
                     f"{', '.join(needs)} would do nothing (the weights never change, no checkpoint is written)",
                fix="drop " + ", ".join(n.split(" ")[0] for n in needs) +
                    (" (--save '' for a YAML file's)" if self.save else "") + ", or drop --debug-rollout-only",
                facts={"field": "debug_rollout_only", "value": True, "needs_trainer": needs}))

    @property
    def trains(self) -> bool:
        """False with --debug-rollout-only: no train worker, no pack, train, save or sync."""
        return not self.debug_rollout_only

    def fixed_settings(self) -> dict[str, Any]:
        """RESUME_FIXED's values, as the checkpoint manifest records them (G and k as the run uses them: an unset
        --global-batch-size is B·n)."""
        out = self.model_dump(mode="json", include=set(RESUME_FIXED))
        plan = self.batch
        out.update(global_batch_size=plan.global_batch_size, num_steps_per_rollout=plan.num_steps_per_rollout)
        if self.train_backend == "megatron":
            out["megatron_layout"] = {k: getattr(self, k) for k in MEGATRON_OPTIM_LAYOUT}
            out["megatron_layout"]["optim_format"] = ("fully_reshardable" if self.dist_ckpt_optim_fully_reshardable
                                                      else "dp_reshardable")
        return out

    def resume_changes(self, recorded: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
        """(field, recorded, now) for each kept setting this config changes, less --allow-config-change's; a
        manifest written before settings were recorded (None) gives none."""
        if not recorded:
            return []
        allowed = {f.replace("-", "_") for f in self.allow_config_change}
        now = self.fixed_settings()
        out = [(k, recorded[k], now[k]) for k in RESUME_FIXED
               if k in recorded and k not in allowed and recorded[k] != now[k]]
        # the Megatron optimizer state loads only into the parallel layout it was saved from (MEGATRON_OPTIM_LAYOUT),
        # unless it was saved with --dist-ckpt-optim-fully-reshardable (the format the checkpoint records)
        old, new = recorded.get("megatron_layout"), now.get("megatron_layout")
        if self.load_optim and old and new and old.get("optim_format", "dp_reshardable") == "dp_reshardable":
            out += [(k, old[k], new[k]) for k in MEGATRON_OPTIM_LAYOUT if k in old and old[k] != new[k]]
        return out

    def engine_in_trainer_blockers(self) -> list[str]:
        """Why the built-in engine cannot serve from a thread of train rank 0's process (--rollout-engine-process
        trainer); [] when nothing in the flags forbids it. Engines on GPUs are checked at place, on the cluster."""
        why = []
        if self.rollout_engine != "builtin":
            why.append(f"--rollout-engine {self.rollout_engine} (it runs a server process of its own)")
        if self.rollout_num_engines > 1:
            why.append(f"--rollout-num-engines {self.rollout_num_engines} (one engine per process)")
        if self.train_world_size > 1:
            why.append(f"{self.train_world_size} train ranks (one train rank only)")
        if self.async_mode != "off":
            why.append(f"--async-mode {self.async_mode} (the engine and the trainer would compute at once in one "
                       "process)")
        if self.use_fault_tolerance:
            why.append("--use-fault-tolerance (a failed engine would take the trainer with it)")
        if self.colocate:
            why.append("--colocate (GPU engines)")
        if self.no_engines:
            why.append(("--load-debug-rollout-data" if self.replay else "--debug-train-only") + " (no engine at all)")
        if self.external_engines:
            why.append("--rollout-external-engine-addrs (servers rollflow did not start)")
        if self.weight_sync_method == "distributed":
            why.append("--weight-sync-method distributed (an engine in the trainer's process takes a copy)")
        if self.debug_rollout_only:
            why.append("--debug-rollout-only (no trainer)")
        return why

    def engine_in_trainer_on_cpu(self) -> bool:
        """Whether the built-in engine serves from train rank 0's process on a cluster without GPUs
        (--rollout-engine-process auto or trainer, and no blocker); stages.engine_in_trainer adds the GPU case."""
        return self.rollout_engine_process != "own" and not self.engine_in_trainer_blockers()

    @property
    def train_world_size(self) -> int:
        """Train ranks (GPUs, or CPU workers): nodes × GPUs per node."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: train ranks / (TP · PP · CP); each replica gets its own micro-batches
        (CP ranks share one micro-batch; preflight checks the divisibility)."""
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size * \
            self.context_parallel_size
        return max(1, self.train_world_size // model_parallel)

    @property
    def batch(self) -> BatchPlan:
        return batch_plan(rollout_batch_size=self.rollout_batch_size,
                          n_samples_per_prompt=self.n_samples_per_prompt, num_rollout=self.num_rollout,
                          global_batch_size=self.global_batch_size,
                          num_steps_per_rollout=self.num_steps_per_rollout,
                          micro_batch_size=self.micro_batch_size, dp_size=self.dp_size,
                          use_dynamic_batch_size=self.use_dynamic_batch_size,
                          max_tokens_per_gpu=self.max_tokens_per_gpu, cp_size=self.context_parallel_size)

    @property
    def sampling_seed(self) -> int:
        """The seed of the data order and the engines' sampling: --rollout-seed, else --seed."""
        return self.seed if self.rollout_seed is None else self.rollout_seed

    def engine_dtype(self, device_type: str) -> str:
        """The built-in engine's dtype on `device_type` ("cuda" / "cpu"): --rollout-dtype, auto resolved."""
        if self.rollout_dtype != "auto":
            return self.rollout_dtype
        return "bfloat16" if self.bf16 and device_type == "cuda" else "float32"

    def mismatch_threshold(self, engine_dtype: str) -> float:
        """RF14's limit on the mean |log π_engine − log π_trainer|: --logprob-mismatch-threshold, else 0.05 when
        either side computes in bf16 and 1e-3 in fp32. Measured on an H200 with the same weights: fp32 6e-7 (torch
        backend vs the fp32 engine); bf16 Megatron vs the bf16 transformers engine 0.014 (0.01, the first default,
        stopped a healthy run); NeMo RL's bar for a correct bf16 model is a mean multiplicative probability error
        ≤ 1.05, i.e. ≈ 0.05 here. A wrong, partial or stale weight gives O(0.1–10)."""
        if self.logprob_mismatch_threshold is not None:
            return self.logprob_mismatch_threshold
        return 0.05 if self.bf16 or engine_dtype != "float32" else 1e-3

    @property
    def model_dir(self) -> str:
        """--hf-checkpoint as a local directory on this node: itself, or for s3:// this node's cached copy
        (engine/cluster/nodes.py:local_model; downloaded on first use)."""
        from engine.cluster.nodes import local_model

        return local_model(self.hf_checkpoint)

    def config_hash(self) -> str:
        """sha256 (16 hex) of the fields that change what is trained (secrets masked: a new engine key is no new
        config, and the hash cannot be used to test guesses of a key)."""
        from engine.tracking.secrets import redact

        data = redact(self.model_dump(mode="json", exclude=NON_SEMANTIC))
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def flat_params(self) -> dict[str, Any]:
        """The config as flat string-able params (for MLflow); lists and dicts as JSON."""
        out = {}
        for k, v in self.model_dump(mode="json").items():
            out[k] = json.dumps(v) if isinstance(v, (list, dict)) else v
        return out


__all__ = ["RunConfig", "SECTIONS", "BatchPlan"]
