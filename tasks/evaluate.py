from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from plumbing import ui


@task(name="evaluate", task_run_name="eval-{step}", cache_policy=NO_CACHE)
def evaluate(run: Run, step: int) -> float | None:
    """Accuracy on the eval prompts after `step` rollouts: 0 (before training), every --eval-interval, and
    --num-rollout (after)."""
    with ui.diagnosed(run):
        accuracy = stages.evaluate(run, step)
    if accuracy is not None:
        get_run_logger().info("eval-%d: %s", step, ", ".join(
            f"{name} accuracy {run.history[f'eval/{name}_accuracy'][step]:.4f} on {len(rows)} prompts"
            for name, rows in run.eval_sets.items()))
    return accuracy
