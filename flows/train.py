"""rl-train: one flow run per training run; reads like slime's train.py — one loop over rollout ids."""
from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_progress_artifact, \
    update_progress_artifact
from prefect.runtime import flow_run
from tqdm import tqdm

import tasks
from engine.config import RunConfig
from engine.run import Run
from engine.stages import should_save, summary


def _flow_run_name() -> str:
    cfg = flow_run.parameters["cfg"]
    name = cfg.run_name if isinstance(cfg, RunConfig) else (cfg or {}).get("run_name")
    exp = cfg.experiment_name if isinstance(cfg, RunConfig) else (cfg or {}).get("experiment_name", "rollflow")
    return f"{exp}/{name}" if name else f"{exp}"


def _iteration_markdown(run: Run, rollout_id: int) -> str:
    h = run.history
    get = lambda k: h.get(k, {}).get(rollout_id, float("nan"))  # noqa: E731
    return (f"### rollout {rollout_id} of {run.cfg.num_rollout}\n\n| metric | value |\n|---|---|\n"
            f"| reward mean | {get('rollout/reward_mean'):.4f} |\n| response length | "
            f"{get('rollout/response_len_mean'):.1f} |\n| loss | {get('train/loss'):.5f} |\n"
            f"| KL (to reference) | {get('train/kl'):.5f} |\n| grad norm | {get('train/grad_norm'):.4f} |\n"
            f"| rollout tokens/s | {get('rollout/tokens_per_s'):.1f} |\n| rollout s | {get('rollout/seconds'):.2f} |\n"
            f"| train s | {get('train/seconds'):.2f} |\n| sync s | {get('sync/seconds'):.2f} |\n")


@flow(name="rl-train", flow_run_name=_flow_run_name, log_prints=False, validate_parameters=True)
def rl_train(cfg: RunConfig) -> dict[str, Any]:
    """RL post-training: preflight → place → convert, then rollout → pack → train → save → sync per rollout."""
    tasks.preflight(cfg)
    run = tasks.place(cfg)
    try:
        start = tasks.convert(run)
        if run.tracker.run_id:
            create_link_artifact(key="mlflow-run", link=f"{run.tracker.uri}#run={run.tracker.run_id}",
                                 link_text=f"MLflow run {run.tracker.run_id}")
        before = run.history.get("eval/test_accuracy_before", {}).get(-1)
        if before is None and start == 0:
            before = tasks.evaluate(run, "before")
            if before is not None:
                run.record({"eval/test_accuracy_before": before}, -1)
                run.tracker.log_metrics({"eval/test_accuracy": before}, step=0)
        progress = create_progress_artifact(progress=100.0 * start / cfg.num_rollout, key="progress",
                                            description="rollouts done")
        bar = tqdm(total=cfg.num_rollout, initial=start, desc="rollouts", unit="rollout", disable=not cfg.progress,
                   dynamic_ncols=True)
        for rollout_id in range(start, cfg.num_rollout):
            batch = tasks.rollout(run, rollout_id)
            packed = tasks.pack(run, batch)
            tasks.train(run, packed)
            if should_save(cfg, rollout_id):
                tasks.save(run, rollout_id)
            tasks.sync(run, rollout_id)
            update_progress_artifact(progress, 100.0 * (rollout_id + 1) / cfg.num_rollout)
            create_markdown_artifact(key="iteration", markdown=_iteration_markdown(run, rollout_id))
            bar.update(1)
            bar.set_postfix(reward=f"{run.history['rollout/reward_mean'][rollout_id]:.3f}",
                            loss=f"{run.history['train/loss'][rollout_id]:.4f}")
        bar.close()
        after = tasks.evaluate(run, "after")
        if after is not None:
            run.tracker.log_metrics({"eval/test_accuracy": after}, step=cfg.num_rollout)
        result = summary(run, acc_before=before, acc_after=after)
        run.tracker.end("FINISHED")
        return result
    except BaseException:
        run.tracker.end("FAILED")
        raise
    finally:
        run.close()
