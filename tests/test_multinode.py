"""Several Ray nodes on this machine (`ray.cluster_utils.Cluster`, loopback only: the head on 127.0.0.1, three
CPU nodes on 127.0.0.2-4): the rl-train flow joins it with --ray-address like a user on a real cluster.

- A DP=2 torch-backend run with --actor-num-nodes 2: its two train ranks sit on different nodes, its engine on
  the third, the ranks meet at rank 0's node address (not the driver's), and its metrics and weights match the
  same run on one node within 1e-6 — trained for 2 rollouts, then resumed to 3.
- No filesystem is shared: every worker node hides the driver's run directories (ROLLFLOW_HIDDEN_PATHS, see
  engine/cluster/nodes.py), so checkpoints are written and read back through Ray's object store; the model comes
  from S3 (a local server on 127.0.0.1) into each node's own cache, once; a model only the driver sees, and disk
  weight sync to engines that do not see the driver's directory, fail at placement with the node and the fix.
- The code reaches the nodes through the job's runtime_env (`--ray-code ship`), merged with each actor's env.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NODES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@pytest.fixture(scope="module")
def driver_only(tmp_path_factory) -> Path:
    """A directory the worker nodes do not see (hidden on each of them)."""
    return tmp_path_factory.mktemp("driver-only")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model, prefect_harness):
    """The same DP=2 run on one node (a local Ray cluster of this process), 3 rollouts."""
    import ray

    from flows.train import rl_train

    if ray.is_initialized():
        ray.shutdown()
    work = tmp_path_factory.mktemp("single")
    out = rl_train(_cfg(tiny_model, work, num_rollout=3, actor_num_gpus_per_node=2))
    assert not ray.is_initialized()  # the run started its own cluster and stopped it
    return out, work


@pytest.fixture(scope="module")
def node_caches(tmp_path_factory) -> Path:
    """Each node's model cache: <this>/<node ip>/ (ROLLFLOW_MODEL_CACHE in the node's environment)."""
    return tmp_path_factory.mktemp("node-caches")


@pytest.fixture(scope="module")
def cluster(baseline, driver_only, node_caches, s3_server):
    """Head (no CPUs: the driver's node runs nothing) + three 1-CPU nodes on loopback addresses, each with its own
    model cache and the S3 settings (of the local S3 server) in its environment, as a node's role would give."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        # every address Ray picks by itself is 127.0.0.1 (not this host's interface address), in this process
        # and in the processes it starts
        mp.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for ip in NODES:
            c.add_node(num_cpus=1, node_ip_address=ip, env_vars={
                "ROLLFLOW_HIDDEN_PATHS": str(driver_only), "ROLLFLOW_MODEL_CACHE": str(node_caches / ip),
                **s3_server})
        c.wait_for_nodes()
        yield c
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _cfg(model: str, work: Path, **over):
    from engine.config import RunConfig
    from engine.config.data import BUNDLED_TEST, BUNDLED_TRAIN

    base = dict(hf_checkpoint=model, prompt_data=BUNDLED_TRAIN, eval_prompt_data=BUNDLED_TEST, eval_max_samples=8,
                apply_chat_template=True, rollout_batch_size=4, n_samples_per_prompt=4, rollout_max_response_len=8,
                lr=1e-3, micro_batch_size=4, global_batch_size=16, num_cpus=2, seed=7, progress=False,
                work_dir=str(work / "work"), save=str(work / "ckpt"), experiment_name="tests-multinode",
                mlflow_tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    base.update(over)
    return RunConfig(**base)


TRAIN_KEYS = ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "train/mismatch",
              "rollout/reward_mean", "rollout/response_len_mean")


def _weights(ckpt: Path, iteration: int) -> dict:
    from engine.weights import load_weights_dir

    return load_weights_dir(ckpt / f"iter_{iteration:07d}" / "model")


def _copies(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / ".complete").is_file()) if root.exists() else []


def test_dp2_over_two_nodes_matches_one_node_and_resumes(cluster, baseline, driver_only, tiny_model, node_caches,
                                                         s3_bucket, tmp_path, monkeypatch):
    """The model comes from S3 (the baseline read the same files from disk): each node downloads it once."""
    import fsspec

    from engine.cluster import nodes
    from flows.train import rl_train

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    model = f"{s3_bucket}/tiny-qwen2-arith"
    for f in sorted(Path(tiny_model).iterdir()):
        if f.is_file():
            fs.put_file(str(f), f"{model}/{f.name}")
    monkeypatch.setenv(nodes.MODEL_CACHE_ENV, str(tmp_path / "driver-cache"))
    monkeypatch.setattr(nodes, "_local_models", {})
    single, single_work = baseline
    work = driver_only / "multi"
    cfg = _cfg(model, work, num_rollout=2, ray_address=cluster.address, actor_num_nodes=2,
               actor_num_gpus_per_node=1)
    first = rl_train(cfg)
    stamps = {ip: [(c / ".complete").stat().st_mtime_ns for c in _copies(node_caches / ip)] for ip in NODES}
    resumed = rl_train(cfg.model_copy(update={"num_rollout": 3}))

    # one copy of the model per node (two ranks and an engine: all three nodes) and on the driver, not fetched again
    assert all(len(v) == 1 for v in stamps.values()), stamps
    assert {ip: [(c / ".complete").stat().st_mtime_ns for c in _copies(node_caches / ip)] for ip in NODES} == stamps
    assert len(_copies(tmp_path / "driver-cache")) == 1

    for out in (first, resumed):
        p = out["placement"]
        ranks, engines = [r["node_ip"] for r in p["train"]], [e["node_ip"] for e in p["engines"]]
        print("placement:", {"train": ranks, "master": p["master"], "engines": engines})
        assert len(set(ranks)) == 2 and set(ranks) <= set(NODES)  # two ranks, two different worker nodes
        assert set(engines).isdisjoint(ranks) and set(engines) <= set(NODES)  # the engine on the third
        host, port = p["master"].rsplit(":", 1)
        assert host == ranks[0] and host != "127.0.0.1" and int(port) > 0  # rank 0's node, not the driver's
    assert resumed["start_rollout"] == 2 and resumed["last_checkpoint"] == 2
    # no rank saw the checkpoint directories: they wrote (first run) and read (resume) through the object store
    assert [d for d, ranks in first["placement"]["shipped_dirs"].items() if ranks == [0, 1]], first["placement"]
    assert [d for d, ranks in resumed["placement"]["shipped_dirs"].items() if ranks == [0, 1]], resumed["placement"]

    # the metrics of every rollout, from the run (rollouts 0-1) and its resume (rollout 2), as on one node
    hist = {k: {**first["history"].get(k, {}), **resumed["history"].get(k, {})} for k in TRAIN_KEYS}
    checked = 0
    for k in TRAIN_KEYS:
        base = single["history"].get(k)
        if base is None:
            continue
        assert sorted(hist[k]) == sorted(base) == ["0", "1", "2"], k
        for i in base:
            assert abs(hist[k][i] - base[i]) <= 1e-6, (k, i, hist[k][i], base[i])
            checked += 1
    assert checked >= 3 * 5
    print("max |Δ| over", checked, "metric values:",
          max(abs(hist[k][i] - single["history"][k][i]) for k in TRAIN_KEYS if k in single["history"]
              for i in single["history"][k]))

    # the weights written by ranks that do not see the checkpoint directory came back through the object store
    a, b = _weights(single_work / "ckpt", 2), _weights(work / "ckpt", 2)  # (retention keeps the last only)
    assert sorted(a) == sorted(b)
    worst = max(float((a[n].float() - b[n].float()).abs().max()) for n in a)
    print(f"final weights: max |Δ| {worst:.3g} over {len(a)} tensors")
    assert worst <= 1e-6, worst
    assert (work / "ckpt" / "iter_0000002" / "optim" / "state.pt").is_file()


def test_model_missing_on_a_node_names_the_node(cluster, driver_only, tiny_model):
    from engine.diagnosis import DiagnosisError
    from flows.train import rl_train

    model = driver_only / "model"
    shutil.copytree(tiny_model, model)
    # the engine in an actor of its own: its bundle needs a CPU, so it lands on a worker node, which lacks the model
    cfg = _cfg(str(model), driver_only / "missing", num_rollout=1, ray_address=cluster.address,
               rollout_engine_process="own")
    with pytest.raises(DiagnosisError) as e:
        rl_train(cfg)
    text = str(e.value)
    assert f"--hf-checkpoint {model} is not there on node 127.0.0." in text, text
    assert "rollout engine 0" in text or "train rank 0" in text
    assert "every node at the same path" in text and "docs/cluster.md" in text


def test_disk_sync_to_engines_that_do_not_see_the_directory_fails_at_placement(cluster, driver_only, tiny_model):
    from engine.diagnosis import DiagnosisError
    from flows.train import rl_train

    # the engine in an actor of its own, on a node that does not see the driver's directory (auto would serve it
    # from train rank 0's process, which the same check covers as "train rank 0")
    cfg = _cfg(tiny_model, driver_only / "disk", num_rollout=1, ray_address=cluster.address,
               weight_sync_method="disk", rollout_engine_process="own")
    with pytest.raises(DiagnosisError) as e:
        rl_train(cfg)
    text = str(e.value)
    assert "--weight-sync-method disk" in text and "rollout engine 0 on 127.0.0." in text, text
    assert "--weight-sync-method tensor" in text


@pytest.mark.parametrize("ray_code", ["ship", "image"])
def test_code_is_shipped_with_the_job_runtime_env(cluster, ray_code):
    import ray

    from engine import cluster as rf_cluster

    if ray.is_initialized():
        ray.shutdown()
    rf_cluster.connect(cluster.address, ray_code=ray_code)
    try:
        @ray.remote(num_cpus=0)
        class Probe:
            def where(self):
                import sys

                env = ray.get_runtime_context().runtime_env
                return env.get("py_modules") or [], env.get("env_vars", {}), [p for p in sys.path
                                                                             if "runtime_resources" in p]

        # an actor with an env of its own, as the train workers and engines have: the job's modules stay
        mods, env, paths = ray.get(Probe.options(runtime_env=rf_cluster._threads_env(1)).remote().where.remote())
    finally:
        ray.shutdown()
    assert env.get("OMP_NUM_THREADS") == "1"
    if ray_code == "image":
        assert mods == [] and paths == []
        return
    print("py_modules:", mods, "sys.path:", paths)
    assert len(mods) == len(rf_cluster.PACKAGES) and all(m.startswith("gcs://_ray_pkg_") for m in mods), mods
    # each package unpacked on the node and put on the worker's path
    assert sorted(p for p in ("engine", "flows", "tasks", "plumbing")
                  if any(os.path.isfile(os.path.join(d, p, "__init__.py")) for d in paths)) == \
        sorted(rf_cluster.PACKAGES), paths


def test_wait_for_nodes(cluster, capsys):
    import ray

    from engine.cluster.wait import main

    if ray.is_initialized():
        ray.shutdown()
    assert main(["--address", cluster.address, "--nodes", "4", "--timeout", "30"]) == 0
    assert "4 Ray nodes alive" in capsys.readouterr().out
    assert main(["--address", cluster.address, "--nodes", "5", "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert "only 4 of 5 Ray nodes joined" in err and "127.0.0.3" in err
