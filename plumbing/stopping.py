"""SIGTERM in a training run: stop at the next stage boundary, end the flow run Cancelled, lose nothing.

A scheduler's preemption, `kill` or a container stop sends SIGTERM. Raising in the main thread at once (Prefect's
own handler) can land inside any library call — an MLflow SQLite write, a Ray call — and leave a locked database
or a C++ abort behind. So the first SIGTERM only asks to stop: the flow checks between tasks (`check()`) and
unwinds from there — engines and workers stopped, Ray shut down, the writer lock released, the MLflow run KILLED —
and the flow run ends Cancelled with where to resume (the marker still names the last complete iteration; the same
command resumes from it). A stage that does not end within GRACE_S seconds is interrupted the hard way (Prefect's
TerminationSignal in the main thread); a second SIGTERM does that at once.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from prefect.exceptions import TerminationSignal

log = logging.getLogger("rollflow")

GRACE_S = 30.0  # most schedulers wait 30 s (Kubernetes' default terminationGracePeriodSeconds) before SIGKILL


class StopRequested(KeyboardInterrupt):
    """Raised by check() at a stage boundary after a SIGTERM (a BaseException, like Ctrl-C: no retry catches it)."""


_requested = threading.Event()


def check() -> None:
    """Between two stages: raise StopRequested when a SIGTERM asked the run to stop."""
    if _requested.is_set():
        raise StopRequested("SIGTERM")


@contextmanager
def sigterm_stops(grace_s: float = GRACE_S) -> Iterator[None]:
    """Handle SIGTERM as the module docstring says for the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if _requested.is_set():  # the second SIGTERM, or the grace timer: interrupt where it is
            raise TerminationSignal(signal=signum)
        _requested.set()
        log.warning("rollflow: SIGTERM: stopping after the current stage (at most %.0f s); a second SIGTERM stops "
                    "at once", grace_s)
        timer = threading.Timer(grace_s, lambda: os.kill(os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    _requested.clear()
    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        _requested.clear()


def resume_point(cfg) -> str:
    """Where the same command resumes after a stop: the iteration the checkpoint marker names."""
    from engine import checkpoint

    marker = checkpoint.read_marker(cfg.save) if cfg.save else None
    return (f"the marker names iteration {marker}: the same command resumes at rollout {marker + 1}"
            if marker is not None else "no checkpoint was written yet")
