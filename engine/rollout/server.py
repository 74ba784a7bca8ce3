"""The built-in rollout engine: SGLang's HTTP API over `Generator`.

Requests that arrive within `batch_window_s` of each other are generated as one batch (one forward per token
for all of them), not one at a time. Endpoints and fields follow SGLang's server (`/generate` with `text` or
`input_ids`, single or batched, `sampling_params`, `return_logprob`; `meta_info.output_token_logprobs` as
`[logprob, token_id, None]` triples, `finish_reason`, `prompt_tokens`, `completion_tokens`).
"""
from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.rollout.generation import GenRequest, GenResult, Generator


@dataclass
class _Pending:
    reqs: list[GenRequest]
    future: asyncio.Future


class BatchingScheduler:
    """Collects requests for a short window, then runs them as one batch on a single generation thread."""

    def __init__(self, generator: Generator, window_s: float = 0.01, max_batch: int = 256):
        self.generator, self.window_s, self.max_batch = generator, window_s, max_batch
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.batches = 0  # batches run (exposed for tests and the benchmark)
        self.batch_sizes: list[int] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, reqs: list[GenRequest]) -> list[GenResult]:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(reqs, fut))
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            group, n = [first], len(first.reqs)
            deadline = loop.time() + self.window_s
            while n < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self.queue.get(), timeout)
                except asyncio.TimeoutError:
                    break
                group.append(nxt)
                n += len(nxt.reqs)
            flat = [r for p in group for r in p.reqs]
            self.batches += 1
            self.batch_sizes.append(len(flat))
            try:
                results = await loop.run_in_executor(None, self.generator.generate, flat)
            except Exception as e:  # deliver the failure to every waiter
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            it = iter(results)
            for p in group:
                if not p.future.done():
                    p.future.set_result(list(itertools.islice(it, len(p.reqs))))


def _to_requests(body: dict[str, Any], tokenizer, default_max_new: int) -> tuple[list[GenRequest], bool]:
    """SGLang GenerateReqInput → GenRequests; returns (requests, batched)."""
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        inputs = ids if batched else [ids]
    elif body.get("text") is not None:
        text = body["text"]
        batched = isinstance(text, list)
        inputs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (text if batched else [text])]
    else:
        raise ValueError("either `text` or `input_ids` is required")
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * len(inputs)
    rids = body.get("rid")
    rids = [None] * len(inputs) if rids is None else rids if isinstance(rids, list) else [rids]
    if len(sps) != len(inputs) or len(rids) != len(inputs):
        raise ValueError("sampling_params / rid lists must match the number of inputs")
    reqs = []
    for x, p, rid in zip(inputs, sps, rids):
        stop = p.get("stop") or []
        reqs.append(GenRequest(
            rid=rid or uuid.uuid4().hex, input_ids=[int(t) for t in x],
            max_new_tokens=int(p.get("max_new_tokens") or default_max_new),
            temperature=float(p.get("temperature", 1.0)), top_p=float(p.get("top_p", 1.0)),
            top_k=int(p.get("top_k", -1)), stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=[int(t) for t in (p.get("stop_token_ids") or [])],
            ignore_eos=bool(p.get("ignore_eos", False)), no_stop_trim=bool(p.get("no_stop_trim", False)),
            skip_special_tokens=bool(p.get("skip_special_tokens", True)),
            seed=p.get("sampling_seed")))
    return reqs, batched


def _to_response(res: GenResult, return_logprob: bool, weight_version: int) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": res.rid, "finish_reason": res.finish_reason, "prompt_tokens": res.prompt_tokens,
                            "completion_tokens": len(res.output_ids), "cached_tokens": 0,
                            "weight_version": str(weight_version)}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res.logprobs, res.output_ids)]
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}


class EngineState:
    """The served model and its version; shared by the HTTP handlers."""

    def __init__(self, model_path: str, *, device: str = "cpu", threads: int | None = None,
                 max_new_tokens: int = 128, batch_window_s: float = 0.01, max_batch: int = 256):
        import torch

        from engine.modeling import eos_token_ids, load_causal_lm, load_tokenizer

        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.model_path, self.device, self.default_max_new = model_path, device, max_new_tokens
        self.tokenizer = load_tokenizer(model_path)
        model = load_causal_lm(model_path, device=device).eval()
        self.generator = Generator(model, self.tokenizer, eos_token_ids(model_path, self.tokenizer), device)
        self.weight_version = 0
        self.released = False
        self.batch_window_s, self.max_batch = batch_window_s, max_batch
        self.scheduler: BatchingScheduler | None = None

    def update_weights_from_disk(self, path: str, version: int | None) -> None:
        from engine.weights import load_weights_dir

        state = load_weights_dir(path)
        with self.generator.lock:
            missing, unexpected = self.generator.model.load_state_dict(state, strict=False)
            real_missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied embeddings
            if real_missing or unexpected:
                raise ValueError(f"weights in {path} do not match the served model: missing {real_missing[:5]}, "
                                 f"unexpected {unexpected[:5]}")
            self.weight_version = version if version is not None else self.weight_version + 1
            self.model_path = path


def create_app(state: EngineState):
    @asynccontextmanager
    async def lifespan(_app):
        state.scheduler = BatchingScheduler(state.generator, state.batch_window_s, state.max_batch)
        state.scheduler.start()
        yield

    app = FastAPI(title="rollflow built-in engine", lifespan=lifespan)

    def err(status: int, msg: str) -> JSONResponse:
        return JSONResponse({"error": {"message": msg}, "success": False, "message": msg}, status_code=status)

    @app.get("/health")
    async def health():
        return JSONResponse({}) if not state.released else err(503, "memory released")

    @app.get("/health_generate")
    async def health_generate():
        if state.released:
            return err(503, "memory released")
        ids = state.tokenizer("1", add_special_tokens=False)["input_ids"]
        await state.scheduler.submit([GenRequest(rid=uuid.uuid4().hex, input_ids=ids, max_new_tokens=1,
                                                 temperature=0.0)])
        return JSONResponse({})

    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "weight_version": str(state.weight_version), "engine": "rollflow-builtin",
                "batches": state.scheduler.batches if state.scheduler else 0}

    @app.get("/get_server_info")
    async def server_info():
        return {"engine": "rollflow-builtin", "device": state.device, "weight_version": str(state.weight_version),
                "pid": os.getpid(), "batch_sizes": state.scheduler.batch_sizes[-100:] if state.scheduler else []}

    @app.post("/generate")
    async def generate(request: Request):
        if state.released:
            return err(503, "memory released: call /resume_memory_occupation first")
        body = await request.json()
        try:
            reqs, batched = _to_requests(body, state.tokenizer, state.default_max_new)
        except (ValueError, TypeError, KeyError) as e:
            return err(400, str(e))
        results = await state.scheduler.submit(reqs)
        out = [_to_response(r, bool(body.get("return_logprob")), state.weight_version) for r in results]
        return out if batched else out[0]

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request.json() if await request.body() else {}
        state.generator.abort(body.get("rid") or None)
        return {"success": True}

    @app.post("/flush_cache")
    async def flush_cache():
        return {"success": True, "message": "no prefix cache in the built-in engine"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await request.json()
        version = body.get("weight_version")
        t0 = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, state.update_weights_from_disk, body["model_path"], int(version) if version else None)
        except Exception as e:
            return err(400, f"{type(e).__name__}: {e}")
        return {"success": True, "message": f"loaded {body['model_path']} in {time.perf_counter() - t0:.3f}s",
                "weight_version": str(state.weight_version)}

    @app.post("/release_memory_occupation")
    async def release():
        state.released = True
        return {"success": True}

    @app.post("/resume_memory_occupation")
    async def resume():
        state.released = False
        return {"success": True}

    return app


class ServerThread:
    """Runs uvicorn for `create_app(state)` in a daemon thread (used inside the Ray engine actor)."""

    def __init__(self, state: EngineState, host: str, port: int):
        import uvicorn

        self.config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning",
                                     access_log=False)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="rollflow-engine")
        self.url = f"http://{host}:{port}"

    def start(self, timeout_s: float = 60.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"engine server on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine server on {self.url} did not start in {timeout_s}s")
            time.sleep(0.05)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(model_path: str, host: str, port: int, *, threads: int | None = None, max_new_tokens: int = 128) -> None:
    """`rollflow serve`: run the built-in engine in the foreground."""
    import uvicorn

    state = EngineState(model_path, threads=threads, max_new_tokens=max_new_tokens)
    print(f"rollflow built-in engine serving {Path(model_path).resolve()} on http://{host}:{port}", flush=True)
    uvicorn.run(create_app(state), host=host, port=port, log_level="warning")
