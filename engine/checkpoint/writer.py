"""One writer per --save: a lock file in the save location itself, `<save>/.rollflow-writer.json`.

Two runs writing one directory would interleave iter_%07d/ saves and markers and log into one MLflow run, and
both would exit 0. The lock is taken before anything reads or writes --save, and needs no server: it works with the
ephemeral Prefect API, a `prefect server`, or no Prefect at all.

    local   the file is created with O_CREAT | O_EXCL: of two runs starting at once exactly one creates it.
    S3      no exclusive create: the record is PUT, then read back after SETTLE_S; the run whose record is there
            holds the lock (a run that loses the race sees the other's record and stops). Best effort where
            two runs start within SETTLE_S of each other.

The record names its holder (machine, pid and start time, run name, Prefect flow run) and a heartbeat the holder
rewrites every HEARTBEAT_S. A second run fails at once naming the holder (`--wait-for-save-lock S` waits up to S
seconds, saying so every LOG_EVERY_S). A holder that can no longer write is taken over at once: on the same machine
when its process is gone (a SIGKILLed run's restart must not wait), anywhere when its heartbeat is older than
STALE_S. The holder deletes the record when it ends.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from engine.checkpoint.storage import Store
from engine.diagnosis import Diagnosis, DiagnosisError

LOCK = ".rollflow-writer.json"
HEARTBEAT_S = 30.0
STALE_S = 120.0  # 4 missed heartbeats
SETTLE_S = 2.0
LOG_EVERY_S = 30.0
log = logging.getLogger("rollflow.checkpoint")


class SaveInUse(DiagnosisError):
    """Another run writes this --save. Retryable: a flow retry (--flow-retries) may find it free."""

    retryable = True


# ---- who is this process, is that one alive ---------------------------------------------------------------------
def machine_id() -> str:
    """Host name + boot id + pid namespace: two containers or hosts never share one (pids are compared only then)."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    return ":".join(parts)


def process_alive(pid: int, started: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False


def this_process() -> tuple[int, float]:
    import psutil

    return os.getpid(), psutil.Process().create_time()


def holder_gone(holder: dict[str, Any], *, now: float, machine: str,
                process_alive: Callable[[int, float], bool] = process_alive) -> bool:
    """Whether a recorded holder can no longer be writing: it ran on this machine and its process (pid + start time,
    so a reused pid does not count) is gone, or its heartbeat is older than STALE_S (its machine went away)."""
    if holder.get("machine") == machine and holder.get("pid") is not None and holder.get("started") is not None:
        if not process_alive(int(holder["pid"]), float(holder["started"])):
            return True
    return now - float(holder.get("heartbeat", 0.0)) > STALE_S


def describe(holder: dict[str, Any]) -> str:
    run = holder.get("run") or "a run"
    flow = f", Prefect flow run {holder['flow_run_id']}" if holder.get("flow_run_id") else ""
    return (f"{run} (pid {holder.get('pid')} on {str(holder.get('machine', '?')).split(':')[0]}{flow}, "
            f"heartbeat {time.time() - float(holder.get('heartbeat', 0)):.0f} s ago)")


# ---- the lock ---------------------------------------------------------------------------------------------------
class WriterLock:
    def __init__(self, save: str, *, run: str = "", flow_run_id: str | None = None):
        self.store = Store(save)
        pid, started = this_process()
        self.record = {"token": uuid.uuid4().hex, "machine": machine_id(), "pid": pid, "started": started,
                       "run": run, "flow_run_id": flow_run_id, "heartbeat": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading and writing the record
    def holder(self) -> dict[str, Any] | None:
        raw = self.store.read_bytes(LOCK)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"token": None, "heartbeat": 0.0, "run": "an unreadable lock record"}  # stale at once

    def _create(self) -> bool:
        """Write our record if there is none; True when we hold the lock afterwards."""
        data = json.dumps(self.record).encode()
        if not self.store.remote:
            self.store.mkdir()
            try:
                fd = os.open(self.store.path(LOCK), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return True
        if self.holder() is not None:
            return False
        self.store.write_atomic(LOCK, data)
        time.sleep(SETTLE_S)  # another run's PUT of the same moment lands by now; the last one wins
        return (self.holder() or {}).get("token") == self.record["token"]

    def _remove_if(self, token: str | None) -> None:
        """Remove the record if it is still the one we judged (never a newer holder's)."""
        if (self.holder() or {}).get("token") == token:
            self.store.rm(LOCK)

    # -- taking and keeping it
    def acquire(self, wait_s: float = 0.0) -> None:
        deadline, next_log = time.monotonic() + wait_s, 0.0
        while True:
            if self._create():
                break
            holder = self.holder()
            if holder is None:
                continue  # released between our attempt and the read
            if holder_gone(holder, now=time.time(), machine=self.record["machine"]):
                log.warning("--save %s: taking over the writer lock of %s, which can no longer be writing",
                            self.store.url, describe(holder))
                self._remove_if(holder.get("token"))
                continue
            if time.monotonic() >= deadline:
                raise SaveInUse(busy(self.store.url, holder, wait_s))
            if time.monotonic() >= next_log:
                log.warning("--save %s is being written by %s; waiting up to %.0f s more (--wait-for-save-lock)",
                            self.store.url, describe(holder), deadline - time.monotonic())
                next_log = time.monotonic() + LOG_EVERY_S
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        self._thread = threading.Thread(target=self._beat, daemon=True, name="rollflow-writer-lock")
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (self.holder() or {}).get("token") != self.record["token"]:
                    log.error("--save %s: the writer lock was taken by another run", self.store.url)
                    return
                self.record["heartbeat"] = time.time()
                self.store.write_atomic(LOCK, json.dumps(self.record).encode())
            except Exception as e:  # noqa: BLE001 — the next beat may succeed; STALE_S allows four misses
                log.warning("--save %s: the writer lock's heartbeat failed (%s)", self.store.url, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self._remove_if(self.record["token"])
        except Exception as e:  # noqa: BLE001 — a stale record is taken over by the next run anyway
            log.warning("--save %s: could not remove the writer lock (%s)", self.store.url, e)


def live_holder(save: str) -> dict[str, Any] | None:
    """The record of a run that holds --save's writer lock and may still be writing; None when there is no lock, its
    holder is gone, or the location cannot be read now (taking the lock reports that). Reads only."""
    try:
        holder = WriterLock(save).holder()
    except Exception:  # noqa: BLE001 — the lock attempt in the flow names a storage problem properly
        return None
    if holder is None or holder_gone(holder, now=time.time(), machine=machine_id()):
        return None
    return holder


def busy(url: str, holder: dict[str, Any], wait_s: float) -> Diagnosis:
    from engine.tracking.secrets import redact_text

    waited = f" (waited {wait_s:.0f} s)" if wait_s else ""
    return Diagnosis(code="CONCURRENCY", severity="error",
                     what=f"--save {redact_text(url)} is being written by {describe(holder)}{waited}: two runs on one "
                          "directory would overwrite each other's checkpoints",
                     fix="wait for that run to finish (--wait-for-save-lock SECONDS waits for it), or use another "
                         f"--save; if no run is writing there, delete {redact_text(url)}/{LOCK}",
                     facts={"save": redact_text(url), "holder": {k: v for k, v in holder.items() if k != "token"}})


@contextmanager
def writer_lock(save: str | None, *, wait_s: float = 0.0, run: str = "",
                flow_run_id: str | None = None) -> Iterator[WriterLock | None]:
    """Hold --save's writer lock for the block (nothing when there is no --save)."""
    if not save:
        yield None
        return
    lock = WriterLock(save, run=run, flow_run_id=flow_run_id)
    try:
        lock.acquire(wait_s)
    except SaveInUse:
        raise
    except Exception as e:  # noqa: BLE001 — a storage error (missing bucket, permissions): one line naming it
        from engine.diagnosis import ConfigError, Diagnosis

        problem = lock.store.write_problem() or f"{type(e).__name__}: {str(e)[:300]}"
        raise ConfigError(Diagnosis(code="STORAGE", severity="error",
                                    what=f"--save {lock.store.url}: its writer lock cannot be taken: {problem}",
                                    fix=lock.store.write_fix(),
                                    facts={"path": lock.store.url})) from None
    try:
        yield lock
    finally:
        lock.release()
