"""Retry rules: which failures a task or the flow run retries, and the flow run's own retry policy.

A ConfigError or a diagnosed error (RF..) fails the same way on every attempt, so only failures that a retry can get
past (a dead engine, an S3 hiccup, busy GPUs: `retryable`) are retried.
"""
from __future__ import annotations

from prefect import get_run_logger

from engine.diagnosis import DiagnosisError


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


# ---- the flow run's retry policy ----------------------------------------------------------------------------------
def _flow_run():
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx.flow_run if ctx is not None and ctx.flow_run is not None else None


def _update_policy(fr, **changes) -> None:
    """Change this flow run's retry policy on the server (its RetryFailedFlows rule reads it there)."""
    from prefect.client.orchestration import get_client

    policy = fr.empirical_policy.model_copy(update=changes)
    with get_client(sync_client=True) as client:
        client.update_flow_run(fr.id, empirical_policy=policy)
    fr.empirical_policy = policy


def set_flow_retries(retries: int, delay_s: float) -> None:
    """--flow-retries / --flow-retry-delay as this flow run's policy, the same from the CLI and a deployment.
    Each retry re-runs the flow, which resumes from the checkpoint marker (nothing trained is repeated)."""
    fr = _flow_run()
    if fr is not None and fr.run_count <= 1 and (fr.empirical_policy.retries or 0) != retries:
        _update_policy(fr, retries=retries, retry_delay=int(delay_s))


def no_flow_retry(e: DiagnosisError) -> None:
    """--flow-retries is for failures a re-run can get past (a crashed engine, a lost node); a diagnosed error
    (config, RF..) fails the same way again, so this flow run's remaining retries are dropped."""
    fr = _flow_run()
    if fr is None or not (fr.empirical_policy.retries or 0) or e.retryable:
        return
    _update_policy(fr, retries=fr.run_count - 1)
    get_run_logger().warning("not retrying the flow run: %s fails the same way on every attempt", ",".join(e.codes))
