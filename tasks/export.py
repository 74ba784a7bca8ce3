from prefect import task
from prefect.cache_policies import NO_CACHE

from engine.convert import checkpoint_to_hf
from plumbing.policy import retry_unless_config_error


@task(name="export-hf", task_run_name="export-hf-{ckpt_step}", retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_config_error, cache_policy=NO_CACHE)
def export_hf(load: str, ckpt_step: int, output_hf: str, hf_checkpoint: str | None = None) -> dict:
    """One verified iteration → a Hugging Face directory (written as <out>.tmp, then renamed: a retry after an S3
    read error starts clean)."""
    return checkpoint_to_hf(load, output_hf, ckpt_step=ckpt_step, hf_checkpoint=hf_checkpoint)
