"""plumbing/limits.py: the GPU slots as a Prefect global concurrency limit, and what a flow run holds.

The pure GPU arithmetic without Prefect; the slots against the session's Prefect test server (a real API server:
leases). --save's writer lock itself: tests/test_writer_lock.py.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine.config import RunConfig
from engine.diagnosis import DiagnosisError
from plumbing import limits

ROOT = Path(__file__).resolve().parents[1]


# ---- pure -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over, cluster_gpus, expected", [
    (dict(actor_num_nodes=2, actor_num_gpus_per_node=4, colocate=True), 8, 8),   # colocated: T = 2·4
    (dict(actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=4), 16, 12),  # decoupled: T + R = 8 + 4
    (dict(actor_num_gpus_per_node=2, rollout_num_engines=3, rollout_num_gpus_per_engine=2), 8, 8),  # 2 + 3·2
    (dict(actor_num_gpus_per_node=2, rollout_num_gpus=0), 8, 2),  # engines on CPU: the train GPUs only
    (dict(actor_num_nodes=2, actor_num_gpus_per_node=4, colocate=True), 0, 0),  # no GPUs in the cluster
])
def test_gpus_occupied_is_rf02s_arithmetic(over, cluster_gpus, expected):
    assert limits.gpus_occupied(RunConfig(**over), cluster_gpus) == expected


def _active(name: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


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


def test_held_takes_the_writer_lock_but_no_gpu_slots_on_the_ephemeral_api(caplog, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from engine.checkpoint.writer import LOCK

    caplog.set_level("INFO", logger="rollflow.limits")
    save = tmp_path / "ckpt"
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert limits.api_is_ephemeral()
        with limits.held(RunConfig(save=str(save)), cluster_gpus=8):
            assert (save / LOCK).is_file()  # one writer per --save holds without a Prefect server
    assert not (save / LOCK).exists()
    assert "rollflow-gpus not taken: the ephemeral Prefect API" in caplog.text


def test_held_takes_the_writer_lock_and_skips_gpus_on_a_cpu_cluster(prefect_harness, tmp_path, caplog):
    from engine.checkpoint.writer import LOCK

    caplog.set_level("INFO", logger="rollflow.limits")
    save = tmp_path / "ckpt"
    with limits.held(RunConfig(save=str(save)), cluster_gpus=0):
        assert (save / LOCK).is_file()
    assert "rollflow-gpus not taken: the run uses no GPUs" in caplog.text
    assert not (save / LOCK).exists()


def test_a_run_waits_for_the_writer_lock_as_long_as_asked(tmp_path, caplog):
    """--wait-for-save-lock reaches the lock through `held`: 0 fails at once, S waits S seconds first."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from engine.checkpoint.writer import SaveInUse, WriterLock

    save = str(tmp_path / "ckpt")
    first = WriterLock(save, run="first")
    first.acquire()
    try:
        with temporary_settings(updates={PREFECT_API_URL: None}):
            t0 = time.monotonic()
            with pytest.raises(SaveInUse):
                with limits.held(RunConfig(save=save), cluster_gpus=0):
                    pass
            assert time.monotonic() - t0 < 3
            t0 = time.monotonic()
            with pytest.raises(SaveInUse, match="waited 2 s"):
                with limits.held(RunConfig(save=save, wait_for_save_lock=2.0), cluster_gpus=0):
                    pass
            assert time.monotonic() - t0 >= 1.9
    finally:
        first.release()
