from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from engine.tracking.record import log_checkpoint
from tasks.common import diagnosed, publish, retry_unless_config_error


@task(name="save", task_run_name="save-{rollout_id}", retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_config_error, cache_policy=NO_CACHE)
def save(run: Run, rollout_id: int) -> str:
    """Write iter_%07d/, then the marker, then retention (a retry rewrites the iteration: S3 I/O can fail);
    record its URI in MLflow and publish a `checkpoint` artifact."""
    with diagnosed(run):
        report = stages.save(run, rollout_id)
    publish(run, rollout_id, report.metrics)
    log_checkpoint(run.tracker, run.cfg, rollout_id, report.uri, run.flow_run_id)
    if report.deleted:
        get_run_logger().info("--keep-last-n %s deleted %s", run.cfg.keep_last_n, report.deleted)
    create_markdown_artifact(key="checkpoint", markdown=report.markdown(),
                             description=f"checkpoint of rollout {rollout_id}")
    return report.uri
