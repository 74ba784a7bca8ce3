"""Ray: connect or start the cluster, the port registry, the train workers (engines: engine/rollout/engines.py).

Every worker gets `TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` in its runtime env by default (RF12: processes sharing
one inductor cache corrupt it and fail with JSONDecodeError).
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from engine import startgc

log = logging.getLogger("rollflow.cluster")

#: OMP_WAIT_POLICY=PASSIVE: in a synchronous run the engine and the trainer take turns on the same cores, and an idle
#: side's spinning OpenMP threads slowed the other (CPU demo, 2 cores, interleaved pairs of 50-step runs: step
#: 0.385 → 0.339 s and 0.327 → 0.292 s; bench/results/trl_race.md). Overridable from the environment like the rest.
WORKER_ENV_DEFAULTS = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TOKENIZERS_PARALLELISM": "false",
                       "OMP_WAIT_POLICY": "PASSIVE"}


#: Fault injection (engine/faults.py) set in the driver's environment reaches the engines and workers too, also on a
#: Ray cluster started before the variables were set.
FORWARDED = ("ROLLFLOW_FAULT", "ROLLFLOW_ENGINE_FAULT", "ROLLFLOW_FAULT_STATE")


def worker_env() -> dict[str, str]:
    """Env for every Ray worker: the defaults, overridable by the caller's environment, plus FORWARDED when set."""
    return {**{k: os.environ.get(k, v) for k, v in WORKER_ENV_DEFAULTS.items()},
            **{k: os.environ[k] for k in FORWARDED if k in os.environ}}


def _threads_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """OpenMP/MKL threads are fixed before torch is imported in the worker (set_num_threads later is not enough).
    The train worker's start-up runs without the cyclic collector until its setup returns (engine/startgc.py).
    `extra`: --train-env-vars (train workers only)."""
    t = str(max(1, threads))
    return {"env_vars": {**worker_env(), **(extra or {}), "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t,
                         startgc.DEFER_ENV: "1"}}


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds (RF02, ConfigError) when `--ray-address host:port` (or ray://host:port) does not accept a TCP
    connection, or (host:port) its cluster refuses this driver's Ray token (check_token_auth): ray.init would
    otherwise wait for minutes, or ~20 s. `auto` / `local` are left to Ray."""
    import socket

    from engine.diagnosis import ConfigError, Diagnosis

    if address in ("auto", "local") or ":" not in address:
        return
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {e}" if not isinstance(e, TimeoutError) else f"no answer within {timeout_s:g} s"
        raise ConfigError(Diagnosis(code="RF02", severity="error",
                                    what=f"--ray-address {address} cannot be reached ({why})",
                                    fix="start the cluster (`ray start --head` on that node), check the address and "
                                        "port (the head's GCS port, 6379 by default) and the firewall, or leave "
                                        "--ray-address unset for a local cluster",
                                    facts={"field": "ray_address", "value": address})) from None
    if "://" not in address:
        check_token_auth(address)


#: Where Ray (≥ 2.52) reads a driver's authentication token, in its order; the value is never logged
TOKEN_SOURCES = "RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token"


def check_token_auth(address: str, timeout_s: float = 5.0) -> None:
    """Fail in milliseconds (RF02, ConfigError) when the cluster at `address` refuses this driver's credentials.

    Ray ≥ 2.52 turns token authentication on for a `ray start` cluster wherever ~/.ray/auth_token exists, and every
    local `ray.init` writes that file. A driver that joins by address uses a token only with RAY_AUTH_MODE=token:
    Ray never sends the local one on its own to an address it was given. Without it, ray.init retries for ~20 s and
    ends in "Failed to connect to Ray cluster". One request to the cluster's GCS says which it is. A probe that
    gets no answer within `timeout_s` (not a GCS there) leaves the diagnosis to ray.init."""
    import threading

    refused: list[Exception] = []

    def probe() -> None:
        try:
            from ray._raylet import GcsClient
            from ray.exceptions import AuthenticationError
        except ImportError:  # a Ray before token authentication (2.52)
            return
        try:
            GcsClient(address=address)
        except AuthenticationError as e:
            refused.append(e)
        except Exception:  # noqa: BLE001 -- anything else: ray.init reports it, as before this probe
            pass

    t = threading.Thread(target=probe, name="rollflow-ray-auth-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    if not refused:
        return
    from engine.diagnosis import ConfigError, Diagnosis

    mode = os.environ.get("RAY_AUTH_MODE")
    if mode and mode.lower() == "token":
        what = (f"--ray-address {address}: the Ray cluster refuses this driver's authentication token "
                f"(RAY_AUTH_MODE=token; the token comes from {TOKEN_SOURCES})")
        fix = ("give this driver the cluster's token: `ray get-auth-token` on the head node prints it; set "
               "RAY_AUTH_TOKEN to it (or RAY_AUTH_TOKEN_PATH to a file holding it) where rollflow runs")
    else:
        what = (f"--ray-address {address}: the Ray cluster requires token authentication and this driver has "
                f"{f'RAY_AUTH_MODE={mode}' if mode else 'no RAY_AUTH_MODE'} (Ray uses a token to join a cluster by "
                "address only with RAY_AUTH_MODE=token)")
        fix = (f"run rollflow with RAY_AUTH_MODE=token and the cluster's token in {TOKEN_SOURCES} "
               "(`ray get-auth-token` on the head node prints it); or start the cluster with RAY_AUTH_MODE=disabled "
               "on every node (anyone who reaches its ports can then run code on it)")
    raise ConfigError(Diagnosis(code="RF02", severity="error", what=what, fix=fix,
                                facts={"field": "ray_address", "value": address, "ray_auth_mode": mode or ""}))


#: rollflow's packages, shipped to the nodes of a joined cluster with --ray-code ship (runtime_env py_modules)
PACKAGES = ("engine", "flows", "tasks", "plumbing")


def code_runtime_env(ray_code: str = "ship") -> dict[str, Any]:
    """The job's runtime_env: the worker env, plus rollflow's packages as `py_modules` when shipping (Ray uploads
    each once per content hash into the cluster's store; every node unpacks it before a worker starts)."""
    env: dict[str, Any] = {"env_vars": worker_env()}
    if ray_code == "ship":
        root = Path(__file__).resolve().parents[2]
        env["py_modules"] = [str(root / p) for p in PACKAGES]
        env["excludes"] = ["__pycache__", "*.pyc"]
    return env


#: A local cluster starts no idle Python workers (Ray prestarts one per CPU for the job's default environment):
#: the engines and the train workers have environments of their own (their thread counts), so they cannot use
#: them (the port registry has no process: it lives in the cluster's key-value store). On the 2-core machine
#: the prestarted ones took ~1 s of CPU each from the start-up of the engines and the trainer.
#: Its workers run at the driver's priority (nice 0). Ray's default (`worker_niceness` 15) keeps its own daemons
#: ahead of the workers; here the workers are the work (train ranks, engines) and would lose the CPU to the
#: bookkeeping that engine/background.py lowers to nice 10 (the MLflow sender, the Prefect API server). Measured
#: on the CPU demo: bench/results/trl_race.md, "Ray's workers at the driver's priority". A cluster rollflow joins
#: (--ray-address) keeps its own setting.
LOCAL_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False, "worker_niceness": 0}


#: Ray's head-node services a local cluster leaves out with --ray-services lean (the default): the autoscaler
#: monitor (a local cluster does not scale), the log monitor (it streams worker output to drivers; rollflow starts Ray
#: with log_to_driver=False, and the workers write their log files themselves) and the state/job API server (no
#: dashboard either way; `ray list` and `ray job` need it). Each is a Python process that imports much of Ray: on the
#: 2-core machine together ~2 s of CPU at start-up, and ray.init waits for the API server's port (~1 s).
LEAN_LEAVES_OUT = ("start_monitor", "start_log_monitor", "start_api_server")

#: With --ray-services lean, the raylet's dashboard agent is replaced by engine/cluster/agent_stand_in.py where Ray
#: has no dashboard packages (the `ray` wheel: its agent loads no module and only writes "not in use" for these
#: ports, after importing much of Ray). These are the names of the port files it writes (ray._raylet's constants).
AGENT_PORT_NAMES = ("METRICS_AGENT_PORT_NAME", "METRICS_EXPORT_PORT_NAME", "DASHBOARD_AGENT_LISTEN_PORT_NAME")


#: (GCS address, services) of the local cluster this process started last: what `services_started` reports
_started: tuple[str, str] | None = None


def services_started() -> str | None:
    """`lean` or `full`: the services of the local cluster this process started, when it is the one connected now;
    None for a cluster joined (or started by someone else). The run's summary reports it (placement.ray_services),
    so a `lean` asked for on a Ray that cannot leave them out shows as `full` there, as in the log."""
    import ray

    if _started is None or not ray.is_initialized():
        return None
    address, services = _started
    return services if ray.get_runtime_context().gcs_address == address else None


@contextmanager
def _services(services: str) -> Iterator[str]:
    """Around a local ray.init: with `lean`, the head's Node leaves out LEAN_LEAVES_OUT. These are methods of Ray's
    private Node class (checked for on every start): on a Ray without them the cluster starts with its full
    services, and a warning says so. Yields the services the start gets."""
    from ray._private import node as ray_node

    missing = [m for m in LEAN_LEAVES_OUT if not callable(getattr(ray_node.Node, m, None))]
    if services != "lean" or missing:
        if services == "lean":
            import ray

            log.warning("rollflow: Ray %s has no Node.%s: the local cluster starts with Ray's full services "
                        "(--ray-services lean cannot leave them out; ~1 s more start-up)", ray.__version__,
                        ", Node.".join(missing))
        yield "full"
        return
    restore_agent = _stand_in_for_the_agent()  # first: if it fails, nothing of Ray's has been swapped yet
    saved = {m: ray_node.Node.__dict__.get(m) for m in LEAN_LEAVES_OUT}
    for m in LEAN_LEAVES_OUT:
        setattr(ray_node.Node, m, lambda self, *args, **kwargs: None)
    try:
        yield "lean"
    finally:
        restore_agent()
        for m, fn in saved.items():
            if fn is None:
                delattr(ray_node.Node, m)
            else:
                setattr(ray_node.Node, m, fn)


def _stand_in_for_the_agent() -> Callable[[], None]:
    """Have the raylet a ray.init starts now run agent_stand_in.py instead of Ray's dashboard agent, where that
    agent would only write its ports as not in use (Ray without its dashboard packages). Ray builds the agent's
    command line with `services._build_python_executable_command_memory_profileable` (the interpreter part, then
    the agent's script and arguments): for the agent it returns the stand-in's instead. Returns what puts it back.
    Where Ray has the dashboard's packages the real agent runs (it serves metrics then); where Ray lacks what this
    relies on, too, with a warning."""
    import ray
    from ray._private import ray_constants, services
    from ray._private.utils import get_dashboard_dependency_error

    if get_dashboard_dependency_error() is None:
        return lambda: None  # ray[default]: the agent has work to do
    import ray._raylet as raylet

    build = getattr(services, "_build_python_executable_command_memory_profileable", None)
    component = getattr(ray_constants, "PROCESS_TYPE_DASHBOARD_AGENT", None)
    names = [getattr(raylet, n, None) for n in AGENT_PORT_NAMES]
    persist = getattr(raylet, "persist_port", None)
    if not callable(build) or component is None or not all(names) or not callable(persist):
        log.warning("rollflow: Ray %s does not build its dashboard agent's command as rollflow knows: its agent "
                    "runs (~0.7 s more CPU at start-up)", ray.__version__)
        return lambda: None
    stand_in = [sys.executable, "-u", str(Path(__file__).with_name("agent_stand_in.py")), ",".join(names)]

    def command(kind, *args, **kwargs):
        return list(stand_in) if kind == component else build(kind, *args, **kwargs)

    services._build_python_executable_command_memory_profileable = command

    def restore() -> None:
        services._build_python_executable_command_memory_profileable = build

    return restore


def connect(address: str | None, num_cpus: int | None = None, ray_code: str = "ship",
            services: str = "lean") -> dict[str, Any]:
    """Join `address` (shipping the code as `ray_code` says) or start a local cluster with `services`
    (--ray-services), whatever RAY_ADDRESS says or `ray start` left running on this machine; returns its
    resources."""
    global _started
    import ray

    if address and not ray.is_initialized():
        check_reachable(address)
    if not ray.is_initialized():
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                                      runtime_env={"env_vars": worker_env()})
        if address:
            kwargs["address"] = address
            kwargs["runtime_env"] = code_runtime_env(ray_code)
        else:
            # "local", not None: Ray's default joins a cluster named by RAY_ADDRESS or one `ray start` left on this
            # machine (/tmp/ray/ray_current_cluster), where num_cpus is then refused with Ray's own ValueError
            kwargs["address"] = "local"
            kwargs["num_cpus"] = num_cpus or os.cpu_count()
            kwargs["_system_config"] = LOCAL_SYSTEM_CONFIG
            if os.environ.get("RAY_ADDRESS"):
                log.warning("rollflow: RAY_ADDRESS=%s is set but --ray-address is not: this run starts a local "
                            "Ray cluster of its own; to join that cluster, pass --ray-address auto (or its address)",
                            os.environ["RAY_ADDRESS"])
        with _services("full" if address else services) as started, _quiet_auth_notice(not address):
            _keeping_sigterm(lambda: ray.init(**kwargs))
        if not address:
            _started = (ray.get_runtime_context().gcs_address, started)
    return dict(ray.cluster_resources())


#: Ray's logger for its token-authentication notices (ray/_private/authentication/authentication_token_setup.py)
AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextmanager
def _quiet_auth_notice(local: bool) -> Iterator[None]:
    """Ray (>= 2.52) starts a local cluster with token authentication unless RAY_AUTH_MODE says otherwise, and
    warns at every start that it did ("Set RAY_AUTH_MODE=disabled to opt out"): the first line of every
    `rollflow train`. For the local cluster a run starts that notice is left out; the mode is Ray's, unchanged."""
    if not local:
        yield
        return
    notices = logging.getLogger(AUTH_NOTICE_LOGGER)
    before = notices.level
    notices.setLevel(logging.ERROR)
    try:
        yield
    finally:
        notices.setLevel(before)


def _keeping_sigterm(fn):
    """Run fn (ray.init) and put back the SIGTERM handler it replaces: a Ray driver's handler exits the process
    at once (sys.exit), which would skip the flow's clean-up; the handler before it (Prefect's, inside a flow run)
    unwinds the run instead."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return fn()
    before = signal.getsignal(signal.SIGTERM)
    try:
        return fn()
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def connected() -> bool:
    import ray

    return ray.is_initialized()


_prestarted = False  # the local cluster `rollflow train` started before its flow (plumbing/prestart.py)


def mark_prestarted() -> None:
    global _prestarted
    _prestarted = True


def take_prestarted() -> bool:
    """True once after mark_prestarted(): the run that takes it owns that cluster (shuts it down at close)."""
    global _prestarted
    taken, _prestarted = _prestarted and connected(), False
    return taken


def shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def port_registry():
    """The cluster's one port registry (RF08): kept in the cluster's key-value store (engine/rollout/ports.py),
    shared by every run on this Ray cluster; a plain value that Ray calls carry to the engines and train ranks.
    A node's first reservation begins at a random port of the range (later ones go on from the cluster's cursor):
    another cluster on the same host has a registry of its own, and two that both began at 30000 would offer the
    same ports at once — each is checked free, but only one server can bind it (the other retries: RF08)."""
    import random

    from engine.rollout.ports import PORT_RANGE, PortRegistry

    return PortRegistry(first=random.randrange(*PORT_RANGE))


_prestarted_worker: dict[str, Any] | None = None  # the train worker `rollflow train` started with Ray


def _worker_class(cfg):
    import ray

    from engine.train.worker import TrainWorker

    gpus = 1 if cfg.train_backend == "megatron" else 0
    return ray.remote(num_cpus=0, num_gpus=gpus, max_restarts=0)(TrainWorker)


def _worker_key(cfg, train_iters: int, threads: int) -> tuple:
    return cfg.model_dump_json(), train_iters, threads


def prestart_train_worker(cfg, *, train_iters: int, threads: int, log_dir: str | None = None) -> bool:
    """Start a one-rank CPU run's train worker and its `setup` (imports, model load) right after `rollflow train`
    started Ray: they run on the core the driver leaves idle during the flow's start and preflight (vmstat: ~45%
    idle for those seconds on the 2-core machine), and `TrainGroup` adopts the worker when the run's config, train
    iterations and threads are the same (else it is killed and a new one started, as without this). False where
    the train ranks are placed (GPUs, several ranks or nodes).

    With the engine in the trainer's process (--rollout-engine-process, `log_dir` given), the worker's next call
    starts that engine too: its tokenizer, model and HTTP server come up while the driver is still starting the
    flow (timestamps on the CPU demo: the driver reached place() ~0.7 s after the worker was ready, and the
    engine's start then took 1.1–1.4 s before the loop could begin). place() adopts it with the worker when the
    run's engine spec is the same, its token aside (`prestarted_hosted_spec`)."""
    global _prestarted_worker
    import secrets

    import ray

    from engine.rollout.engines import engine_spec

    if (cfg.train_world_size != 1 or cfg.actor_num_nodes != 1 or not cfg.trains
            or ray.cluster_resources().get("GPU", 0)):
        return False
    w = _worker_class(cfg).options(runtime_env=_threads_env(threads, cfg.train_env_vars)).remote(
        cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=train_iters, threads=threads, lazy=True)
    _prestarted_worker = {"key": _worker_key(cfg, train_iters, threads), "worker": w, "ready": w.setup.remote(None),
                          "engine": None}
    if log_dir is not None and cfg.engine_in_trainer_on_cpu():  # the spec as plan_rollout_engines makes it
        spec = engine_spec(cfg, threads=None, log_dir=log_dir, on_gpu=False, api_key=secrets.token_urlsafe(24))
        _prestarted_worker["engine"] = {"spec": spec, "started": w.engine_start.remote(spec, 0, port_registry())}
    return True


def prestarted_hosted_spec(spec):
    """The spec of the engine the prestarted train worker serves, when it is `spec` but for its token (place()
    then uses it: that server checks its own token); None otherwise."""
    import dataclasses

    hosted = (_prestarted_worker or {}).get("engine")
    if hosted is not None and dataclasses.replace(hosted["spec"], api_key=spec.api_key) == spec:
        return hosted["spec"]
    return None


def take_prestarted_worker(cfg, train_iters: int, threads: int) -> dict[str, Any] | None:
    """The prestarted worker ({worker, ready}) when it was started for this run, once; one started for another
    config is killed."""
    global _prestarted_worker
    import ray

    taken, _prestarted_worker = _prestarted_worker, None
    if taken is None:
        return None
    if taken["key"] == _worker_key(cfg, train_iters, threads):
        return taken
    ray.kill(taken["worker"], no_restart=True)
    log.info("the train worker started with Ray was for another configuration: killed, a new one starts")
    return None


_prestarted_engine: dict[str, Any] | None = None  # the rollout engine `rollflow train` started with Ray


def prestart_engine(cfg, *, threads: int, log_dir: str) -> bool:
    """Start a CPU run's one built-in rollout engine in a process of its own (--async-mode, or
    --rollout-engine-process own) right after `rollflow train` started Ray, beside the train worker: its process
    imports torch and transformers and loads the model (~4 s of one core on the 2-core machine) while the flow
    starts, instead of after place() asks for it. place() adopts it when the run's engine spec and threads are
    the same (its token is then the run's, `take_prestarted_engine`); else it is killed and the engines start as
    without this. False where nothing is prestarted: GPUs, SGLang, several engines, the engine in the trainer's
    process, no engine at all (--load-debug-rollout-data)."""
    global _prestarted_engine
    import secrets

    import ray

    from engine.rollout.engines import engine_spec, new_engine_actor

    if (cfg.rollout_engine != "builtin" or cfg.rollout_num_engines != 1 or cfg.colocate or cfg.no_engines
            or cfg.external_engines or cfg.engine_in_trainer_on_cpu() or ray.cluster_resources().get("GPU", 0)):
        return False
    spec = engine_spec(cfg, threads=threads, log_dir=log_dir, on_gpu=False, api_key=secrets.token_urlsafe(24))
    actor = new_engine_actor(spec, 0, port_registry(), _threads_env(threads))  # EngineGroup's runtime env
    _prestarted_engine = {"spec": spec, "threads": threads, "actor": actor, "started": actor.start.remote()}
    return True


def take_prestarted_engine(spec, threads: int) -> dict[str, Any] | None:
    """The prestarted engine ({spec, actor, started}) when it was started for this spec (its run token aside) and
    these threads, once; the caller then uses its spec (the token its server checks). One started for another
    spec, or when the run has no engine process of its own (spec None), is killed."""
    global _prestarted_engine
    import dataclasses

    import ray

    taken, _prestarted_engine = _prestarted_engine, None
    if taken is None:
        return None
    if spec is not None and dataclasses.replace(taken["spec"], api_key=spec.api_key) == spec \
            and taken["threads"] == threads:
        return taken
    ray.kill(taken["actor"], no_restart=True)
    log.info("the rollout engine started with Ray was for another configuration: killed, a new one starts")
    return None


class TrainGroup:
    """The DP train workers; every call waits at most `timeout_s`."""

    def __init__(self, cfg, *, train_iters: int, timeout_s: float, threads: int, placement=None, registry=None,
                 wait: bool = True):
        """Start the workers; with wait=False return at once and call `wait_ready` later (the caller starts
        other actors meanwhile). `placement`: a GPU layout's placement group (rank r on bundle
        `layout.train_bundles[r]`) or the CPU train group of `train_placement` (several nodes); None: anywhere."""
        import ray

        self.timeout_s = timeout_s
        world = cfg.train_world_size
        # Megatron's rank order is tp-cp-ep-dp-pp: rank r belongs to DP replica (r // TP) mod DP.
        tp, dp = cfg.tensor_model_parallel_size, cfg.dp_size
        self.dp_rank_of = [(r // tp) % dp for r in range(world)]
        # Megatron shards the model over ranks, the torch backend over DP ranks (FSDP2): gathering the weights is
        # then a collective every rank joins
        self.collective = cfg.train_backend == "megatron" or world > 1
        cls = _worker_class(cfg)
        cfg_dict = cfg.model_dump()
        lay = placement.layout if placement is not None else None
        taken = take_prestarted_worker(cfg, train_iters, threads)
        self.prestarted = taken is not None and world == 1 and lay is None  # adopted (prestart_train_worker)
        # the engine it serves, started after its setup ({spec, started}: the start call), when it was asked to
        self.hosted_engine = taken.get("engine") if self.prestarted else None
        self.nodes: list[dict[str, Any]] = []  # per rank: node_ip, node_id, pid (wait_ready fills it)
        self._seen: dict[str, list[bool]] = {}  # directory → per rank: its node sees it (`seeing`)
        self._group_engines: list | None = None  # the engines of rank 0's weight-update group (`group_push`)
        if taken is not None and not self.prestarted:
            ray.kill(taken["worker"], no_restart=True)
        if self.prestarted:
            self.workers, self.master, self._ready = [taken["worker"]], None, [taken["ready"]]
            if wait:
                self.wait_ready()
            return

        def where(r: int) -> dict:  # a GPU layout puts rank r on bundle r (colocated: 0.8 of it, see placement.py)
            if lay is None or not lay.train_bundles:
                return {}
            return {"num_gpus": lay.train_gpu_fraction, "num_cpus": lay.train_cpu,
                    "scheduling_strategy": placement.strategy(lay.train_bundles[r])}

        self.workers = [cls.options(runtime_env=_threads_env(threads, cfg.train_env_vars), **where(r)).remote(
            cfg_dict, rank=r, world_size=world, master=None, train_iters=train_iters, threads=threads, lazy=True)
            for r in range(world)]
        # The rendezvous is rank 0's node address and a port of that node from the cluster's one allocator (RF08):
        # rank 0 picks it once it runs there, and every rank's setup waits for that answer (Ray passes the ref on).
        self.master = self.workers[0].rendezvous.remote(registry or port_registry()) if world > 1 else None
        self._ready = [w.setup.remote(self.master) for w in self.workers]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "TrainGroup":
        """Wait (at most timeout_s) until every worker has joined the group, built its backend and loaded the
        model; `nodes` then says where each rank runs and `master` is the rendezvous address."""
        import ray

        if not self.nodes:
            self.nodes = ray.get(self._ready, timeout=self.timeout_s)
            if self.master is not None:
                self.master = ray.get(self.master, timeout=self.timeout_s)
        return self

    def _all(self, method: Callable[[Any], Any], *args, per_rank: list | None = None, **kwargs) -> list[Any]:
        """method(worker), e.g. `lambda w: w.train_step`, called on every worker (rank r first gets per_rank[r])."""
        import ray

        refs = [method(w).remote(*((per_rank[r],) if per_rank is not None else ()), *args, **kwargs)
                for r, w in enumerate(self.workers)]
        return ray.get(refs, timeout=self.timeout_s)

    def set_rollout(self, per_rank_steps: list[list[list[Any]]], rewards: list[float],
                    need_ref: bool, normalized: bool = False, old_from: str = "forward",
                    rollout_id: int = -1, old_version: int | None = None) -> list[dict[str, float]]:
        """per_rank_steps: one entry per DP replica; every TP / PP rank of a replica gets the same micro-batches.
        Every rank also gets the rewards of the whole rollout (see engine.train.worker)."""
        return self._all(lambda w: w.set_rollout, rewards, need_ref, normalized, old_from, rollout_id, old_version,
                         per_rank=[per_rank_steps[d] for d in self.dp_rank_of])

    def set_rollout_and_step(self, per_rank_steps: list[list[list[Any]]], rewards: list[float], need_ref: bool,
                             normalized: bool, old_from: str, global_batch_size: int, rollout_id: int = -1
                             ) -> tuple[list[dict[str, float]], list[dict[str, Any]] | None]:
        """set_rollout and, where the workers defer the mismatch to the step's forward, train_step(0) in the same
        call (engine.train.worker.set_rollout_and_step): (facts per rank, step 0's metrics per rank or None)."""
        pairs = self._all(lambda w: w.set_rollout_and_step, rewards, need_ref, normalized, old_from,
                          global_batch_size, rollout_id, per_rank=[per_rank_steps[d] for d in self.dp_rank_of])
        stepped = [out is not None for _, out in pairs]
        if any(stepped) and not all(stepped):  # every rank has the same backend and flags: never expected
            raise RuntimeError(f"train ranks disagree on running step 0 with set_rollout: {stepped}")
        return [f for f, _ in pairs], [out for _, out in pairs] if all(stepped) else None

    def train_step(self, k: int, global_batch_size: int, policy: bool = True) -> list[dict[str, Any]]:
        return self._all(lambda w: w.train_step, k, global_batch_size, policy)

    # ---- directories: nothing assumed shared (engine/cluster/nodes.py) ----------------------------------------
    def seeing(self, path: str) -> list[bool]:
        """Per rank: whether its node sees the driver's directory `path`'s parent (probed once per parent)."""
        from engine.cluster.nodes import Probe

        parent = str(Path(path).resolve().parent)
        if parent not in self._seen:
            with Probe(parent) as p:
                self._seen[parent] = self._all(lambda w: w.sees, p.file, p.token)
            if blind := [r for r, ok in enumerate(self._seen[parent]) if not ok]:
                log.info("train rank(s) %s do not see %s (nodes %s): their files go through Ray's object store",
                         blind, parent, sorted({self.nodes[r]["node_ip"] for r in blind} if self.nodes else ()))
        return self._seen[parent]

    @property
    def blind(self) -> dict[str, list[int]]:
        """Directory → the ranks that did not see it (their files went through Ray's object store)."""
        return {d: [r for r, ok in enumerate(seen) if not ok] for d, seen in self._seen.items() if not all(seen)}

    def _shipped(self, path: str) -> list[bool]:
        return [not s for s in self.seeing(path)]

    def save(self, path: str, save_optim: bool = True) -> list[str]:
        """The ranks write `path`; a rank whose node does not see it returns its files, written here."""
        from engine.cluster.nodes import unpack_dir

        outs = self._all(lambda w: w.save_to, path, save_optim, per_rank=self._shipped(path))
        for out in outs:
            if out["blobs"]:
                unpack_dir(out["blobs"], path)
        return [f for out in outs for f in out["files"]]

    def _files_for(self, path: str) -> list:
        """Per rank: None (its node sees `path`) or a reference to `path`'s files in Ray's object store."""
        import ray

        from engine.cluster.nodes import pack_dir

        ship = self._shipped(path)
        ref = ray.put(pack_dir(path)) if any(ship) else None
        return [ref if s else None for s in ship]

    def load(self, path: str, load_optim: bool = True) -> None:
        self._all(lambda w: w.load_from, path, load_optim, per_rank=self._files_for(path))

    def update_ref(self) -> None:
        self._all(lambda w: w.update_ref)

    def profile_setup(self, directory: str, memory_dir: str) -> None:
        """--use-pytorch-profiler / --record-memory-history on every rank (engine/train/profiling.py)."""
        self._all(lambda w: w.profile_setup, directory, memory_dir)

    def profile_end(self, rollout_id: int) -> list[list[str]]:
        """After a rollout's last step: per rank, the profile / snapshot files written for it."""
        return self._all(lambda w: w.profile_end, rollout_id)

    def save_train_data(self, pattern: str, rollout_id: int) -> list[str]:
        return self._all(lambda w: w.save_train_data, pattern, rollout_id)

    def load_weights(self, path: str, ref: bool = False) -> None:
        """Policy (ref=False) or reference weights from an HF dir or a checkpoint iteration, on every rank."""
        self._all(lambda w: w.load_weights_from, path, ref, per_rank=self._files_for(path))

    def save_weights(self, path: str, engines: list[str] | None = None) -> str:
        """The policy's weights as a safetensors directory at `path` (rank 0 writes; every rank joins a sharded
        gather); `engines` (their URLs): a disk sync's, for --custom-update-weight-post-write-path."""
        self._all(lambda w: w.save_weights, path, engines)
        return path

    def weights_ref(self) -> tuple[Any, float]:
        """(a reference to rank 0's weights in Ray's object store, their MB); the driver never holds the weights."""
        import ray

        joined = self.workers if self.collective else self.workers[:1]
        calls = [w.numpy_state.options(num_returns=2).remote() for w in joined]
        mbs = ray.get([mb for _, mb in calls], timeout=self.timeout_s)
        return calls[0][0], mbs[0]

    def group_push(self, engines: list[tuple[str, int]], version: int, *, api_key: str | None, backend: str,
                   timeout_s: float) -> tuple[list[dict], int]:
        """--weight-sync-method distributed: rank 0 broadcasts the weights to `engines` ((url, ranks) each) as
        `version`; the group is (re)opened first when these are not the engines it holds (the first sync, a
        restarted engine). Returns the engines' answers and the bytes each got."""
        if self._group_engines != engines:
            self._all(lambda w: w.group_open, engines, api_key, backend, timeout_s)
            self._group_engines = engines
        try:
            return self._all(lambda w: w.group_push, version)[0]
        except BaseException:
            self._group_engines = None  # a broken broadcast leaves the group unusable: the next push reopens it
            raise

    def group_close(self) -> None:
        if self._group_engines is not None:
            self._group_engines = None
            self._all(lambda w: w.group_close)

    def ipc_export(self, dtype: str, bucket_bytes: int, exporters: set[int]) -> list[list]:
        """Per rank, the CUDA IPC buckets of its weights in `dtype` (empty for ranks not in `exporters`); the
        workers keep the memory until `ipc_release`."""
        return self._all(lambda w: w.ipc_export, dtype, bucket_bytes,
                         per_rank=[r in exporters for r in range(len(self.workers))])

    def ipc_release(self) -> None:
        self._all(lambda w: w.ipc_release)

    def score(self, mb) -> Any:
        """Log-probs [T] of one micro-batch under the policy (from a rank whose answer counts)."""
        return self.score_start(mb)()

    def score_start(self, mb) -> Callable[[], Any]:
        """`score`, asked of every worker now and waited for by the function it returns: the workers take it before
        any call asked after it, so it scores the weights they hold now while the driver does something else."""
        import ray

        refs = [w.score.remote(mb) for w in self.workers]
        return lambda: next(lp for lp, counts in ray.get(refs, timeout=self.timeout_s) if counts)

    def offload(self) -> None:
        self._all(lambda w: w.offload)

    def memory(self) -> list[dict[str, float]]:
        """Each worker's CUDA memory since the last call ({} on CPU): see engine.train.worker.gpu_memory."""
        return self._all(lambda w: w.memory)

    def export_hf(self, path: str) -> None:
        from engine.cluster.nodes import unpack_dir

        for blobs in self._all(lambda w: w.export_hf_to, path, per_rank=self._shipped(path)):
            if blobs:
                unpack_dir(blobs, path)

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
