from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from plumbing import ui


@task(name="train", task_run_name="train-{packed.rollout_id}", cache_policy=NO_CACHE)
def train(run: Run, packed: stages.PackedRollout) -> dict[str, float]:
    """num_steps_per_rollout optimizer steps on the train workers (not retried: the update is not idempotent)."""
    seen = len(run.state.diagnoses)
    with ui.diagnosed(run):
        out = stages.train(run, packed)
    kl = f", KL {out['train/kl']:.3g}" if "train/kl" in out else ""  # no reference forward: no KL (--log-kl)
    # --loss-type sft_loss computes no mismatch (nothing was sampled)
    mismatch = f", mismatch {out['train/mismatch']:.2g}" if "train/mismatch" in out else ""
    if "train/critic_only" in out:  # --num-critic-only-steps: no policy step
        get_run_logger().info("train-%d: critic only, value loss %.3g%s, %.2f s", packed.rollout_id,
                              out["train/value_loss"], mismatch, out["train/seconds"])
    else:
        get_run_logger().info("train-%d: loss %.3g%s, grad norm %.3g%s, %.2f s", packed.rollout_id,
                              out["train/loss"], kl, out["train/grad_norm"], mismatch, out["train/seconds"])
    new = run.state.diagnoses[seen:]
    for d in new:  # runtime warnings (RF09 grad-norm spike): in the task's log and as an artifact
        get_run_logger().warning(d.render())
    if new:
        create_markdown_artifact(key=ui.artifact_key(run.cfg, "train-warnings"),
                                 markdown="\n\n".join(f"```\n{d.render()}\n```" for d in new))
    return out
