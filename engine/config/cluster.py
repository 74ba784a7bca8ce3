"""Ray and placement flags."""
from typing import Literal, Optional

from pydantic import Field

from engine.config.base import Section


class ClusterArgs(Section):
    ray_address: Optional[str] = None
    """Ray cluster to join: `auto` (the cluster this node belongs to: run the flow on the head node or any node of it) or the head's GCS address `host:6379`; default: start a local cluster for this run (also where RAY_ADDRESS is set or `ray start` left a cluster on this machine, which Ray itself would join: a warning names RAY_ADDRESS). Ray Client (`ray://host:10001`) connects too, but Ray advises against it for ML workloads (every object goes through one proxy): see docs/cluster.md."""

    ray_code: Literal["ship", "image"] = "ship"
    """How rollflow's code reaches the nodes of a joined cluster (--ray-address): `ship` uploads its packages (engine, flows, tasks, plumbing; a few hundred KB) with Ray's runtime_env `py_modules`, so the nodes only need the dependencies; `image` uploads nothing: every node already runs this rollflow (the same container image or checkout at the same path). A local cluster started by the run always sees the driver's files (`image` without --ray-address is an error)."""

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

    ray_services: Literal["lean", "full"] = "lean"
    """What the local Ray cluster started by the run runs besides its GCS, raylet and the raylet's two agents. `lean`: nothing else; Ray's autoscaler monitor (a local cluster does not scale), its log monitor (it streams worker output to drivers, which rollflow turns off; the workers' log files are written as always) and its state/job API server (`ray list …`, `ray job …` against the local cluster need it) are left out: ~2 s less CPU and ~1 s less start-up on the 2-core machine (bench/results/trl_race.md); where Ray has no dashboard packages, its dashboard agent (which then only writes its ports as not in use) is replaced by a stand-in that writes the same (docs/cluster.md). `full`: Ray's defaults. A cluster joined with --ray-address runs what it was started with (`full` is then an error)."""
