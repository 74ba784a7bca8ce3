"""The run's rollout engines: one Ray actor per engine on its placement-group bundle, who is serving, restarts.

An engine serves once its server answered `/health_generate` and — after a restart — once it has been given the
current weights (`resync`). The rollout loop asks `serving()` for URLs and `report_failure(url)` when a request
dies at the connection level; with `--use-fault-tolerance` the health monitor (engine/rollout/health.py) then
restarts that engine on the same bundle. `lock` is held by a restart and by every weight sync, so an engine never
joins halfway through a sync and never misses one.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from engine import startgc
from engine.rollout.actor import EngineActor, EngineSpec
from engine.rollout.client import EngineClient

log = logging.getLogger("rollflow.rollout")


@dataclass
class Slot:
    index: int
    bundle: int
    actor: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    serving: bool = False
    restarts: int = 0

    @property
    def url(self) -> str | None:
        return self.info.get("url")


class HostedEngine:
    """Rollout engine `index` served from a thread of a train worker's process (--rollout-engine-process trainer),
    as the group sees an engine actor: `handle.<method>.remote(...)` calls EngineActor.<method> in that process."""

    def __init__(self, host, spec: EngineSpec, index: int, registry):
        self.host = host
        self.start = SimpleNamespace(remote=lambda: host.engine_start.remote(spec, index, registry))

    def __getattr__(self, name: str) -> SimpleNamespace:
        if name.startswith("_"):
            raise AttributeError(name)
        return SimpleNamespace(remote=lambda *args: self.host.engine_call.remote(name, *args))


class EngineGroup:
    def __init__(self, spec: EngineSpec, placement, registry, *, fault_tolerant: bool = False,
                 runtime_env: dict | None = None, host=None, prestarted: dict | None = None):
        """host: the train worker actor whose process serves the (one) engine (--rollout-engine-process trainer);
        None: every engine is a Ray actor of its own. prestarted: engine 0's actor and its `start` call, made by
        `rollflow train` right after Ray started (engine/cluster `prestart_engine`, for this very spec; with a host,
        the `engine_start` call made on the prestarted train worker, `prestart_train_worker`): `launch` adopts them
        instead of starting an actor."""
        self.spec, self.placement, self.registry = spec, placement, registry
        self.host = host
        self.prestarted = prestarted
        self.fault_tolerant = fault_tolerant
        self.runtime_env = runtime_env or {}
        self._starting: list = []  # the start calls `launch` made and `wait_started` waits for
        self.slots = [Slot(i, b) for i, b in enumerate(placement.layout.engine_bundles)]
        self.lock = threading.RLock()
        self.released = False  # colocated: memory handed to the trainer; health checks pause meanwhile
        self.resync: Callable[[list[Slot]], None] | None = None  # gives these engines the current weights
        self.failures = threading.Event()  # set by report_failure: wakes the health monitor
        self.monitor = None
        self.api_key = spec.api_key  # every request to these engines carries it

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _new_actor(self, slot: Slot):
        if self.host is not None:
            return HostedEngine(self.host, self.spec, slot.index, self.registry)
        lay = self.placement.layout
        return new_engine_actor(self.spec, slot.index, self.registry, self.runtime_env,
                                gpus=lay.engine_gpu_fraction, scheduling_strategy=self.placement.strategy(slot.bundle),
                                gpu_visible=bool(lay.gpus_per_engine))

    def start(self) -> "EngineGroup":
        """Start every engine in parallel; wait at most the start timeout (a failure names the engine)."""
        return self.launch().wait_started()

    def launch(self) -> "EngineGroup":
        """Ask every engine to start and return at once (`wait_started` waits): the caller can start other
        actors meanwhile."""
        adopted, self.prestarted = self.prestarted, None
        self._starting = []
        for s in self.slots:
            if adopted is not None and s.index == 0:  # a hosted engine's actor is its host's (`_new_actor`)
                s.actor = adopted["actor"] if "actor" in adopted else self._new_actor(s)
                self._starting.append(adopted["started"])
            else:
                s.actor = self._new_actor(s)
                self._starting.append(s.actor.start.remote())
        return self

    def wait_started(self) -> "EngineGroup":
        """Wait for the engines `launch` started (at most the start timeout); a second call returns at once."""
        import ray

        infos = ray.get(self._starting, timeout=self.spec.start_timeout_s + 30)
        for s, info in zip(self.slots, infos):
            s.info, s.serving = info, True
        self._starting = []
        return self

    def _kill(self, slot: Slot) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from engine.rollout.actor import kill_process_group

        if slot.actor is None:
            return
        if isinstance(slot.actor, HostedEngine):  # the trainer's process: stop its server, keep the process
            try:
                ray.get(slot.actor.stop.remote(), timeout=15)
            except Exception as e:
                log.warning("rollout engine %d in the train worker's process did not stop: %s", slot.index, e)
            slot.actor = None
            return
        try:
            ray.get(slot.actor.stop.remote(), timeout=15)
        except Exception:  # the actor is dead or hung: a server it launched may still hold its GPUs
            pgid = slot.info.get("child_pid")
            if pgid:
                on_node = NodeAffinitySchedulingStrategy(slot.info["node_id"], soft=False)
                try:
                    ray.get(ray.remote(num_cpus=0)(kill_process_group).options(
                        scheduling_strategy=on_node).remote(pgid), timeout=30)
                except Exception as e:
                    log.error("could not kill engine %d's server process group %s: %s", slot.index, pgid, e)
        ray.kill(slot.actor, no_restart=True)
        slot.actor = None

    def restart(self, slot: Slot) -> None:
        """Replace the engine of `slot` on the same bundle; it serves again only with the current weights."""
        import ray

        with self.lock:
            slot.serving = False
            old = slot.url
            self._kill(slot)
            slot.actor = self._new_actor(slot)
            slot.info = ray.get(slot.actor.start.remote(), timeout=self.spec.start_timeout_s + 30)
            if self.resync is not None:
                self.resync([slot])
            slot.restarts += 1
            slot.serving = True
        log.warning("rollout engine %d restarted: %s → %s (restart %d)", slot.index, old, slot.url, slot.restarts)

    def revive(self, timeout_s: float) -> list[int]:
        """Restart every engine that is out of service or fails `/health_generate` within `timeout_s` (a retried
        rollout starts with all engines serving, with or without --use-fault-tolerance). Returns their indices."""
        dead = [s for s in self.slots if not (s.serving and self.healthy(s, timeout_s))]
        for s in dead:
            self.restart(s)
        return [s.index for s in dead]

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        for s in self.slots:
            s.serving = False
            self._kill(s)

    # ---- what the rollout loop sees --------------------------------------------------------------------------
    def serving(self) -> list[str]:
        return [s.url for s in self.slots if s.serving and s.url]

    @property
    def join_rows(self) -> int:
        """Built-in engines on CPUs answer a batch only once all its rows are done (no continuous batching there),
        so a rollout's groups that start together go to each as one /generate of at most its batch's rows
        (--sglang-max-running-requests; engine/rollout/loop.py:_Round): the same batch, one HTTP exchange instead
        of one per group. SGLang and GPU engines deliver each request as it finishes (rewards scored meanwhile, a
        dynamic filter's round cut early): 0, one request per group."""
        return self.spec.max_batch if self.spec.kind == "builtin" and not self.placement.layout.gpus_per_engine \
            else 0

    def serving_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.serving and s.url]

    @property
    def urls(self) -> list[str]:
        return self.serving()

    def report_failure(self, url: str) -> None:
        for s in self.slots:
            if s.url == url and s.serving:
                s.serving = False
                log.warning("rollout engine %d at %s failed a request; taken out of service", s.index, url)
        self.failures.set()

    def healthy(self, slot: Slot, timeout_s: float) -> bool:
        return slot.url is not None and self.client(slot.url).health_generate(timeout_s)

    def client(self, url: str, timeout_s: float = 60.0) -> EngineClient:
        return EngineClient(url, timeout_s=timeout_s, api_key=self.api_key)

    def wait_serving(self, count: int, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(self.serving()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.serving())} of {count} rollout engines serving after "
                                   f"{timeout_s:.0f}s")
            time.sleep(0.1)
        return self.serving()

    # ---- pause (partial rollouts) ------------------------------------------------------------------------------
    def pause_generation(self) -> int:
        """/pause_generation (mode abort) on every serving engine; returns how many requests were aborted. Call
        under `lock`, and continue_generation() after the weight update."""
        return sum(int(self.client(url).pause_generation().get("aborted", 0)) for url in self.serving())

    def continue_generation(self) -> None:
        for url in self.serving():
            self.client(url).continue_generation()

    def check_weights(self, action: str) -> dict[str, dict]:
        """/weights_checker `action` on every serving engine: its answer by URL (--check-weight-update-equal); an
        engine that gave none answers success false with the error."""
        import httpx

        from engine.rollout.client import EngineError

        out = {}
        for url in self.serving():
            try:
                out[url] = self.client(url).check_weights(action)
            except (EngineError, httpx.HTTPError) as e:
                out[url] = {"success": False, "message": f"{type(e).__name__}: {e}"}
        return out

    # ---- memory (colocated runs) -----------------------------------------------------------------------------
    def release_memory(self) -> None:
        with self.lock:
            for url in self.serving():
                self.client(url).release_memory()
            self.released = True

    def resume_memory(self) -> None:
        with self.lock:
            for url in self.serving():
                self.client(url).resume_memory()
            self.released = False


def new_engine_actor(spec: EngineSpec, index: int, registry, runtime_env: dict, *, gpus: float = 0.0,
                     scheduling_strategy=None, gpu_visible: bool = False):
    """An engine actor (its `start` not yet called): EngineGroup's on its bundle, or `rollflow train`'s prestarted
    one (no strategy: anywhere on the one-node local cluster). Its process starts up without the cyclic collector
    until `start` returns (engine/startgc.py); gpu_visible: SGLang addresses GPUs base_gpu_id.. itself, so Ray must
    not hide the others."""
    import ray

    cls = ray.remote(max_restarts=0, max_concurrency=4)(EngineActor)
    env = dict(runtime_env.get("env_vars", {}))
    env[startgc.DEFER_ENV] = "1"
    if gpu_visible:
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": gpus, "runtime_env": {**runtime_env, "env_vars": env}}
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    return cls.options(**options).remote(spec, index, registry)


def engine_spec(cfg, *, threads: int | None, log_dir: str, on_gpu: bool, api_key: str | None = None) -> EngineSpec:
    """The RunConfig's engine settings (one place for the mapping); on_gpu: the engines sit on GPU bundles; api_key:
    the run's engine token (--sglang-api-key when set, so SGLang and rollflow's clients agree on it)."""
    from pathlib import Path

    routed = cfg.use_rollout_routing_replay
    sglang_args = dict(cfg.sglang_args)
    if routed and cfg.rollout_engine == "sglang":  # SGLang records the routed experts only when launched so
        sglang_args["enable-return-routed-experts"] = True
    return EngineSpec(kind=cfg.rollout_engine, model_path=cfg.hf_checkpoint, log_dir=log_dir,
                      tp_size=cfg.rollout_num_gpus_per_engine if cfg.rollout_engine == "sglang" else 1,
                      threads=threads, max_new_tokens=cfg.rollout_max_response_len,
                      deterministic=bool(cfg.sglang_args.get("enable-deterministic-inference")),
                      sglang_args=sglang_args, python=cfg.rollout_engine_python, colocate=cfg.colocate,
                      start_timeout_s=cfg.rollout_engine_start_timeout,
                      dtype=cfg.engine_dtype("cuda" if on_gpu else "cpu"),
                      max_batch=_count_arg(cfg, "max-running-requests") or 256,
                      api_key=str(cfg.sglang_args["api-key"]) if cfg.sglang_args.get("api-key") else api_key,
                      weight_dirs=[str(Path(cfg.work_dir).resolve() / "weights")],
                      cuda_graphs=not cfg.sglang_args.get("disable-cuda-graph"),
                      compile_decode=bool(cfg.sglang_args.get("enable-torch-compile")),
                      max_total_tokens=_count_arg(cfg, "max-total-tokens"), model_impl=cfg.model_impl,
                      return_routed_experts=routed)


def _count_arg(cfg, key: str) -> int | None:
    """A positive integer SGLang flag the built-in engine uses (`--sglang-KEY N`), None when not given."""
    from engine.diagnosis import ConfigError, Diagnosis

    v = cfg.sglang_args.get(key)
    if v is None:
        return None
    try:
        n = int(v) if not isinstance(v, bool) else 0
    except (TypeError, ValueError):
        n = 0
    if n <= 0:
        raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=f"--sglang-{key} {v!r} is not a positive "
                                    "integer", fix=f"pass --sglang-{key} N with N ≥ 1, or leave it out"))
    return n
