"""What every task shares: the retry condition, runtime diagnosis and metric publishing."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from prefect.artifacts import create_markdown_artifact

from engine.doctor.classify import classify_exception
from engine.doctor.diagnosis import DiagnosisError, render_report
from engine.run import Run


def retry_unless_config_error(task, task_run, state) -> bool:
    """Retry transient failures only: a ConfigError or a diagnosed error (RF..) would fail the same way again,
    unless the diagnosis says it is `retryable` (RF02 busy GPUs)."""
    try:
        state.result()
    except DiagnosisError as e:
        return e.retryable
    except Exception:
        return True
    return True


def retry_only_if_retryable(task, task_run, state) -> bool:
    """Retry only errors that say `retryable` (the place task: busy GPUs yes; infeasible, config, a crash no)."""
    try:
        state.result()
    except Exception as e:
        return bool(getattr(e, "retryable", False))
    return False


def backoff(retries: int, first_s: float) -> list[float]:
    """Exponential retry delays: first_s, 2·first_s, 4·first_s, … (Prefect adds the jitter)."""
    return [first_s * 2**i for i in range(retries)]


def publish(run: Run, rollout_id: int, metrics: dict[str, float]) -> dict[str, float]:
    """Record metrics in the run's history (carried by checkpoints) and in MLflow at step = rollout_id."""
    run.record(metrics, rollout_id)
    run.tracker.log_metrics(metrics, step=rollout_id)
    return metrics


@contextmanager
def diagnosed(run: Run) -> Iterator[None]:
    """Turn a failure the doctor recognises into a DiagnosisError (the task's state message is the report),
    published as the `doctor-report` artifact and logged to MLflow. Unrecognised failures pass unchanged."""
    try:
        yield
    except Exception as e:
        diags = classify_exception(e, run.cfg)
        if not diags:
            raise
        report = render_report(diags)
        create_markdown_artifact(key="doctor-report", markdown=f"# Doctor report\n\n```\n{report}\n```",
                                 description="runtime diagnosis")
        run.tracker.log_text(report, "doctor/report.txt")
        if isinstance(e, DiagnosisError):
            raise
        raise DiagnosisError(diags) from e
