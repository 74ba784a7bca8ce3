import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from tasks.common import diagnosed, publish


@task(name="pack", task_run_name="pack-{batch.rollout_id}", cache_policy=NO_CACHE)
def pack(run: Run, batch: stages.RolloutBatch) -> stages.PackedRollout:
    """Advantages, DP schedule and packed micro-batches for every rank."""
    t0 = time.perf_counter()
    with diagnosed(run):
        packed = stages.pack(run, batch)
    publish(run, batch.rollout_id, {**packed.metrics, "pack/seconds": time.perf_counter() - t0})
    return packed
