"""--rollout-external-engine-addrs: a run that uses rollout servers it did not start (engine/rollout/external.py).

The servers here are the built-in engine started as users start it (`python -m engine.rollout.server`, a process
of its own on a loopback port); a real SGLang server speaks the same HTTP API (it cannot be installed here)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.diagnosis import ConfigError

ROOT = Path(__file__).resolve().parents[1]
KEY = "external-test-key"


def _free_port() -> int:
    from engine.rollout.ports import free_loopback_port

    return free_loopback_port()


class Server:
    """`python -m engine.rollout.server` on a loopback port, with --api-key and the --weight-dir given."""

    def __init__(self, model: str, weight_dir: Path, port: int | None = None):
        self.model, self.weight_dir, self.port = model, weight_dir, port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        self.log = self.weight_dir.parent / f"engine-{self.port}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine.rollout.server", "--model-path", self.model, "--port", str(self.port),
                 "--threads", "1", "--api-key", KEY, "--weight-dir", str(self.weight_dir)],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, f"the engine server exited while starting: {self.log.read_text()[-2000:]}"
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def info(self) -> dict:
        return httpx.get(self.url + "/get_model_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("external") / "work"
    s = Server(tiny_model, work / "weights").start()
    s.work = work
    yield s
    s.stop()


def ext(**over) -> dict:
    return dict(rollout_external_engine_addrs=over.pop("addrs", ["127.0.0.1:30000"]), sglang_args={"api-key": KEY},
                **over)


# ---- configuration --------------------------------------------------------------------------------------------
def test_addresses_become_urls_and_bad_or_repeated_ones_are_named(small_cfg):
    cfg = small_cfg(**ext(addrs=["127.0.0.1:30000", "http://h.example:31000/", "https://[::1]:8443"]))
    assert cfg.rollout_external_engine_addrs == ["http://127.0.0.1:30000", "http://h.example:31000",
                                                 "https://[::1]:8443"]
    assert cfg.external_engines and not small_cfg().external_engines
    with pytest.raises(ConfigError) as e:
        small_cfg(**ext(addrs=["127.0.0.1", "ftp://h:1", "h:1/v1", "h:1", "http://h:1"]))
    text = str(e.value)
    for bad in ("'127.0.0.1'", "'ftp://h:1'", "'h:1/v1'", "names http://h:1 more than once"):
        assert bad in text, text


@pytest.mark.parametrize("over, named", [
    (dict(colocate=True), "--colocate"),
    (dict(use_fault_tolerance=True), "--use-fault-tolerance"),
    (dict(rollout_num_gpus_per_engine=2), "--rollout-num-gpus-per-engine 2"),
    (dict(rollout_num_gpus=4), "--rollout-num-gpus 4"),
    (dict(rollout_num_engines=3), "--rollout-num-engines 3"),
    (dict(rollout_dtype="bfloat16"), "--rollout-dtype bfloat16"),
    (dict(rollout_engine_process="own"), "--rollout-engine-process own"),
    (dict(rollout_engine_python="/opt/sglang/bin/python"), "--rollout-engine-python"),
    (dict(sglang_args={"api-key": KEY, "mem-fraction-static": "0.5"}), "--sglang-mem-fraction-static"),
    (dict(debug_train_only=True, rollout_function_path="engine.rollout.sft:generate_rollout", eval_prompt_data=[]),
     "--debug-train-only"),
])
def test_what_the_servers_own_command_line_sets_is_refused(small_cfg, over, named):
    with pytest.raises(ConfigError) as e:
        small_cfg(**{**ext(), **over})
    assert named in str(e.value) and "would do nothing" in str(e.value)


def test_the_builtin_engine_needs_the_key_its_weights_are_sent_with(small_cfg):
    with pytest.raises(ConfigError, match="--sglang-api-key"):
        small_cfg(rollout_external_engine_addrs=["127.0.0.1:30000"])
    # SGLang takes weights without a key when started without one; rollout-only runs send no weights
    small_cfg(rollout_external_engine_addrs=["127.0.0.1:30000"], rollout_engine="sglang", weight_sync_method="disk")
    small_cfg(rollout_external_engine_addrs=["127.0.0.1:30000"], debug_rollout_only=True, save="")
    small_cfg(**ext(rollout_num_engines=1))  # the default count is no conflict


def test_external_engines_take_no_gpus_or_cores_of_the_cluster(small_cfg):
    from engine.doctor.checks import Environment, topology_fits_cluster
    from engine.run import Run
    from plumbing.limits import gpus_occupied

    cfg = small_cfg(**ext(addrs=["h1:30000", "h2:30000"]), actor_num_gpus_per_node=2)
    assert gpus_occupied(cfg, 2) == 2
    env = Environment(gpus=2, cpus=16, gpus_per_node=[2], cpus_per_node=[16], source="test")
    assert not [d for d in topology_fits_cluster(cfg, env) if d.severity == "error"]
    assert "--rollout-external-engine-addrs" in " ".join(cfg.engine_in_trainer_blockers())
    assert Run(small_cfg(**ext(), num_cpus=8)).threads_per_process == 7  # (cores − 1) / one train rank


# ---- attaching ------------------------------------------------------------------------------------------------
def test_attach_checks_the_key_the_kind_and_that_the_engine_answers(server):
    from engine.rollout.external import ExternalEngines

    good = ExternalEngines([server.url], kind="builtin", api_key=KEY, start_timeout_s=30).wait_started()
    slot = good.slots[0]
    assert good.serving() == [server.url] and slot.info["kind"] == "builtin"
    assert slot.info["dtype"] == "float32" and slot.info["device"] == "cpu" and good.join_rows == 256
    with pytest.raises(ConfigError, match="refused rollflow's key"):
        ExternalEngines([server.url], kind="builtin", api_key="wrong", start_timeout_s=30).wait_started()
    with pytest.raises(ConfigError, match="is the built-in engine, but --rollout-engine is sglang"):
        ExternalEngines([server.url], kind="sglang", api_key=KEY, start_timeout_s=30).wait_started()
    with pytest.raises(ConfigError, match=r"(?s)does not record the experts .* `rollflow serve … "
                                          r"--enable-return-routed-experts`"):
        ExternalEngines([server.url], kind="builtin", api_key=KEY, start_timeout_s=30,
                        routed_experts=True).wait_started()
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="did not answer /health_generate within 1 s"):
        ExternalEngines([f"http://127.0.0.1:{_free_port()}"], kind="builtin", api_key=KEY,
                        start_timeout_s=1).wait_started()
    assert time.monotonic() - t0 < 10
    good.stop()
    assert server.proc.poll() is None  # stop leaves the server running


def test_gpu_memory_metrics_skip_an_external_engine(server):
    """A GPU run on an external server measured the memory of engines it launched, and an external slot has no
    actor: its first sync failed with AttributeError on the H200 (2026-12-05). The engine part is 0 now."""
    from types import SimpleNamespace

    from engine.rollout.external import ExternalEngines
    from engine.stages import gpu_memory_metrics

    engines = ExternalEngines([server.url], kind="builtin", api_key=KEY, start_timeout_s=30).wait_started()
    train = SimpleNamespace(memory=lambda: [{"peak_gib": 1.5}])
    run = SimpleNamespace(on_gpu=True, train_group=train, engines=engines)
    assert gpu_memory_metrics(run, "sync") == {"memory/sync_peak_gib": 1.5, "memory/sync_train_gib": 1.5,
                                               "memory/sync_engine_gib": 0.0}
    engines.stop()


def test_a_server_whose_weights_another_process_updated_stops_the_rollout(tiny_model, tmp_path, server):
    """Two runs on one server overwrite each other's weights. The rollout stage checks that every sample came from
    weights this run pushed (the weight_version each response reports): after another client pushes version 77,
    the next rollout fails with a CONFIG error naming it, and gives its prompts back; before, it passes."""
    from safetensors.torch import load_file
    from test_hooks import make_run

    from engine.rollout.loop import StaticEngines
    from engine.stages import rollout
    from engine.weights.sync import push_tensors

    run = make_run(tmp_path, None, **ext(addrs=[server.url]), rollout_max_response_len=8)
    run.engines = StaticEngines([server.url], api_key=KEY)
    weights = load_file(str(Path(tiny_model) / "model.safetensors"))

    def push(version: int) -> None:  # the same weights, under another version name
        push_tensors([server.url], weights, version, bucket_bytes=1 << 24, timeout_s=60, api_key=KEY)

    push(5)
    run.served_versions.add("5")
    run.state.weight_version = 5
    batch = rollout(run, 0)
    assert {s.metadata["weight_version"] for g in batch.groups for s in g} == {"5"}
    push(77)  # another run's sync
    position = run.dataset.state()
    with pytest.raises(ConfigError, match="weight_version 77, which this run never pushed .*another process"):
        rollout(run, 1)
    assert run.dataset.state() == position


def test_the_doctor_warns_of_a_server_that_does_not_answer(small_cfg, server):
    from engine.doctor.checks import Environment, servers_answer

    down = f"http://127.0.0.1:{_free_port()}"
    found = servers_answer(small_cfg(**ext(addrs=[server.url, down])), Environment())
    assert [(d.severity, d.facts["value"]) for d in found] == [("warning", down)]


@pytest.mark.slow
def test_a_server_that_comes_back_gets_the_weights_again_and_a_dead_one_is_named(tiny_model, tmp_path):
    from engine.rollout.client import EngineError
    from engine.rollout.external import ExternalEngines

    s = Server(tiny_model, tmp_path / "weights").start()
    try:
        group = ExternalEngines([s.url], kind="builtin", api_key=KEY, start_timeout_s=2).wait_started()
        resent = []
        group.resync = lambda slots: resent.append([x.index for x in slots])
        assert group.revive(5) == [] and resent == []  # healthy: nothing to do
        s.stop()
        group.report_failure(s.url)
        assert group.serving() == []
        with pytest.raises(EngineError, match="within 2 s .* does not restart engines it did not start"):
            group.revive(1)
        s.start()  # its owner restarts it, on the same port
        assert group.revive(5) == [0] and resent == [[0]] and group.serving() == [s.url]
    finally:
        s.stop()


# ---- whole runs -----------------------------------------------------------------------------------------------
def _weights(save: str, it: int) -> dict:
    from safetensors.torch import load_file

    from engine import checkpoint

    return load_file(str(checkpoint.iter_dir(save, it) / "model" / "model.safetensors"))


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.mark.slow
def test_a_run_on_an_external_engine_equals_one_on_its_own_engine(prefect_harness, shared_ray, small_cfg, server,
                                                                   tmp_path):
    """Weights as HTTP tensor buckets, and by broadcast in a weight-update group (gloo): the same samples, rewards
    and trained weights as a run whose engine rollflow started, and the server is left serving the run's last
    weights (and out of the group: the second run opens its own)."""
    from flows.train import rl_train

    over = dict(num_rollout=2, save_interval=2, eval_prompt_data=[], lr=1e-3)
    own = rl_train(small_cfg(save=str(tmp_path / "own"), work_dir=str(tmp_path / "w_own"), **over))
    assert own["placement"]["engines"][0]["external"] is False
    for method in ("tensor", "distributed"):
        ext_run = rl_train(small_cfg(save=str(tmp_path / method), work_dir=str(server.work), **over,
                                     weight_sync_method=method, rollout_external_engine_addrs=[server.url],
                                     sglang_args={"api-key": KEY}))
        engines = ext_run["placement"]["engines"]
        assert [(e["url"], e["external"]) for e in engines] == [(server.url, True)]
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss"):
            assert ext_run["history"][key] == own["history"][key], (method, key)
        for key in ("train/mismatch", "sync/probe_mismatch"):  # the engine's log-probs: float rounding of threads
            assert max(ext_run["history"][key].values()) < 1e-5, (method, key, ext_run["history"][key])
        assert _equal(_weights(str(tmp_path / method), 1), _weights(str(tmp_path / "own"), 1)), method
        assert server.info()["weight_version"] == "2"


@pytest.mark.slow
def test_disk_weights_and_a_resume_reach_the_external_engine(prefect_harness, shared_ray, small_cfg, server,
                                                             tmp_path):
    """--weight-sync-method disk: the server loads <work_dir>/weights/vN. A resume first gives it the checkpoint's
    weights (it kept the last run's), and 2 rollouts + a resume to 3 end with the weights of 3 uninterrupted ones."""
    from flows.train import rl_train

    over = dict(save_interval=1, eval_prompt_data=[], lr=1e-3, weight_sync_method="disk", work_dir=str(server.work),
                **ext(addrs=[server.url]))
    whole = rl_train(small_cfg(num_rollout=3, save=str(tmp_path / "whole"), **over))
    assert server.info()["weight_version"] == "3"
    rl_train(small_cfg(num_rollout=2, save=str(tmp_path / "cut"), **over))
    assert server.info()["weight_version"] == "2"
    resumed = rl_train(small_cfg(num_rollout=3, save=str(tmp_path / "cut"), **over))
    assert resumed["history"]["rollout/reward_mean"] == whole["history"]["rollout/reward_mean"]
    assert _equal(_weights(str(tmp_path / "cut"), 2), _weights(str(tmp_path / "whole"), 2))
    assert server.info()["weight_version"] == "3"
    assert not list((server.work / "weights").glob("v*"))  # each version's directory is removed once loaded


@pytest.mark.slow
def test_an_engine_that_cannot_load_the_weights_stops_the_run_before_rollout_0(prefect_harness, shared_ray,
                                                                               small_cfg, server, tmp_path):
    from flows.train import rl_train

    cfg = small_cfg(num_rollout=1, eval_prompt_data=[], save="", weight_sync_method="disk",
                    work_dir=str(tmp_path / "elsewhere"), **ext(addrs=[server.url]))
    with pytest.raises(ConfigError) as e:
        rl_train(cfg)
    text = str(e.value)
    assert "did not reach the external engines" in text and "outside the directories" in text
    assert f"--weight-dir {(tmp_path / 'elsewhere' / 'weights').resolve()}" in text
