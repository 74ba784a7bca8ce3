"""rl-train as a deployment, end to end, with Prefect's own CLI against a real `prefect server start`.

Server on 127.0.0.1 (free port, temp PREFECT_HOME and SQLite, analytics off) → `prefect work-pool create
rollflow-process --type process` → `prefect deploy --all` from prefect.yaml → `prefect worker start` →
`prefect deployment run 'rl-train/rl-train'` with a tiny config as `cfg` overrides → the flow run completes in the
worker's subprocess, with every stage's task run, the artifacts, and its --save limit released. Then the trigger
example, turned on before the run: the run's own `rollflow.checkpoint.committed` event runs rl-export-hf on its
checkpoint.

Every process is started in its own process group; the finalizer kills each group and those of their descendants
(the worker's flow-run subprocess and the Ray processes it starts have groups of their own).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine.rollout.ports import free_loopback_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))


_free_port = free_loopback_port  # engine/rollout/ports.py


class Processes:
    """Popen in a new session each; `kill_all` ends every group they and their descendants are in."""

    def __init__(self, env: dict[str, str], logs: Path):
        self.env, self.logs, self.procs = env, logs, []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = (self.logs / f"{name}.log").open("w")
        p = subprocess.Popen([PREFECT, *args], cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def run(self, name: str, *args: str, timeout: float = 120) -> str:
        p = subprocess.run([PREFECT, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                           timeout=timeout, start_new_session=True)
        (self.logs / f"{name}.log").write_text(p.stdout + p.stderr)
        assert p.returncode == 0, f"prefect {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
        return p.stdout

    def kill_all(self) -> None:
        import psutil

        groups = set()
        for p in self.procs:
            try:
                kids = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                kids = []
            for q in [p.pid, *(k.pid for k in kids)]:
                try:
                    groups.add(os.getpgid(q))
                except ProcessLookupError:
                    pass
        groups.discard(os.getpgid(0))  # never this test process's own group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for g in groups:
                try:
                    os.killpg(g, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 5
            while sig == signal.SIGTERM and time.time() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.2)
        for p in self.procs:
            p.wait(timeout=10)


@pytest.fixture
def prefect_server(tmp_path):
    """A real `prefect server start` and the env (PREFECT_API_URL, …) every `prefect` command here gets."""
    port = _free_port()
    home = tmp_path / "prefect-home"
    home.mkdir()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "INFO",
           "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PREFECT_PROFILES_PATH", None)
    env.pop("MLFLOW_TRACKING_URI", None)  # the run's own SQLite store under work_dir, read below
    procs = Processes(env, tmp_path)
    try:
        procs.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui",
                    "--no-scheduler", "--no-late-runs")
        _wait_healthy(env["PREFECT_API_URL"], procs, deadline_s=120)
        yield procs
    finally:
        procs.kill_all()


def _wait_healthy(api: str, procs: Processes, deadline_s: float) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < deadline_s:
        assert procs.procs[0].poll() is None, (procs.logs / "server.log").read_text()[-3000:]
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    log = (procs.logs / "server.log").read_text()[-3000:]
    raise AssertionError(f"prefect server not healthy after {deadline_s} s: {log}")


def _wait_final(client, flow_run_id, deadline_s: float, logs: Path):
    t0 = time.time()
    while time.time() - t0 < deadline_s:
        fr = client.read_flow_run(flow_run_id)
        if fr.state is not None and fr.state.is_final():
            return fr
        time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} not finished after {deadline_s} s (state {fr.state}); worker log:\n"
                         + (logs / "worker.log").read_text()[-5000:])


def _wait_triggered(client, deployment: str, deadline_s: float, logs: Path):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    t0 = time.time()
    while time.time() - t0 < deadline_s:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])))
        if runs:
            return runs[0]
        time.sleep(1)
    raise AssertionError(f"no flow run of {deployment} after {deadline_s} s; server log:\n"
                         + (logs / "server.log").read_text()[-5000:])


def test_deploy_run_and_trigger_on_a_process_worker(prefect_server, tmp_path):
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from engine.checkpoint.writer import LOCK
    from engine.config import RunConfig
    from plumbing.ui import artifact_key
    from flows.export import export_path

    procs = prefect_server
    procs.run("pool", "work-pool", "create", "rollflow-process", "--type", "process")
    # --limit 2: the export triggered by save-1 starts while the training run finishes (not after it)
    procs.start("worker", "worker", "start", "--pool", "rollflow-process", "--limit", "2")  # starts while we deploy
    procs.run("deploy", "--no-prompt", "deploy", "--all")
    save = str(tmp_path / "ckpt")
    over = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "global_batch_size": 16, "micro_batch_size": 4,
            "num_rollout": 2, "rollout_max_response_len": 8, "eval_max_samples": 16, "num_cpus": 2,
            "work_dir": str(tmp_path / "work"), "save": save, "run_name": "deploy-test"}
    with temporary_settings(updates={PREFECT_API_URL: procs.env["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        # the trigger example ships off: turn it on (and send its exports under tmp_path) before the run
        (automation,) = client.read_automations_by_name("rl-export-hf-on-checkpoint")
        assert not automation.enabled
        client.resume_automation(automation.id)
        export_dep = client.read_deployment_by_name("rl-export-hf/rl-export-hf")
        client.update_deployment(export_dep.id, DeploymentUpdate(parameters={"output_dir": str(tmp_path / "hf")}))

        out = procs.run("run", "deployment", "run", "rl-train/rl-train", "--params", json.dumps({"cfg": over}))
        flow_run_id = UUID(re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1))
        fr = _wait_final(client, flow_run_id, deadline_s=300, logs=tmp_path)
        assert fr.state.is_completed(), f"{fr.state}\n" + (tmp_path / "worker.log").read_text()[-5000:]
        # the file's values and the run's overrides both arrived: the name from cfg (the MLflow run's too), sizes from
        # cfg, the experiment from the file (in the artifact keys)
        assert fr.name == "deploy-test"
        assert fr.parameters["config"] == "deployments/demo.yaml" and fr.parameters["cfg"]["num_rollout"] == 2
        assert client.read_deployment(fr.deployment_id).name == "rl-train"

        trs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        expected = ["preflight", "place", "convert", "eval-0", "eval-2", "save-1"] + [
            f"{stage}-{i}" for i in range(2) for stage in ("rollout", "pack", "train", "sync")]
        assert sorted(t.name for t in trs) == sorted(expected)
        assert all(t.state.is_completed() for t in trs)

        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        key = {name: artifact_key(RunConfig(experiment_name="demo-deployment", save=save), name)
               for name in ("progress", "summary", "mlflow-run", "samples", "checkpoint")}
        keys = [a.key for a in arts]
        assert all(keys.count(k) == 1 for k in key.values()), keys
        progress = next(a for a in arts if a.key == key["progress"])
        assert float(progress.data) == 100.0
        link = next(a for a in arts if a.key == key["mlflow-run"])
        mlflow_run_id = re.search(r"([0-9a-f]{32})", link.data).group(1)

        # the run held --save's writer lock and released it
        assert not (Path(save) / LOCK).exists()

        # the trigger example: the run's own rollflow.checkpoint.committed (save-1) ran rl-export-hf on iter 1
        export = _wait_triggered(client, "rl-export-hf", deadline_s=120, logs=tmp_path)
        export = _wait_final(client, export.id, deadline_s=120, logs=tmp_path)
        assert export.state.is_completed(), f"{export.state}\n" + (tmp_path / "worker.log").read_text()[-5000:]
        assert export.parameters["checkpoint_uri"] == f"{save}/iter_0000001"
    hf = export_path(str(tmp_path / "hf"), save, 1)
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    assert (Path(save) / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    # MLflow (the worker's SQLite store under work_dir): the linked run is this flow run's, with the merged config
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}").get_run(mlflow_run_id)
    assert run.data.tags["prefect.flow_run_id"] == str(flow_run_id) and run.info.status == "FINISHED"
    assert (run.data.params["rollout_batch_size"], run.data.params["lr"]) == ("4", "0.0003")  # cfg, file
