from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from engine import stages
from engine.config import RunConfig
from engine.run import Run
from engine.tracking import Tracker
from tasks.common import retry_unless_config_error


@task(name="place", task_run_name="place", retries=1, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_config_error, cache_policy=NO_CACHE)
def place(cfg: RunConfig, tracker: Tracker | None = None) -> Run:
    """Start Ray, the rollout engines and the train workers; keep the MLflow run opened by `stages.track`."""
    url = flow_run.ui_url  # "None/..." when no UI URL is configured (ephemeral API)
    return stages.place(cfg, tracker=tracker, flow_run_id=flow_run.id,
                        flow_run_url=url if url and url.startswith("http") else None)
