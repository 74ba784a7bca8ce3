"""MLflow as the system of record, with real training runs (Ray, the built-in engine, the torch backend):

- SQLite store, `rollflow train` as a process: SIGKILL mid-run, the same command resumes into the same MLflow run,
  `rollflow compare` counts the redone steps once; a second run with another --lr differs only in `lr`.
- A real `mlflow server` on 127.0.0.1 behind a gate the test opens and closes: a run that starts while MLflow is
  unreachable trains, buffers, and delivers everything once MLflow answers; a run for which MLflow never answers
  still trains and says what was lost.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.config.data import BUNDLED_TRAIN
from engine.rollout.ports import free_loopback_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SECRET = "sk-" + "Q7w" * 10  # passed as --sglang-api-key: must never reach MLflow
STAGE_METRICS = ["rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean", "rollout/truncated_share",
                 "rollout/seconds", "rollout/tokens_per_s", "pack/seconds", "pack/tokens", "train/loss",
                 "train/entropy", "train/grad_norm", "train/lr", "train/mismatch", "train/seconds", "sync/seconds"]


def tiny_yaml(tmp_path: Path, **over) -> Path:
    cfg = dict(prompt_data=BUNDLED_TRAIN, eval_prompt_data="", apply_chat_template=True, rollout_batch_size=4,
               n_samples_per_prompt=4, num_rollout=4, rollout_max_response_len=8, micro_batch_size=4, lr=1e-4,
               work_dir=str(tmp_path / "work"), experiment_name="cmp", progress=False, log_samples_interval=2,
               system_metrics_interval=1.0, num_cpus=2, mlflow_send_interval=0)  # records reach MLflow at once
    cfg.update(over)
    p = tmp_path / f"{over.get('run_name', 'run')}.yaml"
    p.write_text(json.dumps(cfg))  # JSON is YAML
    return p


def train_cmd(config: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train", "--config", str(config), *flags]


def child_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": PREFECT_API_URL.value(),
            "MLFLOW_TRACKING_URI": ""}


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (got := pred()):
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"training exited (rc {proc.returncode}) before {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


# ---- SQLite: kill, resume, compare ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sqlite_runs(prefect_harness, tmp_path_factory):
    """Run a (lr 1e-4): SIGKILLed after rollout 2 was logged (last checkpoint: 1), then the same command again.
    Run b (lr 3e-4): one plain run. Both in one work dir (one SQLite store), experiment `cmp`."""
    tmp = tmp_path_factory.mktemp("sqlite_runs")
    cfg_a = tiny_yaml(tmp, run_name="lr-1e-4", save=str(tmp / "ckpt-a"), save_interval=2,
                      summary_json=str(tmp / "a.json"))
    cmd_a = train_cmd(cfg_a, "--sglang-api-key", SECRET)
    uri = f"sqlite:///{tmp / 'work' / 'mlflow.db'}"
    from engine import checkpoint

    log = (tmp / "a-first.log").open("w")
    proc = subprocess.Popen(cmd_a, cwd=tmp, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        # kill once rollout 2 (after the checkpoint of rollout 1) reached MLflow: its samples file is the cheapest
        # sign to poll (a file beside the store); pack, train and sync of 2 and all of 3 remain before save 3
        def rollout_2_logged():
            if checkpoint.read_marker(tmp / "ckpt-a") != 1:
                return None
            hits = list((tmp / "work" / "mlartifacts").glob("*/artifacts/samples/rollout_0000002.jsonl"))
            return hits[0].parts[-4] if hits else None  # mlartifacts/<run id>/artifacts/…

        first_run_id = wait_for(rollout_2_logged, 600, "rollout 2 in MLflow", proc, poll=0.05)
    finally:
        kill_group(proc)
    killed_at_marker = checkpoint.read_marker(tmp / "ckpt-a")
    second = subprocess.run(cmd_a, cwd=tmp, env=child_env(), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    # the same flags as run a except --lr (and the names and paths of its own)
    cfg_b = tiny_yaml(tmp, run_name="lr-3e-4", lr=3e-4, save=str(tmp / "ckpt-b"), save_interval=2,
                      summary_json=str(tmp / "b.json"))
    third = subprocess.run(train_cmd(cfg_b, "--sglang-api-key", SECRET), cwd=tmp, env=child_env(), capture_output=True, text=True, timeout=900)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    return {"uri": uri, "tmp": tmp, "first_run_id": first_run_id, "killed_at_marker": killed_at_marker,
            "a": json.loads((tmp / "a.json").read_text()), "b": json.loads((tmp / "b.json").read_text()),
            "resume_stdout": second.stdout}


def test_killed_and_resumed_run_is_one_mlflow_run(sqlite_runs):
    from mlflow.tracking import MlflowClient

    from engine.tracking.metrics import describe

    r = sqlite_runs
    assert r["killed_at_marker"] == 1  # killed after rollout 2 was logged, before the save of rollout 3
    a = r["a"]
    assert a["mlflow_run_id"] == r["first_run_id"] and a["rollouts"] == 4 and a["mlflow_lost"] is None
    client = MlflowClient(r["uri"])
    run = client.get_run(a["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id], filter_string="attributes.run_name = 'lr-1e-4'")) == 1

    # rollouts 2 (and maybe 3's first metrics) were logged twice; every step 0..3 is there
    hist = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert sorted({m.step for m in hist}) == [0, 1, 2, 3] and [m.step for m in hist].count(2) == 2
    for key in STAGE_METRICS:
        assert {m.step for m in client.get_metric_history(run.info.run_id, key)} == {0, 1, 2, 3}, key
    assert {m.step for m in client.get_metric_history(run.info.run_id, "save/seconds")} == {1, 3}
    # no KL term: the reference forward (and train/kl) only on the run's first step, for RF01
    assert {m.step for m in client.get_metric_history(run.info.run_id, "train/kl")} == {0}
    undocumented = [k for k in run.data.metrics if describe(k) is None]
    assert not undocumented, f"add these to engine/tracking/metrics.py METRICS: {undocumented}"
    assert any(k.startswith("system/cpu") for k in run.data.metrics)

    # params and tags
    p, t = run.data.params, run.data.tags
    assert p["lr"] == "0.0001" and p["rollout_batch_size"] == "4" and p["derived/global_batch_size"] == "16"
    assert json.loads(p["sglang_args"]) == {"api-key": "<redacted>"}
    assert t["rollflow.resumed_from"] == "1" and json.loads(t["rollflow.resume.1"])["from_iteration"] == 1
    assert "rollflow.resume.2" not in t
    assert t["prefect.flow_run_id"] == a["flow_run_id"] and a["flow_run_id"] in t["prefect.flow_run_url"]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert t["mlflow.source.git.commit"] == commit.strip()
    from engine.config.cli import parse_args

    cfg = parse_args(["--config", str(r["tmp"] / "lr-1e-4.yaml"), "--sglang-api-key", SECRET])
    assert t["rollflow.config_hash"] == cfg.config_hash() and t["rollflow.dataset"] == BUNDLED_TRAIN
    assert t["rollflow.save"] == str(r["tmp"] / "ckpt-a") and t["rollflow.model"] == cfg.hf_checkpoint
    assert t["rollflow.checkpoint.latest"] == str(r["tmp"] / "ckpt-a" / "iter_0000003")

    # artifacts: config, samples every 2 rollouts and the last, plots, checkpoint records
    art_dir = Path(run.info.artifact_uri.removeprefix("file://"))
    files = sorted(str(f.relative_to(art_dir)) for f in art_dir.rglob("*") if f.is_file())
    assert files == ["checkpoints/iter_0000001.json", "checkpoints/iter_0000003.json", "config.yaml",
                     "plots/response_length.png", "plots/reward.png", "plots/stage_seconds.png",
                     "samples/rollout_0000000.json", "samples/rollout_0000000.jsonl", "samples/rollout_0000002.json",
                     "samples/rollout_0000002.jsonl", "samples/rollout_0000003.json", "samples/rollout_0000003.jsonl"]
    # the sample tables, in MLflow's table view: those of the killed attempt and of the resume
    assert [x["path"] for x in json.loads(t["mlflow.loggedArtifacts"])] == [
        f"samples/rollout_000000{i}.json" for i in (0, 2, 3)]
    rows = [json.loads(x) for x in (art_dir / "samples/rollout_0000002.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {x["rollout_id"] for x in rows} == {2}  # B·n = 4·4
    assert json.loads((art_dir / "checkpoints/iter_0000003.json").read_text())["uri"] == t["rollflow.checkpoint.latest"]

    # nothing secret anywhere in MLflow
    blobs = [json.dumps(p), json.dumps(t)] + [(art_dir / f).read_bytes().decode("latin-1") for f in files]
    assert not any(SECRET in b for b in blobs)
    assert SECRET not in r["resume_stdout"]
    assert "rollflow: 2 rollouts in" in r["resume_stdout"] and "(resumed at rollout 2 of 4)" in r["resume_stdout"]


def test_compare_shows_one_value_per_step_and_lr_as_the_difference(sqlite_runs, tmp_path, capsys):
    from engine import checkpoint
    from flows.cli import main

    r = sqlite_runs
    png = tmp_path / "cmp.png"
    assert main(["compare", "cmp", "--mlflow-tracking-uri", r["uri"], "--format", "json", "--plot", str(png)]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["differing_params"] == ["lr"]
    runs = {x["run_name"]: x for x in c["runs"]}
    assert set(runs) == {"lr-1e-4", "lr-3e-4"}
    assert runs["lr-1e-4"]["params"] == {"lr": "0.0001"} and runs["lr-3e-4"]["params"] == {"lr": "0.0003"}
    reward_a = runs["lr-1e-4"]["metrics"]["rollout/reward_mean"]
    assert [s for s, _ in reward_a["series"]] == [0, 1, 2, 3] and reward_a["redone"] >= 1
    # each step's value is the one the finished run itself recorded (its last checkpoint carries its history)
    history = checkpoint.load_manifest(r["tmp"] / "ckpt-a", 3)["history"]["rollout/reward_mean"]
    assert {str(s): v for s, v in reward_a["series"]} == history
    for x in runs.values():
        assert x["metrics"]["rollout/reward_mean"]["points"] == 4
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    assert main(["compare", r["a"]["mlflow_run_id"], "lr-3e-4", "--mlflow-tracking-uri", r["uri"]]) == 0
    table = capsys.readouterr().out
    assert "params that differ" in table and "\nlr " in table


# ---- a real MLflow server behind a gate -------------------------------------------------------------------------
free_port = free_loopback_port  # engine/rollout/ports.py


class Gate:
    """127.0.0.1:port forwards to `target` once opened; before that nothing listens (connection refused)."""

    def __init__(self, target: int):
        self.port, self.target, self.sock = free_port(), target, None

    def open(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        if self.sock:
            self.sock.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    log = (tmp / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp / 'server.db'}", "--artifacts-destination",
                             str(tmp / "artifacts"), "--workers", "1", "--allowed-hosts", "127.0.0.1:*,localhost:*"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def healthy():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                    return b"200" in s.recv(100)
            except OSError:
                return False

        wait_for(healthy, 180, "mlflow server /health", proc)
        yield port
    finally:
        kill_group(proc)


def test_run_started_while_mlflow_was_down_trains_and_delivers_everything(prefect_harness, shared_ray,
                                                                          mlflow_server, small_cfg,
                                                                           tmp_path):
    from mlflow.tracking import MlflowClient

    from engine import checkpoint
    from engine.tracking import TrackingWarning
    from flows.train import rl_train

    gate = Gate(mlflow_server)
    uri = f"http://127.0.0.1:{gate.port}"
    cfg = small_cfg(num_rollout=3, save_interval=1, eval_prompt_data="", mlflow_tracking_uri=uri,
                    mlflow_retry_interval=1.0, experiment_name="gated", run_name="gated", system_metrics_interval=1.0)
    # open the gate once the first checkpoint exists: rollout 0 ran with MLflow unreachable
    opener = threading.Thread(target=lambda: (wait_for(lambda: checkpoint.read_marker(cfg.save) is not None, 600,
                                                       "the first checkpoint"), gate.open()), daemon=True)
    opener.start()
    try:
        with pytest.warns(TrackingWarning, match="failed while"):
            result = rl_train(cfg)
    finally:
        gate.close()
    assert result["rollouts"] == 3 and result["mlflow_lost"] is None and result["mlflow_run_id"]
    client = MlflowClient(f"http://127.0.0.1:{mlflow_server}")
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "gated"
    assert run.data.params["lr"] == "0.0001" and run.data.tags["prefect.flow_run_id"] == result["flow_run_id"]
    for key in STAGE_METRICS:  # buffered points arrive exactly once: one point per rollout
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [0, 1, 2], key
    names = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "plots", "samples", "checkpoints"} <= names
    assert {f.path for f in client.list_artifacts(run.info.run_id, "checkpoints")} == {
        f"checkpoints/iter_{i:07d}.json" for i in range(3)}
    assert result["mlflow_run_url"] == (f"{uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
                                        "/model-metrics?workflowType=machine_learning")


def test_run_with_mlflow_down_throughout_still_trains_and_says_what_was_lost(prefect_harness, shared_ray,
                                                                             small_cfg, tmp_path):
    from engine import checkpoint
    from engine.tracking import TrackingWarning
    from flows.train import rl_train

    cfg = small_cfg(num_rollout=2, eval_prompt_data="", mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}",
                    mlflow_retry_interval=0.0, mlflow_timeout=2)
    t0 = time.time()
    with pytest.warns(TrackingWarning) as warned:
        result = rl_train(cfg)
    assert result["rollouts"] == 2 and checkpoint.read_marker(cfg.save) == 1
    assert result["mlflow_run_id"] is None
    lost = result["mlflow_lost"]
    assert "the run itself (never created)" in lost and "metric points" in lost and "Connection refused" in lost
    assert any("did not receive" in str(w.message) for w in warned)  # said at the end of the run
    assert time.time() - t0 < 600


def test_a_run_failing_preflight_is_a_failed_mlflow_run_with_the_doctor_report(prefect_harness, shared_ray,
                                                                               small_cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    from engine.doctor import ConfigError
    from engine.tracking import default_tracking_uri
    from flows.train import rl_train

    (tmp_path / "not-a-checkpoint").mkdir()
    cfg = small_cfg(load=str(tmp_path / "not-a-checkpoint"), run_name="bad-load", system_metrics_interval=0)
    with pytest.raises(ConfigError) as e:
        rl_train(cfg)
    assert "RF01" in e.value.codes
    client = MlflowClient(default_tracking_uri(cfg.work_dir, None))
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.run_name == "bad-load" and run.info.status == "FAILED"
    assert run.data.tags["rollflow.failure"] == "RF01" and run.data.params["load"] == cfg.load
    report = Path(client.download_artifacts(run.info.run_id, "doctor-report.md", str(tmp_path))).read_text()
    assert "[RF01 error]" in report and "not-a-checkpoint" in report


def test_secrets_never_reach_prefects_database_mlflow_or_the_logs(prefect_harness, shared_ray, small_cfg, tmp_path,
                                                                   caplog):
    """Issue 24: --sglang-api-key and the password of --mlflow-tracking-uri were stored in plain text in the flow
    run's parameters (8 rows of Prefect's database). The run here trains with both; then every byte of Prefect's
    database, the run's logs and files is searched for them."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    from engine.tracking import TrackingWarning
    from flows.train import rl_train

    password, key = "pw-" + "Z9x" * 8, "key-" + "M4q" * 8
    uri = f"http://rollflow:{password}@127.0.0.1:{free_port()}"  # MLflow is down: the password is only carried
    cfg = small_cfg(num_rollout=1, eval_prompt_data="", mlflow_tracking_uri=uri, mlflow_retry_interval=0.0,
                    mlflow_timeout=2, sglang_args={"api-key": key}, run_name="secretive")
    with caplog.at_level("DEBUG"), pytest.warns(TrackingWarning):
        result = rl_train(cfg)
    assert result["rollouts"] == 1

    async def stored_parameters():
        async with get_client() as client:
            return (await client.read_flow_run(result["flow_run_id"])).parameters

    params = asyncio.run(stored_parameters())
    assert params["cfg"]["sglang_args"] == {"api-key": "<redacted>"}
    assert params["cfg"]["mlflow_tracking_uri"] == "http://rollflow:<redacted>@127.0.0.1:" + uri.rsplit(":", 1)[1]
    db = Path(PREFECT_API_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    blobs = {p.name: p.read_bytes() for p in db.parent.glob(db.name + "*")}  # the database and its WAL
    blobs.update({str(p): p.read_bytes() for p in Path(cfg.work_dir).rglob("*") if p.is_file()})
    blobs.update({str(p): p.read_bytes() for p in Path(cfg.save).rglob("*") if p.is_file()})
    blobs["log"] = caplog.text.encode() + json.dumps(result).encode()
    assert len(blobs) > 5 and any(b"secretive" in b for b in blobs.values())  # the search does see this run
    for secret in (password, key):
        leaked = [name for name, b in blobs.items() if secret.encode() in b]
        assert not leaked, f"{secret} in {leaked}"
    # a flow run retried from the UI gets the masked values: a clear error, not a wrong password
    from flows.params import run_config

    with pytest.raises(Exception, match="MLFLOW_TRACKING_PASSWORD"):
        run_config(params["cfg"], None)
