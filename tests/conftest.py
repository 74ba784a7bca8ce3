"""Shared fixtures: the bundled tiny model, a session-scoped Prefect test harness, small run configs."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from engine.config.data import BUNDLED_MODEL, BUNDLED_TEST, BUNDLED_TRAIN  # noqa: E402


#: The files that take longest on the 2-core machine (wall seconds of a serial run: 189, 75, 72, 68, 64, 56 … 28),
#: collected first. `make test` hands whole files to two xdist workers in collection order (--dist loadfile), so a
#: long file collected last would run alone at the end while the other worker idles.
LONGEST_FIRST = ("test_resume_faults.py", "test_ui_browser.py", "test_async.py", "test_tracking_flow.py",
                 "test_orchestration.py", "test_dp_invariance.py", "test_hostile_inputs.py", "test_terminal.py",
                 "test_prestart.py", "test_multinode.py", "test_external_engines.py", "test_deployment.py",
                 "test_weight_sync.py", "test_megatron_cpu_model.py", "test_sft.py", "test_rollout_ray.py",
                 "test_debug_rollout.py", "test_megatron_cpu_backend.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


#: What every process of the Megatron CPU tests imports: ~9 s of CPU a process on the 2-core machine (megatron-core
#: pulls in torch._dynamo, torch._inductor, torch.distributed.tensor and wandb), paid once by the fork server below.
RANK_PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers")


def _rank_main(rank: int, env: dict, fn, *args) -> None:
    """A forked rank starts from the fork server's environment: the caller's, as it was when it spawned, instead."""
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # the OpenMP runtime read the server's environment when it loaded
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    fn(rank, *args)


def spawn_ranks(fn, args: tuple = (), nprocs: int = 1) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), each rank forked from one server per test process that has
    imported RANK_PRELOAD once (multiprocessing's forkserver): a rank starts in a fraction of a second instead of
    importing megatron-core again. Each rank is a fresh process as with spawn (its own module state: nothing of a
    previous rank's process groups or patches), with the caller's sys.path and environment."""
    import multiprocessing

    import torch.multiprocessing as tmp

    multiprocessing.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server starts (the first call)
    tmp.start_processes(_rank_main, args=(dict(os.environ), fn, *args), nprocs=nprocs, start_method="forkserver")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    assert (Path(BUNDLED_MODEL) / "config.json").is_file(), "the bundled model is missing: rebuild it with examples/build_tiny_model.py"
    return BUNDLED_MODEL


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture
def shared_ray():
    """A local Ray cluster kept across consecutive in-process flow runs, as a run joins one with --ray-address
    (a run that did not start Ray leaves it running): saves the ~8 s start of a cluster per flow test. Fixtures
    that need a cluster of their own shut this one down first."""
    from engine import cluster

    if not cluster.connected():
        cluster.connect(None)  # as a run starts its own: Ray's lean services, rollflow's worker env and settings
    yield


def small_configs(tmp_path: Path, model: str = BUNDLED_MODEL):
    """small_cfg's factory, for a process that has no fixtures (tests/test_megatron_cpu_backend.py's ranks)."""
    from engine.config import RunConfig

    def make(**over):
        base = dict(hf_checkpoint=model, prompt_data=BUNDLED_TRAIN, eval_prompt_data=BUNDLED_TEST,
                    eval_max_samples=16, apply_chat_template=True, rollout_batch_size=4, n_samples_per_prompt=4,
                    num_rollout=2, rollout_max_response_len=8, lr=1e-4, micro_batch_size=4,
                    work_dir=str(tmp_path / "work"), save=str(tmp_path / "ckpt"), progress=False,
                    experiment_name="tests")
        base.update(over)
        return RunConfig(**base)

    return make


@pytest.fixture
def small_cfg(tmp_path, tiny_model):
    """A run small enough for CI: B=4 prompts × n=4 samples, 2 rollouts, short responses."""
    return small_configs(tmp_path, tiny_model)


@pytest.fixture(scope="session")
def s3_server():
    """A local S3-compatible server (moto) on 127.0.0.1 for the session; yields the env that points boto at it.

    The credentials are fake but distinctive, so tests can check that they never reach logs or files."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL_S3": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "rollflowtestkeyid",
           "AWS_SECRET_ACCESS_KEY": "rollflow-test-secret-d41d8cd9", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket per test: s3://<bucket>."""
    import re
    import uuid

    import fsspec

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"


@contextmanager
def served_engine(model: str, **state_kw):
    """The built-in engine for `model` (EngineState keyword arguments) on a free loopback port: (state, url)."""
    from engine.rollout.ports import free_loopback_port
    from engine.rollout.server import EngineState, ServerThread

    state = EngineState(model, threads=1, **state_kw)
    server = ServerThread(state, "127.0.0.1", free_loopback_port())
    url = server.start()
    try:
        yield state, url
    finally:
        server.stop()
