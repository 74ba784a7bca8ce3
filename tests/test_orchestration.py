"""Issue 7 under the Prefect test harness with real Ray and the built-in engine: a hung engine request ends at
--rollout-timeout and the rollout task is retried; an engine killed mid-rollout fails the flow run, whose retry
(--flow-retries) resumes from the marker without losing or repeating a step; RF02 on placement (busy GPUs retried
with backoff until another holder releases them; a topology that never fits fails in seconds, not retried)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytestmark = pytest.mark.slow


def _runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            fr = await client.read_flow_run(flow_run_id)
            trs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            return fr, trs

    # task runs reach the API through its event pipeline, a moment after the flow returns: read until stable
    deadline, last = time.monotonic() + 30, None
    while True:
        fr, trs = asyncio.run(read())
        now = sorted((t.name, t.run_count, t.state.type.value) for t in trs)
        if (now == last and all(t.state.is_final() for t in trs)) or time.monotonic() > deadline:
            return fr, trs
        last = now
        time.sleep(1.0)


def _flow_run_named(name: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def read():
        async with get_client() as client:
            frs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
            return frs[-1]

    return _runs(asyncio.run(read()).id)


def test_a_hung_engine_request_hits_the_deadline_and_the_rollout_is_retried(prefect_harness, shared_ray,
                                                                            small_cfg, tmp_path,
                                                                           monkeypatch):
    from flows.train import rl_train

    # the engine's first /generate (rollout 0's: a built-in CPU engine takes a round's groups as one request,
    # EngineGroup.join_rows) never answers; everything else is served
    monkeypatch.setenv("ROLLFLOW_ENGINE_FAULT", "hang@0")
    monkeypatch.setenv("ROLLFLOW_FAULT_STATE", str(tmp_path / "fired"))
    cfg = small_cfg(eval_prompt_data="", num_rollout=1, rollout_timeout=8, rollout_retries=1, run_name="hang")
    t0 = time.monotonic()
    result = rl_train(cfg)
    assert (tmp_path / "fired").read_text() == "engine-hang@0\n"
    assert result["rollouts"] == 1 and time.monotonic() - t0 >= 8

    fr, trs = _runs(result["flow_run_id"])
    assert fr.state.is_completed() and fr.run_count == 1
    r0 = next(t for t in trs if t.name == "rollout-0")
    assert r0.state.is_completed() and r0.run_count == 2  # failed at its deadline, then retried once
    assert [t.name for t in trs if t.name.startswith("train-")] == ["train-0"]


def test_an_engine_killed_mid_rollout_the_flow_retry_resumes_without_losing_a_step(prefect_harness, shared_ray,
                                                                                   small_cfg,
                                                                                  tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from engine import checkpoint
    from flows.train import rl_train

    # /generate requests: 0 is rollout 0 (its groups in one request, EngineGroup.join_rows), 1 the RF14 probe's
    # sampling after sync 0, 2 rollout 1: after iteration 0 was saved
    monkeypatch.setenv("ROLLFLOW_ENGINE_FAULT", "exit@2")
    monkeypatch.setenv("ROLLFLOW_FAULT_STATE", str(tmp_path / "fired"))
    cfg = small_cfg(eval_prompt_data="", num_rollout=2, save_interval=1, rollout_retries=0, flow_retries=1,
                    flow_retry_delay=0, run_name="killed")
    result = rl_train(cfg)
    assert (tmp_path / "fired").read_text() == "engine-exit@2\n"

    fr, trs = _runs(result["flow_run_id"])
    assert fr.state.is_completed() and fr.run_count == 2  # attempt 1 failed in rollout-1, attempt 2 resumed
    names = [t.name for t in trs]
    failed = [t for t in trs if t.state.is_failed()]
    assert [t.name for t in failed] == ["rollout-1"] and "engine" in failed[0].state.message.lower()
    assert names.count("train-0") == 1 and names.count("train-1") == 1
    assert names.count("rollout-1") == 2 and names.count("place") == 2

    assert checkpoint.read_marker(cfg.save) == 1
    client = MlflowClient(tracking_uri=result["mlflow_tracking_uri"])
    assert client.get_run(result["mlflow_run_id"]).data.tags.get("rollflow.resume.1") is not None  # same MLflow run
    steps = [m.step for m in client.get_metric_history(result["mlflow_run_id"], "train/loss")]
    assert sorted(steps) == [0, 1]  # every step trained exactly once


def test_a_config_error_is_not_retried_by_the_flow(prefect_harness, shared_ray, small_cfg, tmp_path):
    """--flow-retries never re-runs what fails the same way: RF01 (--load without a marker) fails once."""
    from engine.doctor import DiagnosisError
    from flows.train import rl_train

    (tmp_path / "empty").mkdir()
    cfg = small_cfg(load=str(tmp_path / "empty"), flow_retries=2, flow_retry_delay=0, run_name="config-error")
    with pytest.raises(DiagnosisError) as e:
        rl_train(cfg)
    assert e.value.codes == ["RF01"]
    fr, _ = _flow_run_named("config-error")
    assert fr.state.is_failed() and fr.run_count == 1


@pytest.fixture
def fake_gpus():
    """A local Ray cluster with 2 fake GPUs (placement logic only: nothing runs on them)."""
    import ray

    from engine.cluster import worker_env

    ray.shutdown()  # shared_ray's cluster has no GPUs
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": worker_env()})
    yield
    ray.shutdown()


def _place_only(cfg):
    from prefect import flow

    import tasks

    @flow(name="place-only", flow_run_name=cfg.run_name)
    def place_only(cfg):
        run = tasks.for_run(cfg).place(cfg)
        placed = run.placement.layout.bundles
        run.close()
        return placed

    return place_only(cfg)


def test_busy_gpus_are_retried_with_backoff_until_the_holder_releases_them(prefect_harness, small_cfg, fake_gpus):
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    import ray

    holder = placement_group([{"GPU": 1.0}, {"GPU": 1.0}], name="another-job")  # another job holds both GPUs
    ray.get(holder.ready(), timeout=30)

    def release_after_a_failed_attempt():
        """The holder lets go once the run's first attempt has given up (its pending group removed after
        --placement-timeout), however long the attempt took to get there (was: a fixed 6 s, which a loaded
        machine's first attempt, 15 s of start-up, outlived: placed at once, no retry, the test failed)."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            states = {v["name"]: v["state"] for v in placement_group_table().values() if v["name"] != "another-job"}
            if "REMOVED" in states.values():
                break
            time.sleep(0.2)
        remove_placement_group(holder)

    threading.Thread(target=release_after_a_failed_attempt, daemon=True).start()
    # decoupled: 1 train GPU + 1 rollout GPU = 2 of the 2 GPUs
    cfg = small_cfg(rollout_num_gpus=1, placement_timeout=2, placement_retries=4, placement_retry_delay=1,
                    eval_prompt_data="", run_name="busy")
    bundles = _place_only(cfg)
    assert bundles == [{"GPU": 1.0}, {"GPU": 1.0}]
    _, trs = _flow_run_named("busy")
    place = next(t for t in trs if t.name == "place")
    assert place.state.is_completed() and place.run_count >= 2  # busy at first, placed after the release


def test_a_topology_that_never_fits_fails_in_seconds_without_retries(prefect_harness, small_cfg, fake_gpus):
    from engine.cluster.placement import PlacementInfeasible

    cfg = small_cfg(rollout_num_gpus=2, placement_timeout=300, placement_retries=3, placement_retry_delay=60,
                    eval_prompt_data="", run_name="never")
    t0 = time.monotonic()
    with pytest.raises(PlacementInfeasible) as e:
        _place_only(cfg)
    assert time.monotonic() - t0 < 60
    d = e.value.diagnoses[0]
    assert d.code == "RF02" and d.facts["need"] == 3 and d.facts["have"] == 2
    assert "1 × 1 + 2 = 3" in d.what and "--colocate" in d.fix
    _, trs = _flow_run_named("never")
    place = next(t for t in trs if t.name == "place")
    assert place.state.is_failed() and place.run_count == 1 and "RF02" in place.state.message
