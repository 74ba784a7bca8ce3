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
— but it pins each engine to a slot that a restart reuses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.doctor.diagnosis import ConfigError, Diagnosis, DiagnosisError

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


@dataclass
class Placement:
    layout: Layout
    pg: Any  # ray PlacementGroup

    def strategy(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle,
                                                placement_group_capture_child_tasks=True)


def place(layout: Layout, *, timeout_s: float = 300.0, name: str | None = None) -> Placement:
    """Create the placement group and wait for it at most `timeout_s`; on timeout remove it and fail with RF02."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(layout.bundles, strategy="PACK", name=name or "")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)  # a pending group would grab the resources later
        have = ray.cluster_resources()
        gpus = sum(b.get("GPU", 0) for b in layout.bundles)
        cpus = sum(b.get("CPU", 0) for b in layout.bundles)
        raise DiagnosisError(Diagnosis(
            code="RF02", severity="error",
            what=f"the placement group ({len(layout.bundles)} bundles: {gpus:g} GPUs, {cpus:g} CPUs) was not ready "
                 f"within {timeout_s:.0f}s; the cluster has {have.get('GPU', 0):g} GPUs and {have.get('CPU', 0):g} "
                 f"CPUs in total",
            fix="free the GPUs held by other jobs, or ask for fewer: --colocate, a smaller --rollout-num-gpus or "
                "--actor-num-gpus-per-node",
            facts={"bundles": layout.bundles, "cluster": dict(have)})) from None
    return Placement(layout, pg)
