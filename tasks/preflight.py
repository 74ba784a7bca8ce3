from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.config import RunConfig
from engine.doctor.diagnosis import ConfigError, render_report


@task(name="preflight", task_run_name="preflight", cache_policy=NO_CACHE)
def preflight(cfg: RunConfig) -> list[dict]:
    """Run every doctor check before anything starts; an error stops the run with the report as an artifact."""
    try:
        diags = stages.preflight(cfg)
    except ConfigError as e:
        create_markdown_artifact(key="doctor-report", markdown="# Doctor report\n\n```\n" + str(e) + "\n```",
                                 description="preflight found errors")
        raise
    if diags:
        create_markdown_artifact(key="doctor-report", markdown="```\n" + render_report(diags) + "\n```")
    return [d.model_dump() for d in diags]
