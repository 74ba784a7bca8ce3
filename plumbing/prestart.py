"""Start-up side by side (issue 18): `rollflow train` launches the ephemeral Prefect API server (its own process,
~5 s of one core) first, then imports the stages and starts the local Ray cluster while that server boots; the
flow then finds both running. Run one after the other, each left a core idle (measured with vmstat: ~50% idle for
the first 15 s of a demo start-up).

The server is a subprocess launched without waiting; Ray starts in the main thread (its SIGTERM handler put back,
as in place()); MLflow's local SQLite store (a fresh one runs MLflow's schema migrations, ~1.5 s) is created by a
thread that is joined before the flow starts, so no thread of this module outlives start-up. Whatever cannot be
pre-started is left to the flow, which starts it the usual way and reports its failure the usual way (a warning
here says so).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger("rollflow.prestart")


def launch_ephemeral_api():
    """Launch Prefect's ephemeral API server (the one its client would start at the flow's first call) without
    waiting for it; None when the run uses a server of its own (PREFECT_API_URL) or ephemeral mode is off."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's client takes (one per port; None = "any port")
    if server.running:
        return None
    server.port = server.find_available_port()
    server.server_process = server._run_uvicorn_command()
    atexit.register(server.stop)  # as SubprocessASGIServer.start does; a SIGTERM meanwhile exits (cmd_train)
    return server


def wait_ephemeral_api(server, timeout_s: float | None = None) -> bool:
    """Wait until the launched server answers /health, as SubprocessASGIServer.start would (exit code 3: its port
    was taken meanwhile, so relaunch on another); then Prefect's client uses it as its own. False (the process
    stopped, a warning logged) when it did not come up: the flow's client then starts one itself and raises its
    own error if that fails too."""
    import httpx
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    timeout_s = timeout_s or PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            code = server.server_process.poll()
            if code == 3:
                server.port = server.find_available_port()
                server.server_process = server._run_uvicorn_command()
                continue
            if code is not None:
                break
            try:
                if client.get(f"{server.api_url}/health", timeout=5).status_code == 200:
                    server.running = True
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    code = server.server_process.poll()
    log.warning("rollflow: the Prefect API server launched at start-up did not answer on %s within %.0f s (%s); "
                "the flow starts its own", server.api_url, timeout_s,
                f"exit code {code}" if code is not None else "still starting")
    if code is None:
        server.server_process.kill()
        server.server_process.wait()
    server.server_process = None
    return False


def start_ray(cfg) -> bool:
    """The local Ray cluster place() would start (same call, same arguments), started now; place() then finds it
    connected and still owns it (run.close() shuts it down). Not for --ray-address (joining a cluster is place()'s,
    with its reachability check and diagnosis). False, with the reason logged, when it failed: place() tries again
    and reports."""
    from engine import cluster

    if cfg.ray_address or cluster.connected():
        return False
    try:
        cluster.connect(None, cfg.num_cpus, cfg.ray_code)
    except Exception as e:  # noqa: BLE001 — place() starts it again inside the flow and reports its error
        log.warning("rollflow: starting Ray at start-up failed (%s: %s); the flow's place step tries again",
                    type(e).__name__, e)
        cluster.shutdown()
        return False
    cluster.mark_prestarted()
    return True


def warm_mlflow_store(cfg) -> threading.Thread | None:
    """Create the run's local MLflow store (`sqlite:///…`: import MLflow, run its schema migrations) in a thread
    while Ray and the Prefect API start; MLflow caches the store per URI, so the flow's tracker opens it at once.
    Join the thread before the flow (two stores migrating one file at once would race). None for a tracking
    server (`http(s)://`: nothing to create)."""
    from engine.tracking import default_tracking_uri, sqlite_path

    work_dir = Path(cfg.work_dir).resolve()
    uri = default_tracking_uri(str(work_dir), cfg.mlflow_tracking_uri)
    if sqlite_path(uri) is None:
        return None

    def warm() -> None:
        try:
            from engine.tracking import _mlflow_client

            work_dir.mkdir(parents=True, exist_ok=True)
            _mlflow_client(uri)._tracking_client.store  # noqa: B018 — creating it is the point
        except Exception as e:  # noqa: BLE001 — the tracker opens it again and reports (training goes on)
            log.warning("rollflow: creating the MLflow store at start-up failed (%s: %s); the tracker retries",
                        type(e).__name__, e)

    thread = threading.Thread(target=warm, name="rollflow-prestart-mlflow")  # not a daemon: exit waits for it
    thread.start()
    return thread
