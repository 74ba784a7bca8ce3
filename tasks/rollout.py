from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from engine import stages
from engine.run import Run
from plumbing import ui
from plumbing.policy import retry_unless_config_error


@task(name="rollout", task_run_name="rollout-{rollout_id}", retries=1, retry_delay_seconds=2,
      retry_condition_fn=retry_unless_config_error, cache_policy=NO_CACHE)
def rollout(run: Run, rollout_id: int) -> stages.RolloutBatch:
    """Generate B prompts × n samples on the engines and score them; publish a sample table. A retry (after a
    deadline or a dead engine) first restarts the engines that stopped serving."""
    with ui.diagnosed(run):
        if (ctx := TaskRunContext.get()) and ctx.task_run.run_count > 1:
            stages.revive_engines(run)
        batch = stages.rollout(run, rollout_id)
    ui.samples(batch)
    m = batch.metrics
    get_run_logger().info("rollout-%d: reward %.3f, %d samples, response length %.1f, %.0f tok/s, %.2f s",
                          rollout_id, m.get("rollout/reward_mean", float("nan")), sum(len(g) for g in batch.groups),
                          m.get("rollout/response_len_mean", float("nan")), m.get("rollout/tokens_per_s", float("nan")),
                          m.get("rollout/seconds", float("nan")))
    return batch
