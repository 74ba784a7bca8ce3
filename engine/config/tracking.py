"""Run identity, work directory, tracking and reporting flags."""
from typing import Optional

from pydantic import Field

from engine.config.base import Section


class TrackingArgs(Section):
    work_dir: str = "runs/default"
    """Run directory: MLflow SQLite store, weight-sync files, logs (created if missing)."""

    experiment_name: str = "rollflow"
    """MLflow experiment name."""

    run_name: Optional[str] = None
    """Name of this training run (MLflow run and Prefect flow run); default: experiment name + time."""

    mlflow_tracking_uri: Optional[str] = None
    """MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<work_dir>/mlflow.db)."""

    mlflow_timeout: int = Field(10, ge=1)
    """Seconds one MLflow HTTP request may take (no retries: a failed call is buffered, never blocks training)."""

    mlflow_retry_interval: float = Field(30.0, ge=0)
    """While MLflow is unreachable, data is buffered and MLflow is tried again at most every this many seconds."""

    mlflow_send_interval: float = Field(2.0, ge=0)
    """Seconds between the MLflow sender's batches during a run (the writes of several fast iterations go out as one;
    0 = send after every stage). A checkpoint and the end of the run send everything at once whatever this is."""

    log_samples_interval: int = Field(10, ge=0)
    """Every N rollouts (and the last) log the rollout's samples as JSONL and redraw the plots in MLflow (plots at
    most once a minute; 0 = off)."""

    log_passrate: bool = False
    """Also log pass@k for k = 1, 2, 4, … up to the samples per prompt (slime's flag): rollout/pass_at_<k> over each rollout's groups, eval/<set>_pass_at_<k> over an eval set's prompts (with more than one sample per prompt). The unbiased estimator 1 − C(n−c, k) / C(n, k) of n samples with c correct, where a reward of 1 is correct, as slime counts."""

    system_metrics_interval: float = Field(10.0, ge=0)
    """Seconds between system metric samples (CPU, memory; GPU when present) logged to MLflow (0 = off)."""

    summary_json: Optional[str] = None
    """Write the final summary (rewards, accuracy, wall time, run ids, save dir) to this JSON file."""

    progress: bool = True
    """Show a progress bar on the terminal."""

    debug: bool = False
    """Show Prefect's tracebacks on the terminal for a diagnosed failure too (without it the terminal shows the
    diagnosis; the tracebacks stay in the Prefect UI's logs)."""
