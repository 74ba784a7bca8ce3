"""--use-wandb (slime's flags): every metric and the run's flags also go to Weights & Biases, beside MLflow.

MLflow stays the run's record (resume, `rollflow compare`, the doctor's history); W&B is a mirror for teams whose
dashboards live there. Each metric section (`rollout/`, `train/`, `eval/`, `system/`, …) gets its own x-axis,
`<section>/step`, because their steps differ: rollout ids, rollouts trained for `eval/*`, seconds for `system/*`
(W&B's own step must only grow); with --wandb-always-use-train-step all but `system/*` share `train/step`, the
optimizer steps taken. The W&B run's id is --wandb-run-id, else the MLflow run's id, so a resumed run
continues its W&B run too (W&B's resume="allow"). A W&B failure never stops training: it is reported once and the
mirror stops; MLflow still has everything.
"""
from __future__ import annotations

import re
import threading
import warnings
from pathlib import Path
from typing import Any

from engine.tracking.secrets import REDACTED, redact, redact_text


class WandbMirror:
    def __init__(self, run: Any, key: str | None = None, steps_per_rollout: int | None = None):
        self.run, self.key = run, key
        self.steps_per_rollout = steps_per_rollout  # --wandb-always-use-train-step: k, else None
        self.sections: set[str] = set()
        self.failed: str | None = None
        self._lock = threading.Lock()  # the stages and the system sampler's thread log at once

    def clean(self, text: str) -> str:
        """`text` without secrets: the known patterns, and the --wandb-key itself (whatever it looks like)."""
        return _clean(text, self.key)

    @classmethod
    def start(cls, cfg: Any, *, run_name: str, run_id: str | None, config: dict[str, Any]) -> "WandbMirror | None":
        """wandb.init for this run (None, with a warning, when W&B refuses: training goes on without it)."""
        from engine.tracking import TrackingWarning

        try:
            import wandb

            settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                      save_code=False, api_key=cfg.wandb_key or None,
                                      **({"base_url": cfg.wandb_host} if cfg.wandb_host else {}))
            wid = cfg.wandb_run_id or (_wandb_id(run_id) if run_id else None)
            directory = Path(cfg.wandb_dir or Path(cfg.work_dir) / "wandb").resolve()
            directory.mkdir(parents=True, exist_ok=True)
            run = wandb.init(project=cfg.wandb_project or cfg.experiment_name, entity=cfg.wandb_team,
                             group=cfg.wandb_group,
                             name=cfg.wandb_group if cfg.disable_wandb_random_suffix else run_name, id=wid,
                             resume="allow" if wid else None,
                             dir=str(directory), mode=cfg.wandb_mode, config=redact(config), settings=settings,
                             reinit="create_new")
        except Exception as e:  # noqa: BLE001 — any W&B failure: reported, training continues
            warnings.warn(f"W&B (--use-wandb) did not start: {type(e).__name__}: "
                          f"{_clean(str(e), cfg.wandb_key)[:300]}; metrics go to MLflow only", TrackingWarning,
                          stacklevel=2)
            return None
        return cls(run, cfg.wandb_key,
                   cfg.batch.num_steps_per_rollout if cfg.wandb_always_use_train_step else None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One W&B log call per metric section, with that section's step (or the optimizer steps taken)."""
        with self._lock:
            self._log(metrics, step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.failed or self.run is None:
            return
        try:
            by: dict[str, dict[str, float]] = {}
            for k, v in metrics.items():
                by.setdefault(k.split("/", 1)[0] if "/" in k else "misc", {})[k] = v
            for section, values in by.items():
                axis, at = f"{section}/step", step
                if self.steps_per_rollout is not None and section != "system":  # steps count rollouts: × k
                    axis, at = "train/step", step * self.steps_per_rollout
                if section not in self.sections:
                    self.run.define_metric(axis)
                    self.run.define_metric(f"{section}/*", step_metric=axis)
                    self.sections.add(section)
                self.run.log({**values, axis: at})
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def finish(self, ok: bool) -> None:
        """Finish the W&B run; then stop W&B's service process (wandb-core), which wandb.init started, unless
        another W&B run of this process still uses it."""
        with self._lock:
            if self.run is None:
                return
            try:
                import wandb

                self.run.finish(exit_code=0 if ok else 1)
                if wandb.run is None:
                    wandb.teardown()
            except Exception as e:  # noqa: BLE001
                self._fail(e)
            self.run = None

    def _fail(self, e: BaseException) -> None:
        from engine.tracking import TrackingWarning

        if self.failed is None:
            self.failed = f"{type(e).__name__}: {self.clean(str(e))[:300]}"
            warnings.warn(f"W&B (--use-wandb) stopped: {self.failed}; metrics go to MLflow only", TrackingWarning,
                          stacklevel=3)


def _wandb_id(mlflow_run_id: str) -> str:
    """A W&B run id from the MLflow run's (hex: already what W&B takes; anything else is cleaned)."""
    return re.sub(r"[^a-z0-9_-]", "", mlflow_run_id.lower())[:64]


def _clean(text: str, key: str | None) -> str:
    text = redact_text(text)
    return text.replace(key, REDACTED) if key else text
