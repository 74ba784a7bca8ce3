"""engine.tracking without training: secrets, buffering while MLflow is down, resume tags, the real SQLite store,
metric docs, artifacts, system metrics, and `rollflow compare` (pure parts and CLI)."""
from __future__ import annotations

import json
import os
import re
import struct
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import RunConfig
from engine.tracking import Tracker, TrackingWarning, artifact_location_for
from engine.tracking.secrets import REDACTED, is_secret_key, redact, redact_text


# ---- secrets ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, secret", [
    ("api_key", True), ("api-key", True), ("hf_token", True), ("client_secret", True), ("password", True),
    ("aws_secret_access_key", True), ("AUTHORIZATION", True), ("credentials", True), ("wandb_key", True),
    # flags whose names merely contain "token" or "key" are not secrets
    ("rollout_stop_token_ids", False), ("input_key", False), ("label_key", False), ("max_tokens_per_gpu", False),
    ("tokenizer", False), ("kl_loss_type", False),
])
def test_secret_key_names(key, secret):
    assert is_secret_key(key) is secret


def test_run_params_never_hold_secrets_and_keep_the_rest():
    from engine.tracking.record import run_params

    hf, sk = "hf_" + "a1B2" * 9, "sk-" + "Zy9" * 8
    cfg = RunConfig(rollout_engine="sglang", weight_sync_method="disk",
                    sglang_args={"api-key": "plain-words-not-a-pattern", "model-path": f"/m?token={hf}"},
                    mlflow_tracking_uri="https://alice:hunter2pass@mlflow.example.com/", run_name=f"run {sk}",
                    rollout_stop_token_ids=[7, 9], input_key="question", use_wandb=True,
                    wandb_key="plain-wandb-key-no-pattern")
    params = run_params(cfg)
    text = json.dumps(params)
    for secret in ("plain-words-not-a-pattern", hf, "hunter2pass", sk, "plain-wandb-key-no-pattern"):
        assert secret not in text, secret
    assert params["sglang_args"]["api-key"] == REDACTED
    assert params["mlflow_tracking_uri"] == f"https://alice:{REDACTED}@mlflow.example.com/"  # user and host kept
    assert params["rollout_stop_token_ids"] == [7, 9] and params["input_key"] == "question"
    # B·n = 8·8 = 64 samples per rollout, one step → G = 64; train_iters = 30 rollouts · 1 = 30
    assert (params["derived/global_batch_size"], params["derived/train_iters"]) == (64, 30)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["hf_", "ghp_", "sk-"]), st.text("abcdefXYZ0123456789", min_size=36, max_size=48),
       st.text(" =:/\"'\n", max_size=3), st.text(" =:/\"'\n", max_size=3))
def test_secret_looking_values_are_redacted_anywhere(prefix, body, before, after):
    token = prefix + body
    out = redact_text(f"{before}{token}{after}")
    assert token not in out and REDACTED in out
    if prefix != "sk-":  # distinctive prefixes are found even glued to a word; "task-…" is not an sk- key
        assert token not in redact_text(f"x{token}")
    assert redact_text("task-" + body) == "task-" + body


def test_redact_walks_nested_dicts_and_lists():
    got = redact({"a": [{"password": "p"}, "Bearer abc.def"], "n": 3, "token": None})
    assert got == {"a": [{"password": REDACTED}, REDACTED], "n": 3, "token": None}


# ---- a hand-written MLflow client that can be down -------------------------------------------------------------
class FakeMlflow:
    """The MlflowClient calls Tracker makes, in memory; `down = True` makes every call raise ConnectionError."""

    def __init__(self):
        self.down, self.calls = False, 0
        self.experiments: dict[str, str] = {}
        self.experiment_tags: dict[str, dict[str, str]] = {}
        self.runs: dict[str, SimpleNamespace] = {}
        self.metrics: list = []
        self.artifacts: dict[str, bytes] = {}

    def _hit(self):
        self.calls += 1
        if self.down:
            raise ConnectionError("connection refused")

    def add_run(self, params=None, tags=None, run_name=None) -> str:
        rid = f"run{len(self.runs)}"
        self.runs[rid] = SimpleNamespace(info=SimpleNamespace(run_id=rid, start_time=1_000, status="RUNNING",
                                                              run_name=run_name or f"name-of-{rid}"),
                                         data=SimpleNamespace(params=dict(params or {}), tags=dict(tags or {})))
        return rid

    def get_experiment_by_name(self, name):
        self._hit()
        eid = self.experiments.get(name)
        return SimpleNamespace(experiment_id=eid, tags=self.experiment_tags[eid]) if eid is not None else None

    def create_experiment(self, name, artifact_location=None, tags=None):
        self._hit()
        self.experiments[name] = str(len(self.experiments))
        self.experiment_tags[self.experiments[name]] = dict(tags or {})
        return self.experiments[name]

    def set_experiment_tag(self, eid, key, value):
        self._hit()
        self.experiment_tags[eid][key] = value

    def get_run(self, run_id):
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

        self._hit()
        if run_id not in self.runs:
            raise MlflowException(f"Run '{run_id}' not found", error_code=RESOURCE_DOES_NOT_EXIST)
        return self.runs[run_id]

    def create_run(self, experiment_id, run_name=None):
        self._hit()
        return self.runs[self.add_run(run_name=run_name)]

    def search_runs(self, experiment_ids, filter_string="", max_results=1000):
        self._hit()
        key, value = re.fullmatch(r"tags\.`(.+)` = '(.*)'", filter_string).groups()
        return [r for r in self.runs.values() if r.data.tags.get(key) == value][:max_results]

    def update_run(self, run_id, status):
        self._hit()
        self.runs[run_id].info.status = status

    def set_terminated(self, run_id, status):
        self.update_run(run_id, status)

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self._hit()
        d = self.runs[run_id].data
        for p in params:
            assert d.params.get(p.key, p.value) == p.value, f"param {p.key} changed: MLflow would refuse"
            d.params[p.key] = p.value
        d.tags.update({t.key: t.value for t in tags})
        self.metrics += [(m.key, m.step, m.value) for m in metrics]

    def log_artifact(self, run_id, local_path, artifact_path=None):
        self._hit()
        name = Path(local_path).name if artifact_path is None else f"{artifact_path}/{Path(local_path).name}"
        self.artifacts[name] = Path(local_path).read_bytes()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make_tracker(tmp_path, fake, clock, **kw) -> Tracker:
    return Tracker("http://127.0.0.1:9/", "exp", outbox=tmp_path / "outbox", retry_interval=30.0,
                   client_factory=lambda uri: fake, clock=clock, **kw)


def test_down_at_start_buffers_everything_and_sends_it_when_mlflow_answers(tmp_path):
    fake, clock = FakeMlflow(), Clock()
    fake.down = True
    t = make_tracker(tmp_path, fake, clock)
    with pytest.warns(TrackingWarning, match="training continues"):
        assert t.start("r", None, tags={"rollflow.model": "m"}, params={"lr": 0.1}) is None
    for step in range(3):
        t.log_metrics({"rollout/reward_mean": step / 10, "train/loss": 1.0}, step=step)
    t.log_text("a: 1\n", "config.yaml")
    assert t.lost == {"run": 1, "params": 1, "tags": 1, "metric_points": 6, "artifacts": 1}

    fake.down = False
    clock.t = 31.0  # past the retry interval: the next call sends the buffer
    t.log_metrics({"rollout/reward_mean": 0.3}, step=3)
    assert t.lost == {} and not t.down
    (run,) = fake.runs.values()
    assert run.data.params == {"lr": "0.1"} and run.data.tags["rollflow.model"] == "m"
    assert sorted(s for k, s, _ in fake.metrics if k == "rollout/reward_mean") == [0, 1, 2, 3]
    assert fake.artifacts == {"config.yaml": b"a: 1\n"}


def test_while_down_mlflow_is_tried_once_per_retry_interval(tmp_path):
    fake, clock = FakeMlflow(), Clock()
    t = make_tracker(tmp_path, fake, clock)
    t.start("r", None, tags={}, params={})
    fake.down = True
    with pytest.warns(TrackingWarning):
        t.log_metrics({"m": 1.0}, step=0)
    calls = fake.calls
    for step in range(1, 50):  # 49 rollouts inside the interval: no request at all
        clock.t = step * 0.5
        t.log_metrics({"m": 1.0}, step=step)
    assert fake.calls == calls
    clock.t = 30.5
    t.log_metrics({"m": 1.0}, step=50)
    assert fake.calls == calls + 1  # one attempt, which failed again
    assert t.lost["metric_points"] == 51


def test_background_mode_sends_off_the_callers_thread_and_drain_and_end_wait(tmp_path):
    """The stages' writes return at once; the sender thread makes the MLflow calls and runs deferred work (plots);
    drain() (before a checkpoint marker) and end() return only once everything logged before them is sent."""
    import threading

    fake, clock = FakeMlflow(), Clock()
    callers: set[str] = set()
    gate, entered = threading.Event(), threading.Event()  # holds the sender inside a slow log_batch
    plain = fake.log_batch

    def slow_log_batch(*a, **k):
        callers.add(threading.current_thread().name)
        entered.set()
        gate.wait(10)
        return plain(*a, **k)

    t = make_tracker(tmp_path, fake, clock, background=True)
    t.start("r", None, tags={}, params={})  # synchronous: the run id is known at once
    assert t.run_id is not None
    fake.log_batch = slow_log_batch
    t0 = time.monotonic()
    for step in range(5):
        t.log_metrics({"m": float(step)}, step=step)
    t.defer(lambda: t.log_text("plot", "plots/x.txt"))
    assert time.monotonic() - t0 < 2  # not one of them waited for the held log_batch
    assert entered.wait(10)  # the sender thread is in log_batch now, holding what it took
    threading.Timer(0.3, gate.set).start()
    assert t.drain() and sorted(s for k, s, _ in fake.metrics if k == "m") == [0, 1, 2, 3, 4]
    assert fake.artifacts["plots/x.txt"] == b"plot"
    assert "rollflow-mlflow-sender" in callers  # the held call ran there, not in the thread that logged
    t.log_metrics({"m": 5.0}, step=5)
    t.defer(lambda: t.log_text("late", "plots/y.txt"))
    t.end()
    assert [s for k, s, _ in fake.metrics if k == "m"][-1] == 5 and fake.artifacts["plots/y.txt"] == b"late"
    assert next(iter(fake.runs.values())).info.status == "FINISHED" and t.lost == {}


def test_send_interval_batches_the_stages_writes_and_drain_sends_at_once(tmp_path):
    """With send_interval the sender sends at most once per interval: the writes of several stages go out as one
    log_batch (SQLite's per-batch cost is most of MLflow's); drain() does not wait for the interval."""
    fake, clock = FakeMlflow(), Clock()
    batches: list[int] = []
    plain = fake.log_batch

    def counting(run_id, metrics=(), *a, **k):
        if metrics:
            batches.append(len(metrics))
        return plain(run_id, metrics, *a, **k)

    t = make_tracker(tmp_path, fake, clock, background=True, send_interval=0.5)
    t.start("r", None, tags={}, params={})
    fake.log_batch = counting
    t.log_metrics({"m": 0.0}, step=0)  # the first send goes out at once
    deadline = time.monotonic() + 5
    while not batches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batches == [1]
    for step in range(1, 6):  # within the interval: held, then sent together
        t.log_metrics({"m": float(step)}, step=step)
        time.sleep(0.02)
    assert batches == [1]
    deadline = time.monotonic() + 5
    while len(batches) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batches == [1, 5]
    t.log_metrics({"m": 6.0}, step=6)
    t0 = time.monotonic()
    assert t.drain() and time.monotonic() - t0 < 0.4  # a checkpoint does not wait for the interval
    assert sorted(s for k, s, _ in fake.metrics if k == "m") == list(range(7))
    t.end()


def test_bookkeeping_threads_lower_only_their_own_priority():
    """engine.background: the calling thread gets nice 10 (Linux); the process's other threads keep theirs."""
    import os
    import sys
    import threading

    from engine.background import BACKGROUND_NICE, lower_this_thread

    if not sys.platform.startswith("linux"):
        pytest.skip("thread priorities are set per thread on Linux only")
    seen = {}

    def body():
        seen["ok"] = lower_this_thread()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    th = threading.Thread(target=body)
    th.start()
    th.join()
    assert seen == {"ok": True, "nice": max(BACKGROUND_NICE, before)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_lower_process_lowers_every_thread_of_a_child_it_started():
    """engine.background.lower_process (the ephemeral Prefect API server): all of the process's threads."""
    import os
    import subprocess
    import sys

    from engine.background import BACKGROUND_NICE, lower_process

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread priorities: Linux only")
    code = "import threading, time; [threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(2)]; print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) >= 3 and lower_process(child.pid) == len(tids)
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {BACKGROUND_NICE}
        assert lower_process(2**22 + 12345) == 0  # no such process: nothing to do, no error
    finally:
        child.kill()
        child.wait()


def test_end_says_what_was_never_sent_and_keeps_artifact_copies(tmp_path):
    fake, clock = FakeMlflow(), Clock()
    fake.down = True
    t = make_tracker(tmp_path, fake, clock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackingWarning)
        t.start("r", None, tags={"a": "b"}, params={"lr": 1})
        t.log_metrics({"m": 1.0, "n": 2.0}, step=0)
        t.log_bytes(b"png", "plots/reward.png")
        t.log_bytes(b"png2", "plots/reward.png")  # a newer plot replaces the pending one
        t.end("FINISHED")
    report = t.lost_report()
    assert "the run itself (never created)" in report and "2 metric points" in report
    assert "1 artifacts" in report and str(tmp_path / "outbox") in report
    assert "ConnectionError: connection refused" in report and "127.0.0.1:9" in report
    assert [p.read_bytes() for p in (tmp_path / "outbox").rglob("reward.png")] == [b"png2"]


def test_a_full_buffer_drops_and_counts_points(tmp_path):
    fake, clock = FakeMlflow(), Clock()
    fake.down = True
    t = make_tracker(tmp_path, fake, clock, max_buffered=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrackingWarning)
        t.start("r", None, tags={}, params={})
        for step in range(3):  # 3 steps × 2 metrics = 6 points, room for 5
            t.log_metrics({"a": 1.0, "b": 2.0}, step=step)
    assert t.dropped == 1 and t.lost["metric_points"] == 6
    fake.down, clock.t = False, 100.0
    assert t.flush()
    assert len(fake.metrics) == 5 and t.lost == {"metric_points": 1}


def test_resume_continues_the_run_tags_each_resume_and_never_rewrites_params(tmp_path):
    fake, clock = FakeMlflow(), Clock()
    rid = fake.add_run(params={"lr": "0.1", "num_rollout": "4"}, tags={"rollflow.resume.1": "{}"})
    fake.experiments["exp"], fake.experiment_tags["0"] = "0", {}
    t = make_tracker(tmp_path, fake, clock)
    with pytest.warns(TrackingWarning, match="keeps its first values of \\['num_rollout'\\]"):
        got = t.start("r", rid, tags={}, params={"lr": 0.1, "num_rollout": 6, "new_flag": 1},
                      resume={"from_iteration": 3})
    assert got == rid and len(fake.runs) == 1
    data = fake.runs[rid].data
    assert data.params == {"lr": "0.1", "num_rollout": "4", "new_flag": "1"}
    tag = json.loads(data.tags["rollflow.resume.2"])  # the second resume of this run
    assert tag == {"from_iteration": 3, "changed_params": {"num_rollout": ["4", "6"]}}


def test_a_retried_flow_run_without_checkpoint_continues_its_mlflow_run(tmp_path):
    fake, clock = FakeMlflow(), Clock()
    first = make_tracker(tmp_path, fake, clock)
    rid = first.start("r", None, tags={"prefect.flow_run_id": "fr-1"}, params={"lr": 1}, flow_run_id="fr-1")
    first.end("FAILED")
    again = make_tracker(tmp_path, fake, clock)  # Prefect retries the flow run: same id, no checkpoint yet
    assert again.start("r", None, tags={"prefect.flow_run_id": "fr-1"}, params={"lr": 1}, flow_run_id="fr-1") == rid
    assert fake.runs[rid].info.status == "RUNNING"
    assert json.loads(fake.runs[rid].data.tags["rollflow.resume.1"])["from_iteration"] is None
    other = make_tracker(tmp_path, fake, clock)  # another flow run of the same config: its own MLflow run
    assert other.start("r", None, tags={}, params={"lr": 1}, flow_run_id="fr-2") != rid


def test_a_manifest_run_missing_from_the_store_starts_a_new_run(tmp_path):
    fake, clock = FakeMlflow(), Clock()
    t = make_tracker(tmp_path, fake, clock)
    with pytest.warns(TrackingWarning, match="does not exist"):
        rid = t.start("r", "gone", tags={}, params={})
    assert rid in fake.runs and rid != "gone"


# ---- the real SQLite store ----------------------------------------------------------------------------------
def _log_run(uri, tmp_path, name, lr, rewards_by_attempt, experiment="exp"):
    """A run whose attempts each log reward/loss for some steps (a later attempt redoes steps)."""
    t = Tracker(uri, experiment, outbox=tmp_path / f"outbox-{name}", artifact_location=artifact_location_for(uri))
    t.start(name, None, tags={}, params={"lr": lr, "work_dir": f"/w/{name}", "seed": 1})
    for attempt in rewards_by_attempt:
        for step, r in attempt.items():
            t.log_metrics({"rollout/reward_mean": r, "train/loss": 1 - r}, step=step)
    t.log_text(f"name: {name}\n", "config.yaml")
    t.end()
    return t.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Read-only for the tests that use it (one store: MLflow's schema migration takes seconds per database)."""
    tmp_path = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # run a: killed after step 2, resumed from the checkpoint of step 1: steps 2 and 3 logged again
    a = _log_run(uri, tmp_path, "a", 3e-4, [{0: 0.1, 1: 0.2, 2: 0.25}, {2: 0.3, 3: 0.5}])
    b = _log_run(uri, tmp_path, "b", 1e-5, [{0: 0.1, 1: 0.15, 2: 0.12, 3: 0.2}])
    return uri, a, b


def test_sqlite_store_keeps_artifacts_beside_the_database(store):
    uri, a, b = store
    db_dir = Path(uri[len("sqlite:///"):]).parent
    assert (db_dir / "mlartifacts" / a / "artifacts" / "config.yaml").read_text() == "name: a\n"
    assert not (db_dir / "outbox-a").exists()  # the outbox is emptied once everything was sent


def test_the_experiment_opens_in_mlflows_model_training_layout(store, tmp_path):
    from mlflow.tracking import MlflowClient

    from engine.tracking import EXPERIMENT_KIND

    uri = store[0]
    client = MlflowClient(uri)
    assert client.get_experiment_by_name("exp").tags[EXPERIMENT_KIND] == "custom_model_development"
    bare = client.create_experiment("made-by-hand")  # an experiment without the tag gets it on first use
    _log_run(uri, tmp_path, "c", 1e-4, [{0: 0.1}], experiment="made-by-hand")
    assert client.get_experiment(bare).tags[EXPERIMENT_KIND] == "custom_model_development"


def test_compare_counts_redone_steps_once_and_lists_the_differing_param(store):
    from mlflow.tracking import MlflowClient

    from engine.tracking.compare import compare

    uri, a, b = store
    c = compare(MlflowClient(uri), ["exp"], ["rollout/reward_mean", "train/loss"], uri=uri)
    assert c["differing_params"] == ["lr"]  # work_dir differs too but only names a place
    ra, rb = c["runs"]
    assert (ra["run_id"], rb["run_id"]) == (a, b)
    rew = ra["metrics"]["rollout/reward_mean"]
    # 5 points logged for steps 0,1,2,2,3 → 4 steps, step 2 = the later 0.3
    assert rew["series"] == [[0, 0.1], [1, 0.2], [2, 0.3], [3, 0.5]] and (rew["points"], rew["redone"]) == (4, 1)
    assert (rew["final"], rew["best"], rew["best_step"]) == (0.5, 0.5, 3)
    loss_b = rb["metrics"]["train/loss"]  # lower is better: best = 1 - 0.2 = 0.8 at step 3
    assert loss_b["best_step"] == 3 and loss_b["best"] == pytest.approx(0.8)
    assert ra["params"] == {"lr": "0.0003"} and rb["params"] == {"lr": "1e-05"}


def test_compare_resolves_run_ids_and_names_and_rejects_unknown_refs(store):
    from mlflow.tracking import MlflowClient

    from engine.doctor import ConfigError
    from engine.tracking.compare import compare

    uri, a, b = store
    client = MlflowClient(uri)
    assert [r["run_id"] for r in compare(client, [b, "a"], uri=uri)["runs"]] == [b, a]
    with pytest.raises(ConfigError, match="'nope' is not a run id"):
        compare(client, ["nope"], uri=uri)
    with pytest.raises(ConfigError, match="rollout/reward_man → did you mean rollout/reward_mean"):
        compare(client, ["exp"], ["rollout/reward_man"], uri=uri)


def test_compare_cli_table_csv_json_and_plot(store, tmp_path, capsys):
    import csv

    from flows.cli import main

    uri, a, b = store
    assert main(["compare", "exp", "--mlflow-tracking-uri", uri]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^lr\s+0\.0003\s+1e-05$", table, re.M)
    assert re.search(r"^rollout/reward_mean\s+a\s+0\.5\s+3\s+0\.5 \(max\)\s+3\s+4\s+1$", table, re.M)

    assert main(["compare", "exp", "--mlflow-tracking-uri", uri, "--format", "csv", "--metrics",
                 "rollout/reward_mean"]) == 0
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert [(r["run_name"], r["param:lr"], r["rollout/reward_mean:final"]) for r in rows] == [
        ("a", "0.0003", "0.5"), ("b", "1e-05", "0.2")]

    png = tmp_path / "cmp.png"
    assert main(["compare", a, b, "--mlflow-tracking-uri", uri, "--format", "json", "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["run_name"] for r in data["runs"]] == ["a", "b"]
    assert_png(png.read_bytes(), min_width=400)


def test_compare_cli_without_a_store_says_where_it_looked(tmp_path, capsys):
    from flows.cli import main

    assert main(["compare", "exp", "--work-dir", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no MLflow store at" in err and "--work-dir" in err
    assert not (tmp_path / "nothing").exists()  # and did not create one


# ---- pure parts ------------------------------------------------------------------------------------------------
def test_latest_per_step_and_summaries():
    from engine.tracking.compare import differing, latest_per_step, summarize

    P = lambda step, value, ts: SimpleNamespace(step=step, value=value, timestamp=ts)  # noqa: E731
    # step 1 logged at t=10 and again (resumed run) at t=50: the later value wins, whatever the list order
    assert latest_per_step([P(1, 0.9, 50), P(0, 0.1, 5), P(1, 0.4, 10)]) == {0: 0.1, 1: 0.9}
    s = {0: 3.0, 1: 1.0, 2: 1.0, 3: 2.0}
    assert summarize(s, "min") == {"final": 2.0, "final_step": 3, "best": 1.0, "best_step": 1}
    assert summarize(s, "max")["best_step"] == 0 and summarize(s, None)["best"] is None
    assert differing([{"lr": "1", "x": "a"}, {"lr": "2", "x": "a"}, {"x": "a", "y": "1"}]) == ["lr", "y"]


def test_every_documented_name_and_template_matches():
    from engine.tracking.metrics import better, describe

    assert describe("rollout/reward_format_mean").name == "rollout/reward_<key>_mean"
    assert describe("system/gpu_3_memory_usage_megabytes").name == "system/gpu_<i>_memory_usage_megabytes"
    assert describe("train/kl").better is None and better("train/loss") == "min"
    assert describe("train/unheard_of") is None and better("train/unheard_of") == "max"


def test_readme_metric_table_matches_the_code():
    from engine.tracking.metrics import END, START, metrics_markdown

    readme = (Path(__file__).parent.parent / "docs" / "mlflow.md").read_text()
    block = readme.split(START, 1)[1].split(END, 1)[0]
    assert block.strip() == metrics_markdown().strip(), "run: python -m engine.tracking.metrics --write docs/mlflow.md"


def assert_png(data: bytes, min_width: int = 100) -> None:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width >= min_width and height >= 100


def test_run_plots_are_pngs_of_the_history(tmp_path):
    from engine.tracking.artifacts import run_plots

    hist = {"rollout/reward_mean": {i: i / 10 for i in range(12)}, "rollout/reward_std": {i: 0.1 for i in range(12)},
            "rollout/response_len_mean": {i: 5.0 - i / 4 for i in range(12)},
            "rollout/response_len_max": {i: 8.0 for i in range(12)},
            "rollout/response_len_p10": {i: 2.0 for i in range(12)},
            "rollout/response_len_p90": {i: 7.0 for i in range(12)},
            "rollout/seconds": {i: 0.5 for i in range(12)}, "train/seconds": {i: 0.3 for i in range(12)},
            "save/seconds": {5: 0.2, 11: 0.2}}
    plots = run_plots(hist)
    assert sorted(plots) == ["plots/response_length.png", "plots/reward.png", "plots/stage_seconds.png"]
    for name, data in plots.items():
        assert_png(data, min_width=400)
    assert run_plots({}) == {}


def test_samples_jsonl_has_one_line_per_sample_without_token_arrays():
    from engine.samples import Sample, Status
    from engine.tracking.artifacts import samples_jsonl

    groups = [[Sample(index=g * 2 + j, group_index=g, rollout_id=4, prompt=f"1+{g}=", tokens=[1, 2, 3, 4],
                      response_length=2, response=str(g + 1), label=str(g + 1), reward=1.0, status=Status.COMPLETED,
                      metadata={"finish_reason": {"type": "stop"}}) for j in range(2)] for g in range(3)]
    rows = [json.loads(line) for line in samples_jsonl(groups).splitlines()]
    assert len(rows) == 6 and {r["rollout_id"] for r in rows} == {4}
    assert rows[5] == {**rows[5], "index": 5, "group_index": 2, "prompt": "1+2=", "response": "3", "status": "completed",
                       "prompt_length": 2, "response_length": 2}
    assert "tokens" not in rows[0] and "rollout_log_probs" not in rows[0]


def test_the_samples_table_is_what_mlflows_table_view_reads(tmp_path):
    """Tracker.log_table writes what MlflowClient.log_table would: MLflow's own load_table reads it back."""
    from mlflow.tracking import MlflowClient

    from engine.samples import Sample, Status
    from engine.tracking import LOGGED_ARTIFACTS, artifact_location_for
    from engine.tracking.artifacts import SAMPLE_COLUMNS, samples_table

    groups = [[Sample(index=g * 2 + j, group_index=g, rollout_id=4, prompt=f"1+{g}=", tokens=[1, 2, 3, 4],
                      response_length=2, response=str(g + j), label=str(g + 1), reward=float(j),
                      status=Status.COMPLETED,
                      metadata={"finish_reason": {"type": "stop"}, "weight_version": "4"}) for j in range(2)]
              for g in range(3)]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(uri, "tables", outbox=tmp_path / "outbox", artifact_location=artifact_location_for(uri))
    t.start("r", None, tags={}, params={})
    t.log_table(samples_table(groups), "samples/rollout_0000004.json")
    t.log_table(samples_table(groups), "samples/rollout_0000005.json")
    t.end()
    import mlflow

    client, before, env_before = MlflowClient(uri), mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)  # load_table searches runs through the fluent API's tracking URI
    try:
        df = client.load_table(client.get_experiment_by_name("tables").experiment_id, "samples/rollout_0000004.json",
                               run_ids=[t.run_id])
    finally:
        # set_tracking_uri also sets MLFLOW_TRACKING_URI, which every later run in this process would take as its
        # store (was: the later tests' runs went to ./mlflow.db, and one found the runs of earlier sessions there)
        mlflow.set_tracking_uri(before)
        if env_before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env_before
    assert list(df.columns)[:len(SAMPLE_COLUMNS)] == SAMPLE_COLUMNS and len(df) == 6
    assert list(df["advantage (group-normalised reward)"].round(3)) == [-0.707, 0.707] * 3  # (0 − ½) / std(0, 1)
    assert list(df["finish_reason"]) == ["stop"] * 6 and list(df["response_tokens"]) == [2] * 6
    tables = json.loads(client.get_run(t.run_id).data.tags[LOGGED_ARTIFACTS])
    assert tables == [{"path": f"samples/rollout_000000{i}.json", "type": "table"} for i in (4, 5)]


def test_failure_report_names_the_diagnosis_or_says_unclassified():
    from engine.diagnosis import Diagnosis, DiagnosisError
    from engine.tracking.artifacts import failure_report

    code, md = failure_report(DiagnosisError(Diagnosis(code="RF13", severity="error", what="NaN at step 3",
                                                       fix="--lr lower")))
    assert code == "RF13" and "NaN at step 3" in md and "--lr lower" in md
    try:
        raise RuntimeError("engine died")
    except RuntimeError as e:
        code, md = failure_report(e)
    assert code == "RuntimeError" and "unclassified" in md and "engine died" in md and "Traceback" in md


def test_system_metrics_host_and_gpu():
    import psutil

    from engine.tracking.metrics import describe
    from engine.tracking.system import gpu_metrics, host_metrics

    host = host_metrics(psutil)
    assert 0 <= host["system/system_memory_usage_percentage"] <= 100
    assert host["system/system_memory_usage_megabytes"] > 0

    class FakeNvml:  # two GPUs: 40 % and 90 % busy, 10 of 80 GiB and 60 of 80 GiB used
        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetUtilizationRates(self, h):
            return SimpleNamespace(gpu=[40, 90][h])

        def nvmlDeviceGetMemoryInfo(self, h):
            return SimpleNamespace(used=[10, 60][h] * 2**30, total=80 * 2**30)

    gpu = gpu_metrics(FakeNvml(), 2)
    assert gpu["system/gpu_1_utilization_percentage"] == 90.0
    assert gpu["system/gpu_0_memory_usage_megabytes"] == 10 * 1024  # 10 GiB = 10240 MiB
    assert gpu["system/gpu_1_memory_usage_percentage"] == 75.0  # 60 / 80
    assert all(describe(k) for k in {**host, **gpu})


def test_system_sampler_feeds_the_tracker(tmp_path):
    from engine.tracking.system import SystemSampler

    fake, clock = FakeMlflow(), Clock()
    t = make_tracker(tmp_path, fake, clock)
    t.start("r", None, tags={}, params={})
    sampler = SystemSampler(t, interval=0.05).start()
    import time

    deadline = time.time() + 10
    while time.time() < deadline and len(t._metrics) < 6:
        time.sleep(0.05)
    sampler.stop()
    t.flush()
    keys = {k for k, _, _ in fake.metrics}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= keys


def test_an_artifact_that_cannot_be_staged_is_counted_not_raised(tmp_path):
    fake, clock = FakeMlflow(), Clock()
    (tmp_path / "file").write_text("not a directory")
    t = Tracker("http://x", "exp", outbox=tmp_path / "file" / "outbox", client_factory=lambda uri: fake, clock=clock)
    t.start("r", None, tags={}, params={})
    with pytest.warns(TrackingWarning, match="config.yaml not staged"):
        t.log_text("a: 1\n", "config.yaml")
    assert t.lost == {"artifacts": 1} and fake.artifacts == {}


def test_ui_cards_are_updated_at_most_every_interval_and_close_publishes_the_newest(monkeypatch):
    """plumbing.ui.Progress: a card updated again within UI_INTERVAL_S keeps only its newest content, which the
    next update after the interval (or close) publishes; nothing is lost, fewer API calls are made."""
    from plumbing import ui

    sent = []
    monkeypatch.setattr(ui, "publisher", lambda: SimpleNamespace(submit=lambda what, fn, *a: sent.append((what, a))))
    clock = [100.0]
    monkeypatch.setattr(ui.time, "monotonic", lambda: clock[0])
    p = object.__new__(ui.Progress)
    p._pending, p._last = {}, {}
    for i in range(5):  # five rollouts 0.4 s apart: the first goes out, the rest wait for the interval
        p._publish("progress", None, i)
        clock[0] += 0.4
    assert sent == [("progress", (0,))]
    clock[0] += ui.UI_INTERVAL_S
    p._publish("progress", None, 5)
    assert sent[-1] == ("progress", (5,)) and len(sent) == 2  # the newest, not 1..4
    p._publish("progress", None, 6)
    p._flush()
    assert sent[-1] == ("progress", (6,)) and p._pending == {}


def test_plots_are_drawn_at_most_once_per_interval(tmp_path, monkeypatch):
    from engine.config import RunConfig
    from engine.tracking import record

    fake, clock = FakeMlflow(), Clock()
    t = make_tracker(tmp_path, fake, clock)
    t.start("r", None, tags={}, params={})
    drawn = []
    monkeypatch.setattr(record, "log_plots", lambda tracker, history: drawn.append(sorted(history)))
    now = [1000.0]
    monkeypatch.setattr(record.time, "monotonic", lambda: now[0])
    cfg = RunConfig(log_samples_interval=1, num_rollout=10)
    for i in range(4):
        record.log_rollout(t, cfg, i, [], {"rollout/reward_mean": {i: 0.5}})
        now[0] += 10.0
    assert len(drawn) == 1  # rollouts 1-3 came within PLOT_INTERVAL_S of the first drawing
    now[0] += record.PLOT_INTERVAL_S
    record.log_rollout(t, cfg, 4, [], {"rollout/reward_mean": {4: 0.5}})
    assert len(drawn) == 2


def test_mlflow_send_interval_reaches_the_runs_tracker(tmp_path):
    """--mlflow-send-interval: the run's tracker (engine/tracking/record.open_tracking, a SQLite store) batches at
    that interval; 0 sends after every stage."""
    from engine.tracking.record import open_tracking

    for interval in (0.0, 5.0):
        cfg = RunConfig(mlflow_send_interval=interval, experiment_name="interval",
                        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        t = open_tracking(cfg, work_dir=tmp_path, resume=None, flow_run_id=None, flow_run_url=None)
        try:
            assert t.background and t.send_interval == interval
        finally:
            t.end()
