from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from engine import stages
from tasks import ui
from engine.run import Run
from engine.tracking.record import log_rollout
from tasks.common import diagnosed, publish, retry_unless_config_error


@task(name="rollout", task_run_name="rollout-{rollout_id}", retries=1, retry_delay_seconds=2,
      retry_condition_fn=retry_unless_config_error, cache_policy=NO_CACHE)
def rollout(run: Run, rollout_id: int) -> dict[str, float]:
    """Generate B prompts × n samples on the engines and score them (kept on the run for `pack`); publish a sample
    table. A retry (after a deadline or a dead engine) first restarts the engines that stopped serving."""
    with diagnosed(run):
        if (ctx := TaskRunContext.get()) and ctx.task_run.run_count > 1:
            stages.revive_engines(run)
        batch = stages.rollout(run, rollout_id)
    publish(run, rollout_id, batch.metrics)
    preview = [{"prompt": str(s.prompt)[:200], "response": s.response[:200], "label": str(s.label),
                "reward": round(s.scalar_reward, 4), "status": s.status.value}
               for g in batch.groups[:4] for s in g[:2]]
    ui.publisher().submit("samples", create_table_artifact, key="samples", table=preview,
                          description=f"sample rollouts of rollout {rollout_id}")
    log_rollout(run.tracker, run.cfg, rollout_id, batch.groups, run.history)  # JSONL + plots, when due
    run.staged[("batch", rollout_id)] = batch
    return batch.metrics


def configured(cfg):
    """The rollout task with --rollout-retries."""
    return rollout.with_options(retries=cfg.rollout_retries)
