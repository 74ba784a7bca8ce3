"""Run identity, work directory, tracking and reporting flags."""
from typing import Optional

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

    summary_json: Optional[str] = None
    """Write the final summary (rewards, accuracy, wall time, run ids, save dir) to this JSON file."""

    progress: bool = True
    """Show a progress bar on the terminal."""
