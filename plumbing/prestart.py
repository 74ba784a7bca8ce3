"""Start-up side by side (issue 18): `rollflow train` launches the ephemeral Prefect API server (its own process,
~4 s of one core, at nice 10), starts Ray while a thread imports the stages, then the train worker (one-rank CPU
runs); the flow then finds all of them running. Run one after the other, each left a core idle (measured with
vmstat: ~50% idle for the first 15 s of a demo start-up).

Ray heads the longest chain: the train worker can only start once Ray is up, and then imports torch and
transformers (~4 s of one core) before the first step. The server's boot, launched before Ray at the normal
priority, took the CPU Ray's start needed (Ray up at ~6 s instead of ~3.5 s); launched after it, it ran beside the
worker's load, but a core was ~50% idle while Ray started (vmstat, 2026-12-05). Launched first at nice 10 (the
priority it keeps for the run: plumbing/ui.py `background_ephemeral_api`), it boots in that idle time and yields
to Ray and the workers otherwise: sync start-up shorter in 8 of 8 interleaved pairs (6.85–7.51 → 6.56–7.01 s), the
async side's in 6 of 8 (bench/results/trl_race.md).

The server is launched before the driver imports Prefect (`launch_ephemeral_api_early`), so that its boot also
has the core the driver leaves idle during that import (~0.7 s: a timeline of the demo's start-up had the second
core ~50% idle for its first 1.5 s); Prefect's settings, once imported, can still stop it (a profile naming a
server). With it the server answered ~0.8 s earlier and the flow started before the train worker was ready.

Ray starts in the main thread (its SIGTERM handler put back, as in place()) while a thread imports Prefect and the
stages (`import_in_background`: ray.init mostly waits). The main thread first imports what starting Ray and the
workers needs (`import_for_ray`), so the two threads never import one module at the same time. Ray then starts
before the driver's own Prefect import instead of after it (~0.7 s): start-up to the first step of the CPU demo was
shorter in 16 of 20 interleaved pairs (medians 7.03 → 6.88 s and 7.35 → 6.98 s, bench/results/trl_race.md). On a
one-rank CPU run the train worker is started right after Ray, with its model load (`start_train_worker`), and so is
a CPU run's one rollout engine when it has a process of its own (--async-mode: `start_engine`); place() adopts them.
The server is a subprocess launched without waiting and without importing Prefect's server module here
(`EphemeralAPI`); once it answers, this process's Prefect uses it as its API. MLflow's local SQLite store is created
by a thread; both threads are joined before the flow starts, so no thread of this module outlives start-up. Whatever
cannot be pre-started is left to the flow, which starts it the usual way and reports its failure the usual way (a
warning here says so).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("rollflow.prestart")


class EphemeralAPI:
    """Prefect's ephemeral API server, launched by rollflow: the command and environment Prefect's own
    `SubprocessASGIServer` uses (uvicorn on `prefect.server.api.server:create_app`, UI off, 127.0.0.1 on a free
    port of 8000–8999; run by plumbing/api_server.py, which builds the app without the cyclic collector), without
    importing that module here: the server module (its app, models and database layer) is ~2.5 s of imports on the
    driver's start-up path that only the server process needs. Once it answers,
    this process points Prefect at it (`PREFECT_API_URL`), so Prefect's clients use it and never start one of
    their own; it stays ephemeral for rollflow (`own_api_url`: no GPU slots, nice 10) and stops at exit."""

    port_range = range(8000, 9000)

    def __init__(self):
        self.port: int | None = None
        self.server_process: subprocess.Popen | None = None
        self.running = False
        self._set_env: list[str] = []

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _free_port(self) -> int:
        for _ in range(20):
            port = random.choice(self.port_range)
            with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                    return port
                except OSError:
                    time.sleep(random.uniform(0.05, 0.2))
        raise RuntimeError("no free port in 8000-8999 for the ephemeral Prefect API")

    def launch(self) -> "EphemeralAPI":
        """Start the server process without waiting for it. Its settings: this process's environment, plus, once
        Prefect is imported here, the settings set in this process (what Prefect's own launcher passes). Before
        that (`launch_ephemeral_api_early`) nothing can have been set in-process, and the server reads the same
        profile, `.env` and `prefect.toml` from the same folder as this process's Prefect will."""
        self.port = self._free_port()
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        if "prefect.settings" in sys.modules:
            from prefect.settings import get_current_settings

            env.update(get_current_settings().to_environment_variables(exclude_unset=True))
        self.server_process = subprocess.Popen(  # uvicorn on Prefect's create_app, its start-up without the GC
            [sys.executable, str(Path(__file__).with_name("api_server.py")), str(self.port)], env=env)
        from engine.background import lower_process

        lower_process(self.server_process.pid)  # nice 10 from its start: its boot yields to Ray's and the workers'
        return self

    def adopt(self) -> None:
        """Point this process's Prefect at the server (its clients, and the UI links at `prefect server start`'s
        address, as without a server of one's own); child processes started from now on inherit it."""
        from prefect.context import refresh_global_settings_context

        self.running = True
        for key, value in (("PREFECT_API_URL", self.api_url), ("PREFECT_UI_URL", LOCAL_UI_URL)):
            if key not in os.environ:
                os.environ[key] = value
                self._set_env.append(key)
        refresh_global_settings_context()

    def stop(self) -> None:
        proc, self.server_process = self.server_process, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.running:
            self.running = False
            for key in self._set_env:
                os.environ.pop(key, None)
            self._set_env = []
            try:
                from prefect.context import refresh_global_settings_context

                refresh_global_settings_context()
            except Exception:  # noqa: BLE001 — at interpreter exit: nothing uses Prefect any more
                pass


#: where `prefect server start` serves the UI on the local database the ephemeral API writes (docs/prefect.md)
LOCAL_UI_URL = "http://127.0.0.1:4200"

_own: EphemeralAPI | None = None


def own_api_url() -> str | None:
    """The API URL of the ephemeral server this process launched and uses, else None."""
    return _own.api_url if _own is not None and _own.running else None


def own_api_pid() -> int | None:
    proc = _own.server_process if _own is not None else None
    return proc.pid if proc is not None and proc.poll() is None else None


def launch_ephemeral_api_early() -> EphemeralAPI | None:
    """Launch the server before this process imports Prefect (~0.7 s of one core, while the other is idle), unless
    the environment names a server (PREFECT_API_URL) or turns ephemeral mode off. A profile or settings file can
    do either too, which only Prefect's settings tell: `launch_ephemeral_api` checks them once Prefect is
    imported and stops a server launched here that the run does not use."""
    global _own
    if (os.environ.get("PREFECT_API_URL") or _own is not None
            or os.environ.get("PREFECT_SERVER_EPHEMERAL_ENABLED", "").strip().lower() in ("0", "false", "no", "off")):
        return None
    _own = EphemeralAPI().launch()
    atexit.register(_own.stop)  # a SIGTERM meanwhile exits (cmd_train), which stops it
    return _own


def launch_ephemeral_api() -> EphemeralAPI | None:
    """Launch the ephemeral Prefect API server (the one Prefect's client would start at the flow's first call)
    without waiting for it, or take the one `launch_ephemeral_api_early` launched; None when the run uses a server
    of its own (PREFECT_API_URL) or ephemeral mode is off (an early launch is then stopped)."""
    global _own
    import prefect.context
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    early = _own if _own is not None and _own.server_process is not None and not _own.running else None
    unused = (PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value()
              or not hasattr(prefect.context, "refresh_global_settings_context"))  # adopt() needs it
    if early is not None:
        if not unused:
            return early
        early.stop()  # launched before the settings said so: a profile names a server, or ephemeral mode is off
        _own = None
        log.info("rollflow: the Prefect settings name an API server (or turn the ephemeral one off): the server "
                 "launched at start-up is stopped")
        return None
    if unused or own_api_url():
        return None  # a Prefect without refresh_global_settings_context: its client starts the server, as before
    _own = EphemeralAPI().launch()
    atexit.register(_own.stop)  # a SIGTERM meanwhile exits (cmd_train), which stops it
    return _own


def wait_ephemeral_api(server: EphemeralAPI, timeout_s: float | None = None) -> bool:
    """Wait until the launched server answers /health (exit code 3: its port was taken meanwhile, so relaunch on
    another), then make it this process's API (`adopt`). False (the process stopped, a warning logged) when it did
    not come up: the flow's client then starts one itself and raises its own error if that fails too."""
    import httpx
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    timeout_s = timeout_s or PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            code = server.server_process.poll()
            if code == 3:
                server.launch()
                continue
            if code is not None:
                break
            try:
                if client.get(f"{server.api_url}/health", timeout=5).status_code == 200:
                    server.adopt()
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    code = server.server_process.poll()
    log.warning("rollflow: the Prefect API server launched at start-up did not answer on %s within %.0f s (%s); "
                "the flow starts its own", server.api_url, timeout_s,
                f"exit code {code}" if code is not None else "still starting")
    server.stop()
    return False


#: what `rollflow train`'s main thread imports before it starts Ray and the train worker (`import_for_ray`): Ray,
#: rollflow's modules that start the workers, and what Ray's serializers for numpy, pydantic and starlette import
#: at the first actor's creation (ray.util.serialization_addons), which Prefect and torch import too
FOR_RAY_IMPORTS = ("ray", "ctypes.util", "engine.cluster", "engine.run", "engine.train.worker",
                   "engine.rollout.engines", "engine.rollout.ports", "engine.tracking", "numpy", "cloudpickle",
                   "sniffio", "anyio", "anyio.to_thread", "starlette.datastructures", "pydantic.v1")
#: what its import thread imports meanwhile (`import_in_background`): Prefect first (the flow needs it first)
BACKGROUND_IMPORTS = ("prefect.settings", "requests", "flows.train", "transformers:AutoTokenizer",
                      "transformers:PreTrainedTokenizerFast")


def import_for_ray() -> None:
    """Import, in this thread, what `start_ray`, `start_train_worker`, `start_engine` and `warm_mlflow_store`
    import (~0.4 s: Ray and rollflow's modules that start the workers), so that the import thread started next
    never imports one of them at the same time: tests/test_prestart.py checks that what those calls import after
    this and what BACKGROUND_IMPORTS import have no module in common."""
    import importlib

    for name in FOR_RAY_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed (Ray's serializers then skip it too): nothing to import twice
            pass


class BackgroundImports(threading.Thread):
    """The import thread: `imported[spec]` is set once `spec` was imported (or failed to), so that another thread
    can wait for a module before importing modules it shares with it."""

    def __init__(self, modules: tuple[str, ...]):
        super().__init__(name="rollflow-prestart-imports")  # not a daemon: joined at once
        self.modules = modules
        self.imported = {spec: threading.Event() for spec in modules}

    def run(self) -> None:
        import importlib

        for spec in self.modules:
            name, _, attr = spec.partition(":")
            try:
                module = importlib.import_module(name)
                if attr:
                    getattr(module, attr)
            except BaseException as e:  # noqa: BLE001 — imported again by the caller, which raises it
                log.debug("rollflow: importing %s at start-up failed (%s)", spec, e)
            finally:
                self.imported[spec].set()


def import_in_background(*modules: str) -> BackgroundImports:
    """Import `modules` (a "module:name" also loads that lazy attribute) in a thread, joined before they are used:
    `ray.init` (main thread only) spends most of its ~4 s waiting for Ray's processes to come up, time the imports
    (Prefect, torch, transformers, the stages: ~3 s of CPU) can use. An import that fails there is left to the
    caller's own import, which raises it."""
    thread = BackgroundImports(modules)
    thread.start()
    return thread


def start_ray(cfg) -> bool:
    """The local Ray cluster place() would start (same call, same arguments), started now; place() then finds it
    connected and still owns it (run.close() shuts it down). Not for --ray-address (joining a cluster is place()'s,
    with its reachability check and diagnosis). False, with the reason logged, when it failed: place() tries again
    and reports."""
    from engine import cluster

    if cfg.ray_address or cluster.connected():
        return False
    try:
        cluster.connect(None, cfg.num_cpus, cfg.ray_code, cfg.ray_services)
    except Exception as e:  # noqa: BLE001 — place() starts it again inside the flow and reports its error
        log.warning("rollflow: starting Ray at start-up failed (%s: %s); the flow's place step tries again",
                    type(e).__name__, e)
        cluster.shutdown()
        return False
    cluster.mark_prestarted()
    return True


def start_train_worker(cfg) -> bool:
    """After `start_ray`: the run's train worker and its model load, started now on a one-rank CPU run, and the
    engine it serves with --rollout-engine-process trainer (engine/cluster `prestart_train_worker`; place() adopts
    them). False, with the reason logged, when it was not started: place() starts the workers as it would anyway."""
    from engine import cluster
    from engine.run import Run

    try:
        run = Run(cfg)
        return cluster.prestart_train_worker(cfg, train_iters=run.plan.train_iters, threads=run.train_threads,
                                             log_dir=str(run.work_dir / "logs"))
    except Exception as e:  # noqa: BLE001 — place() starts the workers and reports what fails
        log.warning("rollflow: starting the train worker at start-up failed (%s: %s); the flow's place step "
                    "starts it", type(e).__name__, e)
        return False


def start_engine(cfg) -> bool:
    """After `start_ray`: a CPU run's one rollout engine in a process of its own (--async-mode, or
    --rollout-engine-process own), started now with its model load (engine/cluster `prestart_engine`; place()
    adopts it). False, with the reason logged where it failed, when it was not started: place() starts the engines
    as it would anyway."""
    from engine import cluster
    from engine.run import Run

    try:
        run = Run(cfg)
        return cluster.prestart_engine(cfg, threads=run.threads_per_process, log_dir=str(run.work_dir / "logs"))
    except Exception as e:  # noqa: BLE001 — place() starts the engines and reports what fails
        log.warning("rollflow: starting the rollout engine at start-up failed (%s: %s); the flow's place step "
                    "starts it", type(e).__name__, e)
        return False


def warm_mlflow_store(cfg, after: threading.Event | None = None) -> threading.Thread | None:
    """Create the run's local MLflow store (`sqlite:///…`: import MLflow, copy the cached schema or run the
    migrations, engine/tracking/schema_cache.py) in a thread while Ray and the Prefect API start; MLflow caches the
    store per URI, so the flow's tracker opens it at once. Join the thread before the flow (two stores created in
    one file at once would race). None for a tracking server (`http(s)://`: nothing to create). `after`: set once
    the import thread has imported Prefect's settings, whose modules MLflow imports too (waited for first)."""
    from engine.tracking import default_tracking_uri, sqlite_path

    work_dir = Path(cfg.work_dir).resolve()
    uri = default_tracking_uri(str(work_dir), cfg.mlflow_tracking_uri)
    if sqlite_path(uri) is None:
        return None

    def warm() -> None:
        if after is not None:  # MLflow shares modules with it (pydantic, anyio, starlette, …): imported one by one
            after.wait()
        try:
            from engine.tracking import _mlflow_client

            work_dir.mkdir(parents=True, exist_ok=True)
            _mlflow_client(uri)  # opens the store (a new one from the cached schema, else migrated)
        except Exception as e:  # noqa: BLE001 — the tracker opens it again and reports (training goes on)
            log.warning("rollflow: creating the MLflow store at start-up failed (%s: %s); the tracker retries",
                        type(e).__name__, e)

    thread = threading.Thread(target=warm, name="rollflow-prestart-mlflow")  # not a daemon: exit waits for it
    thread.start()
    return thread

