"""rl-train: one flow run per training run; reads like slime's train.py — one loop over rollout ids.

The flow's parameters are flows/params.py; Prefect plumbing that is neither flow nor task is plumbing/ (retry
policy, limits, SIGTERM, UI).
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Cancelled
from prefect.utilities.annotations import quote

import tasks
from engine import stages, startgc
from engine.config import RunConfig
from engine.diagnosis import DiagnosisError
from engine.tracking.record import finish, prefect_ui_url
from plumbing import limits, policy, stopping, ui
from flows.params import CfgParam, SecretSafeFlow, flow_run_name, run_config


def _rl_train(cfg: CfgParam = None, config: str | None = None) -> dict[str, Any]:
    """RL post-training. `config`: a RunConfig YAML file; `cfg`: a RunConfig, or flags overriding the file."""
    cfg = run_config(cfg, config)
    if logging.getLogger("rollflow").level == logging.NOTSET:  # Prefect gives its extra loggers no level, so the
        logging.getLogger("rollflow").setLevel(logging.INFO)  # root's WARNING hid the engine's INFO from the UI too
    ui.background_ephemeral_api()  # its event bookkeeping yields the cores to the engines and the trainer
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


class _Saves:
    """The loop's checkpoints: the save task, and with --async-save its commit task running while the loop goes on.

    At most one commit is in flight: a save first waits for the one before (save/wait_seconds), so commits land in
    order and one temp iteration exists at a time. `check` raises a commit's failure at the next step rather than
    at the next save; `drain` waits for the last commit before the run ends; `settle` lets it finish when a later
    stage failed (its checkpoint is then the resume point), within what is left of a SIGTERM's grace period.
    """

    def __init__(self, t, r, run) -> None:
        self.t, self.r, self.run = t, r, run
        self.pending = None  # (rollout id, the commit task's future)

    def save(self, rollout_id: int) -> None:
        waited = self.drain()
        if self.run.cfg.async_save:  # before the save, whose MLflow drain then carries it past a kill
            stages.publish(self.run, rollout_id, {"save/wait_seconds": waited})
        out = self.t.save(self.r, rollout_id)
        if self.run.cfg.async_save:
            self.pending = (rollout_id, self.t.commit.submit(self.r, rollout_id, quote(out)))

    def check(self) -> None:
        if self.pending and self.pending[1].state.is_final():
            self.drain()

    def drain(self) -> float:
        """Seconds waited for the commit in flight (its failure raised)."""
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        (_, fut), self.pending = self.pending, None
        fut.result()
        return time.perf_counter() - t0

    def settle(self) -> None:
        if self.pending is None:
            return
        (rollout_id, fut), self.pending = self.pending, None
        logger = logging.getLogger("rollflow.checkpoint")
        logger.warning("rollflow: waiting for the checkpoint of rollout %d to commit (--async-save)", rollout_id)
        try:
            fut.result(timeout=stopping.time_left(3600.0))
        except Exception as e:  # noqa: BLE001 — the stage's own error is the one the run reports
            logger.error("rollflow: the checkpoint of rollout %d did not commit: %s", rollout_id, e)


def _async_loop(t, r, run, start: int, progress, saves: _Saves) -> None:
    """--async-mode one-step / bounded: rollouts run ahead of training on the engines while the trainer trains.

    K = the staleness bound (one-step 1, bounded --max-staleness). Rollout j may start once the engines serve
    weights of version ≥ j − K (version v = the weights after v train steps), so every sample of rollout j is at
    most K versions older than the step that trains it (stages.staleness_guard enforces it). The engines get the
    newest weights whenever no rollout is in flight (generation never runs on half-updated weights): the trainer
    hands them over first (its probe scores, a copy of its weights) and trains on while the engines load them; the
    rollouts that need that version start once they are loaded, next to the sync's RF14 probe (a failed probe
    fails the run at the next rollout id, before anything generated after it is trained). While a step trains,
    the driver packs the next rollout as soon as it is generated. With --partial-rollout the sync comes right after
    each step instead: the engines pause (abort) what they generate, take the weights and continue, and the rollout
    continues those samples under the new version (packed at its own id); the checkpoint saved next keeps how far
    they got. Each id still has one rollout-{id}, pack-{id} and train-{id} task; a sync is named by the step whose
    weights it pushes. Evaluations run on synced engines.
    """
    import concurrent.futures
    import threading

    cfg = run.cfg
    K, N = cfg.staleness_bound, cfg.num_rollout
    inflight: dict = {}  # rollout id → its task's future
    packed_ahead: dict = {}  # rollout id → its pack, made while the step before it trained
    launched = start
    pending = None  # (future, version, loaded event) of a sync the engines load or probe
    training = None  # the train step's future while it runs

    def served() -> int:
        return pending[1] if pending and pending[2].is_set() else run.state.weight_version

    def launch() -> None:
        """The rollouts the served version allows."""
        nonlocal launched
        while launched < N and launched - K <= served():
            inflight[launched] = t.rollout.submit(r, launched)
            launched += 1

    def settle() -> None:
        """The pending sync's outcome (its error, if it failed)."""
        nonlocal pending
        if pending:
            fut, pending = pending[0], None
            fut.result()

    def wait_for(done: threading.Event, fut) -> None:
        """Until the sync stage sets `done` (a retry too), or its task failed for good: then its error."""
        while not done.wait(1.0):
            if fut.state.is_final():
                fut.result()  # a sync that succeeded set it
                break

    def start_sync(trained: int, pause: bool = False) -> None:
        """The weights after `trained` steps to the engines: returns once the trainer has handed them over (the
        sync stays pending while the engines load them and answer its RF14 probe); then any evaluation due at that
        version, on the synced engines."""
        nonlocal pending
        settle()
        stopping.check()
        exported, loaded = threading.Event(), threading.Event()
        fut = t.sync.submit(r, trained - 1, pause=pause, exported=exported, loaded=loaded)
        wait_for(exported, fut)  # the process's first probe has the trainer score the engines' samples: it waits
        pending = (fut, trained, loaded)
        if stages.should_eval(cfg, trained - 1) and trained < N:
            settle()
            t.evaluate(r, trained)

    def sync_if_idle(trained: int) -> None:
        """Without --partial-rollout: a sync only when no rollout is in flight."""
        if not inflight and served() < trained:
            start_sync(trained)

    def sync_now(trained: int) -> None:
        """--partial-rollout: the new weights right after the step, pausing the rollouts in flight (their samples
        continue under them), then the rollouts the new version allows."""
        start_sync(trained, pause=bool(inflight))
        launch()

    def while_training(nxt: int) -> None:
        """What the driver does while the trainer trains: the rollouts a sync's newly loaded weights allow, then
        rollout `nxt` packed as soon as it is generated (a failed one is left for the loop to raise). Not with
        --partial-rollout: there the rollout in flight is the sync's to pause right after the step."""
        if pending:
            wait_for(pending[2], pending[0])
        launch()
        fut = inflight.get(nxt)
        if fut is None or cfg.partial_rollout:
            return
        done, _ = concurrent.futures.wait([training.wrapped_future, fut.wrapped_future],
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if fut.wrapped_future in done:
            fut.wait()
            if fut.state.is_completed():
                packed_ahead[nxt] = t.pack(r, inflight.pop(nxt).result())

    try:
        launch()
        for rollout_id in range(start, N):
            stopping.check()
            packed = packed_ahead.pop(rollout_id, None)
            settle()  # the sync this rollout may have waited for: its own error first (the rollout's is 'upstream')
            if packed is None:
                batch = inflight.pop(rollout_id).result()
            sync_if_idle(rollout_id)
            launch()
            stopping.check()
            if packed is None:
                packed = t.pack(r, batch)
            training = t.train.submit(r, packed)
            while_training(rollout_id + 1)
            training.result()
            training = None
            if cfg.partial_rollout and rollout_id + 1 < N:
                sync_now(rollout_id + 1)
            stopping.check()
            saves.check()
            if stages.should_save(cfg, rollout_id):
                saves.save(rollout_id)
            progress.done(rollout_id)
        sync_if_idle(N)
        settle()
    finally:  # a failed step: let them end first
        for f in [*inflight.values(), *([pending[0]] if pending else []), *([training] if training else [])]:
            f.wait(timeout=30)


def train(cfg: RunConfig) -> dict[str, Any]:
    """preflight → place → convert, then rollout → pack → train → save → sync per rollout id."""
    t = tasks.for_run(cfg)
    tracker = stages.track(cfg, flow_run_id=str(flow_run.id), flow_run_url=prefect_ui_url(flow_run.id, flow_run.ui_url),
                           run_name=flow_run.name)  # one name in Prefect and MLflow
    ui.mlflow_link(cfg, tracker)
    run = progress = saves = None
    try:
        t.preflight(cfg)
        run = t.place(cfg, tracker)
        r = quote(run)  # every task gets the run, but Prefect's graph draws the data (batch, packed), not run edges
        start = t.convert(r)
        if start:  # the MLflow run it continues keeps its name
            ui.name_flow_run(f"{tracker.run_name} (resumed at rollout {start})")
        elif not cfg.skip_eval_before_train:
            t.evaluate(r, 0)
        progress = ui.Progress(run, start)
        startgc.ready()  # the collector back on, start-up's objects frozen out of its walks
        run.state.loop_started = time.perf_counter()
        run.state.loop_started_unix = time.time()
        saves = _Saves(t, r, run)
        if cfg.async_mode != "off":
            _async_loop(t, r, run, start, progress, saves)
        for rollout_id in range(start, cfg.num_rollout) if cfg.async_mode == "off" else ():
            stopping.check()  # a SIGTERM stops the run here, between stages
            batch = t.rollout(r, rollout_id)
            if not cfg.trains:  # --debug-rollout-only: its samples are logged (and saved) by the rollout
                batch.take()
                progress.done(rollout_id)
                continue
            stopping.check()
            packed = t.pack(r, batch)
            t.train(r, packed)
            stopping.check()
            saves.check()
            if stages.should_save(cfg, rollout_id):
                saves.save(rollout_id)
            stopping.check()
            # --load-debug-rollout-data, --debug-train-only: no engine to send weights to; --update-weights-interval
            if not cfg.no_engines and stages.should_sync(cfg, rollout_id):
                t.sync(r, rollout_id)
            if stages.should_eval(cfg, rollout_id):
                t.evaluate(r, rollout_id + 1)
            progress.done(rollout_id)
        run.state.loop_seconds = time.perf_counter() - run.state.loop_started
        if cfg.trains:  # --debug-rollout-only: the same weights as the evaluation before the loop
            t.evaluate(r, cfg.num_rollout)
        saves.drain()  # --async-save: the last checkpoint's commit ran during the evaluation
        progress.close("finished")
        finish(tracker, run.history)
        return stages.summary(run)
    except BaseException as e:
        if saves is not None:
            saves.settle()
        if progress is not None:
            progress.close(f"stopped ({type(e).__name__})")
        finish(tracker, run.history if run else {}, e)
        raise
    finally:
        ui.say_lost(cfg, tracker)
        ui.close(stopping.time_left(60.0))  # after a SIGTERM, what is left of its grace period
        if run is not None:
            run.close()
