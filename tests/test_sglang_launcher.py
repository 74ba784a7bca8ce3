"""The SGLang launcher with the built-in server as the launched process (SGLang cannot be installed here).

A fake `python` stands in for SGLang's environment (`--rollout-engine-python`): for `-m sglang.launch_server ARGS`
it runs `python -m engine.rollout.server ARGS` (which takes launch_server's flags), or, on request, prints what a
crashing SGLang prints, or never becomes healthy.
"""
from __future__ import annotations

import sys

import httpx
import pytest

from engine.diagnosis import DiagnosisError
from engine.rollout.sglang import LaunchedEngine, sglang_command
from engine.rollout.ports import free_loopback_port

pytestmark = pytest.mark.slow


_free_port = free_loopback_port  # engine/rollout/ports.py


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "sglang-env" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text(f"""#!/bin/sh
[ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ] || {{ echo "unexpected: $*" >&2; exit 3; }}
shift 2
case "$FAKE_SGLANG_MODE" in
  crash) echo "Loading weights..."; echo "RuntimeError: CUDA error: an illegal memory access was encountered" >&2
         exit 1 ;;
  hang)  exec sleep 600 ;;
esac
exec {sys.executable} -m engine.rollout.server --threads 1 "$@"
""")
    path.chmod(0o755)
    return str(path)


def _engine(fake_python, tiny_model, tmp_path, sglang_args, env=None):
    port, nccl, dist = _free_port(), _free_port(), _free_port()
    cmd = sglang_command(python=fake_python, model_path=tiny_model, host="127.0.0.1", port=port, tp_size=1,
                         base_gpu_id=0, nccl_port=nccl, dist_init_addr=f"127.0.0.1:{dist}", sglang_args=sglang_args)
    return LaunchedEngine(cmd, url=f"http://127.0.0.1:{port}", log_path=str(tmp_path / "logs" / "engine-0.log"),
                          ports=[port, nccl, dist], mem_fraction_static=0.7, env=env)


def test_launched_server_serves_with_passed_flags_and_its_log_captured(fake_python, tiny_model, tmp_path):
    eng = _engine(fake_python, tiny_model, tmp_path, {"mem-fraction-static": "0.7",
                                                        "enable-deterministic-inference": True,
                                                        "model-impl": "transformers"})
    url = eng.start(timeout_s=180)
    try:
        r = httpx.post(url + "/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 2}},
                       timeout=60).json()
        assert r["meta_info"]["completion_tokens"] >= 1
        info = httpx.get(url + "/get_server_info").json()
        assert info["deterministic"] is True and info["model_impl"] == "transformers"  # the --sglang-* flags arrived
        log = eng.log_text()
        assert log.startswith(f"$ {fake_python} -m sglang.launch_server --model-path {tiny_model}")
        assert "--nccl-port" in log and "--mem-fraction-static 0.7" in log  # flags it does not use are listed
    finally:
        eng.stop()
    assert not eng.alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_crash_with_illegal_memory_access_is_rf11(fake_python, tiny_model, tmp_path):
    eng = _engine(fake_python, tiny_model, tmp_path, {"mem-fraction-static": "0.7"}, env={"FAKE_SGLANG_MODE": "crash"})
    with pytest.raises(DiagnosisError) as e:
        eng.start(timeout_s=60)
    assert e.value.codes == ["RF11"]
    assert "--sglang-mem-fraction-static = 0.7" in str(e.value) and "--sglang-mem-fraction-static 0.6" in str(e.value)


def test_engine_that_never_answers_fails_at_its_deadline_as_rf08(fake_python, tiny_model, tmp_path):
    import time

    eng = _engine(fake_python, tiny_model, tmp_path, {}, env={"FAKE_SGLANG_MODE": "hang"})
    t0 = time.monotonic()
    with pytest.raises(DiagnosisError) as e:
        eng.start(timeout_s=2)
    assert time.monotonic() - t0 < 20
    assert e.value.codes == ["RF08"] and "did not answer /health_generate within 2s" in str(e.value)
    assert not eng.alive()  # killed, with its process group


def _other_runs_server(accepts_any_key: bool):
    """A server of another run on a free loopback port: /health* answers without a key (as SGLang's does); every
    other path refuses this run's key, or (a run given the same --sglang-api-key) accepts it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if accepts_any_key or self.path.startswith("/health") else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("seen_by", ["api_key", "proc"])
def test_another_runs_server_answering_on_the_port_is_a_lost_race(fake_python, tiny_model, tmp_path, monkeypatch,
                                                                   seen_by):
    """Two Ray clusters on one host (each its own port registry) offer the same port: the other run's server binds
    it and answers this launch's /health_generate (no key needed) before this launch exits with 'address already in
    use'. That is not this launch's server: it refuses this run's --api-key (here with /proc blind, as for another
    user's process), or, where it accepts the key (the same --sglang-api-key), its listening process in /proc is
    outside this launch's session. The launch is an RF08 lost race, killed; the engine actor launches again on the
    next ports and gets its own server."""
    import os

    from engine.rollout import sglang as launcher
    from engine.rollout.actor import EngineActor, EngineSpec

    if seen_by == "api_key":
        monkeypatch.setattr(launcher, "port_holder_pid", lambda port, **kw: None)
    other = _other_runs_server(accepts_any_key=seen_by == "proc")
    taken = other.server_address[1]
    try:
        cmd = sglang_command(python=fake_python, model_path=tiny_model, host="127.0.0.1", port=taken, tp_size=1,
                             base_gpu_id=0, nccl_port=_free_port(), dist_init_addr=f"127.0.0.1:{_free_port()}",
                             sglang_args={}, api_key="this-runs-key")
        eng = LaunchedEngine(cmd, url=f"http://127.0.0.1:{taken}", log_path=str(tmp_path / "lost.log"),
                             ports=[taken, 0, 0], mem_fraction_static=None)
        with pytest.raises(DiagnosisError) as e:
            eng.start(timeout_s=60)
        assert e.value.codes == ["RF08"] and f"port {taken} on 127.0.0.1 is already in use" in str(e.value)
        seen = f"answered by pid {os.getpid()} (" if seen_by == "proc" else "refuses this run's --api-key (HTTP 401)"
        assert seen in str(e.value)
        assert eng.lost_port_race() and not eng.alive()

        offered = iter([[taken, _free_port(), _free_port()], [_free_port(), _free_port(), _free_port()]])
        a = EngineActor(EngineSpec(kind="sglang", model_path=tiny_model, log_dir=str(tmp_path), python=fake_python,
                                   start_timeout_s=120, api_key="this-runs-key"), 0, None)
        a._ports = lambda node, k: next(offered)
        url, ports, pid = a._start_sglang("127.0.0.1", 0, str(tmp_path / "engine-0.log"))
        try:
            assert ports[0] != taken and url.endswith(f":{ports[0]}")
            assert httpx.get(url + "/get_model_info", headers={"Authorization": "Bearer this-runs-key"},
                             timeout=10).status_code == 200  # its own server, with the run's key
        finally:
            a.server.stop()
    finally:
        other.shutdown()
        other.server_close()


def test_a_port_taken_before_sglang_binds_is_retried_on_new_ports(fake_python, tiny_model, tmp_path):
    """Two runs on one machine (each its own port registry from 30000): the launched server loses the bind and
    exits with 'address already in use'; the engine actor launches it again on the next ports. A launch that
    fails otherwise is not retried, and the retry's log is diagnosed without the first launch's clash."""
    import socket

    from engine.rollout.actor import EngineActor, EngineSpec

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    offered = iter([[taken, _free_port(), _free_port()], [_free_port(), _free_port(), _free_port()]])
    a = EngineActor(EngineSpec(kind="sglang", model_path=tiny_model, log_dir=str(tmp_path), python=fake_python,
                               start_timeout_s=60), 0, None)
    a._ports = lambda node, k: next(offered)
    log = str(tmp_path / "engine-0.log")
    try:
        url, ports, pid = a._start_sglang("127.0.0.1", 0, log)
        try:
            assert ports[0] != taken and url.endswith(f":{ports[0]}") and pid == a.server.proc.pid
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            text = open(log).read()
            assert text.count("sglang.launch_server") == 2 and f"port {taken} on 127.0.0.1 is already in use" in text
            assert a.server.diagnose() == []  # this launch's lines only
        finally:
            a.server.stop()
    finally:
        holder.close()

    crash = EngineActor(EngineSpec(kind="sglang", model_path=tiny_model, log_dir=str(tmp_path), python=fake_python,
                                   start_timeout_s=60), 1, None)
    calls = []
    crash._ports = lambda node, k: calls.append(k) or [_free_port() for _ in range(k)]
    import os
    os.environ["FAKE_SGLANG_MODE"] = "crash"
    try:
        with pytest.raises(DiagnosisError) as e:
            crash._start_sglang("127.0.0.1", 0, str(tmp_path / "engine-1.log"))
    finally:
        del os.environ["FAKE_SGLANG_MODE"]
    assert e.value.codes == ["RF11"] and calls == [3]
