from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from plumbing import ui
from plumbing.policy import retry_unless_config_error


@task(name="sync", task_run_name="sync-{rollout_id}", retries=1, retry_delay_seconds=2,
      retry_condition_fn=retry_unless_config_error, cache_policy=NO_CACHE)
def sync(run: Run, rollout_id: int, pause: bool = False, exported: Any = None, loaded: Any = None
         ) -> dict[str, float]:
    """Push the trainer's weights to every rollout engine (CUDA IPC, Ray's object store, or a versioned dir);
    pause: generations in flight are paused around it and continue under the new weights (--partial-rollout);
    exported: an Event set once the trainer's part is done (--async-mode: it trains on meanwhile); loaded: an Event
    set once the engines serve the new weights (--async-mode: the next rollout starts while the probe runs)."""
    with ui.diagnosed(run):
        return stages.sync(run, rollout_id, pause, exported, loaded)
