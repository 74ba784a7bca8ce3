"""MLflow as the system of record; called from the driver process only (SQLite dislikes many writers).

Invariants
- Tracking never stops training. Every MLflow call is guarded; the first failure marks MLflow *down* (one warning),
  and from then on params, tags, metrics and artifacts are buffered (metrics in memory up to `max_buffered` points,
  artifacts as files in an outbox directory) while MLflow is tried again at most every `retry_interval` seconds,
  and once more at the end of the run whatever the interval. A request never waits longer than the HTTP timeout
  set by `open_tracking` (--mlflow-timeout, no retries), so an outage costs one timeout per retry interval.
- What was never sent is counted in `lost` and said in one line (`lost_report`) at the end of the run.
- One MLflow run per training run: `start` continues the run id from the checkpoint manifest when it has one, and
  tags each resume (`rollflow.resume.<k>`). Params already logged are never re-sent (MLflow params are immutable):
  a changed value on resume is listed in that resume tag instead.
- Metric steps are rollout ids; a resumed run logs redone steps again (readers keep the latest value per step).
- Everything that reaches MLflow or a log line here is passed through `secrets.redact` / `redact_text`.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from engine.tracking.secrets import redact, redact_text

log = logging.getLogger("rollflow.tracking")

# MLflow's per-call limits for log_batch (REST API): 1000 metrics, 100 params, 100 tags.
_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
_PARAM_CHARS = 6000  # MLflow 3 param value limit


class TrackingWarning(UserWarning):
    """MLflow could not be reached or refused data; training goes on."""


def default_tracking_uri(work_dir: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(work_dir).resolve() / 'mlflow.db'}"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///…` URI (None for other stores)."""
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def artifact_location_for(uri: str) -> str | None:
    """SQLite stores keep artifacts beside the database (MLflow's own default is ./mlruns in the CWD)."""
    db = sqlite_path(uri)
    return (db.resolve().parent / "mlartifacts").as_uri() if db else None


def run_ui_url(uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """The run's metric charts in the MLflow UI (the server itself, or `mlflow ui` on its default port for a local
    store), in MLflow 3's "Model training" layout: without `workflowType` MLflow opens its GenAI layout, and switching
    layouts there leaves the run."""
    if not (experiment_id and run_id):
        return None
    base = redact_text(uri.rstrip("/")) if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?workflowType=machine_learning"


def _mlflow_client(uri: str):
    """MLflow's client for `uri`. A local store that does not exist yet is created here, from the cached schema
    when there is one (engine/tracking/schema_cache.py: no migrations), else by MLflow's migrations, after which
    its schema is cached for the next fresh store."""
    from mlflow.tracking import MlflowClient

    from engine.tracking import schema_cache

    db = sqlite_path(uri)
    if db is None or db.exists():
        return MlflowClient(tracking_uri=uri)
    if schema_cache.seed(db):
        try:
            client = MlflowClient(tracking_uri=uri)
            client._tracking_client.store  # noqa: B018 — MLflow opens it: its schema check, experiment 0
            return client
        except Exception as e:  # noqa: BLE001 — a template MLflow refuses: create the store the usual way
            log.warning("rollflow: the cached MLflow schema was refused (%s: %s); creating %s with MLflow's "
                        "migrations", type(e).__name__, e, db)
            _forget_store(uri)
            schema_cache.forget(db)
    client = MlflowClient(tracking_uri=uri)
    client._tracking_client.store  # noqa: B018 — created and migrated now, so that its schema can be kept
    schema_cache.remember(db)
    return client


def _forget_store(uri: str) -> None:
    """Drop MLflow's open engine on `uri` (it caches one per URI): the file under it is about to be removed, and
    the store made next must not reach the removed file through it."""
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        with SqlAlchemyStore._engine_map_lock:
            engine = SqlAlchemyStore._engine_map.pop(uri, None)
        if engine is not None:
            engine.dispose()
    except Exception as e:  # noqa: BLE001 — an MLflow without that cache: nothing to drop
        log.debug("rollflow: MLflow's engine for %s not dropped (%s)", uri, e)


#: MLflow opens an experiment in the layout its kind names: "custom_model_development" is the model-training
#: layout (runs, metric charts); without the tag MLflow 3 guesses and may show the GenAI "Evaluations" layout
EXPERIMENT_KIND = "mlflow.experimentKind"
LOGGED_ARTIFACTS = "mlflow.loggedArtifacts"  # MLflow's list of a run's table artifacts
EXPERIMENT_TAGS = {EXPERIMENT_KIND: "custom_model_development"}


class Tracker:
    def __init__(self, uri: str, experiment_name: str, *, outbox: Path, artifact_location: str | None = None,
                 retry_interval: float = 30.0, max_buffered: int = 100_000,
                 client_factory: Callable[[str], Any] = _mlflow_client, clock: Callable[[], float] = time.monotonic,
                 background: bool = False, send_interval: float = 0.0):
        self.uri, self.experiment_name = uri, experiment_name
        self.safe_uri = redact_text(uri)
        self.artifact_location, self.retry_interval, self.max_buffered = artifact_location, retry_interval, max_buffered
        self.outbox = Path(outbox)
        self._make_client, self._clock = client_factory, clock
        self.client = None
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self.run_start_s: float | None = None  # wall time the MLflow run was first created
        self.run_name: str | None = None  # the MLflow run's name (a continued run keeps its own)
        self._tables: list[str] = []  # table artifacts of the run (the mlflow.loggedArtifacts tag)
        self.sampler = None  # the SystemSampler feeding this tracker, if any
        self.mirrors: list = []  # --use-wandb, --use-tensorboard: where every metric also goes
        self.plots_drawn_at = float("-inf")  # monotonic time the plots were last queued (record.log_rollout)
        self.created_s = time.time()
        self._want: dict[str, Any] | None = None  # what start() asked for, until the run is open
        self._params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._metrics: list[tuple[str, float, int, int]] = []  # (key, value, timestamp ms, step)
        self._artifacts: dict[str, Path] = {}  # artifact file (run-relative) → staged local file
        self._seq = itertools.count()
        self.dropped = 0  # metric points dropped because the buffer was full
        self.dropped_artifacts = 0  # artifacts that could not even be staged locally
        self.failures = 0
        self.last_error: str | None = None
        self.down_since: float | None = None  # clock() of the first failure of the current outage
        self._retry_at = 0.0
        self._lock = threading.RLock()
        # background: `flush()` only wakes a sender thread, which also runs `defer`red work (plots); the stages'
        # writes leave the critical path. `drain()` (before a checkpoint's marker) and `end()` wait for it.
        # send_interval: the sender sends at most once per this many seconds (writes of several stages go out as
        # one batch: SQLite's per-batch cost is most of MLflow's, measured); drain / end / a forced flush send now
        self.background, self.send_interval = background, send_interval
        self._last_send = float("-inf")
        self._jobs: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._sender: threading.Thread | None = None
        self._busy = threading.Lock()  # held by whoever is sending (the sender thread or a drain)

    # ---- what callers use ------------------------------------------------------------------------------------
    def start(self, run_name: str, run_id: str | None, *, tags: dict[str, str], params: dict[str, Any],
              resume: dict[str, Any] | None = None, flow_run_id: str | None = None) -> str | None:
        """Open (or continue `run_id`) now if MLflow answers, else as soon as it does; returns the run id or None.

        Without `run_id` (no checkpoint yet), a run tagged with the same `prefect.flow_run_id` is continued: a
        retried flow run keeps its MLflow run even when it failed before its first checkpoint. Continuing a run
        adds its next `rollflow.resume.<k>` tag (`resume`: from which iteration, when, which flow run).
        """
        with self._lock:
            self._want = {"run_name": run_name, "run_id": run_id, "resume": resume, "flow_run_id": flow_run_id}
            self.run_name = run_name  # until MLflow says (a continued run keeps its own name)
            self._tags.update({k: redact_text(str(v)) for k, v in tags.items()})
            self._params.update({k: _param_value(v) for k, v in redact(params).items()})
        self.flush(force=True)
        return self.run_id

    def set_tags(self, tags: dict[str, str]) -> None:
        with self._lock:
            self._tags.update({k: redact_text(str(v)) for k, v in tags.items()})
        self.flush()

    def log_metrics(self, metrics: dict[str, float], step: int, *, flush: bool = True) -> None:
        for mirror in self.mirrors:
            mirror.log(metrics, step)
        ts = int(time.time() * 1000)
        with self._lock:
            room = self.max_buffered - len(self._metrics)
            points = [(k, float(v), ts, int(step)) for k, v in metrics.items()]
            if len(points) > room:
                if self.dropped == 0:
                    warnings.warn(f"MLflow buffer full ({self.max_buffered} metric points); newer points are "
                                  f"dropped until MLflow at {self.safe_uri} answers", TrackingWarning, stacklevel=2)
                self.dropped += len(points) - max(room, 0)
                points = points[:max(room, 0)]
            self._metrics.extend(points)
        if flush:
            self.flush()

    def log_table(self, table_json: str, artifact_file: str) -> None:
        """A table MLflow's UI shows as one (what MlflowClient.log_table writes: pandas' "split" JSON, its path
        listed in the run's `mlflow.loggedArtifacts` tag), through the same buffer as every artifact."""
        self.log_text(table_json, artifact_file)
        if artifact_file not in self._tables:
            self._tables.append(artifact_file)
        self.set_tags({LOGGED_ARTIFACTS: json.dumps([{"path": p, "type": "table"} for p in self._tables])})

    def log_text(self, text: str, artifact_file: str) -> None:
        """A text artifact (secrets redacted), e.g. `config.yaml` or `samples/rollout_0000010.jsonl`."""
        self.log_bytes(redact_text(text).encode(), artifact_file)

    def log_bytes(self, data: bytes, artifact_file: str) -> None:
        """Stage `data` in the outbox as `artifact_file` (a newer one replaces a pending older one), then send."""
        local = self.outbox / f"{next(self._seq):06d}" / Path(artifact_file).name
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
        except OSError as e:  # e.g. a full disk: this artifact is lost, training goes on
            self.dropped_artifacts += 1
            warnings.warn(f"artifact {artifact_file} not staged ({e}); it will not reach MLflow", TrackingWarning,
                          stacklevel=2)
            return
        with self._lock:
            old = self._artifacts.pop(artifact_file, None)
            if old is not None:
                shutil.rmtree(old.parent, ignore_errors=True)
            self._artifacts[artifact_file] = local
        self.flush()

    def defer(self, job: Callable[[], None]) -> None:
        """Work that only feeds MLflow (e.g. rendering plots): on the sender thread in background mode, else now."""
        if not self.background:
            job()
            return
        with self._lock:
            self._jobs.append(job)
        self._kick()

    def drain(self) -> bool:
        """Everything queued so far sent (or buffered, when MLflow is down) before returning: deferred jobs run
        and a flush, in this thread. Called before a checkpoint's marker is written, so a kill after it loses no
        data of a step the resume will not redo."""
        with self._busy:
            self._run_jobs()
            return self._flush_now()

    def _kick(self) -> None:
        with self._lock:
            if self._sender is None or not self._sender.is_alive():
                self._sender = threading.Thread(target=self._send_loop, name="rollflow-mlflow-sender", daemon=True)
                self._sender.start()
        self._wake.set()

    def _send_loop(self) -> None:
        from engine.background import lower_this_thread

        lower_this_thread()  # bookkeeping: it runs in the gaps left by the stages (engine/background.py)
        while True:
            self._wake.wait()
            wait = self._last_send + self.send_interval - time.monotonic()
            if wait > 0:  # gather what the next stages publish into the same batch
                time.sleep(wait)
            self._wake.clear()
            with self._busy:
                self._run_jobs()
                self._flush_now()
                self._last_send = time.monotonic()

    def _run_jobs(self) -> None:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            try:
                job()
            except Exception as e:  # an artifact that cannot be built must not stop the others (or training)
                warnings.warn(f"MLflow record skipped ({type(e).__name__}: {e}); training continues",
                              TrackingWarning, stacklevel=2)

    def end(self, status: str = "FINISHED") -> None:
        """Last flush (whatever the retry interval), then mark the run terminated."""
        if self.background:
            with self._busy:  # the sender's work in progress, then what it had not taken yet
                self._run_jobs()
        for mirror in self.mirrors:
            mirror.finish(ok=status == "FINISHED")
        if self.flush(force=True) and self.run_id:
            self._call("end", lambda: self.client.set_terminated(self.run_id, status))
        for d in (self.outbox, self.outbox.parent):  # empty once everything was sent
            try:
                d.rmdir()
            except OSError:
                break

    @property
    def down(self) -> bool:
        return self.down_since is not None

    @property
    def lost(self) -> dict[str, int]:
        """What has not reached MLflow (so far): counts per kind, zeros left out."""
        with self._lock:
            out = {"run": int(self.run_id is None), "params": len(self._params), "tags": len(self._tags),
                   "metric_points": len(self._metrics) + self.dropped,
                   "artifacts": len(self._artifacts) + self.dropped_artifacts}
        return {k: v for k, v in out.items() if v}

    def lost_report(self) -> str | None:
        """One line for the end of the run: what MLflow never received and why; None when nothing was lost."""
        lost = self.lost
        if not lost:
            return None
        what = ", ".join(("the run itself (never created)" if k == "run" else f"{v} {k.replace('_', ' ')}")
                         for k, v in lost.items())
        where = f" (kept under {self.outbox})" if lost.get("artifacts") else ""
        return (f"MLflow at {self.safe_uri} did not receive: {what}{where}; {self.failures} failed attempt(s), "
                f"last error: {self.last_error}")

    def run_url(self) -> str | None:
        return run_ui_url(self.uri, self.experiment_id, self.run_id)

    # ---- sending ---------------------------------------------------------------------------------------------
    def flush(self, force: bool = False) -> bool:
        """Send everything pending; True when nothing is left. While down, tries only every retry_interval.
        In background mode an unforced flush wakes the sender thread and returns at once (True unless down)."""
        if self.background and not force and threading.current_thread() is not self._sender:
            self._kick()
            return not self.down
        if self.background and force:
            with self._busy:
                return self._flush_now(force)
        return self._flush_now(force)

    def _flush_now(self, force: bool = False) -> bool:
        with self._lock:
            if self.down and not force and self._clock() < self._retry_at:
                return False
            try:
                self._connect()
                self._open_run()
                if self.run_id:
                    self._send()
            except Exception as e:  # tracking must never stop training
                self._went_down(e)
                return False
            if self.down:
                log.warning("MLflow at %s answers again after %.0fs; buffered data sent", self.safe_uri,
                            self._clock() - self.down_since)
                self.down_since = None
            return self.run_id is not None

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        with self._lock:
            try:
                return fn()
            except Exception as e:
                self._went_down(e, what)
                return None

    def _went_down(self, e: Exception, what: str = "sending") -> None:
        self.failures += 1
        err = redact_text(f"{type(e).__name__}: {e}")
        self.last_error = err if len(err) <= 400 else f"{err[:200]} … {err[-200:]}"  # the cause is at the end
        self._retry_at = self._clock() + self.retry_interval
        if not self.down:
            self.down_since = self._clock()
            warnings.warn(f"MLflow at {self.safe_uri} failed while {what} ({self.last_error}); training continues, "
                          f"tracking data is buffered and sent when MLflow answers (next try in "
                          f"{self.retry_interval:.0f}s)", TrackingWarning, stacklevel=4)

    def _connect(self) -> None:
        if self.client is None:
            self.client = self._make_client(self.uri)
        if self.experiment_id is None:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
                self.experiment_name, artifact_location=self.artifact_location, tags=EXPERIMENT_TAGS)
            if exp is not None and exp.tags.get(EXPERIMENT_KIND) is None:  # made by an older rollflow, or by hand
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, EXPERIMENT_TAGS[EXPERIMENT_KIND])

    def _open_run(self) -> None:
        if self.run_id or self._want is None:
            return
        from mlflow.exceptions import MlflowException

        want, run = self._want, None
        if want["run_id"]:
            try:
                run = self.client.get_run(want["run_id"])
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                warnings.warn(f"MLflow run {want['run_id']} named by the checkpoint manifest does not exist at "
                              f"{self.safe_uri}; this training run continues in a new MLflow run", TrackingWarning,
                              stacklevel=4)
        if run is None and want["flow_run_id"]:
            same = self.client.search_runs([self.experiment_id], max_results=1,
                                           filter_string=f"tags.`prefect.flow_run_id` = '{want['flow_run_id']}'")
            run = same[0] if same else None
        continued = run is not None
        if continued:
            self.client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self.experiment_id, run_name=want["run_name"])
        old_params, old_tags = run.data.params, run.data.tags
        changed = {k: [old_params[k], v] for k, v in self._params.items() if k in old_params and old_params[k] != v}
        self._params = {k: v for k, v in self._params.items() if k not in old_params}
        if continued:
            earlier = [t["path"] for t in json.loads(old_tags.get(LOGGED_ARTIFACTS, "[]")) if t.get("type") == "table"]
            self._tables = earlier + [p for p in self._tables if p not in earlier]
            if self._tables:
                self._tags[LOGGED_ARTIFACTS] = json.dumps([{"path": p, "type": "table"} for p in self._tables])
            k = 1 + sum(t.startswith("rollflow.resume.") for t in old_tags)
            resume = want["resume"] or {"from_iteration": None, "flow_run_id": want["flow_run_id"]}
            self._tags[f"rollflow.resume.{k}"] = json.dumps({**resume, "changed_params": changed})
        if changed:
            warnings.warn(f"resumed MLflow run {run.info.run_id} keeps its first values of {sorted(changed)} "
                          f"(MLflow params are immutable); the new values are in the resume tag", TrackingWarning,
                          stacklevel=4)
        self.run_id, self.run_start_s = run.info.run_id, run.info.start_time / 1000.0
        self.run_name = run.info.run_name or want["run_name"]

    def _send(self) -> None:
        """Each batch leaves the buffer only once MLflow accepted it, so a failure midway resends nothing twice."""
        from mlflow.entities import Metric, Param, RunTag

        while self._params:
            batch = dict(itertools.islice(self._params.items(), _MAX_PARAMS))
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in batch.items()])
            for k in batch:
                del self._params[k]
        while self._tags:
            batch = dict(itertools.islice(self._tags.items(), _MAX_TAGS))
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in batch.items()])
            for k in batch:
                del self._tags[k]
        while self._metrics:
            batch = self._metrics[:_MAX_METRICS]
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in batch])
            del self._metrics[:len(batch)]
        for name, local in list(self._artifacts.items()):
            parent = str(Path(name).parent)
            self.client.log_artifact(self.run_id, str(local), None if parent == "." else parent)
            del self._artifacts[name]
            shutil.rmtree(local.parent, ignore_errors=True)


def _param_value(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return s if len(s) <= _PARAM_CHARS else s[:_PARAM_CHARS - 3] + "..."
