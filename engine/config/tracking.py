"""Run identity, work directory, tracking and reporting flags."""
from typing import Literal, Optional

from pydantic import Field, model_validator

from engine.config.base import Section, config_error


class TrackingArgs(Section):
    work_dir: str = "runs/default"
    """Run directory: MLflow SQLite store, weight-sync files, logs (created if missing)."""

    experiment_name: str = "rollflow"
    """MLflow experiment name."""

    run_name: Optional[str] = None
    """Name of this training run (MLflow run and Prefect flow run); default: experiment name + time."""

    mlflow_tracking_uri: Optional[str] = None
    """MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<work_dir>/mlflow.db)."""

    mlflow_timeout: int = Field(10, ge=1)
    """Seconds one MLflow HTTP request may take (no retries: a failed call is buffered, never blocks training)."""

    mlflow_retry_interval: float = Field(30.0, ge=0)
    """While MLflow is unreachable, data is buffered and MLflow is tried again at most every this many seconds."""

    mlflow_send_interval: float = Field(2.0, ge=0)
    """Seconds between the MLflow sender's batches during a run (the writes of several fast iterations go out as one;
    0 = send after every stage). A checkpoint and the end of the run send everything at once whatever this is."""

    log_samples_interval: int = Field(10, ge=0)
    """Every N rollouts (and the last) log the rollout's samples as JSONL and redraw the plots in MLflow (plots at
    most once a minute; 0 = off)."""

    use_wandb: bool = False
    """Also log every metric and the run's flags to Weights & Biases (slime's flag), beside MLflow, which stays the run's record (resume, `rollflow compare`). Needs `pip install wandb`. Each metric section has its own x-axis (`rollout/step`, `eval/step`, …); a resumed run continues its W&B run (its id is the MLflow run's). A W&B failure is reported once and training goes on. docs/mlflow.md, "Weights & Biases"."""

    wandb_project: Optional[str] = None
    """W&B project (slime's flag). Default: --experiment-name."""

    wandb_team: Optional[str] = None
    """W&B entity, a team or user (slime's flag). Default: the API key's user."""

    wandb_group: Optional[str] = None
    """W&B run group (slime's flag), e.g. to show several runs of one sweep together."""

    wandb_mode: Literal["online", "offline"] = "online"
    """online: stream to the W&B server; offline: write under --wandb-dir only, `wandb sync DIR` uploads later (a cluster without internet)."""

    wandb_dir: Optional[str] = None
    """Where W&B writes its files (slime's flag). Default: <work_dir>/wandb."""

    wandb_key: Optional[str] = None
    """W&B API key (slime's flag). A secret: never logged, never a param or artifact. Default: $WANDB_API_KEY or `wandb login`'s."""

    wandb_host: Optional[str] = None
    """W&B server URL for a self-hosted W&B (slime's flag). Default: W&B's cloud."""

    wandb_run_id: Optional[str] = None
    """Log into this W&B run id (slime's flag; created if missing). Default: the MLflow run's id, so a resumed run continues its W&B run."""

    disable_wandb_random_suffix: bool = False
    """Name the W&B run --wandb-group exactly (slime's flag, which otherwise names it <group>_<random id>-RANK_0). rollflow names a W&B run after its MLflow run, whose name is unique already (<experiment>-<date>-<time>, or --run-name), so it adds no random suffix; with this flag a slime script's runs keep slime's names. Needs --wandb-group."""

    wandb_always_use_train_step: bool = False
    """Plot every W&B metric against `train/step`, the optimizer steps taken (slime's flag): a rollout's metrics at rollout id × --num-steps-per-rollout, the evaluations at rollouts trained × the same. Default: each section against its own `<section>/step` (rollout ids; rollouts trained for eval/*). system/* stays in seconds. MLflow's steps do not change."""

    log_passrate: bool = False
    """Also log pass@k for k = 1, 2, 4, … up to the samples per prompt (slime's flag): rollout/pass_at_<k> over each rollout's groups, eval/<set>_pass_at_<k> over an eval set's prompts (with more than one sample per prompt). The unbiased estimator 1 − C(n−c, k) / C(n, k) of n samples with c correct, where a reward of 1 is correct, as slime counts."""

    log_multi_turn: bool = False
    """Also log multi-turn rollout metrics (slime's flag): rollout/multi_turn_trained_len_{mean,max,min} (each response's model tokens, loss mask 1), rollout/multi_turn_observation_len_mean (its tool or environment tokens, loss mask 0), rollout/multi_turn_response_len_min and rollout/multi_turn_clip_ratio (share at --rollout-max-response-len), and rollout/multi_turn_round_number_{mean,max,min} from each sample's metadata["round_number"] where the generate function sets it (examples/tool_calc.py does)."""

    log_correct_samples: bool = False
    """Also log metrics of each rollout's correct samples, those with reward 1 (slime's flag): rollout/correct_samples (how many), rollout/correct_length_p25, _p50, _p75, _p100 (the share of their responses whose length falls in each quarter of --rollout-max-response-len) and rollout/correct_entropy (their mean per-token −log p under the engine, over trained tokens). Only the count when no sample is correct."""

    system_metrics_interval: float = Field(10.0, ge=0)
    """Seconds between system metric samples (CPU, memory; GPU when present) logged to MLflow (0 = off)."""

    summary_json: Optional[str] = None
    """Write the final summary (rewards, accuracy, wall time, run ids, save dir) to this JSON file."""

    progress: bool = True
    """Show a progress bar on the terminal."""

    debug: bool = False
    """Show Prefect's tracebacks on the terminal for a diagnosed failure too (without it the terminal shows the
    diagnosis; the tracebacks stay in the Prefect UI's logs)."""

    use_tensorboard: bool = False
    """Also write every metric to TensorBoard event files (slime's flag), beside MLflow: `tensorboard --logdir DIR`. DIR is $TENSORBOARD_DIR, else `tensorboard_log/<--tb-project-name>/<--tb-experiment-name>` (slime's layout), else <work_dir>/tensorboard/<run name>. Each metric at its MLflow step (rollout id; rollouts trained for eval/*; seconds for system/*). Needs `pip install tensorboardX` (installed with the dev extra). A failure is reported once and training goes on."""

    tb_project_name: Optional[str] = None
    """--use-tensorboard: the event files go to tensorboard_log/<this>/<--tb-experiment-name> (slime's flag), unless $TENSORBOARD_DIR is set."""

    tb_experiment_name: Optional[str] = None
    """--use-tensorboard with --tb-project-name: the directory under it (slime's flag). Default: the date and time."""

    use_pytorch_profiler: bool = False
    """Profile the train ranks with torch.profiler (Megatron's and slime's flag): rollouts --profile-step-start ≤ id < --profile-step-end, ranks --profile-ranks, regions --profile-target. Each profile is written as a Chrome trace, `<target>_rollout<id>[_step<k>]_rank<r>.pt.trace.json.gz` in <work_dir>/profile/ on the rank's node (open it in ui.perfetto.dev, chrome://tracing or TensorBoard's profiler plugin); the run's log names each file. Profiled rollouts run slower: shapes, stacks, memory and FLOPs are recorded (as slime does), and writing a trace takes about a second per step of the bundled model on the CPU. Both backends, CPU and CUDA."""

    profile_step_start: int = Field(10, ge=0)
    """--use-pytorch-profiler: the first rollout id profiled (Megatron's flag and default)."""

    profile_step_end: int = Field(12, ge=1)
    """--use-pytorch-profiler: the rollout id the profiling stops before (Megatron's flag and default)."""

    profile_ranks: list[int] = [0]
    """--use-pytorch-profiler: the train ranks profiled (Megatron's flag and default)."""

    profile_target: list[Literal["train_overall", "train_actor", "train_log_probs"]] = ["train_overall"]
    """--use-pytorch-profiler: what is profiled (slime's flag and default). train_overall: the whole of a rollout's training on the rank, from its log-prob forwards to the end of its last optimizer step (other threads of the process included); train_log_probs: the no-grad forwards before the steps (old log-probs, reference, values; no trace where none runs, e.g. --use-rollout-logprobs with one step); train_actor: each optimizer step (forward, backward, update), a trace per step. train_overall contains the others and is not combined with them (torch.profiler runs one profile at a time)."""

    record_memory_history: bool = False
    """Record the memory allocations of every train rank from its start, with their stacks (Megatron's and slime's flag), by --memory-recorder. torch: the CUDA caching allocator's history; the snapshot is written after the rollout --memory-snapshot-num-steps − 1 is trained, and on an out-of-memory error (`.oom` appended), to --memory-snapshot-dir/rank<r>_<--memory-snapshot-path>: drag it into pytorch.org/memory_viz. CUDA only (a cluster without GPUs is a CONFIG error at placement). memray: the process's host memory (tested on CPU runs), written when rollout --memory-snapshot-num-steps − 1 is trained: `memray flamegraph FILE`. Either slows allocation."""

    memory_recorder: Literal["torch", "memray"] = "torch"
    """--record-memory-history's recorder (slime's flag): torch (the CUDA caching allocator) or memray (host memory, every Python and native allocation; `pip install memray`, in the dev extra; needs --memory-snapshot-num-steps)."""

    memory_snapshot_dir: Optional[str] = None
    """--record-memory-history: where the snapshots go on each rank's node (slime's flag). Default: <work_dir>/profile."""

    memory_snapshot_num_steps: Optional[int] = Field(None, ge=1)
    """--record-memory-history: write the snapshot (and stop recording) once rollout id N − 1 is trained (slime's flag). Unset: only on an out-of-memory error."""

    memory_snapshot_path: str = "snapshot.pickle"
    """--record-memory-history: the snapshot's file name after rank<r>_ (Megatron's flag and default; with --memory-recorder memray the default is memray.bin)."""

    @model_validator(mode="after")
    def _profiling(self) -> "TrackingArgs":
        """Profiler and memory-history settings without their switch would do nothing; the window must be one."""
        fields = type(self).model_fields

        def changed(names):
            return [f"--{k.replace('_', '-')}" for k in self.changed(*names)]

        for switch, names in (("use_pytorch_profiler", ("profile_step_start", "profile_step_end", "profile_ranks",
                                                        "profile_target")),
                              ("record_memory_history", ("memory_snapshot_dir", "memory_snapshot_num_steps",
                                                         "memory_snapshot_path", "memory_recorder"))):
            if (set_ := changed(names)) and not getattr(self, switch):
                raise config_error(f"{', '.join(set_)} without --{switch.replace('_', '-')}: they would do nothing",
                                   f"add --{switch.replace('_', '-')}, or drop them", field=switch, value=False)
        if self.use_pytorch_profiler:
            if self.profile_step_end <= self.profile_step_start:
                raise config_error(f"--profile-step-end {self.profile_step_end} ≤ --profile-step-start "
                                   f"{self.profile_step_start}: no rollout would be profiled",
                                   "a --profile-step-end above --profile-step-start (rollouts start ≤ id < end)",
                                   field="profile_step_end", value=self.profile_step_end)
            if not self.profile_ranks or min(self.profile_ranks) < 0:
                raise config_error(f"--profile-ranks {self.profile_ranks}: train ranks are numbered from 0",
                                   "e.g. --profile-ranks 0 1", field="profile_ranks", value=self.profile_ranks)
            if "train_overall" in self.profile_target and len(set(self.profile_target)) > 1:
                raise config_error(f"--profile-target {' '.join(self.profile_target)}: train_overall contains the "
                                   "other targets, and torch.profiler runs one profile at a time",
                                   "--profile-target train_overall, or train_actor and/or train_log_probs",
                                   field="profile_target", value=self.profile_target)
        if self.record_memory_history and self.memory_recorder == "memray":
            import importlib.util

            if self.memory_snapshot_num_steps is None:
                raise config_error("--memory-recorder memray writes its file when the recording stops, and "
                                   "--memory-snapshot-num-steps is not set (there is no out-of-memory dump)",
                                   "e.g. --memory-snapshot-num-steps 2 (recorded until rollout 1 is trained)",
                                   field="memory_snapshot_num_steps", value=None)
            if importlib.util.find_spec("memray") is None:
                raise config_error("--memory-recorder memray, but the memray package is not installed",
                                   "pip install memray (or --memory-recorder torch on a GPU)",
                                   field="memory_recorder", value="memray")
        if self.memory_snapshot_path != fields["memory_snapshot_path"].default and \
                ("/" in self.memory_snapshot_path or not self.memory_snapshot_path.strip()):
            raise config_error(f"--memory-snapshot-path {self.memory_snapshot_path!r} is a file name (the directory "
                               "is --memory-snapshot-dir)", "e.g. --memory-snapshot-path snapshot.pickle",
                               field="memory_snapshot_path", value=self.memory_snapshot_path)
        return self

    @model_validator(mode="after")
    def _tensorboard(self) -> "TrackingArgs":
        """--tb-* without --use-tensorboard would do nothing; --use-tensorboard without tensorboardX cannot work."""
        from engine.diagnosis import ConfigError, Diagnosis

        set_ = [f"--{k.replace('_', '-')}" for k in ("tb_project_name", "tb_experiment_name") if getattr(self, k)]
        if set_ and not self.use_tensorboard:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                        what=f"{', '.join(set_)} without --use-tensorboard: no event file is written",
                                        fix="add --use-tensorboard, or drop them", facts={"field": "use_tensorboard"}))
        if self.tb_experiment_name and not self.tb_project_name:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                        what="--tb-experiment-name names a directory under --tb-project-name, which "
                                             "is not set", fix="add --tb-project-name", facts={"field":
                                                                                               "tb_experiment_name"}))
        if self.use_tensorboard:
            import importlib.util

            if importlib.util.find_spec("tensorboardX") is None:
                raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                            what="--use-tensorboard, but the tensorboardX package is not installed",
                                            fix="pip install tensorboardX (or drop --use-tensorboard: MLflow records "
                                                "the run)", facts={"field": "use_tensorboard"}))
        return self

    @model_validator(mode="after")
    def _wandb(self) -> "TrackingArgs":
        """--wandb-* without --use-wandb would do nothing; --use-wandb without the package cannot work."""
        from engine.diagnosis import ConfigError, Diagnosis

        set_ = [f"--{k.replace('_', '-')}" for k in ("wandb_project", "wandb_team", "wandb_group", "wandb_dir",
                                                     "wandb_key", "wandb_host", "wandb_run_id",
                                                     "disable_wandb_random_suffix", "wandb_always_use_train_step")
                if getattr(self, k)]
        if self.wandb_mode != "online":
            set_.append(f"--wandb-mode {self.wandb_mode}")
        if set_ and not self.use_wandb:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                        what=f"{', '.join(set_)} without --use-wandb: nothing is sent to W&B",
                                        fix="add --use-wandb, or drop them", facts={"field": "use_wandb"}))
        if self.disable_wandb_random_suffix and not self.wandb_group:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                        what="--disable-wandb-random-suffix names the W&B run --wandb-group, which is "
                                             "not set", fix="add --wandb-group NAME (or drop the flag: the run is "
                                                            "then named after its MLflow run)",
                                        facts={"field": "disable_wandb_random_suffix", "value": True}))
        if self.use_wandb:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                            what="--use-wandb, but the wandb package is not installed",
                                            fix="pip install wandb (or drop --use-wandb: MLflow records the run)",
                                            facts={"field": "use_wandb"}))
        return self
