"""SIGTERM in a training run (plumbing/stopping.py): the first one asks to stop at the next stage boundary, the
grace period interrupts a stage that does not end, and the handler never hangs the run.

Each case runs in its own process: it signals itself."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, timeout: float = 90, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_sigterm_while_the_main_thread_holds_prefects_service_lock_stops_the_run(prefect_harness):
    """A CI run hung here (2026-12-03): the handler logged, and a record bound for the Prefect API takes Prefect's service
    lock, which the main thread holds whenever it logs or emits an event itself. The SIGTERM arrives here while the
    main thread holds it; before the fix this process never ended."""
    from prefect.settings import PREFECT_API_URL

    r = _run("""
        import logging, os, signal, time
        from prefect import flow
        from prefect._internal.concurrency.services import _QueueServiceBase
        from plumbing import stopping

        @flow
        def run():
            logging.getLogger("rollflow").info("the API log worker is running")
            with stopping.sigterm_stops(grace_s=30):
                with _QueueServiceBase._instance_lock:  # as inside Prefect's APILogWorker.instance()
                    os.kill(os.getpid(), signal.SIGTERM)
                    sum(range(100_000))  # the handler runs in here
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        stopping.check()  # a stage boundary
                    except stopping.StopRequested:
                        print("stopped at the stage boundary", flush=True)
                        return
                    time.sleep(0.05)
            print("not stopped", flush=True)

        run()
        """, timeout=60, PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_LOGGING_EXTRA_LOGGERS="rollflow")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "stopped at the stage boundary" in out, out[-3000:]
    # the warning still comes, from the watcher thread, as a log of the flow run (no "without a flow run id")
    assert "SIGTERM: stopping after the current stage (at most 30 s)" in out, out[-3000:]
    assert "without a flow run id" not in out, out[-3000:]


def test_a_stage_that_does_not_end_within_the_grace_period_is_interrupted():
    r = _run("""
        import os, signal, time
        from prefect.exceptions import TerminationSignal
        from plumbing import stopping

        t0 = time.monotonic()
        try:
            with stopping.sigterm_stops(grace_s=1.0):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(60)  # a stage that never reaches its boundary
        except TerminationSignal:
            print(f"interrupted after {time.monotonic() - t0:.1f} s", flush=True)
        stopping.check()  # outside the block: no stop pending (it would raise StopRequested)
        print("no stop pending after the block")
        print("default handler back:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        """, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    took = float(out.split("interrupted after ")[1].split(" s")[0])
    assert 0.9 <= took < 10, out
    assert "did not end within 1 s of SIGTERM: interrupting it" in out
    assert "no stop pending after the block" in out and "default handler back: True" in out


def test_a_second_sigterm_interrupts_at_once_and_a_block_without_one_runs_to_its_end():
    r = _run("""
        import os, signal, time
        from prefect.exceptions import TerminationSignal
        from plumbing import stopping

        with stopping.sigterm_stops(grace_s=60.0):
            stopping.check()
            time.sleep(0.3)
        print("a quiet block ends normally")
        t0 = time.monotonic()
        try:
            with stopping.sigterm_stops(grace_s=60.0):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(60)
        except TerminationSignal:
            print(f"second SIGTERM: interrupted after {time.monotonic() - t0:.1f} s", flush=True)
        """, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "a quiet block ends normally" in out, out[-3000:]
    took = float(out.split("interrupted after ")[1].split(" s")[0])
    assert took < 5, out


def test_the_engines_sigterm_abort_takes_no_lock():
    """uvicorn's SIGTERM handler in `rollflow serve` aborts every request; it runs in the main thread, which serves
    the requests and may hold the abort book's lock at that moment."""
    import threading

    from engine.rollout.generation import AbortBook

    book = AbortBook()
    book.add(["a-1", "b-1"])
    with book._lock:  # the main thread inside add() / done() when the signal comes
        t = threading.Thread(target=book.stop)
        t.start()
        t.join(5)
        assert not t.is_alive()
    assert book.is_aborted("a-1") and book.is_aborted("not-yet-sent")  # later requests too: the server stops
