"""SIGTERM in a training run: stop at the next stage boundary, end the flow run Cancelled, lose nothing.

A scheduler's preemption, `kill` or a container stop sends SIGTERM. Raising in the main thread at once (Prefect's
own handler) can land inside any library call — an MLflow SQLite write, a Ray call — and leave a locked database
or a C++ abort behind. So the first SIGTERM only asks to stop: the flow checks between tasks (`check()`) and
unwinds from there — engines and workers stopped, Ray shut down, the writer lock released, the MLflow run KILLED —
and the flow run ends Cancelled with where to resume (the marker still names the last complete iteration; the same
command resumes from it). A stage that does not end within GRACE_S seconds is interrupted the hard way (Prefect's
TerminationSignal in the main thread); a second SIGTERM does that at once. The handler only notes the time; a
watcher thread logs and keeps the grace period (see sigterm_stops).
"""
from __future__ import annotations

import contextvars
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from prefect.exceptions import TerminationSignal

log = logging.getLogger("rollflow")

GRACE_S = 30.0  # most schedulers wait 30 s (Kubernetes' default terminationGracePeriodSeconds) before SIGKILL


class StopRequested(KeyboardInterrupt):
    """Raised by check() at a stage boundary after a SIGTERM (a BaseException, like Ctrl-C: no retry catches it)."""


_requested_at: float | None = None  # time.monotonic() of the first SIGTERM in the block; None: not asked to stop
_grace_s = GRACE_S


def check() -> None:
    """Between two stages: raise StopRequested when a SIGTERM asked the run to stop."""
    if _requested_at is not None:
        raise StopRequested("SIGTERM")


def time_left(default: float, floor: float = 2.0) -> float:
    """How long a clean-up step may wait: `default` without a SIGTERM; after one, what is left of the grace period
    (at least `floor`), so that publishing the UI's last state does not keep a stopped run past it."""
    if _requested_at is None:
        return default
    return min(default, max(floor, _requested_at + _grace_s - time.monotonic()))


@contextmanager
def sigterm_stops(grace_s: float = GRACE_S) -> Iterator[None]:
    """Handle SIGTERM as the module docstring says for the block (main thread only; elsewhere a no-op).

    The handler itself only notes the time. It runs between two bytecodes of the main thread, which may then hold
    a lock that is not reentrant: Prefect's service lookup and queues, which every log record and event bound for
    the Prefect API passes through, or threading's own (a thread start). Logging there, or starting the grace
    timer there, would take that lock again and hang the run for good (seen: a SIGTERM during a training run, and
    the process never exited). A watcher thread does both instead, a tenth of a second later at most."""
    global _requested_at, _grace_s
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _grace_s = grace_s

    def handler(signum, frame):
        global _requested_at
        if _requested_at is not None:  # the second SIGTERM, or the watcher at the grace deadline
            raise TerminationSignal(signal=signum)
        _requested_at = time.monotonic()

    done = threading.Event()
    ending = threading.Lock()  # the watcher's SIGTERM never comes after the block ended (another handler by then)

    def watch() -> None:
        while _requested_at is None and not done.wait(0.1):
            pass
        asked = _requested_at  # read once (the block's end clears it only after this thread is done)
        if asked is None:  # the block ended without a SIGTERM
            return
        log.warning("rollflow: SIGTERM: stopping after the current stage (at most %.0f s); a second SIGTERM stops "
                    "at once", grace_s)
        if not done.wait(max(0.0, asked + grace_s - time.monotonic())):
            log.warning("rollflow: the current stage did not end within %.0f s of SIGTERM: interrupting it", grace_s)
            with ending:
                if not done.is_set():
                    os.kill(os.getpid(), signal.SIGTERM)

    _requested_at = None
    before = signal.signal(signal.SIGTERM, handler)
    # in the block's context: its warnings are the flow run's logs in the Prefect UI
    watcher = threading.Thread(target=contextvars.copy_context().run, args=(watch,), name="rollflow-sigterm",
                               daemon=True)
    watcher.start()
    try:
        yield
    finally:
        try:
            with ending:  # a SIGTERM sent just before raises here; the rest still runs
                done.set()
        finally:
            signal.signal(signal.SIGTERM, before)
            watcher.join(5.0)  # a stop that came just before the block ended still gets its warning
            _requested_at = None


def resume_point(cfg) -> str:
    """Where the same command resumes after a stop: the iteration the checkpoint marker names."""
    from engine import checkpoint

    marker = checkpoint.read_marker(cfg.save) if cfg.save else None
    return (f"the marker names iteration {marker}: the same command resumes at rollout {marker + 1}"
            if marker is not None else "no checkpoint was written yet")
