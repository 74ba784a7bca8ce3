"""rl-train: one flow run per training run; reads like slime's train.py — one loop over rollout ids.

The flow's parameters are flows/params.py; Prefect plumbing that is neither flow nor task is plumbing/ (retry
policy, limits, SIGTERM, UI).
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Cancelled
from prefect.utilities.annotations import quote

import tasks
from engine import stages
from engine.config import RunConfig
from engine.diagnosis import DiagnosisError
from engine.tracking.record import finish, prefect_ui_url
from plumbing import limits, policy, stopping, ui
from flows.params import CfgParam, SecretSafeFlow, flow_run_name, run_config


def _rl_train(cfg: CfgParam = None, config: str | None = None) -> dict[str, Any]:
    """RL post-training. `config`: a RunConfig YAML file; `cfg`: a RunConfig, or flags overriding the file."""
    cfg = run_config(cfg, config)
    ui.diagnosis_first(not cfg.debug)  # the terminal shows a diagnosed failure as its diagnosis; the UI keeps all
    policy.set_flow_retries(cfg.flow_retries, cfg.flow_retry_delay)
    try:
        with ExitStack() as stack, stopping.sigterm_stops():
            stack.enter_context(limits.held(cfg))  # one writer per --save, GPU slots
            return train(cfg)
    except DiagnosisError as e:
        policy.no_flow_retry(e)  # a diagnosed error fails the same way on every attempt
        raise
    except (stopping.StopRequested, TerminationSignal):  # SIGTERM: stopped between stages
        get_run_logger().warning("rollflow: stopped by SIGTERM; %s", where := stopping.resume_point(cfg))
        return Cancelled(message=f"stopped by SIGTERM; {where}")


rl_train = SecretSafeFlow(_rl_train, name="rl-train", flow_run_name=flow_run_name, log_prints=False,
                          validate_parameters=True)


def train(cfg: RunConfig) -> dict[str, Any]:
    """preflight → place → convert, then rollout → pack → train → save → sync per rollout id."""
    t = tasks.for_run(cfg)
    tracker = stages.track(cfg, flow_run_id=str(flow_run.id), flow_run_url=prefect_ui_url(flow_run.id, flow_run.ui_url),
                           run_name=flow_run.name)  # one name in Prefect and MLflow
    ui.mlflow_link(cfg, tracker)
    run = progress = None
    try:
        t.preflight(cfg)
        run = t.place(cfg, tracker)
        r = quote(run)  # every task gets the run, but Prefect's graph draws the data (batch, packed), not run edges
        start = t.convert(r)
        if start:  # the MLflow run it continues keeps its name
            ui.name_flow_run(f"{tracker.run_name} (resumed at rollout {start})")
        else:
            t.evaluate(r, 0)
        progress = ui.Progress(run, start)
        for rollout_id in range(start, cfg.num_rollout):
            stopping.check()  # a SIGTERM stops the run here, between stages
            batch = t.rollout(r, rollout_id)
            stopping.check()
            packed = t.pack(r, batch)
            t.train(r, packed)
            stopping.check()
            if stages.should_save(cfg, rollout_id):
                t.save(r, rollout_id)
            stopping.check()
            t.sync(r, rollout_id)
            if stages.should_eval(cfg, rollout_id):
                t.evaluate(r, rollout_id + 1)
            progress.done(rollout_id)
        t.evaluate(r, cfg.num_rollout)
        progress.close("finished")
        finish(tracker, run.history)
        return stages.summary(run)
    except BaseException as e:
        if progress is not None:
            progress.close(f"stopped ({type(e).__name__})")
        finish(tracker, run.history if run else {}, e)
        raise
    finally:
        ui.say_lost(cfg, tracker)
        ui.close()
        if run is not None:
            run.close()
