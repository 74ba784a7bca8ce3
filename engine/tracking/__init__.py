"""MLflow as the system of record; called from the driver process only (SQLite dislikes many writers).

MLflow being unreachable never stops training: each failed call is warned once and counted in `lost`.
"""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any


def default_tracking_uri(work_dir: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(work_dir).resolve() / 'mlflow.db'}"


class Tracker:
    def __init__(self, uri: str, experiment_name: str):
        self.uri, self.experiment_name = uri, experiment_name
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.lost: dict[str, int] = {}
        self._warned: set[str] = set()
        self.client = None
        self._guard("connect", self._connect)

    def _connect(self) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(self.experiment_name)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(self.experiment_name)

    def _guard(self, what: str, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # tracking must never stop training
            self.lost[what] = self.lost.get(what, 0) + 1
            if what not in self._warned:
                self._warned.add(what)
                warnings.warn(f"MLflow at {self.uri} failed during {what} ({type(e).__name__}: {e}); training "
                              f"continues, this data is not recorded", stacklevel=3)
            return None

    @property
    def ok(self) -> bool:
        return self.client is not None and self.run_id is not None

    def start(self, run_name: str, run_id: str | None, tags: dict[str, str]) -> str | None:
        """Start a new run, or continue `run_id` (a resumed training run keeps its MLflow run)."""
        def go() -> str:
            if run_id:
                self.client.update_run(run_id, status="RUNNING")
                rid = run_id
            else:
                rid = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id
            return rid

        if self.client is None:
            return None
        self.run_id = self._guard("start", go)
        if self.run_id and run_id:
            self.set_tags(tags)
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        def go():
            existing = self.client.get_run(self.run_id).data.params
            new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
            for i in range(0, len(new), 100):
                self.client.log_batch(self.run_id, params=new[i:i + 100])

        if self.ok:
            self._guard("log_params", go)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        if self.ok:
            self._guard("set_tags", self.client.log_batch, self.run_id,
                        tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        if self.ok:
            self._guard("log_metrics", self.client.log_batch, self.run_id, metrics=ms)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self.ok:
            self._guard("log_artifact", self.client.log_artifact, self.run_id, path, artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.ok:
            self._guard("log_text", self.client.log_text, self.run_id, text, artifact_file)

    def end(self, status: str = "FINISHED") -> None:
        if self.ok:
            self._guard("end", self.client.set_terminated, self.run_id, status)

    def ui_hint(self) -> str:
        if self.uri.startswith("sqlite:"):
            return f"mlflow ui --backend-store-uri {self.uri}  (then open http://127.0.0.1:5000)"
        return f"open {self.uri}"
