"""Multi-node pieces without a cluster: the CPU train layout, the CPU topology check, what a node sees."""
from __future__ import annotations

import pytest


def test_cpu_train_layout_one_bundle_per_node_strict_spread():
    from engine.cluster.placement import cpu_train_layout

    assert cpu_train_layout(nodes=1, per_node=4) is None  # one node: unplaced, the ranks share its cores
    lay = cpu_train_layout(nodes=3, per_node=2)
    assert lay.strategy == "STRICT_SPREAD" and lay.bundles == [{"CPU": 2.0}] * 3
    assert lay.train_bundles == [0, 0, 1, 1, 2, 2] and lay.train_cpu == 1.0 and lay.engine_bundles == []


def test_cpu_topology_needs_enough_nodes(small_cfg):
    from engine.doctor.checks import Environment, topology_fits_cluster

    cfg = small_cfg(actor_num_nodes=3, actor_num_gpus_per_node=2, rollout_batch_size=6, micro_batch_size=1)
    env = Environment(cpus=6, cpus_per_node=[0, 4, 2, 1], source="Ray cluster x:6379")
    (d,) = topology_fits_cluster(cfg, env)
    assert d.code == "RF02" and "--actor-num-nodes 3" in d.what and "only 2 of" in d.what
    assert d.fix.startswith("--actor-num-nodes 2")
    assert topology_fits_cluster(cfg, Environment(cpus=8, cpus_per_node=[2, 2, 4])) == []
    assert topology_fits_cluster(small_cfg(), env) == []  # one node: nothing to place


def test_probe_sees_and_hidden_paths(tmp_path, monkeypatch):
    from engine.cluster import nodes

    with nodes.Probe(tmp_path / "d") as p:
        assert nodes.sees(p.file, p.token)
        assert not nodes.sees(p.file, "another run's token")
        monkeypatch.setenv(nodes.HIDDEN_ENV, f"/elsewhere:{tmp_path}")
        assert not nodes.sees(p.file, p.token) and not nodes.visible(tmp_path / "d")
        monkeypatch.setenv(nodes.HIDDEN_ENV, f"{tmp_path}-sibling")  # a prefix of the name is not the directory
        assert nodes.sees(p.file, p.token)
    assert not (tmp_path / "d").joinpath(p.file).exists()


def test_probe_of_a_read_only_directory_compares_its_entries(tmp_path, monkeypatch):
    import os

    from engine.cluster import nodes

    d = tmp_path / "ro"
    d.mkdir()
    (d / "latest_checkpointed_iteration.txt").write_text("3\n")
    other = tmp_path / "other"  # a namesake elsewhere (another node's own disk) with other content
    other.mkdir()
    (other / "latest_checkpointed_iteration.txt").write_text("12\n")
    monkeypatch.setattr(nodes.Path, "write_text", lambda *a, **k: (_ for _ in ()).throw(PermissionError("ro")))
    p = nodes.Probe(d)
    assert not p.written and p.file == str(d) and nodes.sees(p.file, p.token)
    p.remove()
    assert os.listdir(d) == ["latest_checkpointed_iteration.txt"]  # nothing written, nothing removed
    assert not nodes.sees(str(other), p.token)


def test_require_model_names_node_and_fix(tmp_path, tiny_model, monkeypatch):
    from engine.cluster import nodes
    from engine.diagnosis import ConfigError

    nodes.require_model(tiny_model, who="rollout engine 0")
    monkeypatch.setenv(nodes.HIDDEN_ENV, tiny_model)
    with pytest.raises(ConfigError) as e:
        nodes.require_model(tiny_model, who="train rank 1")
    (d,) = e.value.diagnoses
    assert f"--hf-checkpoint {tiny_model} is not there on node" in d.what and "train rank 1" in d.what
    assert d.facts["field"] == "hf_checkpoint" and d.facts["value"] == tiny_model and d.facts["node"]


def test_pack_written_and_local_copy_round_trip(tmp_path):
    from engine.cluster import nodes

    def write(d):
        (tmp_path / "seen").write_text(d)
        import pathlib
        pathlib.Path(d, "model").mkdir()
        pathlib.Path(d, "model", "w.bin").write_bytes(b"\x00\x01")
        pathlib.Path(d, "state.pt").write_bytes(b"s")
        return ["model/w.bin", "state.pt"]

    out, files = nodes.written(write)
    assert out == ["model/w.bin", "state.pt"] and files == {"model/w.bin": b"\x00\x01", "state.pt": b"s"}
    import os
    assert not os.path.exists((tmp_path / "seen").read_text())  # the node-local directory is gone
    nodes.unpack_dir(files, tmp_path / "ckpt")
    assert nodes.pack_dir(tmp_path / "ckpt") == files
    assert nodes.local_copy(files, lambda d: sorted(nodes.pack_dir(d))) == ["model/w.bin", "state.pt"]


# ---- a model in S3: one copy per node ---------------------------------------------------------------------------
def _upload(fs, src: str, dst: str) -> None:
    import os

    for f in sorted(os.listdir(src)):
        if os.path.isfile(os.path.join(src, f)):
            fs.put_file(os.path.join(src, f), f"{dst}/{f}")


def test_s3_model_is_downloaded_once_per_node_and_again_when_it_changes(s3_bucket, tiny_model, tmp_path,
                                                                         monkeypatch):
    import fsspec

    from engine.cluster import nodes
    from engine.diagnosis import ConfigError

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    uri = f"{s3_bucket}/models/tiny"
    _upload(fs, tiny_model, uri)
    monkeypatch.setenv(nodes.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(nodes, "_local_models", {})
    local = nodes.local_model(uri)
    assert local.startswith(str(tmp_path / "cache")) and (tmp_path / "cache").joinpath(local, ".complete").is_file()
    import filecmp
    import os
    same = [f for f in os.listdir(tiny_model) if os.path.isfile(os.path.join(tiny_model, f))]
    match, mismatch, errors = filecmp.cmpfiles(tiny_model, local, same, shallow=False)
    assert sorted(match) == sorted(same) and not mismatch and not errors
    stamp = os.stat(os.path.join(local, ".complete")).st_mtime_ns
    monkeypatch.setattr(nodes, "_local_models", {})  # another process of the node: finds the copy, no download
    assert nodes.local_model(uri) == local and os.stat(os.path.join(local, ".complete")).st_mtime_ns == stamp
    fs.pipe_file(f"{uri}/extra.txt", b"changed")  # the model changed in S3: a new copy
    monkeypatch.setattr(nodes, "_local_models", {})
    again = nodes.local_model(uri)
    assert again != local and open(os.path.join(again, "extra.txt")).read() == "changed"
    assert nodes.local_model(tiny_model) == tiny_model  # a path is used as it is
    with pytest.raises(ConfigError) as e:
        nodes.local_model(f"{s3_bucket}/models/nothing-here")
    (d,) = e.value.diagnoses
    assert "has no config.json (0 objects under it)" in d.what and d.facts["field"] == "hf_checkpoint"


def test_s3_prompt_data_is_read_through_the_cache(s3_bucket, tmp_path, monkeypatch):
    import fsspec

    from engine.cluster import nodes
    from engine.config.data import BUNDLED_TRAIN
    from engine.data import load_prompts
    from engine.diagnosis import ConfigError

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put_file(BUNDLED_TRAIN, f"{s3_bucket}/data/train.jsonl")
    monkeypatch.setenv(nodes.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    rows = load_prompts(f"{s3_bucket}/data/train.jsonl@[0:3]", input_key="prompt", label_key="label")
    local = load_prompts(BUNDLED_TRAIN, input_key="prompt", label_key="label")[:3]
    assert [(r.prompt, r.label) for r in rows] == [(r.prompt, r.label) for r in local]
    (copy,) = (tmp_path / "cache" / "files").glob("*-train.jsonl")
    assert copy.read_bytes() == open(BUNDLED_TRAIN, "rb").read()
    with pytest.raises(ConfigError) as e:
        load_prompts(f"{s3_bucket}/data/nope.jsonl", input_key="prompt", label_key="label", flag="--prompt-data")
    (d,) = e.value.diagnoses
    assert d.what.startswith(f"--prompt-data {s3_bucket}/data/nope.jsonl: cannot be read (FileNotFoundError")


def test_a_lean_local_cluster_runs_only_the_gcs_the_raylet_and_its_agents():
    """--ray-services lean (the default) on a real local start, in a fresh interpreter: no autoscaler monitor, log
    monitor or API server among the head's processes, the dashboard agent is the stand-in (this Ray has no
    dashboard packages) and its ports are written as not in use, and tasks still run; Ray's Node and its command
    builder are as they were afterwards, and the stand-in exits with the raylet. RAY_ADDRESS names a cluster that is
    not there: a run without --ray-address starts its own all the same (Ray's default would join it, or a `ray
    start` cluster of this machine, and refuse num_cpus), and says so. Ray's token authentication is on, as Ray
    starts a local cluster, without Ray's notice of it on every start."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import psutil, ray
from ray._private import node, ray_constants as rc, services, worker
from ray._private.utils import get_dashboard_dependency_error
from engine import cluster
assert get_dashboard_dependency_error() is not None  # the `ray` wheel: its agent would load no module
before = {m: getattr(node.Node, m) for m in cluster.LEAN_LEAVES_OUT}
build = services._build_python_executable_command_memory_profileable
assert cluster.services_started() is None
cluster.connect(None, 1, "ship", "lean")
assert cluster.services_started() == "lean"
import os
assert os.environ.get("RAY_AUTH_MODE") == "token"  # Ray's default for a local cluster, kept (its notice is not)
kinds = set(worker._global_node.all_processes)
print({"gcs_server", "raylet"} <= kinds, kinds.isdisjoint({rc.PROCESS_TYPE_MONITOR, rc.PROCESS_TYPE_LOG_MONITOR,
                                                           rc.PROCESS_TYPE_DASHBOARD}), sorted(kinds))
print(ray.get(ray.remote(lambda: 6 * 7).remote()))
raylet = psutil.Process(worker._global_node.all_processes[rc.PROCESS_TYPE_RAYLET][0].process.pid)
agents = [' '.join(p.cmdline()) for p in raylet.children()]
stand_in = [p for p in raylet.children() if 'agent_stand_in.py' in ' '.join(p.cmdline())]
print(len(stand_in), sum('DashboardAgent' in a or ('dashboard/agent.py' in a and 'stand_in' not in a) for a in agents),
      sum('RuntimeEnvAgent' in a or 'runtime_env' in a for a in agents), agents)
session, node_id = worker._global_node.get_session_dir_path(), worker._global_node.node_id
import ray._raylet as raylet
print([open(f"{session}/{getattr(raylet, n)}_{node_id}").read() for n in cluster.AGENT_PORT_NAMES])
print(all(getattr(node.Node, m) is fn for m, fn in before.items()),
      services._build_python_executable_command_memory_profileable is build)
ray.shutdown()
assert cluster.services_started() is None
stand_in[0].wait(timeout=15)  # the raylet is gone: the stand-in follows it
print("stand-in exited")
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # as a fresh shell has it
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120, env={**env, "RAY_ADDRESS": "127.0.0.1:9"})
    assert out.returncode == 0, out.stderr
    assert "Token authentication is enabled" not in out.stderr, out.stderr  # Ray's notice at every start
    assert "RAY_ADDRESS=127.0.0.1:9 is set but --ray-address is not" in out.stderr, out.stderr
    procs, answer, agents, ports, restored, exited = out.stdout.strip().splitlines()[-6:]
    assert procs.startswith("True True "), procs  # the GCS and the raylet run; no monitor, log monitor, API server
    assert answer == "42" and restored == "True True" and exited == "stand-in exited"
    assert agents.startswith("1 0 1 "), agents  # the stand-in, not Ray's dashboard agent; the runtime-env agent
    assert ports == "['-1', '-1', '-1']", ports


def test_the_agent_stand_in_writes_the_port_files_as_ray_does(tmp_path):
    """agent_stand_in.py writes Ray's own port files (`ray._raylet.persist_port`: same names, same content), so a
    Ray that changed them fails here rather than in a raylet waiting for its agent's ports."""
    import ray._raylet as raylet

    from engine.cluster import AGENT_PORT_NAMES, agent_stand_in

    node_id = "ab" * 28
    ours, rays = tmp_path / "ours", tmp_path / "rays"
    ours.mkdir(), rays.mkdir()
    for name in (getattr(raylet, n) for n in AGENT_PORT_NAMES):
        agent_stand_in.persist(str(ours), node_id, name, -1)
        raylet.persist_port(str(rays), node_id, name, -1)
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in rays.iterdir())
    assert all((ours / p.name).read_bytes() == p.read_bytes() for p in rays.iterdir())
    assert len(list(ours.iterdir())) == 3


def test_the_agent_is_replaced_only_where_it_has_nothing_to_do(monkeypatch, caplog):
    """With the dashboard's packages (ray[default]) the agent serves metrics: Ray's own command is kept. Without
    them the agent's command (only the agent's) is the stand-in's, for the start only. A Ray that builds the command
    otherwise keeps its agent, with a warning."""
    from ray._private import ray_constants, services
    from ray._private import utils as ray_utils

    from engine import cluster

    build = services._build_python_executable_command_memory_profileable
    restore = cluster._stand_in_for_the_agent()
    try:
        agent = services._build_python_executable_command_memory_profileable(
            ray_constants.PROCESS_TYPE_DASHBOARD_AGENT, "/tmp/s")
        assert agent[2].endswith("agent_stand_in.py") and "metrics_agent_port" in agent[3]
        other = services._build_python_executable_command_memory_profileable(
            ray_constants.PROCESS_TYPE_RUNTIME_ENV_AGENT, "/tmp/s")
        assert other == build(ray_constants.PROCESS_TYPE_RUNTIME_ENV_AGENT, "/tmp/s")
    finally:
        restore()
    assert services._build_python_executable_command_memory_profileable is build
    monkeypatch.setattr(ray_utils, "get_dashboard_dependency_error", lambda: None)
    cluster._stand_in_for_the_agent()
    assert services._build_python_executable_command_memory_profileable is build
    monkeypatch.undo()
    monkeypatch.delattr(services, "_build_python_executable_command_memory_profileable")
    with caplog.at_level("WARNING", logger="rollflow.cluster"):
        cluster._stand_in_for_the_agent()()
    assert "its agent runs" in caplog.text


def test_full_services_start_rays_own_and_a_ray_without_the_hooks_is_reported(monkeypatch, caplog):
    """`full` leaves Ray's Node alone; `lean` swaps the three methods for the start only; a Ray whose Node lacks
    one starts its full services with a warning that says so (never silently)."""
    from ray._private import node

    from engine import cluster

    original = {m: getattr(node.Node, m) for m in cluster.LEAN_LEAVES_OUT}
    with cluster._services("full") as started:
        assert all(getattr(node.Node, m) is fn for m, fn in original.items()) and started == "full"
    with cluster._services("lean") as started:
        assert started == "lean"
        assert all(getattr(node.Node, m) is not fn for m, fn in original.items())
        assert node.Node.start_monitor(object()) is None
    assert all(getattr(node.Node, m) is fn for m, fn in original.items())
    monkeypatch.delattr(node.Node, "start_log_monitor")
    with caplog.at_level("WARNING", logger="rollflow.cluster"), cluster._services("lean") as started:
        assert getattr(node.Node, "start_monitor") is original["start_monitor"] and started == "full"
    assert "no Node.start_log_monitor" in caplog.text and "full services" in caplog.text


def test_full_ray_services_with_a_joined_cluster_is_a_config_error(small_cfg):
    from engine.diagnosis import ConfigError

    with pytest.raises(ConfigError) as e:
        small_cfg(ray_address="auto", ray_services="full")
    assert "--ray-services full" in str(e.value) and "ray_services" in str(e.value.diagnoses[0].facts)
    assert small_cfg(ray_address="auto").ray_services == "lean"


def test_the_weight_group_is_opened_again_only_when_its_engines_change():
    """--weight-sync-method distributed: TrainGroup.group_push opens rank 0's group on the first push, reuses it
    while the engines are the same, opens it anew for a restarted engine's new address (its old process left the
    group with it), and after a failed broadcast."""
    from engine.cluster import TrainGroup

    calls = []
    fail = []

    def all_(method, *args, **kwargs):
        name = method(type("W", (), {"__getattr__": lambda self, n: n})())
        calls.append(name)
        if name == "group_push" and fail:
            raise RuntimeError(fail.pop())
        return [([{"success": True}], 10)]

    tg = object.__new__(TrainGroup)
    tg._group_engines, tg._all = None, all_
    kw = dict(api_key="k", backend="gloo", timeout_s=5)
    a, b = [("http://e0:1", 1), ("http://e1:1", 1)], [("http://e0:2", 1)]
    assert tg.group_push(a, 1, **kw) == ([{"success": True}], 10)
    tg.group_push(a, 2, **kw)
    assert calls == ["group_open", "group_push", "group_push"]
    tg.group_push(b, 2, **kw)  # engine 0 restarted on a new port: a group of its own for its resync
    tg.group_push(a, 3, **kw)  # the next sync to every engine: one group again
    assert calls[3:] == ["group_open", "group_push", "group_open", "group_push"]
    fail.append("gloo timeout")
    with pytest.raises(RuntimeError):
        tg.group_push(a, 4, **kw)
    tg.group_push(a, 4, **kw)  # the broken group is not reused
    assert calls[7:] == ["group_push", "group_open", "group_push"]
    tg.group_close()
    assert calls[-1] == "group_close" and tg._group_engines is None


def test_a_token_authenticated_cluster_is_diagnosed_at_once_and_joined_with_its_token(tmp_path):
    """A real `ray start --head` with Ray's token authentication (RAY_AUTH_MODE=token, as Ray turns it on wherever
    ~/.ray/auth_token exists): a driver joining by address without token mode, or with another token, is refused
    by the GCS; engine.cluster.check_token_auth names that (RF02, exit 2 of engine.cluster.wait) instead of
    ray.init's ~20 s of retries and "Failed to connect"; with the cluster's token it joins. No token reaches the
    output."""
    import os
    import secrets
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    token, wrong = secrets.token_hex(16), secrets.token_hex(16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path / "home"  # no ~/.ray/auth_token for any process here
    home.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))} | {
        "HOME": str(home)}
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--node-ip-address=127.0.0.1",
         f"--port={port}", "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats",
         "--dashboard-agent-listen-port=0", f"--temp-dir={temp_dir}", "--block"],
        env=base | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)

    def wait(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine.cluster.wait", "--address", f"127.0.0.1:{port}",
                               "--nodes", "1", "--timeout", "60"], cwd=root, env=base | env, capture_output=True,
                              text=True, timeout=120)

    try:
        for line in head.stdout:  # up once Ray says how to join it
            if "ray start --address" in line or "--block" in line:
                break
        assert head.poll() is None, "ray start exited"
        joined = wait(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        assert joined.returncode == 0 and "1 Ray nodes alive" in joined.stdout, joined.stderr
        plain = wait()
        assert plain.returncode == 2, plain.stderr
        assert "[RF02 error]" in plain.stderr and "requires token authentication" in plain.stderr
        assert "no RAY_AUTH_MODE" in plain.stderr and "run rollflow with RAY_AUTH_MODE=token" in plain.stderr
        other = wait(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=wrong)
        assert other.returncode == 2, other.stderr
        assert "refuses this driver's authentication token" in other.stderr
        for p in (joined, plain, other):
            assert token not in p.stdout + p.stderr and wrong not in p.stdout + p.stderr
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        head.stdout.close()
