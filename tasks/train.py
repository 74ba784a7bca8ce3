from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from tasks.common import diagnosed, publish


@task(name="train", task_run_name="train-{packed.rollout_id}", cache_policy=NO_CACHE)
def train(run: Run, packed: stages.PackedRollout) -> dict[str, float]:
    """num_steps_per_rollout optimizer steps on the train workers (not retried: the update is not idempotent)."""
    with diagnosed(run):
        return publish(run, packed.rollout_id, stages.train(run, packed))
