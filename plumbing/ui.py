"""What the Prefect UI (and the terminal) shows: artifacts, the doctor report, the progress bar — published off the
training loop's critical path.

Each artifact call is an HTTP round trip to the Prefect API (measured: ~50 ms to create one, ~115 ms to update the
progress artifact on a 2-core machine, against a demo iteration of ~0.8 s). `UIPublisher` runs them on one
background thread, in submission order, each inside a copy of the caller's context (so the artifact is attached to
the same flow run and task run as if called inline). `drain()` waits for the queue at the end of the flow; a call
that fails is logged as a warning with its artifact key — never silently dropped, never failing the training.
"""
from __future__ import annotations

import contextvars
import logging
import queue
import re
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_progress_artifact, \
    create_table_artifact, update_progress_artifact
from tqdm import tqdm

from engine.config import RunConfig
from engine.doctor.classify import classify_exception
from engine.diagnosis import DiagnosisError, render_report
from engine.run import Run

log = logging.getLogger("rollflow.ui")


class UIPublisher:
    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self.failed: list[str] = []
        self._thread = threading.Thread(target=self._loop, name="rollflow-ui", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[..., Any], *args, **kwargs) -> None:
        """Run fn(*args, **kwargs) later, in the caller's Prefect context; `what` names it in a warning."""
        self._q.put((what, contextvars.copy_context(), fn, args, kwargs))

    def _loop(self) -> None:
        from engine.background import lower_this_thread

        lower_this_thread()  # UI bookkeeping runs in the gaps the stages leave (engine/background.py)
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                what, ctx, fn, args, kwargs = item
                try:
                    ctx.run(fn, *args, **kwargs)
                except Exception as e:  # the UI is best effort; the run is not
                    self.failed.append(what)
                    log.warning("Prefect UI: could not publish %s: %s: %s", what, type(e).__name__, e)
            finally:
                self._q.task_done()

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything submitted is published (at most timeout_s); True when the queue is empty."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._q.unfinished_tasks:
            log.warning("Prefect UI: %d artifact update(s) still pending after %.0fs", self._q.unfinished_tasks,
                        timeout_s)
            return False
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        self.drain(timeout_s)
        self._q.put(None)


def background_ephemeral_api() -> int:
    """Lower the priority of the Prefect API server this process started (ephemeral mode, no PREFECT_API_URL): it
    records task-run events and serves the UI, none of which the training loop waits for, so on a machine whose
    cores are all busy it runs in the gaps (engine/background.py). A server given by PREFECT_API_URL is not
    touched. Returns how many of its threads were lowered."""
    from engine.background import lower_process
    from plumbing.prestart import own_api_pid

    pids = [own_api_pid()]  # the one `rollflow train` launched (plumbing/prestart.py)
    server_module = sys.modules.get("prefect.server.api.server")  # Prefect's own, if its client started one
    for server in list(getattr(getattr(server_module, "SubprocessASGIServer", None), "_instances", {}).values()):
        proc = getattr(server, "server_process", None)
        if proc is not None and proc.poll() is None:
            pids.append(proc.pid)
    return sum(lower_process(pid) for pid in pids if pid is not None)


_current: UIPublisher | None = None


def publisher() -> UIPublisher:
    """The running flow's publisher (a flow run is one training run, one per process at a time)."""
    global _current
    if _current is None:
        _current = UIPublisher()
    return _current


def close(timeout_s: float = 60.0) -> list[str]:
    """Publish what is pending and stop; returns the artifacts that could not be published."""
    global _current
    if _current is None:
        return []
    pub, _current = _current, None
    pub.close(timeout_s)
    return pub.failed


# ---- artifacts ----------------------------------------------------------------------------------------------------
# Prefect's artifact keys are global: every key carries the run's identity (the experiment and 8 hex of --save, else
# the work dir), so one key never mixes runs and a resumed run continues its own artifacts.
def artifact_key(cfg: RunConfig, name: str) -> str:
    from engine.run import run_key

    experiment = re.sub(r"[^a-z0-9]+", "-", cfg.experiment_name.lower()).strip("-")[:40] or "run"
    return f"{name}-{experiment}-{run_key(cfg)[:8]}"


def doctor_report(cfg: RunConfig, report: str, description: str) -> None:
    """The `doctor-report` artifact: the doctor's rendered report (preflight, placement or a runtime failure)."""
    create_markdown_artifact(key=artifact_key(cfg, "doctor-report"),
                             markdown=f"# Doctor report\n\n```\n{report}\n```", description=description)


@contextmanager
def diagnosed(run: Run) -> Iterator[None]:
    """Turn a failure the doctor recognises into a DiagnosisError (the task's state message is the report),
    published as the `doctor-report` artifact and logged to MLflow. Unrecognised failures pass unchanged."""
    try:
        yield
    except Exception as e:
        diags = classify_exception(e, run.cfg)
        if not diags:
            raise
        report = render_report(diags)
        doctor_report(run.cfg, report, "runtime diagnosis")
        if run.tracker is not None:
            run.tracker.log_text(report, "doctor/report.txt")
        if isinstance(e, DiagnosisError):
            raise
        raise DiagnosisError(diags) from e


def mlflow_link(cfg: RunConfig, tracker) -> None:
    if tracker.run_id:
        publisher().submit("mlflow-run", create_link_artifact, key=artifact_key(cfg, "mlflow-run"),
                           link=tracker.run_url(), link_text=f"MLflow run {tracker.run_name} ({tracker.run_id})",
                           description="this run's metric charts, sample tables, plots and checkpoint records")


def name_flow_run(name: str) -> None:
    """Rename this flow run (a resume takes the name of the MLflow run it continues); best effort, like every UI
    update: a failure is a warning, never the run's."""
    from prefect.runtime import flow_run

    if flow_run.id and flow_run.name != name:
        publisher().submit("flow run name", _rename, flow_run.id, name)


def _rename(flow_run_id, name: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run_id, name=name)


def _update(artifact_id, data: str, description: str | None = None) -> None:
    """Replace an artifact's content in place (one card that changes, not one per rollout)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    update = ArtifactUpdate(data=data, description=description) if description else ArtifactUpdate(data=data)
    with get_client(sync_client=True) as client:  # a description left unset keeps the card's own
        client.update_artifact(artifact_id, update)


def sample_rows(batch) -> list[dict[str, Any]]:
    """2 samples of each of the first 4 groups: prompt and response (cut at 300 characters, lengths given), label,
    reward, the group-normalised reward (GRPO's advantage), status and finish reason."""
    from engine.tracking.artifacts import group_advantages

    rows = []
    for g in batch.groups[:4]:
        for s, advantage in list(zip(g, group_advantages(g)))[:2]:
            fr = s.metadata.get("finish_reason") or {}
            rows.append({"group": s.group_index, "prompt": str(s.prompt)[:300], "response": s.response[:300],
                         "response tokens": s.response_length, "label": str(s.label),
                         "reward": round(s.scalar_reward, 4), "advantage (group-normalised)": round(advantage, 4),
                         "status": s.status.value, "finish": fr.get("type", "") if isinstance(fr, dict) else str(fr)})
    return rows


def iteration_markdown(run: Run, rollout_id: int) -> str:
    h = run.history
    get = lambda k: h.get(k, {}).get(rollout_id, float("nan"))  # noqa: E731
    return (f"#### rollout {rollout_id} of {run.cfg.num_rollout}\n\n| metric | value |\n|---|---|\n"
            f"| reward mean | {get('rollout/reward_mean'):.4f} |\n| response length | "
            f"{get('rollout/response_len_mean'):.1f} |\n| loss | {get('train/loss'):.4g} |\n"
            f"| KL (to reference) | {get('train/kl'):.4g} |\n| grad norm | {get('train/grad_norm'):.4g} |\n"
            f"| train–inference mismatch, mean / max (RF14) | {get('train/mismatch'):.3g} / "
            f"{get('train/mismatch_max'):.3g} |\n"
            f"| rollout tokens/s | {get('rollout/tokens_per_s'):.1f} |\n"
            "| seconds: rollout / pack / train / save / sync | "
            f"{get('rollout/seconds'):.2f} / {get('pack/seconds'):.2f} / {get('train/seconds'):.2f} / "
            f"{h.get('save/seconds', {}).get(rollout_id, 0.0):.2f} / {get('sync/seconds'):.2f} |\n"
            + (f"| peak GPU GiB rollout / train / sync | {get('memory/rollout_peak_gib'):.2f} / "
               f"{get('memory/train_peak_gib'):.2f} / {get('memory/sync_peak_gib'):.2f} |\n"
               if "memory/rollout_peak_gib" in h else ""))


def summary_markdown(run: Run, state: str, rollout_id: int | None = None) -> str:
    """The run so far: reward first → latest, eval accuracy first → latest, wall time, links, the last rollout."""
    h, cfg = run.history, run.cfg
    rewards = [v for _, v in sorted(h.get("rollout/reward_mean", {}).items())]
    from engine.stages import eval_accuracy_key

    evals = sorted(h.get(eval_accuracy_key(cfg), {}).items())
    done = 0 if rollout_id is None else rollout_id + 1
    lines = [f"### {run.tracker.run_name if run.tracker else cfg.experiment_name}: {state}, {done} of "
             f"{cfg.num_rollout} rollouts", "", "| | |", "|---|---|"]
    from engine.rollout.sft import placeholder_rewards

    if rewards and not placeholder_rewards(cfg):  # engine.rollout.sft's samples carry reward 0
        first, last = rewards[:3], rewards[-3:]
        lines.append(f"| reward, mean of first 3 → last 3 rollouts | {sum(first) / len(first):.3f} → "
                     f"{sum(last) / len(last):.3f} |")
    if cfg.loss_type == "sft_loss" and h.get("train/loss"):
        from engine.stages import first_last

        a, b = first_last(h["train/loss"])
        lines.append(f"| SFT loss, mean of first 3 → last 3 rollouts | {a:.3g} → {b:.3g} |")
    if evals:
        name = eval_accuracy_key(cfg)[len("eval/"):-len("_accuracy")]
        lines.append(f"| eval accuracy ({name}), step {evals[0][0]} → {evals[-1][0]} | {100 * evals[0][1]:.1f}% → "
                     f"{100 * evals[-1][1]:.1f}% |")
    lines.append(f"| wall time | {time.time() - run.state.started_at:.0f} s |")
    if run.tracker is not None and run.tracker.run_id:
        lines.append(f"| MLflow run | [{run.tracker.run_name or run.tracker.run_id}]({run.tracker.run_url()}) |")
    if cfg.save:
        lines.append(f"| checkpoints | `{cfg.save}` |")
    if rollout_id is not None:
        lines += ["", iteration_markdown(run, rollout_id)]
    return "\n".join(lines) + "\n"


_progress: "Progress | None" = None  # the running flow's (one training run per process at a time)


def samples(batch) -> None:
    """The rollout's samples into the running flow's `samples` card."""
    if _progress is not None:
        _progress.rollout(batch)


def progress_bar(cfg: RunConfig, start: int) -> tqdm:
    """The terminal's rollout bar (--progress; --no-progress for logs and tests)."""
    return tqdm(total=cfg.num_rollout, initial=start, desc="rollouts", unit="rollout", disable=not cfg.progress,
                dynamic_ncols=True)


#: a card is updated at most once per this many seconds while the run trains (the newest content wins; close()
#: publishes what is still pending): each update is an HTTP call and a database write on the Prefect API
UI_INTERVAL_S = 2.0


class Progress:
    """What the run shows while it trains, each one card updated in place: `progress` (rollouts done), `summary`
    (the run so far and the last rollout), `samples` (the last rollout's samples); and the terminal bar."""

    def __init__(self, run: Run, start: int):
        cfg = run.cfg
        self.run, self.total = run, cfg.num_rollout
        self.artifact = create_progress_artifact(progress=100.0 * start / self.total,
                                                 key=artifact_key(cfg, "progress"), description="rollouts done")
        first = summary_markdown(run, "training", start - 1 if start else None)
        self.summary = create_markdown_artifact(key=artifact_key(cfg, "summary"), markdown=first,
                                                description="the run so far (updated as it trains)")
        self.samples = None
        self.bar = progress_bar(cfg, start)
        self._pending: dict[str, tuple] = {}  # card → the newest (what, fn, args) not yet submitted
        self._last: dict[str, float] = {}  # card → monotonic time of its last submission
        global _progress
        _progress = self

    def _publish(self, card: str, fn: Callable[..., Any], *args) -> None:
        """Update `card` now, or keep the newest content for later when it was updated < UI_INTERVAL_S ago."""
        self._pending[card] = (card, fn, args)
        now = time.monotonic()
        if now - self._last.get(card, float("-inf")) >= UI_INTERVAL_S:
            self._last[card] = now
            what, fn, args = self._pending.pop(card)
            publisher().submit(what, fn, *args)

    def _flush(self) -> None:
        for what, fn, args in self._pending.values():
            publisher().submit(what, fn, *args)
        self._pending.clear()

    def rollout(self, batch) -> None:
        """The rollout's samples into the `samples` card (created by the first rollout)."""
        from prefect.artifacts import TableArtifact

        rows, what = sample_rows(batch), f"samples of rollout {batch.rollout_id}"
        if self.samples is None:
            self.samples = create_table_artifact(key=artifact_key(self.run.cfg, "samples"), table=rows,
                                                 description=what)
        else:
            self._publish("samples", _update, self.samples, TableArtifact(table=rows).format(), what)

    def done(self, rollout_id: int) -> None:
        run = self.run
        if run.state.loop_started:  # seconds into the loop when each rollout id finished training (bench/async.py)
            run.state.done_at[rollout_id] = time.perf_counter() - run.state.loop_started
        self._publish("progress", update_progress_artifact, self.artifact, 100.0 * (rollout_id + 1) / self.total)
        self._publish("summary", _update, self.summary, summary_markdown(run, "training", rollout_id))
        self.bar.update(1)
        loss = run.history.get("train/loss", {}).get(rollout_id)  # none with --debug-rollout-only
        from engine.rollout.sft import placeholder_rewards

        reward = {} if placeholder_rewards(run.cfg) else {  # engine.rollout.sft's samples carry reward 0
            "reward": f"{run.history['rollout/reward_mean'][rollout_id]:.3f}"}
        self.bar.set_postfix(**reward, **({"loss": f"{loss:.3g}"} if loss is not None else {}))

    def close(self, state: str = "finished") -> None:
        global _progress
        _progress = None
        self.bar.close()
        self._pending.pop("summary", None)  # replaced by the final one below
        self._flush()
        last = max(self.run.history.get("rollout/reward_mean", {}), default=None)
        publisher().submit("summary", _update, self.summary, summary_markdown(self.run, state, last))


class _DiagnosisFirst(logging.Filter):
    """On the console handler: drop Prefect's records of a diagnosed failure (its traceback, the failed state),
    which the CLI prints as the diagnosis at the end; the Prefect API and UI still get them in full."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], DiagnosisError):
            return False
        message = record.getMessage()
        return not any(f"exception {name}" in message or f"{name}(" in message for name in _diagnosis_types())


def _diagnosis_types() -> set[str]:
    found, todo = set(), [DiagnosisError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return found


def diagnosis_first(on: bool) -> None:
    """The terminal shows a diagnosed failure as the diagnosis alone; off (--debug), Prefect's tracebacks too. Set per
    flow run: the console handler is the process's, shared by every run it starts."""
    import prefect.logging.handlers as handlers

    for logger in (logging.getLogger(), logging.getLogger("prefect")):  # where Prefect's logging.yml puts it
        for h in logger.handlers:
            if isinstance(h, handlers.PrefectConsoleHandler):
                for f in [f for f in h.filters if isinstance(f, _DiagnosisFirst)]:
                    h.removeFilter(f)
                if on:
                    h.addFilter(_DiagnosisFirst())


def say_lost(cfg: RunConfig, tracker) -> None:
    """What MLflow never received, at the end of the run: a warning on the console and a Prefect artifact."""
    from engine.tracking import TrackingWarning

    if report := tracker.lost_report():
        warnings.warn(report, TrackingWarning, stacklevel=2)
        create_markdown_artifact(key=artifact_key(cfg, "mlflow-lost"), markdown=f"**MLflow incomplete**: {report}")
