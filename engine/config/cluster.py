"""Ray and placement flags."""
from typing import Optional

from pydantic import Field

from engine.config.base import Section


class ClusterArgs(Section):
    ray_address: Optional[str] = None
    """Ray cluster to join (e.g. ray://head:10001 or auto); default: start a local cluster for this run."""

    actor_num_nodes: int = Field(1, ge=1)
    """Nodes for the training actors."""

    actor_num_gpus_per_node: int = Field(1, ge=1)
    """Training workers (GPUs) per node; DP size = nodes × this (on CPU, workers share the cores)."""

    colocate: bool = False
    """Training and rollout share the same GPUs (engines release memory while training runs)."""

    rollout_num_gpus: Optional[int] = Field(None, ge=0)
    """GPUs for rollout engines in decoupled mode (default: the training GPUs when colocated)."""

    num_cpus: Optional[int] = Field(None, ge=1)
    """CPUs for the local Ray cluster started by the run (default: all)."""
