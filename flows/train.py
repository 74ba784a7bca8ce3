"""rl-train: one flow run per training run; reads like slime's train.py — one loop over rollout ids."""
from __future__ import annotations

import warnings
from contextlib import ExitStack
from typing import Any

from prefect import Flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_progress_artifact, \
    update_progress_artifact
from prefect.runtime import flow_run
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled
from tqdm import tqdm

import tasks
from engine.config import RunConfig
from engine.doctor.diagnosis import DiagnosisError
from engine.run import Run
from engine.stages import should_save, summary, track
from engine.tracking import TrackingWarning
from engine.tracking.record import finish, prefect_ui_url
from engine.tracking.secrets import redact
from flows import limits, stopping
from flows.params import CfgParam, run_config
from tasks import ui


def _flow_run_name() -> str:
    try:
        cfg = run_config(flow_run.parameters.get("cfg"), flow_run.parameters.get("config"))
    except DiagnosisError:  # the flow body raises it again: the run fails with the message instead of staying Pending
        return "rollflow/invalid-config"
    return f"{cfg.experiment_name}/{cfg.run_name}" if cfg.run_name else cfg.experiment_name


def _iteration_markdown(run: Run, rollout_id: int) -> str:
    h = run.history
    get = lambda k: h.get(k, {}).get(rollout_id, float("nan"))  # noqa: E731
    return (f"### rollout {rollout_id} of {run.cfg.num_rollout}\n\n| metric | value |\n|---|---|\n"
            f"| reward mean | {get('rollout/reward_mean'):.4f} |\n| response length | "
            f"{get('rollout/response_len_mean'):.1f} |\n| loss | {get('train/loss'):.5f} |\n"
            f"| KL (to reference) | {get('train/kl'):.5f} |\n| grad norm | {get('train/grad_norm'):.4f} |\n"
            f"| train–inference mismatch, mean / max (RF14) | {get('train/mismatch'):.3g} / "
            f"{get('train/mismatch_max'):.3g} |\n"
            f"| rollout tokens/s | {get('rollout/tokens_per_s'):.1f} |\n| rollout s | {get('rollout/seconds'):.2f} |\n"
            f"| train s | {get('train/seconds'):.2f} |\n| sync s | {get('sync/seconds'):.2f} |\n"
            + (f"| peak GPU GiB rollout / train / sync | {get('memory/rollout_peak_gib'):.2f} / "
               f"{get('memory/train_peak_gib'):.2f} / {get('memory/sync_peak_gib'):.2f} |\n"
               if "memory/rollout_peak_gib" in h else ""))


class SecretSafeFlow(Flow):
    """A flow whose parameters reach Prefect's database (and UI) with secrets masked: `--sglang-api-key`, the
    password of `--mlflow-tracking-uri` and any value engine/tracking/secrets.py counts as secret become
    `<redacted>`; the flow body still gets the real values (they never leave this process). A flow run started
    from the UI or a deployment gets only what Prefect stored, so there the secrets come from the worker's
    environment (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD; a run's engine token is made per run)."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        return redact(super().serialize_parameters(parameters))

    def with_options(self, **kwargs: Any) -> "SecretSafeFlow":
        new = super().with_options(**kwargs)
        new.__class__ = SecretSafeFlow
        return new


def _rl_train(cfg: CfgParam = None, config: str | None = None) -> dict[str, Any]:
    """RL post-training. `config`: a RunConfig YAML file; `cfg`: a RunConfig, or flags overriding the file."""
    cfg = run_config(cfg, config)
    _set_flow_retries(cfg)
    with ExitStack() as stack:
        try:
            stack.enter_context(limits.held(cfg))  # one writer per --save, GPU slots (flows/limits.py)
        except DiagnosisError as e:
            if not e.retryable:  # a GPU request the limit can never give
                _no_flow_retry(e)
            raise
        try:
            with stopping.sigterm_stops():
                return _train(cfg)
        except (stopping.StopRequested, TerminationSignal):  # SIGTERM: flows/stopping.py
            from engine import checkpoint

            marker = checkpoint.read_marker(cfg.save) if cfg.save else None
            where = (f"the marker names iteration {marker}: the same command resumes at rollout {marker + 1}"
                     if marker is not None else "no checkpoint was written yet")
            get_run_logger().warning("rollflow: stopped by SIGTERM; %s", where)
            return Cancelled(message=f"stopped by SIGTERM; {where}")


rl_train = SecretSafeFlow(_rl_train, name="rl-train", flow_run_name=_flow_run_name, log_prints=False,
                          validate_parameters=True)


def _train(cfg: RunConfig) -> dict[str, Any]:
    """preflight → place → convert, then rollout → pack → train → save → sync per rollout."""
    tracker = track(cfg, flow_run_id=str(flow_run.id), flow_run_url=prefect_ui_url(flow_run.id, flow_run.ui_url))
    if tracker.run_id:
        create_link_artifact(key="mlflow-run", link=tracker.run_url(), link_text=f"MLflow run {tracker.run_id}")
    run = None
    try:
        tasks.preflight(cfg)
        run = tasks.place_for(cfg)(cfg, tracker)
        start = tasks.convert(run)
        before = run.history.get("eval/test_accuracy_before", {}).get(-1)
        if before is None and start == 0:
            before = tasks.evaluate(run, "before")
            if before is not None:
                run.record({"eval/test_accuracy_before": before}, -1)
                run.tracker.log_metrics({"eval/test_accuracy": before}, step=0)
        progress = create_progress_artifact(progress=100.0 * start / cfg.num_rollout, key="progress",
                                            description="rollouts done")
        bar = progress_bar(cfg, start)
        for rollout_id in range(start, cfg.num_rollout):
            stopping.check()  # a SIGTERM stops the run here, between stages (flows/stopping.py)
            tasks.rollout_for(cfg)(run, rollout_id)  # tasks pass ids; samples and tensors stay on `run.staged`
            stopping.check()
            tasks.pack(run, rollout_id)
            tasks.train(run, rollout_id)
            stopping.check()
            if should_save(cfg, rollout_id):
                tasks.save(run, rollout_id)
            stopping.check()
            tasks.sync(run, rollout_id)
            ui.publisher().submit("progress", update_progress_artifact, progress,
                                  100.0 * (rollout_id + 1) / cfg.num_rollout)
            ui.publisher().submit("iteration", create_markdown_artifact, key="iteration",
                                  markdown=_iteration_markdown(run, rollout_id))
            bar.update(1)
            bar.set_postfix(reward=f"{run.history['rollout/reward_mean'][rollout_id]:.3f}",
                            loss=f"{run.history['train/loss'][rollout_id]:.4f}")
        bar.close()
        after = tasks.evaluate(run, "after")
        if after is not None:
            run.tracker.log_metrics({"eval/test_accuracy": after}, step=cfg.num_rollout)
        finish(tracker, run.history)
        _say_lost(tracker)
        return summary(run, acc_before=before, acc_after=after)
    except BaseException as e:
        finish(tracker, run.history if run else {}, e)
        _say_lost(tracker)
        if isinstance(e, DiagnosisError) and not e.retryable:
            _no_flow_retry(e)
        raise
    finally:
        ui.close()
        if run is not None:
            run.close()


def progress_bar(cfg: RunConfig, start: int) -> tqdm:
    """The terminal's rollout bar (--progress; --no-progress for logs and tests)."""
    return tqdm(total=cfg.num_rollout, initial=start, desc="rollouts", unit="rollout", disable=not cfg.progress,
                dynamic_ncols=True)


def _update_policy(**changes) -> bool:
    """Change this flow run's retry policy on the server (its RetryFailedFlows rule reads it there)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return False
    policy = ctx.flow_run.empirical_policy.model_copy(update=changes)
    with get_client(sync_client=True) as client:
        client.update_flow_run(ctx.flow_run.id, empirical_policy=policy)
    ctx.flow_run.empirical_policy = policy
    return True


def _set_flow_retries(cfg: RunConfig) -> None:
    """--flow-retries / --flow-retry-delay as this flow run's policy, the same from the CLI and a deployment.
    Each retry re-runs the flow, which resumes from the checkpoint marker (nothing trained is repeated)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None and ctx.flow_run.run_count <= 1 \
            and (ctx.flow_run.empirical_policy.retries or 0) != cfg.flow_retries:
        _update_policy(retries=cfg.flow_retries, retry_delay=int(cfg.flow_retry_delay))


def _no_flow_retry(e: DiagnosisError) -> None:
    """--flow-retries is for failures a re-run can get past (a crashed engine, a lost node); a diagnosed error
    (config, RF..) fails the same way again, so this flow run's remaining retries are dropped."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None or not (ctx.flow_run.empirical_policy.retries or 0):
        return
    if _update_policy(retries=ctx.flow_run.run_count - 1):
        get_run_logger().warning("not retrying the flow run: %s fails the same way on every attempt",
                                 ",".join(e.codes))


def _say_lost(tracker) -> None:
    """What MLflow never received, at the end of the run: a warning on the console and a Prefect artifact."""
    if report := tracker.lost_report():
        warnings.warn(report, TrackingWarning, stacklevel=2)
        create_markdown_artifact(key="mlflow-lost", markdown=f"**MLflow incomplete**: {report}")
