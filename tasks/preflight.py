from prefect import task
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.config import RunConfig
from engine.diagnosis import ConfigError, render_report
from plumbing import ui


@task(name="preflight", task_run_name="preflight", cache_policy=NO_CACHE)
def preflight(cfg: RunConfig) -> list[dict]:
    """Run every doctor check before anything starts; an error stops the run with the report as an artifact."""
    try:
        diags = stages.preflight(cfg)
    except ConfigError as e:
        ui.doctor_report(cfg, str(e), "preflight found errors")
        raise
    if diags:
        ui.doctor_report(cfg, render_report(diags), "preflight warnings")
    return [d.model_dump() for d in diags]
