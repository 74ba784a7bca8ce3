import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from tasks.common import diagnosed, publish


@task(name="pack", task_run_name="pack-{rollout_id}", cache_policy=NO_CACHE)
def pack(run: Run, rollout_id: int) -> dict[str, float]:
    """The DP schedule and packed micro-batches for every rank, from the rollout's samples kept on the run
    (`run.staged`: task inputs and outputs stay small, never samples or tensors)."""
    t0 = time.perf_counter()
    with diagnosed(run):
        run.staged[("packed", rollout_id)] = stages.pack(run, run.staged.pop(("batch", rollout_id)))
    return publish(run, rollout_id, {**run.staged[("packed", rollout_id)].metrics,
                                     "pack/seconds": time.perf_counter() - t0})
