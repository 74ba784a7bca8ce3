"""What every task shares: the retry condition and metric publishing."""
from __future__ import annotations

from engine.doctor.diagnosis import DiagnosisError
from engine.run import Run


def retry_unless_config_error(task, task_run, state) -> bool:
    """Retry transient failures only: a ConfigError or a diagnosed error (RF..) would fail the same way again."""
    try:
        state.result()
    except DiagnosisError:
        return False
    except Exception:
        return True
    return True


def publish(run: Run, rollout_id: int, metrics: dict[str, float]) -> dict[str, float]:
    """Record metrics in the run's history (carried by checkpoints) and in MLflow at step = rollout_id."""
    run.record(metrics, rollout_id)
    run.tracker.log_metrics(metrics, step=rollout_id)
    return metrics
