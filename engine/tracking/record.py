"""What a training run records in MLflow and when: the calls the stages, tasks and flow make.

open_tracking (place)  params = the redacted flat RunConfig + derived batch numbers; tags = config hash, model,
                       dataset, --save, work dir, Prefect flow-run id and URL, git commit, version; the resolved config
                       as `config.yaml`; system metrics start.
log_rollout (rollout)  every --log-samples-interval rollouts and the last: `samples/rollout_%07d.jsonl` and the plots.
log_checkpoint (save)  `checkpoints/iter_%07d.json` and the `rollflow.checkpoint.latest` tag.
finish (flow end)      plots; on failure the doctor report (`doctor-report.md`, tag `rollflow.failure`); the run ends
                       FINISHED / FAILED / KILLED; system metrics stop.
"""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from engine.config import RunConfig
from engine.tracking import Tracker, TrackingWarning, artifact_location_for, default_tracking_uri
from engine.tracking import artifacts as art
from engine.tracking.secrets import redact
from engine.tracking.system import SystemSampler

#: the plots are redrawn with the sample tables, at most once per this many seconds (and at the end of the run):
#: three matplotlib PNGs cost ~0.3 s of CPU, a third of a core on the CPU demo if drawn every 10 rollouts
PLOT_INTERVAL_S = 60.0


def run_params(cfg: RunConfig) -> dict[str, Any]:
    """The flattened RunConfig with secrets redacted, plus the derived batch numbers (`derived/…`)."""
    params = redact(cfg.model_dump(mode="json"))
    plan = cfg.batch
    params.update({"derived/samples_per_rollout": plan.samples_per_rollout,
                   "derived/global_batch_size": plan.global_batch_size,
                   "derived/num_steps_per_rollout": plan.num_steps_per_rollout,
                   "derived/train_iters": plan.train_iters})
    return params


def prefect_ui_url(flow_run_id: str | None, ui_url: str | None) -> str | None:
    """Prefect's own URL when it knows its UI; else the local server's page for the run (the ephemeral API keeps
    its history in Prefect's local database, which `prefect server start` serves on 127.0.0.1:4200)."""
    if ui_url and ui_url.startswith("http"):
        return ui_url
    return f"http://127.0.0.1:4200/runs/flow-run/{flow_run_id}" if flow_run_id else None


def open_tracking(cfg: RunConfig, *, work_dir: Path, resume: dict[str, Any] | None, flow_run_id: str | None,
                  flow_run_url: str | None, run_name: str | None = None) -> Tracker:
    """The run's Tracker with its MLflow run started (a new one named `run_name`, default run_name_of(cfg), or the
    one a resume continues), its tags, params and config.yaml."""
    # MLflow reads these per request: one bounded attempt, the tracker buffers instead of retrying inline
    # (MLflow's defaults, 7 retries with backoff factor 2 and a 120 s timeout, would stall training for minutes).
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(cfg.mlflow_timeout)
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    work_dir.mkdir(parents=True, exist_ok=True)
    uri = default_tracking_uri(str(work_dir), cfg.mlflow_tracking_uri)
    tracker = Tracker(uri, cfg.experiment_name, outbox=work_dir / "mlflow-outbox" / f"{time.time_ns()}",
                      artifact_location=artifact_location_for(uri), retry_interval=cfg.mlflow_retry_interval,
                      background=True, send_interval=cfg.mlflow_send_interval)
    # background: off the stages' critical path, in batches; drained before each checkpoint's marker and at the end
    save = cfg.save or ""
    if save and "://" not in save:
        save = str(Path(save).resolve())
    tags = {"rollflow.config_hash": cfg.config_hash(), "rollflow.model": cfg.hf_checkpoint,
            "rollflow.dataset": cfg.prompt_data, "rollflow.save": save, "rollflow.work_dir": str(work_dir),
            "rollflow.version": art.package_version(), "mlflow.source.name": "rollflow train", **art.git_info()}
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
        tags["prefect.flow_run_url"] = flow_run_url or ""
        tags["mlflow.note.content"] = (f"Prefect flow run [{flow_run_id}]({flow_run_url})" +
                                       (f"; checkpoints in `{save}`" if save else ""))
    resume_info = None
    if resume:
        resume_info = {"from_iteration": resume["iteration"], "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "flow_run_id": flow_run_id, "automatic": resume.get("automatic", False)}
        tags["rollflow.resumed_from"] = str(resume["iteration"])
        if resume.get("parent_run_id"):  # a copy of another run's --save: a new run, shown under its parent
            tags.update({"rollflow.parent_run_id": resume["parent_run_id"], "mlflow.parentRunId":
                         resume["parent_run_id"], "rollflow.copied_from": resume.get("written_to", "")})
    run_name = run_name or run_name_of(cfg)
    manifest_run = (resume or {}).get("manifest", {}).get("mlflow_run_id")
    tracker.start(run_name, manifest_run, tags=tags, params=run_params(cfg), resume=resume_info,
                  flow_run_id=flow_run_id)
    _safely("config", lambda: tracker.log_text(art.as_yaml(redact(cfg.model_dump(mode="json"))), "config.yaml"))
    if cfg.use_wandb:
        from engine.tracking.wandb_mirror import WandbMirror

        mirror = WandbMirror.start(cfg, run_name=tracker.run_name or run_name, run_id=tracker.run_id,
                                   config=cfg.model_dump(mode="json"))
        tracker.mirrors += [mirror] if mirror is not None else []
    if cfg.use_tensorboard:
        from engine.tracking.tb_mirror import TensorboardMirror

        mirror = TensorboardMirror.start(cfg, run_name=tracker.run_name or run_name)
        tracker.mirrors += [mirror] if mirror is not None else []
    tracker.sampler = SystemSampler(tracker, cfg.system_metrics_interval).start() \
        if cfg.system_metrics_interval > 0 else None
    return tracker


def run_name_of(cfg: RunConfig) -> str:
    """A new run's name in MLflow and Prefect: --run-name, else `<experiment>-<date>-<time>`."""
    return cfg.run_name or f"{cfg.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def should_log_samples(cfg: RunConfig, rollout_id: int) -> bool:
    n = cfg.log_samples_interval
    return n > 0 and (rollout_id % n == 0 or rollout_id == cfg.num_rollout - 1)


def _safely(what: str, fn: Callable[[], None]) -> None:
    """Building an artifact must not stop training either (the Tracker guards MLflow itself)."""
    try:
        fn()
    except Exception as e:
        warnings.warn(f"MLflow {what} skipped ({type(e).__name__}: {e}); training continues", TrackingWarning,
                      stacklevel=3)


def log_plots(tracker: Tracker, history: dict) -> None:
    for name, png in art.run_plots(history).items():
        tracker.log_bytes(png, name)


def log_rollout(tracker: Tracker, cfg: RunConfig, rollout_id: int, groups: list, history: dict) -> None:
    """Sample rollouts and redrawn plots, when this rollout is due (should_log_samples)."""
    if should_log_samples(cfg, rollout_id):
        _safely("samples", lambda: tracker.log_text(art.samples_jsonl(groups),
                                                    f"samples/rollout_{rollout_id:07d}.jsonl"))
        _safely("samples table", lambda: tracker.log_table(art.samples_table(groups),
                                                           f"samples/rollout_{rollout_id:07d}.json"))
        now = time.monotonic()
        if now - tracker.plots_drawn_at >= PLOT_INTERVAL_S:
            tracker.plots_drawn_at = now
            snapshot = {k: dict(v) for k, v in history.items()}  # the sender thread draws them later
            tracker.defer(lambda: _safely("plots", lambda: log_plots(tracker, snapshot)))


def log_checkpoint(tracker: Tracker, cfg: RunConfig, rollout_id: int, path: str, flow_run_id: str | None) -> None:
    _safely("checkpoint record", lambda: tracker.log_text(
        art.checkpoint_record(rollout_id, path, cfg.save, flow_run_id), f"checkpoints/iter_{rollout_id:07d}.json"))
    tracker.set_tags({"rollflow.checkpoint.latest": path})


def finish(tracker: Tracker, history: dict, error: BaseException | None = None) -> None:
    """Plots, the failure report when `error` is set, then end the run (FINISHED / FAILED / KILLED)."""
    if tracker.sampler:
        tracker.sampler.stop()
    _safely("plots", lambda: log_plots(tracker, history))
    status = "FINISHED"
    if error is not None:
        code, report = art.failure_report(error)
        tracker.log_text(report, "doctor-report.md")
        tracker.set_tags({"rollflow.failure": code})
        # Ctrl-C, SIGTERM (Prefect's TerminationSignal), SystemExit: stopped, not failed
        status = "KILLED" if not isinstance(error, Exception) else "FAILED"
    tracker.end(status)
