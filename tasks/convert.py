from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from tasks.common import diagnosed


@task(name="convert", task_run_name="convert", cache_policy=NO_CACHE)
def convert(run: Run) -> int:
    """Load the starting weights (HF or the resumed checkpoint) everywhere; return the first rollout id."""
    with diagnosed(run):
        return stages.convert(run)
