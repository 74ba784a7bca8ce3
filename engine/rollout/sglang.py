"""The SGLang engine: build `python -m sglang.launch_server …`, run it with its log captured, wait, scan, stop.

rollflow owns the flags that come from placement and the port allocator (model path, host, port, TP size, base
GPU id, NCCL port, dist-init address); every `--sglang-<flag> [value]` of the run passes through as `--<flag>`
(a value list as several arguments). Colocated runs add `--enable-memory-saver` so that
`/release_memory_occupation` frees the GPU for training. The Python executable is configurable
(`--rollout-engine-python`), so SGLang can live in its own environment.

`LaunchedEngine` waits for `/health_generate` with a deadline, and checks that the server answering is its own
(`foreign_server`); if the process exits first or the deadline passes, the failure carries what the log says (RF11
illegal memory access / OOM, RF08 port taken) and its last lines.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from engine.config.sglang_args import OWNED
from engine.diagnosis import ConfigError, Diagnosis, DiagnosisError
from engine.rollout.client import auth_headers, shared_http
from engine.rollout.diagnose import health_timeout, scan_engine_log
from engine.rollout.ports import port_holder_pid, port_in_use


def sglang_command(*, python: str, model_path: str, host: str, port: int, tp_size: int, base_gpu_id: int,
                   nccl_port: int, dist_init_addr: str, sglang_args: dict[str, Any],
                   colocate: bool = False, api_key: str | None = None) -> list[str]:
    """argv of one SGLang server (`--api-key` = the run's engine token unless --sglang-api-key set one)."""
    for k in sglang_args:
        if k in OWNED:
            via = f"; set it with {OWNED[k]}" if OWNED[k] else ""
            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--sglang-{k} is set by rollflow itself (placement and the port allocator){via}",
                fix=f"drop --sglang-{k}"))
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
           "--tp-size", str(tp_size), "--base-gpu-id", str(base_gpu_id), "--nccl-port", str(nccl_port),
           "--dist-init-addr", dist_init_addr]
    if colocate and "enable-memory-saver" not in sglang_args:
        cmd.append("--enable-memory-saver")
    if api_key and "api-key" not in sglang_args:
        cmd += ["--api-key", api_key]
    for k, v in sglang_args.items():
        if v is True:
            cmd.append(f"--{k}")
        elif v is False or v is None:
            continue  # a YAML `false` means: leave SGLang's default
        elif isinstance(v, (list, tuple)):
            cmd += [f"--{k}", *map(str, v)]
        else:
            cmd += [f"--{k}", str(v)]
    return cmd


SECRET_FLAGS = ("--api-key", "--admin-api-key")


def redacted_argv(cmd: list[str]) -> list[str]:
    """The command line with the values of key flags replaced (what is written to the engine log)."""
    return [("***" if i and cmd[i - 1] in SECRET_FLAGS else a) for i, a in enumerate(cmd)]


def flag_value(cmd: list[str], flag: str) -> str | None:
    """The value given to `flag` in an argv (the last one), or None."""
    values = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]
    return values[-1] if values else None


def mem_fraction_of(sglang_args: dict[str, Any]) -> float | None:
    v = sglang_args.get("mem-fraction-static")
    try:
        return None if v in (None, True, False) else float(v)
    except (TypeError, ValueError):
        return None


class LaunchedEngine:
    """One engine process: started with its output in `log_path`, killed with its whole process group."""

    def __init__(self, cmd: list[str], *, url: str, log_path: str, ports: list[int],
                 mem_fraction_static: float | None, env: dict[str, str] | None = None):
        self.cmd, self.url, self.log_path, self.ports = cmd, url, Path(log_path), ports
        self.mem_fraction_static, self.env = mem_fraction_static, env
        self.proc: subprocess.Popen | None = None
        self._log_start = 0
        self._lost_race = False  # another server answered on this launch's port (foreign_server)

    def start(self, timeout_s: float) -> str:
        from engine.rollout.client import EngineClient

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._log_start = log.tell()  # diagnose() reads this launch's lines, not an earlier launch's
            log.write(f"$ {' '.join(redacted_argv(self.cmd))}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(self.env or {})}, start_new_session=True)
        client = EngineClient(self.url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._failure(f"the engine process exited with code {self.proc.returncode} during start-up")
            if client.health_generate(timeout_s=min(10.0, max(0.5, deadline - time.monotonic()))):
                if (other := self.foreign_server()) is None:
                    return self.url
                self.stop()  # it lost the bind to `other`, and exits (or hangs) by itself: not worth waiting for
                self._lost_race = True
                raise DiagnosisError(port_in_use(self.ports[0], httpx.URL(self.url).host,
                                                 f"the launched engine's HTTP port (answered by {other})"))
            time.sleep(0.25)
        self.stop()
        found = self.diagnose()
        raise DiagnosisError(found + [health_timeout(self.url, self.ports[0], timeout_s, self.log_tail())])

    def _failure(self, what: str) -> DiagnosisError:
        found = self.diagnose()
        if found:
            return DiagnosisError(found)
        return DiagnosisError(Diagnosis(code="ENGINE", severity="error",
                                        what=f"{what}; command: {' '.join(self.cmd)}; last log lines "
                                             f"({self.log_path}):\n{self.log_tail()}",
                                        fix="read the log; check --rollout-engine-python and the --sglang-* flags",
                                        facts={"returncode": self.proc.returncode if self.proc else None}))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def diagnose(self) -> list[Diagnosis]:
        """What this launch's log lines say (the log is appended to by every launch of the engine: a restart
        after a port clash is not diagnosed with the clash)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            text = ""
        return scan_engine_log(text, mem_fraction_static=self.mem_fraction_static, ports=self.ports,
                               log_path=str(self.log_path))

    def foreign_server(self) -> str | None:
        """What answers on this launch's HTTP port when it is not this launch's server, else None.

        Two Ray clusters on one host (two runs, two test workers) keep separate port registries, so both can check
        a port free and launch on it: one server binds it, the other exits with 'address already in use' — but
        until it exits, the winner answers the loser's /health_generate (SGLang serves /health* without the API
        key). Not this launch's: a server that refuses its --api-key on /get_model_info (every run has a key of its
        own), or one whose listening process (/proc; found for this user's processes) is outside this launch's
        session (it runs in a session of its own, which its children inherit)."""
        key = flag_value(self.cmd, "--api-key")
        if key:
            try:
                code = shared_http().get(self.url + "/get_model_info", headers=auth_headers(key), timeout=10).status_code
            except httpx.HTTPError:
                code = None  # /health_generate just answered: a transient error is no judgement
            if code in (401, 403):
                return f"a server that refuses this run's --api-key (HTTP {code})"
        holder = port_holder_pid(self.ports[0], listening=True)
        if holder is None:
            return None
        try:
            mine = os.getsid(holder[0]) == self.proc.pid
        except ProcessLookupError:  # it listened on this port a moment ago and is gone: not this launch's server
            mine = False
        return None if mine else f"pid {holder[0]} ({holder[1][:160]})"

    def lost_port_race(self) -> bool:
        """True when this launch lost a port (RF08: its log says so and it exited by itself, or another server
        answered on its port): another port may do, where a hang or a crash would not."""
        return self._lost_race or (self.proc is not None and self.proc.poll() is not None
                                   and self.proc.returncode > 0 and any(d.code == "RF08" for d in self.diagnose()))

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:  # the server exited: what it started may live on in its group
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its scheduler / detokenizer children
            self.proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=grace_s)
