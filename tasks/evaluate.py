from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run


@task(name="evaluate", task_run_name="eval-{tag}", cache_policy=NO_CACHE)
def evaluate(run: Run, tag: str) -> float | None:
    """Greedy accuracy on the eval prompts: `before` training (step 0) or `after` it (step --num-rollout)."""
    return stages.evaluate(run, 0 if tag == "before" else run.cfg.num_rollout)
