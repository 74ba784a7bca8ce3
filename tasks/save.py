import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from engine.tracking.record import log_checkpoint
from tasks.common import diagnosed, publish


@task(name="save", task_run_name="save-{rollout_id}", cache_policy=NO_CACHE)
def save(run: Run, rollout_id: int) -> str:
    """Write iter_%07d/ and then the latest_checkpointed_iteration.txt marker; record its URI in MLflow."""
    t0 = time.perf_counter()
    with diagnosed(run):
        path = stages.save(run, rollout_id)
    publish(run, rollout_id, {"save/seconds": time.perf_counter() - t0})
    log_checkpoint(run.tracker, run.cfg, rollout_id, path, run.flow_run_id)
    return path
