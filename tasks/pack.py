from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from plumbing import ui


@task(name="pack", task_run_name="pack-{batch.rollout_id}", cache_policy=NO_CACHE)
def pack(run: Run, batch: stages.RolloutBatch) -> stages.PackedRollout:
    """The DP schedule and packed micro-batches for every rank, from the rollout's samples."""
    with ui.diagnosed(run):
        return stages.pack(run, batch)
