"""--use-tensorboard (slime's flags): every metric also goes to TensorBoard event files, beside MLflow.

MLflow stays the run's record; the event files are a mirror for `tensorboard --logdir`. They are written with
tensorboardX (standard `events.out.tfevents.*` files, no TensorFlow or tensorboard package needed to write them).
Where they go, as slime: $TENSORBOARD_DIR, else `tensorboard_log/<--tb-project-name>/<--tb-experiment-name>`
(the experiment name defaults to the date and time); without either, rollflow's own default
`<work_dir>/tensorboard/<run name>`. Each metric is a scalar at its own step: the rollout id (`rollout/*`,
`train/*`, …), the rollouts trained (`eval/*`), the seconds since the run started (`system/*`), as MLflow has
them. A resumed run appends to the same directory when it has the same name. A TensorBoard failure never stops
training: it is reported once and the mirror stops.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any


def log_dir(cfg: Any, run_name: str) -> Path:
    """Where the event files go (see the module docstring)."""
    if os.environ.get("TENSORBOARD_DIR"):
        return Path(os.environ["TENSORBOARD_DIR"])
    if cfg.tb_project_name:
        return Path("tensorboard_log") / cfg.tb_project_name / (cfg.tb_experiment_name or
                                                               time.strftime("%Y%m%d_%H%M%S"))
    return Path(cfg.work_dir) / "tensorboard" / run_name


class TensorboardMirror:
    def __init__(self, writer: Any, directory: Path):
        self.writer, self.directory = writer, directory
        self.failed: str | None = None
        self._lock = threading.Lock()  # the stages and the system sampler's thread log at once

    @classmethod
    def start(cls, cfg: Any, *, run_name: str) -> "TensorboardMirror | None":
        """A writer for this run (None, with a warning, when it cannot start: training goes on without it)."""
        from engine.tracking import TrackingWarning

        try:
            from tensorboardX import SummaryWriter

            directory = log_dir(cfg, run_name).resolve()
            directory.mkdir(parents=True, exist_ok=True)
            writer = SummaryWriter(str(directory), flush_secs=10)
        except Exception as e:  # noqa: BLE001 — reported, training continues
            warnings.warn(f"TensorBoard (--use-tensorboard) did not start: {type(e).__name__}: {str(e)[:300]}; "
                          "metrics go to MLflow only", TrackingWarning, stacklevel=2)
            return None
        return cls(writer, directory)

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self._lock:
            if self.failed or self.writer is None:
                return
            try:
                for k, v in metrics.items():
                    self.writer.add_scalar(k, float(v), int(step))
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    def finish(self, ok: bool) -> None:
        with self._lock:
            if self.writer is None:
                return
            try:
                self.writer.close()
            except Exception as e:  # noqa: BLE001
                self._fail(e)
            self.writer = None

    def _fail(self, e: BaseException) -> None:
        from engine.tracking import TrackingWarning

        if self.failed is None:
            self.failed = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"TensorBoard (--use-tensorboard) stopped: {self.failed}; metrics go to MLflow only",
                          TrackingWarning, stacklevel=3)
