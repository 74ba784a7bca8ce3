"""One training run: the live handles `place` sets once (engines, train workers, data, tracker, how they are placed)
and `state`, what changes while it trains (history, weight version, grad norms, runtime diagnoses).

A plain object (not a dataclass) so Prefect passes it to tasks as an opaque handle and never walks into it.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.checkpoint import StartPoint
from engine.config import RunConfig


@dataclass
class RunState:
    """What changes while the run trains; the checkpoint carries `history`, a resume restores it."""
    history: dict[str, dict[int, float]] = field(default_factory=dict)  # metric → {step: value}
    weight_version: int = 0  # the weights the engines serve (rollout id + 1 after that rollout's sync)
    data_positions: dict = field(default_factory=dict)  # rollout id → the data source's state when it started
    partial: dict = field(default_factory=dict)  # --partial-rollout: rollout id in flight → its PartialBuffer
    resume_partial: dict = field(default_factory=dict)  # rollout id → (data position, PartialBuffer) from a checkpoint
    loop_started: float = 0.0  # perf_counter when the loop over rollout ids began
    loop_started_unix: float | None = None  # the same moment as time.time() (bench/trl_race.py: start-up)
    done_at: dict = field(default_factory=dict)  # rollout id → seconds into the loop when it finished training
    loop_seconds: float | None = None  # its wall time (the summary's loop_wall_s: async vs sync, bench/async.py)
    start_rollout_id: int = 0  # the first rollout this process runs (marker + 1 when resumed)
    grad_norms: list[float] = field(default_factory=list)  # per optimizer step of this process (RF09's median)
    diagnoses: list = field(default_factory=list)  # runtime warnings (Diagnosis, e.g. RF09), published by the tasks
    started_at: float = field(default_factory=time.time)


def run_key(cfg: RunConfig) -> str:
    """12 hex of --save (else the work dir): names what belongs to this run on a shared cluster (its placement
    group, its Prefect artifacts), so a later attempt of the same run finds an earlier attempt's."""
    import hashlib

    return hashlib.sha256((cfg.save or str(Path(cfg.work_dir).resolve())).encode()).hexdigest()[:12]


class Run:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self._history_lock = threading.RLock()
        self.plan = cfg.batch
        self.work_dir = Path(cfg.work_dir).resolve()
        self.state = RunState()
        self.tokenizer = None
        self.eos_ids: list[int] = []
        self.dataset = None
        self.eval_sets: dict[str, list] = {}  # --eval-prompt-data / --eval-config: name → rows
        self.eval_datasets: dict[str, Any] = {}  # name → its resolved EvalDataset (keys, reward, sampling)
        self.reward_model = None
        self.engines = None  # engine.rollout.engines.EngineGroup
        self.served_versions: set[str] = set()  # every weight_version this process pushed (stages.shared_server)
        self.placement = None  # engine.cluster.placement.Placement
        self.train_placement = None  # CPU train workers over several nodes (stages.place_train_workers)
        self.ports = None  # the cluster's port registry (engine/rollout/ports.py: in its key-value store)
        self.sample_filter = None  # --dynamic-sampling-filter-path, loaded
        self.hooks = None  # engine.rollout.hooks.Hooks: slime's hook flags, loaded by stages.place
        self.data_source = None  # --data-source-path's object, else the prompt file's rows (stages.data_source)
        self.train_group = None
        self.tracker = None
        self.start = StartPoint("fresh")  # set by stages.place: fresh, HF weights or a verified iteration
        self.ref_dir: str | None = None  # reference weights to load (None: --hf-checkpoint's)
        self.store = None  # checkpoint.Store of --save (local or s3://)
        self.staging = self.work_dir / "ckpt-staging"  # local scratch for S3 uploads / downloads
        self.memory_dumped = False  # --record-memory-history: the snapshot --memory-snapshot-num-steps asks for is out
        self.flow_run_id: str | None = None
        self.flow_run_url: str | None = None
        self.cluster: dict[str, Any] = {}
        self.owns_ray = True  # this run connected to (or started) Ray, so close() disconnects
        self.on_gpu = False  # the engines (and colocated trainers) sit on GPU bundles
        self.prestarted_engine: dict[str, Any] | None = None  # adopted from `rollflow train` (stages.place)
        self.engine_dtype = "float32"  # the built-in engines' dtype (--rollout-dtype, resolved by place)
        self.engine_spec = None  # engine.rollout.actor.EngineSpec (stages.plan_rollout_engines)
        self.engine_in_trainer = False  # the engine serves from train rank 0's process (--rollout-engine-process)
        # cuda_ipc | object_store | in_process | http | disk | distributed | none: place decides
        # (stages.sync_transport); until then what the flag says
        self.sync_transport = cfg.weight_sync_method if cfg.weight_sync_method != "tensor" else "object_store"
        self.probe: list[list[int]] = []  # prompts every engine answers after a sync, scored by the trainer (RF14)
        self.probe_seqs: list[tuple[list[int], list[int]]] = []  # (prompt, sampled answer): later probes score them
        # weight version → what the trainer handed over for it (stages.handed): a retried sync reuses it
        self.handed_over: dict[int, dict[str, Any]] = {}

    # ---- CPU threads ------------------------------------------------------------------------------------------
    # Processes that run at the same time share the cores: with --async-mode the engines and the train workers
    # overlap, so each gets cores / (workers + engines) (on a busy 2-core machine OpenMP with 2 threads per process
    # was 3-4x slower than 1 thread: measured). Synchronous runs alternate — the engines generate while the
    # trainer waits, then the trainer trains while the engines wait — so each side gets the cores its own
    # processes share, less one core left to the driver: (cores - 1) / max(workers, engines). The driver is not
    # idle while a side computes (the rollout loop's HTTP, Prefect's task and event bookkeeping, MLflow, the local
    # Prefect API server: ~0.75 of a core at the CPU demo's 3 steps/s), and an OpenMP team whose threads it
    # preempts waits for them at every parallel region. The CPU demo's train step, the same micro-batches in one
    # process with OMP_WAIT_POLICY=PASSIVE: 2 threads 164 ms, 1 thread 89 ms; in the flow, interleaved pairs of
    # 60-step runs: train stage 0.169 → 0.113 s and 0.146 → 0.114 s (bench/results/trl_race.md).
    @property
    def cpus(self) -> int:
        return int(self.cfg.num_cpus or os.cpu_count() or 1)

    @property
    def threads_per_process(self) -> int:
        dp = self.cfg.dp_size
        engines = 0 if self.cfg.external_engines else self.cfg.rollout_num_engines  # external: not our cores
        if self.cfg.async_mode != "off":
            return max(1, self.cpus // (dp + engines))
        return max(1, (self.cpus - 1) // max(dp, engines))

    @property
    def train_threads(self) -> int:
        return self.cfg.train_threads or self.threads_per_process

    @property
    def train_dtype(self) -> str:
        return "bfloat16" if self.cfg.bf16 else "float32"

    @property
    def key(self) -> str:
        return run_key(self.cfg)

    @property
    def origin(self) -> dict[str, Any]:
        """What this run starts from (--load, --ckpt-step), recorded in its checkpoints."""
        from engine.checkpoint import origin_of

        return origin_of(self.cfg.load, self.cfg.ckpt_step)

    @property
    def history(self) -> dict[str, dict[int, float]]:
        """Every metric recorded so far by step (state.history; read-only here: `record` writes)."""
        return self.state.history

    def record(self, metrics: dict[str, float], step: int) -> None:
        with self._history_lock:  # async mode: a rollout ahead publishes while the flow trains and saves
            for k, v in metrics.items():
                self.state.history.setdefault(k, {})[step] = float(v)

    def history_copy(self) -> dict[str, dict[int, float]]:
        """A snapshot of the history, safe to iterate while stages running in other threads record."""
        with self._history_lock:
            return {k: dict(d) for k, d in self.state.history.items()}

    def close(self) -> None:
        from engine.cluster import shutdown

        for closer in (self._leave_weight_group, self._stop_engines, self._stop_train):
            try:
                closer()
            except Exception:
                pass
        if self.owns_ray:
            shutdown()
        shutil.rmtree(self.work_dir / "weights", ignore_errors=True)
        shutil.rmtree(self.staging, ignore_errors=True)

    def _leave_weight_group(self) -> None:
        """--weight-sync-method distributed: the engines leave the run's weight-update group (an external server
        outlives the run, and a group it still held would refuse the next run's)."""
        if self.train_group is not None:
            self.train_group.group_close()

    def _stop_engines(self) -> None:
        if self.engines:
            self.engines.stop()
        if self.placement is not None and (self.cfg.ray_address or not self.owns_ray):  # else: gone with shutdown()
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement.pg)

    def _stop_train(self) -> None:
        if self.train_group:
            self.train_group.shutdown()
        if self.train_placement is not None and (self.cfg.ray_address or not self.owns_ray):
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.train_placement.pg)
