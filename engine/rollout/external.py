"""Rollout engines rollflow did not start (--rollout-external-engine-addrs, slime's flag): SGLang-API servers that
already run (`python -m sglang.launch_server …`, or the built-in engine's `rollflow serve …`), on this machine or
elsewhere.

rollflow never starts, restarts or stops them. At place it waits for each to answer `/health_generate` (at most
--rollout-engine-start-timeout), reads `/get_server_info` and checks what it can: the server kind matches
--rollout-engine (the transports differ), it generates, and it accepts the run's key. The trainer's weights then
reach them before the first rollout (a fresh run too: a server may have been launched with any weights), and after
every train step (--weight-sync-method):

- disk: `/update_weights_from_disk` of `<work_dir>/weights/vN`, which the server must see at that path (a shared
  filesystem; the built-in engine also needs `--weight-dir <work_dir>/weights`);
- tensor (built-in engine only): the weights in safetensors buckets of --update-weight-buffer-size, POSTed to
  `/update_weights_from_tensor` (engine/weights/sync.py:push_tensors). SGLang's own /update_weights_from_tensor
  takes CUDA IPC handles, usable only on its host, so an SGLang server is fed from disk or by broadcast;
- distributed: train rank 0 and the servers' ranks form a weight-update group (SGLang's
  /init_weights_update_group; engine/weights/distributed.py) and each sync is a broadcast; the group is left when
  the run ends, and one a killed run left is dropped when the next run opens its own.

The RF14 probe after each sync checks that the server then scores like the trainer (a different model, or weights
that did not load, fail it). An engine that stops answering is taken out of service; before a retried rollout it is
waited for (at most --rollout-engine-start-timeout) and, once it answers again, given the run's weights again (its
owner may have restarted it). Two runs must not share one server: each would overwrite the other's weights.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from typing import Any
from urllib.parse import urlparse

from engine.config.base import config_error
from engine.rollout.client import EngineClient, EngineError
from engine.rollout.engines import EngineGroup, Slot

log = logging.getLogger("rollflow.rollout")

BUILTIN_MARK = "rollflow-builtin"  # the built-in engine's /get_model_info "engine"; SGLang's has none
FLAG = "--rollout-external-engine-addrs"


def normalize_addr(addr: str) -> str:
    """`host:port`, `http://host:port` or `https://host:port` → its base URL (no trailing slash); ValueError when it
    is none of them (IPv6 hosts in brackets)."""
    text = str(addr).strip()
    url = text if "://" in text else f"http://{text}"
    url = url.rstrip("/")
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None or parsed.path \
            or parsed.query:
        raise ValueError(f"{addr!r} is not host:port or http(s)://host:port (an IPv6 host in brackets: [::1]:30000)")
    return url


def kind_of(info: dict[str, Any]) -> str:
    """builtin for the built-in engine (its /get_model_info says so), else sglang."""
    return "builtin" if info.get("engine") == BUILTIN_MARK else "sglang"


def served_dtype(info: dict[str, Any]) -> str:
    """The dtype a server reports (SGLang's server args and the built-in engine's /get_server_info carry `dtype`);
    "auto" or unknown when it does not say (RF14's default threshold is then the bf16 one)."""
    return str(info.get("dtype") or "unknown")


class ExternalEngines(EngineGroup):
    """The run's engines at fixed URLs, as EngineGroup's callers see engines: serving(), report_failure(),
    revive(), the lock that syncs hold. No actors, no placement."""

    def __init__(self, urls: list[str], *, kind: str, api_key: str | None, start_timeout_s: float,
                 routed_experts: bool = False):
        """routed_experts (--use-rollout-routing-replay): each server must say it records them."""
        self.routed_experts = routed_experts
        self.spec = self.placement = self.host = self.prestarted = None
        self.kind, self.start_timeout_s = kind, start_timeout_s
        self.fault_tolerant, self.runtime_env, self._starting = False, {}, []
        self.slots = [Slot(i, -1, info={"url": u, "external": True}) for i, u in enumerate(urls)]
        self.lock = threading.RLock()
        self.released = False
        self.resync = None  # gives a re-attached engine the run's current weights (stages.launch_rollout_engines)
        self.failures = threading.Event()
        self.monitor = None
        self.api_key = api_key

    # ---- lifecycle: attach, never start or stop -------------------------------------------------------------
    def launch(self) -> "ExternalEngines":
        return self

    def wait_started(self) -> "ExternalEngines":
        """Every engine answers /health_generate (at most the start timeout) and passes `_check`; in parallel."""
        pending = [s for s in self.slots if not s.serving]
        with cf.ThreadPoolExecutor(max(1, len(pending))) as pool:
            for s, info in zip(pending, pool.map(self._attach, pending)):
                s.info.update(info)
                s.serving = True
        if pending:
            log.info("rollflow: attached to %d external rollout engine(s): %s", len(pending),
                     ", ".join(f"{s.url} ({s.info.get('kind')}, {s.info.get('model_path')}, "
                               f"{s.info.get('dtype')})" for s in pending))
        return self

    def _answers(self, client: EngineClient) -> bool:
        """Whether the server answers /health_generate within the start timeout (asked again every 0.5 s: a
        server still starting refuses connections)."""
        deadline = time.monotonic() + self.start_timeout_s
        while not client.health_generate(min(30.0, max(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def _attach(self, slot: Slot) -> dict[str, Any]:
        client = self.client(slot.url, timeout_s=30.0)
        if not self._answers(client):
            raise config_error(
                f"{FLAG}: the engine at {slot.url} did not answer /health_generate within "
                f"{self.start_timeout_s:g} s (--rollout-engine-start-timeout); rollflow does not start external "
                "engines",
                f"start it first (e.g. `rollflow serve --port {urlparse(slot.url).port} --api-key KEY --weight-dir "
                f"<work_dir>/weights`, or `python -m sglang.launch_server …`), check the address, or drop {FLAG} to "
                "let rollflow start its engines",
                field="rollout_external_engine_addrs", value=slot.url)
        return self._check(slot, client)

    def _check(self, slot: Slot, client: EngineClient) -> dict[str, Any]:
        try:
            info = client.server_info()
        except EngineError as e:
            unauthorized = "HTTP 401" in str(e) or "HTTP 403" in str(e)
            raise config_error(
                f"{FLAG}: the engine at {slot.url} " + (
                    "refused rollflow's key (HTTP 401/403)" if unauthorized else f"gave no server info: {e}"),
                "pass the server's --api-key as --sglang-api-key KEY" if unauthorized else
                "point the flag at an SGLang-API server (SGLang or the built-in engine)",
                field="rollout_external_engine_addrs", value=slot.url) from None
        kind = kind_of(info)
        if kind != self.kind:
            what = "the built-in engine" if kind == "builtin" else "an SGLang server"
            raise config_error(
                f"{FLAG}: {slot.url} is {what}, but --rollout-engine is {self.kind} (the weights reach the two "
                "kinds differently)",
                f"--rollout-engine {kind}",
                field="rollout_engine", value=self.kind, url=slot.url, served_kind=kind)
        if info.get("is_generation") is False:
            raise config_error(
                f"{FLAG}: {slot.url} serves {info.get('model_path')!r} as an embedding/reward model "
                "(is_generation false); a rollout needs a generating one",
                "point the flag at a server of the policy model",
                field="rollout_external_engine_addrs", value=slot.url)
        if self.routed_experts and info.get("enable_return_routed_experts") is not True:
            start = "rollflow serve … --enable-return-routed-experts" if kind == "builtin" else \
                "python -m sglang.launch_server … --enable-return-routed-experts"
            raise config_error(
                f"{FLAG}: --use-rollout-routing-replay, and {slot.url} does not record the experts it routes each "
                "token to (its /get_server_info has no enable_return_routed_experts: true)",
                f"restart it with `{start}`, or drop --use-rollout-routing-replay",
                field="use_rollout_routing_replay", value=True, url=slot.url)
        return {"kind": kind, "model_path": info.get("model_path"), "dtype": served_dtype(info),
                "pid": info.get("pid"), "model_impl": info.get("model_impl"), "device": info.get("device"),
                "max_running_requests": info.get("max_running_requests"),
                "ranks": 1 if kind == "builtin" else int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1),
                "weight_version": info.get("weight_version")}

    def _kill(self, slot: Slot) -> None:  # not ours to stop
        slot.actor = None

    def stop(self) -> None:
        """Leaves the servers running, serving the run's last weights."""
        for s in self.slots:
            s.serving = False

    def restart(self, slot: Slot) -> None:
        """Wait for the server at `slot` to answer again (its owner restarts it), then give it the run's weights:
        a restarted server serves what it was launched with, whatever version it reports."""
        with self.lock:
            slot.serving = False
            if not self._answers(self.client(slot.url, timeout_s=30.0)):
                raise EngineError(f"external rollout engine {slot.url} did not answer /health_generate within "
                                  f"{self.start_timeout_s:g} s (--rollout-engine-start-timeout): rollflow does not "
                                  f"restart engines it did not start ({FLAG}); restart it, then run the same command "
                                  "again (the run resumes from its last checkpoint)")
            if self.resync is not None:
                log.warning("external rollout engine %s answers again: sending it the run's weights", slot.url)
                self.resync([slot])
            slot.serving = True
            slot.restarts += 1

    def revive(self, timeout_s: float) -> list[int]:
        dead = [s for s in self.slots if not (s.serving and self.healthy(s, timeout_s))]
        for s in dead:
            self.restart(s)
        return [s.index for s in dead]

    @property
    def join_rows(self) -> int:
        """As EngineGroup.join_rows: built-in engines on CPUs get a rollout's groups that start together as one
        /generate of at most their --max-running-requests rows (each reports its device and that number); any
        other server gets one request per group."""
        sizes = [s.info.get("max_running_requests") for s in self.slots
                 if s.info.get("kind") == "builtin" and s.info.get("device") == "cpu"]
        return int(min(sizes)) if sizes and len(sizes) == len(self.slots) and all(sizes) else 0

    # ---- memory: never colocated ----------------------------------------------------------------------------
    def release_memory(self) -> None:
        raise EngineError(f"{FLAG}: external engines are not colocated; nothing to release")

    resume_memory = release_memory
