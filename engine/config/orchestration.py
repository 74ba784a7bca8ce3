"""Placement deadlines and the retries the Prefect flow makes (never for a configuration error)."""
from pydantic import Field

from engine.config.base import Section


class OrchestrationArgs(Section):
    placement_timeout: float = Field(300.0, gt=0)
    """Seconds to wait for the placement group (all GPUs of the run) before reading why it is not ready (RF02)."""

    placement_retries: int = Field(3, ge=0)
    """Retries of the place task when the GPUs are busy (held by other jobs); an infeasible request is not retried."""

    placement_retry_delay: float = Field(30.0, ge=0)
    """First delay before a placement retry in seconds; doubles each retry, with ±50% jitter."""

    rollout_retries: int = Field(1, ge=0)
    """Retries of a failed rollout (deadline, dead engine: dead engines are restarted first)."""

    flow_retries: int = Field(0, ge=0)
    """Retries of the whole flow run after a failure that is not a config error; each resumes from the marker."""

    flow_retry_delay: float = Field(10.0, ge=0)
    """Seconds before a flow retry."""
