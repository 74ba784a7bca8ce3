from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from engine import stages
from engine.run import Run
from plumbing import ui


@task(name="convert", task_run_name="convert", cache_policy=NO_CACHE)
def convert(run: Run) -> int:
    """Load the starting weights (HF or the resumed checkpoint) everywhere; return the first rollout id.

    Fallbacks from damaged iterations and clean-ups of killed saves are logged and published as `resume`."""
    with ui.diagnosed(run):
        start = stages.convert(run)
    logger = get_run_logger()
    for note in run.start.notes:
        logger.warning(note)
    logger.info(run.start.describe())
    if run.start.kind != "fresh" or run.start.notes:
        create_markdown_artifact(key=ui.artifact_key(run.cfg, "resume"), markdown=run.start.markdown(),
                                 description=run.start.describe())
    return start
