"""Start-up side by side (plumbing/prestart.py): the Prefect API server launched before the flow is the one the
flow's client uses; a server that never answers is stopped and left to Prefect; a pre-started Ray is owned once;
the train worker and an engine of its own started with Ray are adopted by their own run only.

Each Prefect case runs in a fresh interpreter: the ephemeral server is a per-process singleton."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sees_a_gpu() -> bool:
    """Whether Ray would see a GPU here (nvidia-smi answers): `rollflow train` then prestarts no train worker and no
    engine (engine/cluster: prestart_train_worker, prestart_engine), by design."""
    import shutil

    if not shutil.which("nvidia-smi"):
        return False
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.returncode == 0 and "GPU" in out.stdout


#: the start-up prestart of the train worker and the engine is for CPU runs: where Ray sees a GPU nothing is
#: prestarted, and these tests of it do not apply (test_gpu_flow covers the GPU's start-up)
cpu_prestart = pytest.mark.skipif(_sees_a_gpu(), reason="prestart is for CPU runs: Ray sees a GPU on this machine")


def _python(code: str, timeout: int = 180) -> str:
    env_code = "import os; os.environ.pop('PREFECT_API_URL', None)\n" + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", env_code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_the_launched_api_is_the_one_the_flow_client_uses():
    out = _python("""
        import os, sys
        import psutil
        from plumbing import prestart
        server = prestart.launch_ephemeral_api_early()  # as `rollflow train` does, before Prefect is imported
        assert server is not None and not server.running and 'prefect' not in sys.modules
        from plumbing import limits, ui
        assert prestart.launch_ephemeral_api() is server  # Prefect's settings name no server: it is the run's
        # at nice 10 from its start, so that its boot yields to Ray's and the workers' (before Ray: the idle core)
        assert os.getpriority(os.PRIO_PROCESS, server.server_process.pid) >= 10
        assert prestart.wait_ephemeral_api(server)
        from prefect import flow
        from prefect.client.orchestration import get_client
        with get_client(sync_client=True) as client:
            assert str(client.api_url).rstrip('/') == server.api_url.rstrip('/'), (client.api_url, server.api_url)
            assert client.api_healthcheck() is None
        from prefect import task
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
        import time
        step = task(lambda: 7, name='step')
        run = flow(lambda: step(return_state=True).result(), name='one-step')(return_state=True)  # a flow run on it
        assert run.result() == 7
        # the task run reaches the API through the server's batched task-run recorder (plumbing/api_server.py)
        ids = FlowRunFilter(id=FlowRunFilterId(any_=[run.state_details.flow_run_id]))
        deadline = time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while True:
                states = [t.state_type.value for t in client.read_task_runs(flow_run_filter=ids)]
                if states == ['COMPLETED'] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        print('task runs', states)
        # still the ephemeral API for rollflow: no GPU slots on it, its priority lowered
        assert limits.api_is_ephemeral() and ui.background_ephemeral_api() > 0
        # ours runs plumbing/api_server.py; one Prefect's client started itself would run `-m uvicorn`
        kids = [p for p in psutil.Process().children(recursive=True)
                if any(w in ' '.join(p.cmdline()) for w in ('uvicorn', 'api_server.py'))]
        print('servers', len(kids), 'server module', 'prefect.server.api.server' in sys.modules)
        server.stop()
        assert 'PREFECT_API_URL' not in os.environ and 'PREFECT_UI_URL' not in os.environ  # put back
    """)
    assert "servers 1" in out  # the client did not start a second one
    assert "task runs ['COMPLETED']" in out
    assert "server module False" in out  # and this process never imported Prefect's server (~2.5 s)


def test_the_launched_server_batches_its_task_run_records_unless_a_setting_says_otherwise(tmp_path):
    """plumbing/api_server.py: the task-run recorder's batch size and flush interval are rollflow's where no
    Prefect settings source sets them; a value from the environment or from prefect.toml is kept."""
    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        from api_server import TASK_RUN_RECORDER, batch_task_run_records
        added = batch_task_run_records()
        from prefect.settings import get_current_settings
        s = get_current_settings().server.services.task_run_recorder
        print(json.dumps([sorted(added), s.batch_size, s.flush_interval, TASK_RUN_RECORDER]))
    """)

    def run(env: dict, cwd: Path) -> list:
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER")}
        out = subprocess.run([sys.executable, "-c", code, str(ROOT / "plumbing")], cwd=cwd, capture_output=True,
                             text=True, timeout=120, env={**base, **env})
        assert out.returncode == 0, out.stderr
        import json

        return json.loads(out.stdout.strip().splitlines()[-1])

    added, batch, interval, ours = run({}, tmp_path)
    assert (batch, interval) == (ours["batch_size"], ours["flush_interval"]) and batch > 1  # Prefect's default: 1
    assert added == ["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE",
                     "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"]
    added, batch, interval, _ = run({"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "3"}, tmp_path)
    assert (batch, interval) == (3, ours["flush_interval"])  # the environment's value kept
    (tmp_path / "prefect.toml").write_text("[server.services.task_run_recorder]\nflush_interval = 0.25\n")
    added, batch, interval, _ = run({}, tmp_path)
    assert (batch, interval) == (ours["batch_size"], 0.25)  # prefect.toml's value kept


def test_a_prefect_without_the_recorder_settings_keeps_its_own_and_says_so(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "plumbing"))
    try:
        import api_server
    finally:
        sys.path.remove(str(ROOT / "plumbing"))
    monkeypatch.setattr(api_server, "TASK_RUN_RECORDER", {"batch_size": 100, "no_such_setting": 1})
    before = dict(os.environ)
    assert api_server.batch_task_run_records() == {}
    assert dict(os.environ) == before
    assert "task-run recorder writes with Prefect's defaults" in capsys.readouterr().err


def test_a_server_that_does_not_answer_is_stopped_and_left_to_prefect():
    out = _python("""
        import logging, os
        logging.basicConfig()
        from plumbing import prestart
        server = prestart.launch_ephemeral_api()
        proc = server.server_process
        proc.kill(); proc.wait()
        assert not prestart.wait_ephemeral_api(server, timeout_s=5)
        assert server.server_process is None and not server.running and 'PREFECT_API_URL' not in os.environ
        from prefect.client.orchestration import get_client
        with get_client(sync_client=True) as client:  # Prefect starts its own, as without prestart
            assert client.api_healthcheck() is None
            print('prefect started', str(client.api_url) != server.api_url)
    """)
    assert "prefect started True" in out
    assert "did not answer" in out and "exit code" in out  # the warning says so


def test_no_launch_when_a_server_is_given():
    code = ("from plumbing import prestart; "
            "print(prestart.launch_ephemeral_api_early(), prestart.launch_ephemeral_api())")
    for env in ({"PREFECT_API_URL": "http://127.0.0.1:9/api"}, {"PREFECT_SERVER_EPHEMERAL_ENABLED": "false"}):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "None None", env


def test_an_early_server_is_stopped_when_a_profile_names_a_server(tmp_path):
    """The environment names no server, so the server is launched before Prefect is imported; the active profile
    names one, which only Prefect's settings tell: that launch is stopped, and the run uses the profile's server."""
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('active = "remote"\n[profiles.remote]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    os.environ["PREFECT_PROFILES_PATH"] = str(profiles)  # the child inherits it (_python's environment)
    try:
        out = _python("""
            import sys
            from plumbing import prestart
            early = prestart.launch_ephemeral_api_early()
            assert early is not None and 'prefect' not in sys.modules
            proc = early.server_process
            print('taken', prestart.launch_ephemeral_api())
            print('stopped', proc.poll() is not None, early.server_process is None, prestart.own_api_url())
            from prefect.settings import PREFECT_API_URL
            print('api', PREFECT_API_URL.value())
        """)
    finally:
        del os.environ["PREFECT_PROFILES_PATH"]
    assert "taken None" in out and "stopped True True None" in out
    assert "api http://127.0.0.1:9/api" in out


def test_a_prestarted_cluster_is_owned_by_the_first_run_only(monkeypatch):
    from engine import cluster

    monkeypatch.setattr(cluster, "connected", lambda: True)
    monkeypatch.setattr(cluster, "_prestarted", False)  # whatever an earlier test of this process left
    assert not cluster.take_prestarted()  # nothing was pre-started: a caller's cluster stays the caller's
    cluster.mark_prestarted()
    assert cluster.take_prestarted()
    assert not cluster.take_prestarted()  # a retried place() finds it shut down or someone else's
    cluster.mark_prestarted()
    monkeypatch.setattr(cluster, "connected", lambda: False)
    assert not cluster.take_prestarted()  # gone meanwhile: nothing to own


def test_background_imports_load_modules_and_leave_failures_to_the_caller():
    out = _python("""
        import sys
        from plumbing import prestart
        lazy = 'transformers.models.auto.tokenization_auto'  # what transformers' lazy AutoTokenizer loads
        assert lazy not in sys.modules
        t = prestart.import_in_background("json.decoder", "transformers:AutoTokenizer", "no_such_module_here")
        t.join(timeout=120)
        assert not t.is_alive()
        print('json.decoder' in sys.modules, lazy in sys.modules, 'no_such_module_here' in sys.modules)
    """)
    assert "True True False" in out


def test_the_driver_starts_the_train_worker_without_importing_torch():
    """What `start_train_worker` needs in the driver (the run's numbers, the actor class, its runtime env) imports
    no torch: torch's import in the driver's background thread holds its module lock, and the worker's creation
    waited ~0.6–1 s for it before its own process could start importing."""
    out = _python("""
        import sys
        from engine import cluster
        from engine.run import Run
        from engine.train.worker import TrainWorker
        print('torch' in sys.modules)
    """)
    assert out.strip().endswith("False"), out


def _gc_state(actor) -> tuple[bool, int, str | None]:
    """In an actor's process: whether the collector is on, how many objects are frozen, and the defer variable."""
    import ray

    def state(_self):
        import gc

        from engine.startgc import DEFER_ENV

        return gc.isenabled(), gc.get_freeze_count(), os.environ.get(DEFER_ENV)

    return ray.get(actor.__ray_call__.remote(state), timeout=60)


def test_importing_engine_defers_the_collector_only_where_rollflow_asked():
    """A Ray worker rollflow starts has ROLLFLOW_DEFER_GC=1 (engine/startgc.py): importing `engine` (before the
    actor's module imports torch) turns the collector off and drops the variable, so child processes start
    normally; `ready` turns it back on with start-up's objects frozen. Without the variable nothing changes."""
    code = """
        import gc, os, sys
        base = gc.get_freeze_count()  # an interpreter may start with frozen objects (the GPU device's: 375)
        import engine, torch
        from engine import startgc
        print('before', gc.isenabled(), os.environ.get(startgc.DEFER_ENV), gc.get_freeze_count() - base)
        startgc.ready()
        print('after', gc.isenabled(), gc.get_freeze_count() > 10000)
    """
    asked = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "ROLLFLOW_DEFER_GC": "1"})
    assert "before False None 0" in asked.stdout and "after True True" in asked.stdout, asked.stdout + asked.stderr
    plain = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env={k: v for k, v in os.environ.items() if k != "ROLLFLOW_DEFER_GC"})
    assert "before True None 0" in plain.stdout and "after True False" in plain.stdout, plain.stdout + plain.stderr


@cpu_prestart
def test_a_prestarted_train_worker_is_adopted_by_its_own_run_only(shared_ray, small_cfg):
    """prestart_train_worker on a one-rank CPU run: TrainGroup adopts that worker (its setup already asked) for the
    same config, iterations and threads; a group for another config kills it and starts its own. Several ranks:
    nothing is prestarted (they are placed by place())."""
    import ray

    from engine import cluster

    cfg, other = small_cfg(), small_cfg(lr=3e-4)
    assert not cluster.prestart_train_worker(small_cfg(actor_num_gpus_per_node=2), train_iters=2, threads=1)
    assert cluster.prestart_train_worker(cfg, train_iters=2, threads=1)
    first = cluster._prestarted_worker["worker"]
    group = cluster.TrainGroup(cfg, train_iters=2, timeout_s=120, threads=1)
    try:
        assert group.prestarted and group.workers == [first] and group.nodes[0]["pid"]
        enabled, frozen, env = _gc_state(first)  # its start-up ran without the collector, which is back on
        assert enabled and frozen > 100_000 and env is None, (enabled, frozen, env)
        assert cluster.take_prestarted_worker(cfg, 2, 1) is None  # adopted once
    finally:
        group.shutdown()
    assert cluster.prestart_train_worker(cfg, train_iters=2, threads=1)
    stale = cluster._prestarted_worker["worker"]
    group = cluster.TrainGroup(other, train_iters=2, timeout_s=120, threads=1)
    try:
        assert not group.prestarted and group.workers != [stale]
        try:
            ray.get(stale.where.remote(), timeout=60)
            alive = True
        except ray.exceptions.RayActorError:
            alive = False
        assert not alive  # killed, not left holding its model
    finally:
        group.shutdown()


@cpu_prestart
def test_a_prestarted_engine_is_adopted_by_its_own_run_only(shared_ray, small_cfg):
    """prestart_engine on a CPU run whose engine has a process of its own (--async-mode): the run's engine plan
    adopts that actor and its start, and the engine answers with the token it was started with, which is now the
    run's; for another spec (other threads) it is killed. With the engine in the trainer's process (sync mode), or
    several engines, nothing is prestarted."""
    import httpx
    import ray

    from engine import cluster, stages
    from engine.run import Run

    assert not cluster.prestart_engine(small_cfg(), threads=1, log_dir="/tmp")  # served from the trainer's process
    assert not cluster.prestart_engine(small_cfg(async_mode="one-step", rollout_num_engines=2), threads=1,
                                       log_dir="/tmp")
    cfg = small_cfg(async_mode="one-step")
    run = Run(cfg)
    run.cluster, run.owns_ray = dict(ray.cluster_resources()), False  # close() leaves the shared cluster up
    assert cluster.prestart_engine(cfg, threads=run.threads_per_process, log_dir=str(run.work_dir / "logs"))
    first = cluster._prestarted_engine
    try:
        stages.plan_rollout_engines(run)
        stages.launch_rollout_engines(run)
        run.engines.wait_started()
        assert run.prestarted_engine is first and run.engines.slots[0].actor is first["actor"]
        assert run.engine_spec.api_key == first["spec"].api_key and run.engines.api_key == first["spec"].api_key
        assert cluster.take_prestarted_engine(run.engine_spec, run.threads_per_process) is None  # adopted once
        url = run.engines.serving()[0]
        body = {"text": "1+1=", "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(url + "/generate", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {run.engines.api_key}"}).status_code == 200
        assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 401
        enabled, frozen, env = _gc_state(first["actor"])  # started up without the collector, which is back on
        assert enabled and frozen > 100_000 and env is None, (enabled, frozen, env)
    finally:
        run.close()
    assert cluster.prestart_engine(cfg, threads=run.threads_per_process, log_dir=str(run.work_dir / "logs"))
    stale = cluster._prestarted_engine
    assert cluster.take_prestarted_engine(stale["spec"], run.threads_per_process + 1) is None
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stale["actor"].stop.remote(), timeout=60)  # killed, not left holding its model


def test_start_up_defers_the_garbage_collector_and_training_freezes_what_start_up_built():
    """`rollflow train` turns the cyclic collector off for its start-up (its imports build millions of long-lived
    objects that each full collection walked: 2.2 s of the CPU demo's start-up) and back on when training starts,
    with start-up's objects frozen out of its walks; a library caller (no defer) keeps its collector as it is."""
    import gc

    from engine import startgc

    def is_frozen(obj) -> bool:  # tracked, but in none of the collector's generations: in the permanent one
        return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())

    base = gc.get_freeze_count()  # an interpreter may start with frozen objects (the GPU device's: 375)
    assert gc.isenabled()
    try:
        startgc.ready()  # not deferred here: nothing frozen, nothing changed
        assert gc.isenabled() and gc.get_freeze_count() == base
        startgc.defer()
        assert not gc.isenabled()
        built = [[] for _ in range(10)]  # objects start-up leaves alive (lists: the collector tracks them)
        startgc.ready()
        assert gc.isenabled() and all(is_frozen(o) for o in built)
        later = []  # built during training
        startgc.ready()  # once only: a second call freezes nothing
        assert not is_frozen(later) and gc.isenabled()
        # (the freeze count itself is no witness: it drops whenever a frozen object is freed)
    finally:
        gc.unfreeze()
        gc.enable()


@cpu_prestart
def test_the_prestarted_train_worker_serves_its_engine_once_adopted(shared_ray, small_cfg):
    """Sync CPU run (the engine in the trainer's process): prestart_train_worker also starts the engine the worker
    serves, right after its setup. The run's plan takes that engine's spec (its token), and launching the engines
    on the adopted worker adopts that start call: the engine answers with the run's token. A worker prestarted for
    another config is killed with its engine, and the run's engine starts on its own worker."""
    import httpx
    import ray

    from engine import cluster, stages
    from engine.run import Run

    def prestart(cfg) -> Run:
        run = Run(cfg)
        run.cluster, run.owns_ray = dict(ray.cluster_resources()), False  # close() leaves the shared cluster up
        assert cluster.prestart_train_worker(cfg, train_iters=run.plan.train_iters, threads=run.train_threads,
                                             log_dir=str(run.work_dir / "logs"))
        return run

    def place(run: Run) -> None:
        stages.plan_rollout_engines(run)
        run.train_group = cluster.TrainGroup(run.cfg, train_iters=run.plan.train_iters, timeout_s=120,
                                             threads=run.train_threads, registry=run.ports, wait=False)
        stages.launch_rollout_engines(run, host=run.train_group.workers[0])
        run.engines.wait_started()
        run.train_group.wait_ready()

    cfg = small_cfg()
    run = prestart(cfg)
    hosted = cluster._prestarted_worker["engine"]
    assert hosted is not None and hosted["spec"].threads is None  # the trainer's threads, as place() makes it
    try:
        place(run)
        assert run.train_group.prestarted and run.prestarted_engine is hosted and run.engine_spec is hosted["spec"]
        url = run.engines.serving()[0]
        body = {"text": "1+1=", "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(url + "/generate", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {run.engines.api_key}"}).status_code == 200
        assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 401
        assert run.engines.slots[0].info["pid"] == run.train_group.nodes[0]["pid"]  # served from the worker
    finally:
        run.close()
    prestart(small_cfg(lr=3e-4))  # prestarted for another config than the run's
    run = Run(cfg)
    run.cluster, run.owns_ray = dict(ray.cluster_resources()), False
    stale_worker = cluster._prestarted_worker["worker"]
    try:
        place(run)
        assert not run.train_group.prestarted and run.prestarted_engine is None
        assert run.engines.slots[0].info["pid"] == run.train_group.nodes[0]["pid"]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(stale_worker.where.remote(), timeout=60)  # killed, with the engine it served
    finally:
        run.close()


@cpu_prestart
def test_the_start_up_threads_import_disjoint_modules(tmp_path):
    """`rollflow train` starts Ray and the workers in its main thread while a thread imports BACKGROUND_IMPORTS;
    what the main thread imports for that after `import_for_ray` and what the import thread imports have no module
    in common, so no module is ever imported by both at once (which can leave one of them a half-initialised
    module). Both engine placements: the engine in the train worker's process (sync) and in its own (async)."""
    main = _python(f"""
        import sys
        from engine.config.cli import parse_args
        from plumbing import prestart
        args = ["--config", "examples/demo.yaml", "--eval-prompt-data", "", "--work-dir", {str(tmp_path / 'w')!r}]
        sync_cfg = parse_args(args, prog="t")
        async_cfg = parse_args(args + ["--async-mode", "one-step"], prog="t")
        prestart.import_for_ray()
        before = set(sys.modules)
        from engine import cluster
        try:
            assert prestart.start_ray(sync_cfg)
            assert prestart.start_train_worker(sync_cfg)  # with the engine it serves
            assert prestart.start_engine(async_cfg)  # an engine in a process of its own
        finally:
            cluster.shutdown()
        print("NEW", sorted(set(sys.modules) - before))
    """)
    background = _python("""
        import importlib, sys
        from plumbing import prestart
        prestart.import_for_ray()
        before = set(sys.modules)
        for spec in prestart.BACKGROUND_IMPORTS:
            name, _, attr = spec.partition(":")
            module = importlib.import_module(name)
            getattr(module, attr) if attr else None
        print("NEW", sorted(set(sys.modules) - before))
    """)

    def new(out: str) -> set[str]:
        return set(eval(next(line for line in out.splitlines() if line.startswith("NEW "))[4:]))

    ray_side, import_side = new(main), new(background)
    assert len(ray_side) > 10 and "prefect" in import_side and "torch" in import_side  # both did import
    assert not ray_side & import_side, sorted(ray_side & import_side)
