from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.events import emit_event
from prefect.cache_policies import NO_CACHE

from engine import checkpoint, stages
from engine.run import Run
from plumbing import ui
from plumbing.policy import retry_unless_config_error


@task(name="save", task_run_name="save-{rollout_id}", retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_config_error, cache_policy=NO_CACHE)
def save(run: Run, rollout_id: int) -> str | checkpoint.Staged:
    """Write iter_%07d/, then the marker, then retention (a retry rewrites the iteration: S3 I/O can fail);
    publish a `checkpoint` artifact and the `rollflow.checkpoint.committed` event. --async-save: only the state,
    returned for the `commit` task."""
    with ui.diagnosed(run):
        staged = stages.stage_save(run, rollout_id)
        if run.cfg.async_save:
            return staged
        report = stages.commit_save(run, staged)
    announce(run, rollout_id, report)
    return report.uri


@task(name="commit", task_run_name="commit-{rollout_id}", retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_config_error, cache_policy=NO_CACHE)
def commit(run: Run, rollout_id: int, staged: checkpoint.Staged) -> str:
    """--async-save: the rest of the save of `rollout_id` (checksums, the move or upload into iter_%07d/, the marker,
    retention) while the loop goes on, then what a plain save publishes. A retry goes on from where it failed."""
    with ui.diagnosed(run):
        report = stages.commit_save(run, staged)
    announce(run, rollout_id, report)
    return report.uri


def announce(run: Run, rollout_id: int, report: checkpoint.SaveReport) -> None:
    """A committed checkpoint: retention's deletions logged, the `checkpoint` artifacts, the event."""
    if report.deleted:
        get_run_logger().info("--keep-last-n %s deleted %s", run.cfg.keep_last_n, report.deleted)
    create_markdown_artifact(key=ui.artifact_key(run.cfg, "checkpoint"), markdown=report.markdown(),
                             description=f"checkpoint of rollout {rollout_id}")
    create_link_artifact(key=ui.artifact_key(run.cfg, "checkpoint-link"), link=as_link(report.uri),
                         link_text=f"iter {rollout_id}: {report.uri}")
    committed(run, rollout_id, report.uri)


def as_link(uri: str) -> str:
    """A clickable URI: local paths become file:// URLs; s3:// and others stay as they are."""
    return uri if "://" in uri else Path(uri).resolve().as_uri()


def committed(run: Run, rollout_id: int, uri: str):
    """The `rollflow.checkpoint.committed` event (after the marker names this iteration): other deployments can be
    triggered by it (prefect.yaml: rl-export-hf on each commit). Resource id: rollflow.checkpoint.<--save>."""
    return emit_event(event="rollflow.checkpoint.committed",
                      resource={"prefect.resource.id": f"rollflow.checkpoint.{run.cfg.save}",
                                "prefect.resource.name": f"{run.cfg.experiment_name} iter {rollout_id}",
                                "rollflow.iteration": str(rollout_id), "rollflow.uri": uri},
                      payload={"iteration": rollout_id, "uri": uri, "save": run.cfg.save,
                               "flow_run_id": str(run.flow_run_id) if run.flow_run_id else None,
                               "mlflow_run_id": run.tracker.run_id if run.tracker else None})
