"""Where train workers and rollout engines run: one Ray placement group, one bundle per GPU.

GPU layout (strategy PACK, bundles {"GPU": 1}); T = actor_num_nodes · actor_num_gpus_per_node train
GPUs, g = --rollout-num-gpus-per-engine:
    colocated   bundles 0..T-1;  train rank r on bundle r;  engine e on bundle e·g;       T/g engines
    decoupled   bundles 0..T+R-1 (R = --rollout-num-gpus, else engines × g);  engine e on bundle T + e·g;  R/g engines
An engine's Ray actor holds ENGINE_GPU_FRACTION of its first bundle: only a claim. The server it starts uses GPUs
base_gpu_id .. base_gpu_id+g-1 of that node (base_gpu_id = the physical id Ray assigned to the actor), so when
colocated the trainer holds the rest of the same bundle (1 − 0.2 = 0.8).
    e.g. colocated, T = 8, g = 2 → engines on bundles 0, 2, 4, 6; train ranks on 0..7 with 0.8 GPU each.

CPU layout (the cluster has no GPUs, or --rollout-num-gpus 0): one bundle {"CPU": CPU_ENGINE_CLAIM} per engine
(--rollout-num-engines). The claim is nominal — engines and trainers share the cores by thread counts (engine/run.py)
— but it pins each engine to a slot that a restart reuses. CPU train workers are unplaced on one node; with
--actor-num-nodes N > 1 they get a group of their own (`cpu_train_layout`): N bundles, STRICT_SPREAD.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.diagnosis import ConfigError, Diagnosis, DiagnosisError

ENGINE_GPU_FRACTION = 0.2
CPU_ENGINE_CLAIM = 0.01


@dataclass(frozen=True)
class Layout:
    bundles: list[dict[str, float]]
    engine_bundles: list[int]  # first bundle of each engine
    train_bundles: list[int] = field(default_factory=list)  # one per train rank (GPU layouts only)
    gpus_per_engine: int = 0  # 0 = CPU engines
    engine_gpu_fraction: float = 0.0
    train_gpu_fraction: float = 0.0
    train_cpu: float = 0.0  # CPUs each train rank claims inside its bundle (CPU train groups over several nodes)
    strategy: str = "PACK"  # Ray's placement strategy for the bundles

    @property
    def num_engines(self) -> int:
        return len(self.engine_bundles)


def rollout_layout(*, cluster_gpus: float, train_gpus: int, colocate: bool, rollout_num_gpus: int | None,
                   gpus_per_engine: int, num_engines: int) -> Layout:
    """The bundles and who sits where (pure: tested without Ray).

    Decoupled rollout GPUs are --rollout-num-gpus, else --rollout-num-engines × --rollout-num-gpus-per-engine (the
    doctor's RF02 arithmetic); --rollout-num-gpus 0 keeps the engines on CPU.
    """
    if colocate:
        rollout_gpus = train_gpus
    else:
        rollout_gpus = rollout_num_gpus if rollout_num_gpus is not None else num_engines * gpus_per_engine
    if cluster_gpus <= 0 or rollout_gpus == 0:
        return Layout(bundles=[{"CPU": CPU_ENGINE_CLAIM} for _ in range(num_engines)],
                      engine_bundles=list(range(num_engines)))
    flag = "--actor-num-nodes × --actor-num-gpus-per-node (colocated)" if colocate else "--rollout-num-gpus"
    if rollout_gpus % gpus_per_engine:
        ok = [g for g in range(1, rollout_gpus + 1) if rollout_gpus % g == 0]
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"{rollout_gpus} rollout GPUs ({flag}) do not split into engines of --rollout-num-gpus-per-engine "
                 f"{gpus_per_engine}",
            fix=f"--rollout-num-gpus-per-engine one of {ok}", facts={"rollout_gpus": rollout_gpus}))
    first = 0 if colocate else train_gpus
    total = train_gpus if colocate else train_gpus + rollout_gpus
    return Layout(bundles=[{"GPU": 1.0} for _ in range(total)],
                  engine_bundles=[first + e * gpus_per_engine for e in range(rollout_gpus // gpus_per_engine)],
                  train_bundles=list(range(train_gpus)), gpus_per_engine=gpus_per_engine,
                  engine_gpu_fraction=ENGINE_GPU_FRACTION,
                  train_gpu_fraction=1.0 - ENGINE_GPU_FRACTION if colocate else 1.0)


def train_only_layout(*, cluster_gpus: float, train_gpus: int) -> Layout | None:
    """--load-debug-rollout-data (no engines): a GPU for each train rank, as a decoupled layout gives them; None on
    a cluster without GPUs (the CPU workers are placed as in any run: `cpu_train_layout`)."""
    if cluster_gpus <= 0:
        return None
    return Layout(bundles=[{"GPU": 1.0} for _ in range(train_gpus)], engine_bundles=[],
                  train_bundles=list(range(train_gpus)), train_gpu_fraction=1.0)


def cpu_train_layout(*, nodes: int, per_node: int) -> Layout | None:
    """CPU train workers over `nodes` > 1 Ray nodes: one bundle {"CPU": per_node} per node, STRICT_SPREAD (no two
    on one node), rank r on bundle r // per_node claiming 1 CPU of it: each node's ranks sit together and
    --actor-num-nodes is honoured, as slime does per GPU node. None on one node (the workers share its cores,
    unplaced; engine/run.py splits the threads)."""
    if nodes <= 1:
        return None
    return Layout(bundles=[{"CPU": float(per_node)} for _ in range(nodes)], engine_bundles=[],
                  train_bundles=[r // per_node for r in range(nodes * per_node)], train_cpu=1.0,
                  strategy="STRICT_SPREAD")


@dataclass
class Placement:
    layout: Layout
    pg: Any  # ray PlacementGroup

    def strategy(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle,
                                                placement_group_capture_child_tasks=True)


class PlacementBusy(DiagnosisError):
    """RF02, transient: the GPUs exist but other jobs hold them. The place task retries this one (backoff)."""

    retryable = True


class PlacementInfeasible(DiagnosisError):
    """RF02, permanent: no node of this cluster can ever hold a bundle. Not retried."""


def group_name(key: str) -> str:
    """The run's placement-group name: one per --save (or work dir), so a crashed attempt's group is found again."""
    return f"rollflow-{key}"


def remove_leftovers(name: str) -> int:
    """Remove placement groups named `name` left by an earlier attempt of this run (a pending one would take
    the GPUs as soon as they free up). Returns how many were removed."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
    from ray._raylet import PlacementGroupID

    gone = 0
    for pg_id, row in placement_group_table().items():
        if row.get("name") == name and row.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            gone += 1
    return gone


def _why_not_ready(pg) -> str:
    """Ray's own reason: INFEASIBLE (no node can hold a bundle), NO_RESOURCES (busy), QUEUED, ... ('' if unknown)."""
    from ray.util.placement_group import placement_group_table

    try:
        return str((placement_group_table(pg).get("stats") or {}).get("scheduling_state", ""))
    except Exception:
        return ""


def place(layout: Layout, *, timeout_s: float = 300.0, name: str | None = None) -> Placement:
    """Create the placement group and wait for it at most `timeout_s`. When it is not ready: read why from Ray's
    placement-group table, remove the pending group (it would grab the GPUs later), and raise PlacementInfeasible
    (never fits) or PlacementBusy (fits, but the GPUs are held: worth a retry)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(layout.bundles, strategy=layout.strategy, name=name or "")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        why = _why_not_ready(pg)
        remove_placement_group(pg)
        total, free = ray.cluster_resources(), ray.available_resources()
        gpus = sum(b.get("GPU", 0) for b in layout.bundles)
        cpus = sum(b.get("CPU", 0) for b in layout.bundles)
        asked = f"{len(layout.bundles)} bundles: {gpus:g} GPUs, {cpus:g} CPUs"
        facts = {"bundles": layout.bundles, "scheduling_state": why, "cluster_gpus": total.get("GPU", 0.0),
                 "free_gpus": free.get("GPU", 0.0), "timeout_s": timeout_s}
        if why == "INFEASIBLE" or gpus > total.get("GPU", 0.0):
            raise PlacementInfeasible(Diagnosis(
                code="RF02", severity="error",
                what=f"the placement group ({asked}) can never be placed: Ray says {why or 'it does not fit'}; the "
                     f"cluster has {total.get('GPU', 0):g} GPUs and {total.get('CPU', 0):g} CPUs in total",
                fix="ask for fewer GPUs per node or in total: --colocate, a smaller --rollout-num-gpus or "
                    "--actor-num-gpus-per-node, or add nodes", facts=facts)) from None
        raise PlacementBusy(Diagnosis(
            code="RF02", severity="error",
            what=f"the placement group ({asked}) was not ready within {timeout_s:g}s (--placement-timeout): Ray "
                 f"says {why or 'pending'}; {free.get('GPU', 0):g} of the cluster's {total.get('GPU', 0):g} GPUs "
                 f"are free, the rest are held by other jobs",
            fix="wait for the other jobs (the place task retries: --placement-retries, --placement-retry-delay), "
                "free their GPUs (`ray list placement-groups`), or ask for fewer GPUs", facts=facts)) from None
    return Placement(layout, pg)
