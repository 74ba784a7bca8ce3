"""The one HTTP client for SGLang-API engines (built-in or SGLang); every call has its own deadline.

`EngineClient` for control calls and scoring (sync, one connection pool per process: `shared_http`),
`generate_async` for the rollout's many concurrent /generate requests on the process's rollout loop and its
httpx.AsyncClient (`run_on_rollout_loop`, engine/rollout/loop.py).

SGLang answers some control endpoints with plain text ("Cache flushed...") and others with JSON; both are read.
"""
from __future__ import annotations

import asyncio
import os
import threading
import uuid
from typing import Any, Awaitable, Callable, TypeVar

import httpx

T = TypeVar("T")
_shared: tuple[int, httpx.Client] | None = None
_shared_lock = threading.Lock()
#: Idle pooled connections are dropped after this many seconds: well before the engines' server closes them
#: (uvicorn's keep-alive is 5 s, httpx's default expiry too), so a request never goes out on a connection the server
#: is closing at that moment (seen as a ReadError on /generate after an idle pause, once in a full test run).
KEEPALIVE_S = 2.0

#: the header a rollflow client puts on the /generate requests it sends together ("<id> <count>"): the built-in
#: engine starts their batch as soon as all `count` are in (engine/rollout/server.py BatchingScheduler); SGLang
#: ignores it
BURST_HEADER = "X-Rollflow-Burst"


def alone() -> dict[str, str]:
    """The burst header of a /generate call that is a whole batch by itself (the RF14 probe, a score): the engine
    starts it at once instead of lingering for company (~20 ms a call on the CPU demo's engine, issue 18)."""
    return {BURST_HEADER: f"one-{uuid.uuid4().hex[:16]} 1"}


def shared_http() -> httpx.Client:
    """One connection pool per process for the control calls and scoring: a new httpx client per call costs
    ~10 ms of CPU (its SSL context) and a TCP handshake, several times per rollout (measured: issue 18). Made anew
    in a forked child (sockets are not shared across processes). Deadlines and headers are per request."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), httpx.Client(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64,
                                                                      keepalive_expiry=KEEPALIVE_S)))
        return _shared[1]


class EngineError(RuntimeError):
    """An engine answered with an error, or its answer broke the protocol."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """SGLang's `--api-key` header (empty without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def score_body(input_ids: list[list[int]], temperature: float) -> dict[str, Any]:
    """The /generate body that scores sequences: a prefill only, returning every token's log-prob after the
    first (EngineClient.score; the built-in engine's EngineState.score_local parses the same body)."""
    return {"input_ids": input_ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature}}


def _answers(r: httpx.Response, url: str) -> list[dict]:
    """/generate's answer as a list (SGLang answers one object for a single input, a list for a batch)."""
    if r.status_code >= 400:
        raise EngineError(f"{url}/generate → HTTP {r.status_code}: {r.text[:300]}")
    try:
        out = r.json()
    except ValueError:
        raise EngineError(f"{url}/generate answered no JSON: {r.text[:300]}") from None
    return out if isinstance(out, list) else [out]


class _RolloutIO:
    """The rollouts' event loop: one thread per process running one asyncio loop for the whole run, with one
    httpx.AsyncClient (connection pool) per API key on it. Each rollout used to start its own loop and client
    (asyncio.run + a new AsyncClient: ~0.1 s of driver CPU per rollout on the CPU demo, measured: issue 18)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.clients: dict[str | None, httpx.AsyncClient] = {}
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollflow-rollout-io", daemon=True)
        self.thread.start()

    def client(self, api_key: str | None) -> httpx.AsyncClient:
        """(on the loop) The pool for `api_key`. No overall timeout: each rollout enforces its own deadline."""
        if api_key not in self.clients:
            self.clients[api_key] = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0), headers=auth_headers(api_key),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                    keepalive_expiry=KEEPALIVE_S))
        return self.clients[api_key]


_io: tuple[int, _RolloutIO] | None = None


def run_on_rollout_loop(make: Callable[[httpx.AsyncClient], Awaitable[T]], api_key: str | None) -> T:
    """Run `make(client)` on the process's rollout loop and wait for its result in this thread; an exception
    (or KeyboardInterrupt) here cancels it there. Not for calls made from that loop itself."""
    global _io
    with _shared_lock:
        if _io is None or _io[0] != os.getpid():
            _io = (os.getpid(), _RolloutIO())
        io = _io[1]

    async def call() -> T:
        return await make(io.client(api_key))

    fut = asyncio.run_coroutine_threadsafe(call(), io.loop)
    try:
        return fut.result()
    except BaseException:
        fut.cancel()
        raise


async def generate_async(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                         headers: dict[str, str] | None = None) -> list[dict]:
    """POST /generate on the engine at `url` through a shared async client (its headers carry the API key).
    Transport errors (a dead engine) propagate as httpx.TransportError for the caller's retry policy."""
    return _answers(await http.post(url + "/generate", json=body, headers=headers), url)


class EngineClient:
    def __init__(self, url: str, timeout_s: float = 60.0, api_key: str | None = None):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.headers = auth_headers(api_key)

    @staticmethod
    def _read(r: httpx.Response) -> Any:
        if not r.content:
            return {}
        try:
            return r.json()
        except ValueError:
            return {"message": r.text}

    def _get(self, path: str, timeout_s: float | None = None) -> Any:
        r = shared_http().get(self.url + path, timeout=timeout_s or self.timeout_s, headers=self.headers)
        if r.status_code >= 400:
            raise EngineError(f"{self.url}{path} → HTTP {r.status_code}: {r.text[:500]}")
        return self._read(r)

    def _post(self, path: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        r = shared_http().post(self.url + path, json=body or {}, timeout=timeout_s or self.timeout_s,
                               headers=self.headers)
        if r.status_code >= 400:
            raise EngineError(f"{self.url}{path} → HTTP {r.status_code}: {r.text[:500]}")
        return self._read(r)

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return shared_http().get(self.url + "/health", timeout=timeout_s, headers=self.headers).status_code == 200
        except httpx.HTTPError:
            return False

    def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            return shared_http().get(self.url + "/health_generate", timeout=timeout_s,
                                     headers=self.headers).status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self._get("/get_model_info", timeout_s)

    def server_info(self, timeout_s: float | None = None) -> dict[str, Any]:
        """/get_server_info (SGLang's server args and state; older SGLang: /server_info), with /get_model_info's
        keys (model_path, is_generation, weight_version, the built-in engine's `engine`) added where it lacks them."""
        try:
            info = self._get("/get_server_info", timeout_s)
        except EngineError as e:
            if "HTTP 404" not in str(e):
                raise
            info = self._get("/server_info", timeout_s)
        info = info if isinstance(info, dict) else {}
        return {**self.model_info(timeout_s), **info}

    def weight_version(self, timeout_s: float | None = None) -> str:
        return str(self.model_info(timeout_s).get("weight_version"))

    def generate(self, body: dict[str, Any], timeout_s: float | None = None) -> list[dict]:
        r = shared_http().post(self.url + "/generate", json=body, timeout=timeout_s or self.timeout_s,
                               headers={**self.headers, **alone()})
        return _answers(r, self.url)

    def score(self, input_ids: list[list[int]], temperature: float, timeout_s: float | None = None
              ) -> list[list[float]]:
        """log π(seq[k] | seq[:k]) for k ≥ 1 of each sequence, under the served weights (a prefill: /generate with
        max_new_tokens 0, return_logprob, logprob_start_len 0; SGLang's `input_token_logprobs`)."""
        out = self.generate(score_body(input_ids, temperature), timeout_s)
        try:
            return [[float(e[0]) for e in o["meta_info"]["input_token_logprobs"][1:]] for o in out]
        except (KeyError, TypeError, IndexError) as e:
            raise EngineError(f"{self.url}/generate: no input_token_logprobs in the answer ({e})") from None

    def _weights(self, path: str, body: dict, timeout_s: float | None) -> dict:
        out = self._post(path, body, timeout_s)
        if not out.get("success", False):
            raise EngineError(f"{self.url}{path} refused the weights: {out.get('message')}")
        return out

    def update_weights_from_disk(self, path: str, version: int, timeout_s: float | None = None) -> dict:
        body = {"model_path": path, "weight_version": str(version), "flush_cache": True}
        return self._weights("/update_weights_from_disk", body, timeout_s)

    def update_weights_from_tensor(self, serialized: list[str], *, load_format: str, version: int | None,
                                   flush_cache: bool, timeout_s: float | None = None) -> dict:
        body = {"serialized_named_tensors": serialized, "load_format": load_format, "flush_cache": flush_cache,
                "weight_version": None if version is None else str(version)}
        return self._weights("/update_weights_from_tensor", body, timeout_s)

    def update_weights_from_tensor_raw(self, blob: bytes, *, version: int | None, flush_cache: bool,
                                       timeout_s: float | None = None) -> dict:
        """One safetensors blob as the raw body (the built-in engine's fast path, no base64 / JSON)."""
        params = {"load_format": "safetensors", "flush_cache": str(flush_cache).lower()}
        if version is not None:
            params["weight_version"] = str(version)
        r = shared_http().post(self.url + "/update_weights_from_tensor", content=blob, params=params,
                               headers={"Content-Type": "application/octet-stream", **self.headers},
                               timeout=timeout_s or self.timeout_s)
        if r.status_code >= 400:
            raise EngineError(f"{self.url}/update_weights_from_tensor → HTTP {r.status_code}: {r.text[:500]}")
        out = self._read(r)
        if not out.get("success", False):
            raise EngineError(f"{self.url}/update_weights_from_tensor refused the weights: {out.get('message')}")
        return out

    def init_weights_update_group(self, master_address: str, master_port: int, *, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl",
                                  timeout_s: float | None = None) -> dict:
        """SGLang's /init_weights_update_group: the engine joins the trainer's weight-update process group (the call
        returns once every rank joined: engine/weights/distributed.py makes it from a thread)."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        out = self._post("/init_weights_update_group", body, timeout_s)
        if not out.get("success", False):
            raise EngineError(f"{self.url}/init_weights_update_group: {out.get('message')}")
        return out

    def update_weights_from_distributed(self, body: dict, timeout_s: float | None = None) -> dict:
        """SGLang's /update_weights_from_distributed: `names`, `dtypes`, `shapes` announced here, the tensors
        broadcast by rank 0 of the group meanwhile."""
        return self._weights("/update_weights_from_distributed", body, timeout_s)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._post("/destroy_weights_update_group", {"group_name": group_name})

    def flush_cache(self) -> dict:
        return self._post("/flush_cache")

    def abort(self, rid: str | None = None) -> dict:
        """Abort one request, or every request whose rid starts with `rid` (SGLang matches by prefix); all if None."""
        return self._post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    def pause_generation(self, mode: str = "abort") -> dict:
        """SGLang's /pause_generation: with mode "abort" every request in flight returns now (finish_reason abort,
        its tokens so far) and new ones wait for /continue_generation."""
        return self._post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._post("/continue_generation", {})

    def check_weights(self, action: str, timeout_s: float = 600.0) -> dict:
        """SGLang's /weights_checker: snapshot, reset_tensors, compare or checksum. Its answer, {"success": …,
        "message": …} — a compare that finds differences says success false (listing them), with an HTTP error
        status — or an EngineError when the server gave no such answer."""
        r = shared_http().post(self.url + "/weights_checker", json={"action": action}, timeout=timeout_s,
                               headers=self.headers)
        try:
            body = r.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "success" in body:
            return body
        raise EngineError(f"{self.url}/weights_checker → HTTP {r.status_code}: {r.text[:500]}")

    def release_memory(self) -> dict:
        return self._post("/release_memory_occupation", {})

    def resume_memory(self) -> dict:
        return self._post("/resume_memory_occupation", {})
