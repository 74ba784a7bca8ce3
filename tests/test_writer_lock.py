"""One writer per --save (engine/checkpoint/writer.py): a lock file in the save location itself, no server needed.

Two real processes on one directory; a holder killed with SIGKILL and a restart that takes over at once; a live
holder elsewhere that is never taken over; waiting when asked; S3 through the local S3 server.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint.writer import LOCK, STALE_S, SaveInUse, WriterLock, holder_gone, process_alive, writer_lock

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
from engine.checkpoint.writer import writer_lock
with writer_lock(sys.argv[1], run="demo/first"):
    print("held", flush=True)
    time.sleep(600)
"""


def _hold(save: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, save], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def test_a_second_writer_fails_at_once_naming_the_first(tmp_path):
    save = str(tmp_path / "ckpt")
    p = _hold(save)
    try:
        t0 = time.monotonic()
        with pytest.raises(SaveInUse) as e:
            with writer_lock(save, run="demo/second"):
                pass
        assert time.monotonic() - t0 < 5  # no silent 45 s wait
        (d,) = e.value.diagnoses
        assert "demo/first" in d.what and f"pid {p.pid}" in d.what and "--wait-for-save-lock" in d.fix
        assert e.value.retryable  # a flow retry may find it free
        with writer_lock(str(tmp_path / "other")):  # another directory is another lock
            pass
    finally:
        _kill(p)


def test_a_restart_takes_over_the_lock_of_a_killed_holder_at_once(tmp_path):
    save = str(tmp_path / "ckpt")
    p = _hold(save)
    _kill(p)  # SIGKILL: no release, the record stays
    assert json.loads((Path(save) / LOCK).read_text())["pid"] == p.pid
    t0 = time.monotonic()
    with writer_lock(save, run="restart") as lock:
        assert time.monotonic() - t0 < 5
        assert json.loads((Path(save) / LOCK).read_text())["token"] == lock.record["token"]
    assert not (Path(save) / LOCK).exists()  # released at the end


def test_a_live_holder_elsewhere_is_never_taken_over_and_waiting_is_reported(tmp_path, caplog):
    save = tmp_path / "ckpt"
    save.mkdir()
    other = {"token": "t", "machine": "another-host:boot:1", "pid": 1, "started": 0.0, "run": "far/away",
             "heartbeat": time.time()}
    (save / LOCK).write_text(json.dumps(other))
    caplog.set_level("WARNING", logger="rollflow.checkpoint")
    t0 = time.monotonic()
    with pytest.raises(SaveInUse, match="far/away"):
        with writer_lock(str(save), wait_s=1.5):
            pass
    assert 1.4 < time.monotonic() - t0 < 5 and "waiting up to" in caplog.text
    assert json.loads((save / LOCK).read_text())["token"] == "t"  # untouched


def test_a_waiting_run_gets_the_lock_when_the_holder_ends(tmp_path):
    save = str(tmp_path / "ckpt")
    first = WriterLock(save, run="first")
    first.acquire()
    import threading

    threading.Timer(1.0, first.release).start()
    t0 = time.monotonic()
    with writer_lock(save, wait_s=20, run="second"):
        assert 0.9 < time.monotonic() - t0 < 10


def test_the_lock_is_released_when_the_block_raises(tmp_path):
    save = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with writer_lock(str(save)):
            raise RuntimeError("the flow failed")
    assert not (save / LOCK).exists()


def test_a_holder_is_gone_when_its_process_here_died_or_its_heartbeat_stopped():
    now = time.time()
    rec = {"machine": "m1", "pid": 42, "started": 100.0, "heartbeat": now}
    alive, dead = (lambda pid, t: True), (lambda pid, t: False)
    assert holder_gone(rec, now=now, machine="m1", process_alive=dead)  # its process on this machine is gone
    assert not holder_gone(rec, now=now, machine="m1", process_alive=alive)
    assert not holder_gone(rec, now=now, machine="m2", process_alive=dead)  # not our pid space: trust the beat
    assert holder_gone(rec, now=now + STALE_S + 1, machine="m2", process_alive=alive)  # heartbeat too old
    pid = os.getpid()
    import psutil

    started = psutil.Process(pid).create_time()
    assert process_alive(pid, started) and not process_alive(pid, started - 3600)  # a reused pid is not the holder


def test_no_secret_of_the_save_url_reaches_the_message(tmp_path):
    from engine.checkpoint.writer import busy

    for url in ("s3://bucket/run?sig=SeCrEtSiG0123456789&x=1", "https://user:Pa55w0rdXYZ@host/ckpt"):
        text = busy(url, {"run": "r", "pid": 1, "machine": "m", "heartbeat": time.time()}, 0).model_dump_json()
        assert "SeCrEtSiG0123456789" not in text and "Pa55w0rdXYZ" not in text


def test_one_writer_on_s3(s3_server):
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.mkdir("rollflow-lock-test")
    save = "s3://rollflow-lock-test/run"
    with writer_lock(save, run="first"):
        assert fs.exists(f"{save}/{LOCK}")
        with pytest.raises(SaveInUse, match="first"):
            with writer_lock(save, run="second"):
                pass
    fs.invalidate_cache()
    assert not fs.exists(f"{save}/{LOCK}")


def test_rollflow_train_on_a_save_in_use_fails_before_its_start_up(tmp_path):
    """`rollflow train` reads the lock before starting Prefect's API, Ray and the actors (flows/cli.py): the second
    run fails naming the first, having started nothing (no Ray, no work directory); a holder that is gone does not
    stop it."""
    from engine.checkpoint.writer import live_holder

    save = str(tmp_path / "ck")
    holder = _hold(save)
    try:
        assert live_holder(save)["pid"] == holder.pid
        r = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", "examples/demo.yaml", "--save", save,
                            "--work-dir", str(tmp_path / "w"), "--no-progress"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "[CONCURRENCY error]" in out and f"pid {holder.pid}" in out, out
        assert "Ray" not in out and not (tmp_path / "w").exists(), out  # nothing started, nothing written
    finally:
        _kill(holder)
    holder.wait()
    assert live_holder(save) is None  # its process is gone: the next run takes the lock over
