"""The resume proof: SIGKILL `rollflow train` at every boundary, restart the same command, get the same weights.

One uninterrupted run of 3 rollouts (fixed seed, --sglang-enable-deterministic-inference, a save per rollout) is the reference.
Then ONE command, restarted unchanged (same argv, same env) until it exits 0, carries five faults that each fire
once (ROLLFLOW_FAULT_STATE): after_rollout@0 (before any checkpoint), during_train@1, during_save@1,
before_marker@2, after_marker@2. On S3 (local moto server) the same for during_save@1 (killed mid-upload).
Required (issue 6): every restart finishes; final weights bitwise equal; no iteration missing; one MLflow run id.

The launches share one Ray cluster and the Prefect test server started by this process (only to save ~40 s of
start-up per launch on a 2-core machine); the killed process is the training driver itself, as in production
with --ray-address. bench/resume.py runs the same proof with each launch starting its own Ray and Prefect.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.resume import child_env, compare, faulted_run, fingerprint, run_until_done, train_command
from engine import checkpoint

pytestmark = pytest.mark.slow
N = 3
CHAIN = "after_rollout@0,during_train@1,during_save@1,before_marker@2,after_marker@2"


@pytest.fixture(scope="module")
def launch_env(prefect_harness, tmp_path_factory):
    """Env + extra flags for the launches: this process's Prefect test server and a Ray cluster they join."""
    import ray
    from prefect.settings import PREFECT_API_URL

    from engine.cluster import worker_env

    ray.shutdown()  # a cluster of its own, reached by --ray-address
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": worker_env()})
    env = child_env({"PREFECT_API_URL": PREFECT_API_URL.value()})
    yield env, ["--ray-address", ray.get_runtime_context().gcs_address]
    ray.shutdown()


@pytest.fixture(scope="module")
def baseline(launch_env, tmp_path_factory):
    env, extra = launch_env
    d = tmp_path_factory.mktemp("baseline")
    launches = run_until_done(train_command(N, d / "work", str(d / "ckpt"), extra), env, d / "log.txt")
    assert [x["rc"] for x in launches] == [0]
    fp = fingerprint(str(d / "ckpt"), d / "verify")
    assert sorted(fp["iterations"]) == [0, 1, 2] and all("model" in v for v in fp["iterations"].values())
    return fp


def _check(base, run, spec, work: Path) -> None:
    launches = [x["rc"] for x in run["launches"]]
    fired = spec.split(",")
    assert sorted(run["fired"]) == sorted(fired), "a fault did not fire: the proof would be vacuous"
    assert launches == [-9] * len(fired) + [0], run["launches"]
    checks = compare(base, run["fingerprint"], N)
    assert {k: v for k, v in checks.items() if isinstance(v, bool)} == {
        "all_iterations_present": True, "all_iterations_verify": True, "final_weights_bitwise_equal": True,
        "every_iteration_bitwise_equal": True, "one_mlflow_run_id": True}, checks
    # one MLflow run for the whole lineage: finished, one tag per restart
    (mlrun,) = run["mlflow"]
    assert mlrun["run_id"] == checks["mlflow_run_ids"][0] and mlrun["status"] == "FINISHED"
    assert len(mlrun["resume_tags"]) == len(fired)
    # the metrics carried in the checkpoints are the uninterrupted run's, rollout by rollout
    assert [run["fingerprint"]["iterations"][i]["reward_mean"] for i in range(N)] == \
        [base["iterations"][i]["reward_mean"] for i in range(N)]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["rollouts"] == N and summary["last_checkpoint"] == N - 1


def test_sigkill_at_every_boundary_then_same_weights(launch_env, baseline, tmp_path):
    env, extra = launch_env
    run = faulted_run("chain", CHAIN, N, tmp_path, str(tmp_path / "ckpt"), env, extra)
    _check(baseline, run, CHAIN, tmp_path / "chain" / "work")
    assert not list((tmp_path / "ckpt").glob("*.tmp"))  # the killed save's iter_0000001.tmp was cleaned


def test_sigkill_during_an_s3_save_then_same_weights(launch_env, baseline, tmp_path, s3_bucket, s3_server):
    env, extra = launch_env
    url = s3_bucket + "/run"
    run = faulted_run("s3", "during_save@1", N, tmp_path, url, {**env, **s3_server}, extra)
    _check(baseline, run, "during_save@1", tmp_path / "s3" / "work")
    log = (tmp_path / "s3" / "log.txt").read_text()
    assert s3_server["AWS_SECRET_ACCESS_KEY"] not in log
    assert checkpoint.list_iterations(url) == [0, 1, 2]


def test_async_sigkill_at_every_boundary_then_every_rollout_trained_once(launch_env, tmp_path):
    """--async-mode one-step --partial-rollout --async-save under the same five SIGKILLs: rollout i+1 is in flight
    while step i trains and saves, so a resume redraws it from where it started (the checkpoint's data position) and
    continues what the checkpoint kept of it; the save faults fire in the commit task, while the next step trains. Weights differ from a synchronous run by design (staleness); what must hold:
    every launch but the last killed, every iteration complete, each rollout id trained exactly once in the final
    lineage (the optimizer's step count), one MLflow run."""
    import torch

    env, extra = launch_env
    save = tmp_path / "ckpt"
    run = faulted_run("async", CHAIN, N, tmp_path, str(save), env,
                      [*extra, "--async-mode", "one-step", "--partial-rollout", "--async-save"])
    fired = CHAIN.split(",")
    assert sorted(run["fired"]) == sorted(fired) and [x["rc"] for x in run["launches"]] == [-9] * len(fired) + [0]
    its = run["fingerprint"]["iterations"]
    assert sorted(its) == list(range(N)) and all("problem" not in v for v in its.values()), its
    (mlrun,) = run["mlflow"]
    assert mlrun["status"] == "FINISHED" and len(mlrun["resume_tags"]) == len(fired)
    assert {v["mlflow_run_id"] for v in its.values()} == {mlrun["run_id"]}
    last = save / checkpoint.iter_name(N - 1)
    state = torch.load(last / "optim" / "state.pt", weights_only=False)
    assert state["steps_done"] == N * 2  # --num-steps-per-rollout 2: no rollout trained twice, none skipped
    manifest = json.loads((last / "manifest.json").read_text())
    assert sorted(map(int, manifest["history"]["train/loss"])) == list(range(N))
    assert sorted(map(int, manifest["history"]["async/staleness_max"])) == list(range(N))
    assert all(v <= 1 for v in manifest["history"]["async/staleness_max"].values())
    assert "sync/paused_requests" in manifest["history"]  # --partial-rollout: syncs pause the rollout in flight
    # --async-save: every save went through _Saves, which logs save/wait_seconds before the save (so its drain keeps
    # it past any of the kills)
    import sqlite3

    db = sqlite3.connect(tmp_path / "async" / "work" / "mlflow.db")
    steps = {s for (s,) in db.execute("SELECT DISTINCT step FROM metrics WHERE key = 'save/wait_seconds'")}
    db.close()
    assert steps == set(range(N)), steps
    summary = json.loads((tmp_path / "async" / "work" / "summary.json").read_text())
    assert summary["rollouts"] == N and summary["async_mode"] == "one-step"
