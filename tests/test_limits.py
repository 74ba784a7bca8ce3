"""flows/limits.py: one writer per --save directory and GPU slots, as Prefect global concurrency limits.

Pure parts (names, GPU arithmetic, holder liveness) without Prefect; the slots against the session's Prefect test
server (a real API server: leases, variables), including a holder killed with SIGKILL and a restart that takes over.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.config import RunConfig
from engine.doctor.diagnosis import DiagnosisError
from flows import limits

ROOT = Path(__file__).resolve().parents[1]


# ---- pure -------------------------------------------------------------------------------------------------------
def test_one_directory_however_spelled_has_one_limit_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    names = {limits.save_limit_name(p) for p in ("runs/ckpt", "./runs/ckpt/", str(tmp_path / "runs" / "ckpt"),
                                                 "runs/../runs/ckpt")}
    assert len(names) == 1
    (name,) = names
    assert name.startswith("rollflow-save-ckpt-") and len(name) == len("rollflow-save-ckpt-") + 12
    assert limits.save_limit_name("s3://b/run/") == limits.save_limit_name("s3://b/run")


def test_different_directories_have_different_names_made_of_allowed_characters(tmp_path):
    import re

    saves = [str(tmp_path / "a" / "ckpt"), str(tmp_path / "b" / "ckpt"), "s3://bucket/ckpt", "s3://other/ckpt",
             str(tmp_path / "Weird Name!%/x"), "/"]
    names = [limits.save_limit_name(s) for s in saves]
    assert len(set(names)) == len(saves)
    assert all(re.fullmatch(r"[a-z0-9-]+", n) and len(n) <= 64 for n in names)  # a valid Prefect variable name


def test_a_secret_in_the_save_url_reaches_neither_the_name_nor_the_message():
    for save in ("s3://bucket/run?sig=SeCrEtSiG0123456789&x=1", "https://user:Pa55w0rdXYZ@host/ckpt"):
        name = limits.save_limit_name(save)
        busy = limits._save_busy(save, name, None, 90).render()
        assert not any(s.lower() in (name + busy).lower() for s in ("SeCrEtSiG0123456789", "Pa55w0rdXYZ"))
    assert limits.save_limit_name("s3://bucket/run?sig=a") != limits.save_limit_name("s3://bucket/run?sig=b")


@pytest.mark.parametrize("over, cluster_gpus, expected", [
    (dict(actor_num_nodes=2, actor_num_gpus_per_node=4, colocate=True), 8, 8),   # colocated: T = 2·4
    (dict(actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=4), 16, 12),  # decoupled: T + R = 8 + 4
    (dict(actor_num_gpus_per_node=2, rollout_num_engines=3, rollout_num_gpus_per_engine=2), 8, 8),  # 2 + 3·2
    (dict(actor_num_gpus_per_node=2, rollout_num_gpus=0), 8, 2),  # engines on CPU: the train GPUs only
    (dict(actor_num_nodes=2, actor_num_gpus_per_node=4, colocate=True), 0, 0),  # no GPUs in the cluster
])
def test_gpus_occupied_is_rf02s_arithmetic(over, cluster_gpus, expected):
    assert limits.gpus_occupied(RunConfig(**over), cluster_gpus) == expected


def test_a_holder_is_gone_only_when_its_run_ended_or_its_process_on_this_machine_died():
    rec = {"machine": "m1", "pid": 42, "started": 1000.0}
    dead = lambda pid, started: False  # noqa: E731
    alive = lambda pid, started: True  # noqa: E731
    assert limits.holder_gone(rec, flow_run_final=True, machine="m2", process_alive=alive)  # its flow run ended
    assert limits.holder_gone(rec, flow_run_final=False, machine="m1", process_alive=dead)
    assert not limits.holder_gone(rec, flow_run_final=False, machine="m1", process_alive=alive)
    assert not limits.holder_gone(rec, flow_run_final=False, machine="m2", process_alive=dead)  # not our pid space
    assert not limits.holder_gone({"machine": "m1"}, flow_run_final=False, machine="m1", process_alive=dead)


def test_a_reused_pid_is_not_the_holder():
    pid, started = os.getpid(), limits._this_process()[1]
    assert limits.process_alive(pid, started)
    assert not limits.process_alive(pid, started - 3600)  # same pid, another process start time


# ---- against a Prefect API server -------------------------------------------------------------------------------
def _active(name: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def test_a_second_writer_of_the_same_save_waits_then_fails_naming_the_holder(prefect_harness, tmp_path):
    from prefect.variables import Variable

    save = str(tmp_path / "ckpt")
    with limits.save_slot(save) as name:
        assert _active(name) == 1
        rec = Variable.get(name)
        assert rec["pid"] == os.getpid() and rec["save"] == str(Path(save).resolve())
        t0 = time.monotonic()
        with pytest.raises(DiagnosisError) as e:
            with limits.save_slot(save, wait_s=1.5):
                pass
        assert time.monotonic() - t0 >= 1.5
        d = e.value.diagnoses[0]
        assert d.code == "CONCURRENCY" and save in d.what and f"pid {os.getpid()}" in d.what and name in d.fix
        assert e.value.retryable  # a flow retry may find the directory free
        with limits.save_slot(str(tmp_path / "other")):  # another directory is another limit
            pass
    assert _active(name) == 0 and Variable.get(name) is None
    with limits.save_slot(save):  # free again
        assert _active(name) == 1


def test_the_slot_is_released_when_the_block_raises(prefect_harness, tmp_path):
    save = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError):
        with limits.save_slot(save) as name:
            raise RuntimeError("the flow failed")
    assert _active(name) == 0


HOLDER = """
import sys, time
from flows import limits
with limits.save_slot(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_restart_takes_over_the_slot_of_a_killed_holder_at_once(prefect_harness, tmp_path):
    """SIGKILL leaves the slot held (its lease would expire only after 60 s + the server's loop); the next run
    on this machine sees the recorded pid is gone, releases that lease and goes on without waiting."""
    from prefect.settings import PREFECT_API_URL

    save = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": PREFECT_API_URL.value()}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, save], env=env, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "held"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    name = limits.save_limit_name(save)
    assert _active(name) == 1  # the dead holder's slot
    t0 = time.monotonic()
    with limits.save_slot(save, wait_s=20):
        assert time.monotonic() - t0 < 10
        assert _active(name) == 1  # the dead lease was released, not just outnumbered
    assert _active(name) == 0


def test_a_holder_whose_flow_run_ended_elsewhere_is_taken_over(prefect_harness, tmp_path):
    """A worker on another machine marks a killed flow run Crashed: its record's run is final → released."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.variables import Variable

    save = str(tmp_path / "ckpt")
    name = limits.save_limit_name(save)

    @flow(name="dies-holding-a-slot")
    def holder():
        with get_client(sync_client=True) as client:
            limits._ensure_limit(client, name, 1)
            lease = limits._acquire(client, name, 1, timeout_s=0)
        Variable.set(name, {"flow_run_id": str(flow_run.id), "machine": "another-host:boot:1", "pid": 1,
                            "started": 0.0, "lease_id": str(lease)}, overwrite=True)

    holder()  # returns without releasing: its flow run is Completed, its slot still held
    assert _active(name) == 1
    with limits.save_slot(save, wait_s=20):
        assert _active(name) == 1
    assert _active(name) == 0


def test_a_live_holder_elsewhere_is_never_taken_over(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.variables import Variable

    save = str(tmp_path / "ckpt")
    name = limits.save_limit_name(save)
    with get_client(sync_client=True) as client:
        limits._ensure_limit(client, name, 1)
        lease = limits._acquire(client, name, 1, timeout_s=0)
        Variable.set(name, {"flow_run_id": None, "machine": "another-host:boot:1", "pid": 1, "started": 0.0,
                            "lease_id": str(lease)}, overwrite=True)
        try:
            with pytest.raises(DiagnosisError, match="pid 1 on another-host"):
                with limits.save_slot(save, wait_s=1):
                    pass
            assert _active(name) == 1
        finally:
            client.release_concurrency_slots_with_lease(lease)
            Variable.unset(name)


def test_gpu_slots_queue_and_refuse_what_the_limit_can_never_give(prefect_harness):
    from prefect.client.orchestration import get_client

    try:
        with limits.gpu_slots(3, cluster_gpus=4):  # creates rollflow-gpus with the cluster's 4 GPUs
            assert _active(limits.GPU_LIMIT) == 3
            with pytest.raises(DiagnosisError) as e:
                with limits.gpu_slots(5, cluster_gpus=4):
                    pass
            assert e.value.codes == ["RF02"] and "5 GPUs" in str(e.value) and "4 slots" in str(e.value)
            assert not e.value.retryable  # it would fail the same way on every attempt

            got = []

            def second():
                with limits.gpu_slots(2, cluster_gpus=4):
                    got.append(time.monotonic())

            t = threading.Thread(target=second)
            t.start()
            time.sleep(2.0)
            assert not got  # 3 + 2 > 4: waits
            released = time.monotonic()
        t.join(timeout=30)
        assert got and got[0] >= released  # got its 2 slots only after the first 3 were released
        assert _active(limits.GPU_LIMIT) == 0
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(limits.GPU_LIMIT)


def test_held_takes_nothing_on_the_ephemeral_api_and_says_why(caplog, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    caplog.set_level("INFO", logger="rollflow.limits")
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert limits.api_is_ephemeral()
        with limits.held(RunConfig(save=str(tmp_path / "ckpt")), cluster_gpus=8):
            pass
    assert "concurrency limits not taken: the ephemeral Prefect API" in caplog.text


def test_held_takes_the_save_slot_and_skips_gpus_on_a_cpu_cluster(prefect_harness, tmp_path, caplog):
    caplog.set_level("INFO", logger="rollflow.limits")
    save = str(tmp_path / "ckpt")
    with limits.held(RunConfig(save=save), cluster_gpus=0):
        assert _active(limits.save_limit_name(save)) == 1
    assert "rollflow-gpus not taken: the run uses no GPUs" in caplog.text
    assert _active(limits.save_limit_name(save)) == 0
