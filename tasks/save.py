from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from tasks.common import diagnosed


@task(name="save", task_run_name="save-{rollout_id}", cache_policy=NO_CACHE)
def save(run: Run, rollout_id: int) -> str:
    """Write iter_%07d/ and then the latest_checkpointed_iteration.txt marker."""
    with diagnosed(run):
        return stages.save(run, rollout_id)
