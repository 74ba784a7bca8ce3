import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from engine import stages
from engine.config import RunConfig
from engine.diagnosis import DiagnosisError, render_report
from engine.run import Run
from engine.tracking import Tracker
from plumbing import ui
from plumbing.policy import backoff, retry_only_if_retryable


@task(name="place", task_run_name="place", cache_policy=NO_CACHE, retry_condition_fn=retry_only_if_retryable)
def place(cfg: RunConfig, tracker: Tracker | None = None) -> Run:
    """Start Ray, the rollout engines and the train workers; keep the MLflow run opened by `stages.track`.

    Retried (see `configured`) only when the GPUs are busy (RF02 PlacementBusy); a topology that can never fit
    fails at once."""
    url = flow_run.ui_url  # "None/..." when no UI URL is configured (ephemeral API)
    t0 = time.perf_counter()
    try:
        run = stages.place(cfg, tracker=tracker, flow_run_id=flow_run.id,
                           flow_run_url=url if url and url.startswith("http") else None)
    except DiagnosisError as e:
        ui.doctor_report(cfg, render_report(e.diagnoses), "placement" + (" (will be retried)" if e.retryable else ""))
        raise
    engines = run.engines.serving() if run.engines is not None else []  # none with --load-debug-rollout-data
    ranks = [n.get("node_ip", "?") for n in run.train_group.nodes] if run.train_group is not None else []
    get_run_logger().info("place: %d rollout engine(s) at %s, %d train worker(s) on %s%s, %s; %.1f s", len(engines),
                          ", ".join(engines), len(ranks), ", ".join(ranks) or "?",
                          f" (rendezvous {master})" if (master := getattr(run.train_group, "master", None)) else "",
                          run.start.describe(), time.perf_counter() - t0)
    return run


def configured(cfg: RunConfig):
    """The place task with this run's retry policy: --placement-retries, exponential delays from
    --placement-retry-delay, ±50% jitter (two runs waiting on the same GPUs do not retry in lockstep)."""
    return place.with_options(retries=cfg.placement_retries,
                              retry_delay_seconds=backoff(cfg.placement_retries, cfg.placement_retry_delay),
                              retry_jitter_factor=0.5 if cfg.placement_retry_delay else None)
