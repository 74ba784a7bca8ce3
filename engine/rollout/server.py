"""The built-in rollout engine: SGLang's HTTP API (engine/rollout/protocol.py) over `Generator`.

Requests that arrive together (a burst: no gap over 10 ms, at most 50 ms) are generated as one batch (one forward
per token for all of them), not one at a time. With `deterministic` (SGLang's `--enable-deterministic-inference`,
which the launcher passes through) every HTTP request is generated as its own batch, so a request's tokens depend
only on the request and the weights, never on what else arrived at the same time (see generation.py for why).

Run it standalone with SGLang's launcher flags, so the SGLang launcher can start it as its process:
    python -m engine.rollout.server --model-path DIR --host 127.0.0.1 --port 30000 [--tp-size 1] [...]

Hostile requests (as SGLang's flags name the limits):
- a body over `max_request_bytes` is refused with 413 before it is read whole; every /generate value is checked
  (engine/rollout/protocol.py `Limits`: ids, context length, finite sampling params) → 400;
- at most `max_queued` rows wait for the generator (`--max-queued-requests`): more get 503 with Retry-After;
- `--api-key`: every endpoint but /health and /health_generate needs `Authorization: Bearer <key>` (401);
  `--admin-api-key` (else the API key) guards the endpoints that change the served weights or free its memory,
  and an engine with neither key refuses those endpoints (403): nobody who can merely reach it replaces its
  weights. /update_weights_from_disk loads only from `weight_dirs` (a run's own weights directory);
- a generator that made no decode step for `watchdog_s` (`--watchdog-timeout`) makes /health and /health_generate
  answer 503; a stop (SIGTERM) aborts every request, so the server exits within seconds.
"""
from __future__ import annotations

import asyncio
import errno
import itertools
import os
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine import faults
from engine.rollout.client import BURST_HEADER
from engine.rollout.generation import JOIN_ROWS, Feed, GenRequest, GenResult, Generator
from engine.rollout.protocol import COMPACT_F64, COMPACT_HEADER, ProtocolError, to_requests, to_response


@dataclass
class _Pending:
    reqs: list[GenRequest]
    future: asyncio.Future
    burst: tuple[str, int] | None = None  # (id, requests in it): the client's X-Rollflow-Burst header
    results: list[GenResult | None] | None = None  # filled as each request finishes (continuous batching)
    left: int = 0




def parse_burst(value: str | None) -> tuple[str, int] | None:
    """"<id> <count>" → (id, count); anything else → None (the request is batched as an unannounced one)."""
    parts = (value or "").split()
    if len(parts) != 2 or not parts[1].isdigit() or not 0 < int(parts[1]) <= 1 << 20 or len(parts[0]) > 128:
        return None
    return parts[0], int(parts[1])


class QueueFull(RuntimeError):
    """More rows than --max-queued-requests would wait: 503 with Retry-After."""


class BatchingScheduler:
    """Collects a burst of requests, then runs them as one batch on a single generation thread.

    A batch closes when no request arrived for `gap_s`, or `window_s` after its first request, or at `max_batch`
    rows: a burst of concurrent requests (a rollout's groups) lands in one batch even when the client's sends
    spread over tens of milliseconds on a busy machine, while a lone request waits only `gap_s`.

    A client that announces its burst (the `X-Rollflow-Burst: <id> <count>` header on each of the `count` requests
    it sends together; rollflow's rollout loop does) gets exact batching:
    - the batch closes as soon as all `count` have arrived, with no linger;
    - with `hold_bursts` (a GPU engine) it also stays open until then: until none came for `burst_gap_s` (e.g. a
      burst spread over several engines) or `burst_window_s` passed. Without the hold (64 groups × 8, the engine
      in its own process) the first rollout ran as one batch of 512 rows and later ones as 2–7 batches, each a
      whole generation. On a GPU, where a step costs about the same for 64 rows as for 512, holding took the
      0.5B RL rollout from 20.9 s to 17.0 s (bench/results/gpu_rl_step.md).
    - On a CPU a step costs in proportion to its rows, and a batch runs until its last row stops. There, smaller
      batches that start while the rest arrive were faster (bench/results/rollout_batching.json), so a CPU engine
      does not hold.
    """

    def __init__(self, generator: Generator, window_s: float = 0.05, max_batch: int = 256,
                 isolate: bool = False, gap_s: float = 0.01, max_queued: int | None = None,
                 burst_gap_s: float = 0.2, burst_window_s: float = 2.0, hold_bursts: bool = True,
                 max_total_tokens: int | None = None):
        self.generator, self.window_s, self.max_batch, self.isolate = generator, window_s, max_batch, isolate
        self.max_total_tokens = max_total_tokens
        self.gap_s = min(gap_s, window_s)
        self.burst_gap_s, self.burst_window_s, self.hold_bursts = burst_gap_s, burst_window_s, hold_bursts
        self.max_queued = max_queued if max_queued is not None else 4 * max_batch
        self.queued_rows = 0  # rows submitted and not yet in a batch, except those offered to the running one
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.batch_sizes: list[int] = []  # rows per batch run (exposed for tests and the benchmark)
        self.batch_seconds: list[float] = []  # each batch's generation time (the same order)
        self._carry: list[_Pending] = []  # offered to a running batch and not taken: the next batch's first
        self._feed: Feed | None = None  # the running batch's (continuous batching)
        self._task: asyncio.Task | None = None

    @property
    def batches(self) -> int:
        return len(self.batch_sizes)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, reqs: list[GenRequest], burst: tuple[str, int] | None = None) -> list[GenResult]:
        if self.queued_rows + (self._feed.rows if self._feed is not None else 0) + len(reqs) > self.max_queued:
            raise QueueFull(f"{self.queued_rows} rows are waiting for the generator (at most {self.max_queued}, "
                            "--max-queued-requests): retry later")
        self.queued_rows += len(reqs)
        rids = [r.rid for r in reqs]
        self.generator.aborts.add(rids)
        try:
            fut = asyncio.get_running_loop().create_future()
            await self.queue.put(_Pending(reqs, fut, burst))
            return await fut
        finally:
            self.generator.aborts.done(rids)

    async def _collect(self, first: _Pending) -> list[_Pending]:
        loop = asyncio.get_running_loop()
        group, n = [first], len(first.reqs)
        start = loop.time()
        want: dict[str, int] = {}  # announced bursts: id → requests in it
        seen: dict[str, int] = {}

        def note(p: _Pending) -> None:
            if p.burst is not None:
                want[p.burst[0]] = p.burst[1]
                seen[p.burst[0]] = seen.get(p.burst[0], 0) + 1

        note(first)
        while not self.isolate and n < self.max_batch:
            if self._carry:  # left over from the last batch: they have waited already
                nxt = self._carry.pop(0)
                if not self._fits(group, nxt):
                    self._carry.insert(0, nxt)
                    break
                group.append(nxt)
                note(nxt)
                n += len(nxt.reqs)
                continue
            now = loop.time()
            incomplete = any(seen[b] < want[b] for b in want)
            if incomplete and self.hold_bursts:  # more of an announced burst is on its way: wait for it
                timeout = min(start + self.burst_window_s - now, self.burst_gap_s)
            elif want and not incomplete:  # every announced burst is in: run now
                break
            else:
                timeout = min(start + self.window_s - now, self.gap_s)
            if timeout <= 0:
                break
            try:
                nxt = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                break  # a gap: the burst is over
            if not self._fits(group, nxt):  # over the token budget: it starts the next batch
                self._carry.insert(0, nxt)  # (its rows still count in queued_rows)
                break
            group.append(nxt)
            note(nxt)
            n += len(nxt.reqs)
        return group

    def cache_tokens(self, reqs: list[GenRequest]) -> int:
        """The KV-cache tokens a batch of `reqs` takes in the CUDA-graph decoder: its rows (a power of two, at
        least JOIN_ROWS when requests may join it) × its cache length (longest prompt + largest max_new_tokens,
        rounded up to 256). The eager path's cache grows to about the same."""
        from engine.rollout.cuda_graphs import len_bucket, rows_bucket

        rows = rows_bucket(max(len(reqs), JOIN_ROWS if self.continuous else 1))
        return rows * len_bucket(max(len(r.input_ids) for r in reqs) + max(r.max_new_tokens for r in reqs))

    def _fits(self, group: list[_Pending], nxt: _Pending) -> bool:
        """Whether `nxt` may join the batch being collected under --max-total-tokens (a batch always takes its
        first call, however large)."""
        return self.max_total_tokens is None or \
            self.cache_tokens([r for p in (*group, nxt) for r in p.reqs]) <= self.max_total_tokens

    @property
    def continuous(self) -> bool:
        """Requests join a running batch: the CUDA-graph decoder only (the CPU runs each batch to its end), and
        not under --enable-deterministic-inference (one request per batch)."""
        return getattr(self.generator, "graphs", None) is not None and not self.isolate

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            group = await self._collect(self._carry.pop(0) if self._carry else await self.queue.get())
            flat = [r for p in group for r in p.reqs]
            self.queued_rows -= len(flat)
            self.batch_sizes.append(len(flat))
            t = time.perf_counter()
            try:
                if self.continuous:
                    await self._run_continuous(group, flat)
                    continue
                results = await loop.run_in_executor(None, self.generator.generate, flat)
            except Exception as e:  # deliver the failure to every waiter
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            finally:
                self.batch_seconds.append(round(time.perf_counter() - t, 4))
            it = iter(results)
            for p in group:
                if not p.future.done():
                    p.future.set_result(list(itertools.islice(it, len(p.reqs))))

    async def _run_continuous(self, group: list[_Pending], flat: list[GenRequest]) -> None:
        """Run a batch that takes more requests while it decodes: a task moves what arrives into the batch's
        `Feed`; the generation thread puts it into free rows between steps and hands back each request's result
        as soon as it finishes, so a short request does not wait for the batch's longest. What the batch could not
        take (no free row, a prompt longer than the batch's slots so far, other filters, a weight update waiting)
        starts the next batch."""
        loop = asyncio.get_running_loop()
        owner: dict[int, tuple[_Pending, int]] = {}  # id(request) → (its call, its index there)
        self._feed = feed = Feed()

        def register(p: _Pending) -> None:
            p.results, p.left = [None] * len(p.reqs), len(p.reqs)
            for j, r in enumerate(p.reqs):
                owner[id(r)] = (p, j)

        def delivered(req: GenRequest, res: GenResult) -> None:  # on the event loop
            p, j = owner[id(req)]
            p.results[j] = res
            p.left -= 1
            if p.left == 0 and not p.future.done():
                p.future.set_result(p.results)

        async def move() -> None:  # arrivals → the feed, while the batch runs
            while True:
                p = await self.queue.get()
                self.queued_rows -= len(p.reqs)
                register(p)
                feed.put(p.reqs)

        for p in group:
            register(p)
        mover = loop.create_task(move())
        error: Exception | None = None
        try:
            await loop.run_in_executor(None, self.generator.generate, flat, feed,
                                       lambda req, res: loop.call_soon_threadsafe(delivered, req, res))
        except Exception as e:
            error = e
        finally:
            mover.cancel()
            self._feed = None
        await asyncio.sleep(0)  # the last deliveries (call_soon_threadsafe) run before what is left is carried over
        while len(feed):  # not taken: the next batch starts with them, in arrival order
            reqs = feed.pop()
            p, _ = owner[id(reqs[0])]
            p.results, p.left = None, 0
            self._carry.append(p)
            self.queued_rows += len(p.reqs)
        if error is not None:  # every call that ran in this batch fails with it (not those carried over)
            for p, _ in owner.values():
                if p.left and not p.future.done():
                    p.future.set_exception(error)


def decoder_info(gen: Generator) -> dict[str, Any]:
    """How the engine decodes, for /get_server_info: CUDA graphs, fused RMSNorms, GQA folded, torch.compile, requests
    that joined a running batch, and the last graph batch's steps, the host's wait for the GPU (a small wait: the host
    loop bound the step), the GPU's own time in those steps, the host's time launching them, reading their tokens
    (take_s) and joining requests (join_s), and the process's garbage collections meanwhile (gc_s, gc_collections)."""
    g = gen.graphs
    if g is None:
        why = getattr(gen, "graphs_off", None)
        return {"cuda_graphs": False, **({"cuda_graphs_off": why} if why else {})}
    return {"cuda_graphs": True, "fused_rms_norms": getattr(gen, "fused_norms", 0),
            "fused_rotary": getattr(gen, "fused_rotary", False), "folded_gqa": g.folded_gqa,
            "compiled_decode": g.step_model is not g.model,
            "joined_requests": g.joined_rows, "last_batch_steps": g.steps,
            "last_batch_gpu_wait_s": round(g.wait_s, 3), "last_batch_gpu_busy_s": round(g.gpu_s, 3),
            "last_batch_launch_s": round(g.launch_s, 3),
            **{f"last_batch_{k}": round(v, 3) for k, v in getattr(gen, "host_stats", {}).items()}}


class EngineState:
    """The served model and its version; shared by the HTTP handlers."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", threads: int | None = None,
                 max_new_tokens: int = 128, batch_window_s: float = 0.05, max_batch: int = 256,
                 deterministic: bool = False, batch_gap_s: float = 0.01, api_key: str | None = None,
                 admin_api_key: str | None = None, weight_dirs: list[str] | None = None,
                 max_request_bytes: int = 16 * 2**20, max_queued: int | None = None, watchdog_s: float = 300.0,
                 cuda_graphs: bool = True, compile_decode: bool = False, max_total_tokens: int | None = None,
                 model_impl: str = "auto", return_routed_experts: bool = False):
        import torch

        from engine.modeling import eos_token_ids, impl_of, load_causal_lm
        from engine.rollout.protocol import Limits
        from engine.rollout.tokenizer_cache import engine_tokenizer

        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.weight_dirs = [Path(d).resolve() for d in (weight_dirs or [])]
        self.max_request_bytes, self.max_queued, self.watchdog_s = max_request_bytes, max_queued, watchdog_s

        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.model_path, self.device, self.dtype, self.default_max_new = model_path, device, dtype, max_new_tokens
        self.tokenizer = engine_tokenizer(model_path)  # without transformers where it was cached
        model = load_causal_lm(model_path, dtype=dtype, device=device, impl=model_impl).eval()
        self.model_impl = impl_of(model)  # native or transformers (/get_server_info)
        self.generator = Generator(model, self.tokenizer, eos_token_ids(model_path, self.tokenizer), device,
                                   cuda_graphs=cuda_graphs, compile_decode=compile_decode,
                                   return_routed_experts=return_routed_experts)
        self.limits = Limits(context_len=int(getattr(model.config, "max_position_embeddings", None) or 2**31),
                             vocab_size=int(model.config.vocab_size), max_inputs=max(4 * max_batch, 64))
        self.released = False
        self.unpaused: asyncio.Event | None = None  # cleared by /pause_generation: new /generate requests wait
        self.batch_window_s, self.max_batch, self.deterministic = batch_window_s, max_batch, deterministic
        self.batch_gap_s, self.max_total_tokens = batch_gap_s, max_total_tokens
        self.scheduler: BatchingScheduler | None = None
        self.groups: dict[str, tuple[Any, str]] = {}  # group_name → (process group, backend): /init_weights_update_group
        self._snapshot: dict[str, Any] | None = None  # /weights_checker snapshot: weight name → host copy

    @property
    def weight_version(self) -> str:
        """SGLang's weight_version ("default" until the first update names one). Kept by the generator and set
        under its lock, so a batch reports the version it actually ran under."""
        return self.generator.version

    @weight_version.setter
    def weight_version(self, v: str) -> None:
        self.generator.version = v

    def score_local(self, input_ids: list[list[int]], temperature: float) -> tuple[list[list[float]], str]:
        """What EngineClient.score answers, computed in this process without HTTP: the same body through the same
        parser into this engine's generator (its lock orders the call with the serving thread's batches). Used by
        the RF14 probe of an engine served from the train worker's process (TrainWorker.engine_take_weights).
        Returns (log-probs of each sequence's tokens after the first, the weight_version they were computed
        under)."""
        from engine.rollout.client import score_body

        reqs, _ = to_requests(score_body(input_ids, temperature), self.tokenize, self.default_max_new, self.limits)
        results = self.generator.generate(reqs)
        version = results[0].weight_version if results else self.weight_version
        return [[float(x) for x in r.input_logprobs[1:]] for r in results], str(version)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def update_from_disk(self, path: str, version: str | None) -> int:
        from engine.weights import check_and_copy, load_weights_dir

        where = Path(path).resolve()
        if not any(where == d or d in where.parents for d in self.weight_dirs):
            allowed = ", ".join(map(str, self.weight_dirs)) or "none (rollflow serve --weight-dir DIR allows one)"
            raise PermissionError(f"{path} is outside the directories this engine loads weights from: {allowed}")
        state = load_weights_dir(where)
        with self.generator.exclusive():
            n = check_and_copy(self.generator.model, state, full=True)
            self.model_path = path
            if version is not None:
                self.weight_version = version
        return n

    def update_from_tensors(self, blobs: list[str | bytes], version: str | None) -> int:
        from engine.weights import check_and_copy, decode_tensors

        if len(blobs) != 1:
            raise ValueError(f"serialized_named_tensors has {len(blobs)} entries; the built-in engine has one "
                             "tensor-parallel rank, so send exactly one")
        named = decode_tensors(blobs[0])
        with self.generator.exclusive():
            n = check_and_copy(self.generator.model, named, full=False)
            if version is not None:
                self.weight_version = version
        return n

    def update_from_named(self, named: dict, version: str | None) -> int:
        """A full state dict (tensors, or HostWeights from Ray's object store) — the in-cluster path."""
        from engine.weights import HostWeights, check_and_copy

        if isinstance(named, HostWeights):
            named = named.tensors()
        with self.generator.exclusive():
            n = check_and_copy(self.generator.model, named, full=True)
            if version is not None:
                self.weight_version = version
        return n

    def update_from_ipc(self, buckets: list, version: str | None) -> int:
        """CUDA IPC buckets from a trainer on the same GPU (engine/weights/ipc.py: SGLang's flattened-bucket
        shape): every name is checked before anything is copied; the copies run on this device."""
        import torch

        from engine.weights import check_names, ipc

        model = self.generator.model
        targets = check_names(model, {m["name"]: tuple(m["shape"]) for b in buckets for m in b.metadata}, full=True)
        copied = 0
        with self.generator.exclusive(), torch.no_grad():
            for b in buckets:
                flat = ipc.open_bucket(b)
                for name, t in ipc.unflatten(flat, b.metadata).items():
                    targets[name].copy_(t)  # same device; cast if the dtypes differ
                copied += b.nbytes
                del flat
            torch.cuda.synchronize()  # done reading the trainer's memory before it frees it
            if version is not None:
                self.weight_version = version
        return copied

    def join_group(self, body: dict[str, Any]) -> str:
        """SGLang's /init_weights_update_group: join the trainer's weight-update group as rank `rank_offset`."""
        from engine.weights.distributed import DEFAULT_GROUP, join_group

        name, backend = body.get("group_name") or DEFAULT_GROUP, body.get("backend") or "nccl"
        if name in self.groups:
            raise ValueError(f"group_name {name!r} is already joined; /destroy_weights_update_group it first")
        if backend == "nccl" and not str(self.device).startswith("cuda"):
            raise ValueError(f"backend 'nccl' needs a CUDA engine and this one runs on {self.device}: send "
                             "backend 'gloo'")
        for k in ("master_address", "master_port", "rank_offset", "world_size"):
            if body.get(k) is None:
                raise ValueError(f"`{k}` is required")
        pg = join_group(str(body["master_address"]), int(body["master_port"]), int(body["rank_offset"]),
                        int(body["world_size"]), backend)
        self.groups[name] = (pg, backend)
        return name

    def update_from_distributed(self, body: dict[str, Any], version: str | None) -> int:
        """SGLang's /update_weights_from_distributed: receive the named tensors broadcast by rank 0."""
        from engine.weights.distributed import DEFAULT_GROUP, receive_into

        name = body.get("group_name") or DEFAULT_GROUP
        if name not in self.groups:
            raise ValueError(f"group_name {name!r} is not joined; call /init_weights_update_group first")
        pg, backend = self.groups[name]
        with self.generator.exclusive():
            n = receive_into(self.generator.model, pg, list(body.get("names") or []),
                             list(body.get("dtypes") or []), list(body.get("shapes") or []),
                             "cpu" if backend == "gloo" else self.device)
            if version is not None:
                self.weight_version = version
        return n

    # ---- SGLang's /weights_checker (slime's --check-weight-update-equal) ------------------------------------------
    def _checked_tensors(self) -> dict[str, Any]:
        """The served weights by name: parameters and persistent buffers (a tied tensor under each of its names);
        computed buffers (rotary frequencies) are not weights and no sync sends them."""
        return dict(self.generator.model.state_dict(keep_vars=True))

    def check_weights(self, action: str, skip: list[str] | None = None) -> dict[str, Any]:
        """snapshot: keep a host copy of every weight; reset_tensors: overwrite every weight with random values, so
        that one a weight sync misses cannot pass for right; compare: every weight equal to the snapshot (the
        weight sync in between must have written all of them, bit for bit); checksum: sha256 per weight (this
        engine's own names). Names containing a `skip` entry are left out of all four."""
        import hashlib

        import torch

        skip = list(skip or [])
        named = {k: v for k, v in self._checked_tensors().items() if not any(s in k for s in skip)}
        with self.generator.exclusive(), torch.no_grad():
            if action == "snapshot":
                self._snapshot = {k: v.detach().to("cpu", copy=True) for k, v in named.items()}
                return {"success": True, "message": f"snapshot of {len(named)} tensors"}
            if action == "reset_tensors":
                gen = torch.Generator(device="cpu").manual_seed(0)
                for t in {id(v): v for v in named.values()}.values():
                    if t.dtype.is_floating_point:
                        t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
                    else:
                        t.zero_()
                return {"success": True, "message": f"reset {len(named)} tensors to random values"}
            if action == "compare":
                snap = self._snapshot
                if snap is None:
                    raise ValueError("compare before snapshot: POST {\"action\": \"snapshot\"} first")
                bad = [f"{k}: missing" for k in sorted(set(snap) - set(named))]
                bad += [f"{k}: not in the snapshot" for k in sorted(set(named) - set(snap))]
                for k in sorted(set(snap) & set(named)):
                    now = named[k].detach().cpu()
                    if now.shape != snap[k].shape or now.dtype != snap[k].dtype:
                        bad.append(f"{k}: {tuple(now.shape)} {now.dtype}, snapshot {tuple(snap[k].shape)} "
                                   f"{snap[k].dtype}")
                    elif not torch.equal(now, snap[k]):
                        diff = (now.double() - snap[k].double()).abs()
                        bad.append(f"{k}: max_abs_err={diff.max().item():.3g} mean_abs_err={diff.mean().item():.3g} "
                                   f"num_diff={int((diff > 0).sum())}/{diff.numel()}")
                if bad:
                    return {"success": False, "message": f"check tensor equality failed: {len(bad)} of {len(snap)} "
                                                         "tensors differ:\n" + "\n".join(bad)}
                return {"success": True, "message": f"all {len(snap)} tensors equal the snapshot"}
            if action == "checksum":
                sums = {k: hashlib.sha256(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
                        .hexdigest() for k, v in named.items()}
                overall = hashlib.sha256("".join(k + sums[k] for k in sorted(sums)).encode()).hexdigest()
                return {"success": True, "message": f"checksums of {len(sums)} tensors", "checksums": sums,
                        "per_gpu_checksum": overall}
        raise ValueError(f"action {action!r}: one of snapshot, reset_tensors, compare, checksum")

    def stalled_s(self) -> float | None:
        """Seconds the generator has been inside a batch without a decode step, when that exceeds watchdog_s."""
        g = self.generator
        if g.busy_since is None:
            return None
        idle = time.monotonic() - max(g.last_step, g.busy_since)
        return idle if idle > self.watchdog_s else None

    def stop_generating(self) -> None:
        """Abort every queued and running request (a stop must not wait for a long generation)."""
        self.generator.aborts.abort(None)

    def set_released(self, released: bool) -> None:
        """SGLang's /release_memory_occupation: on a GPU the weights go to host memory and the allocator's cached
        blocks (the KV cache of the last batch included) go back to the driver, so a colocated trainer can use
        them; /resume_memory_occupation brings the weights back."""
        import torch

        with self.generator.exclusive():
            if self.device != "cpu":
                if released and self.generator.graphs is not None:  # its caches; its graphs read the old addresses
                    self.generator.graphs.clear()
                self.generator.model.to("cpu" if released else self.device)
                if released:  # cached blocks, and cuBLAS's workspaces (32 MiB a stream on Hopper) held in them
                    torch._C._cuda_clearCublasWorkspaces()
                    torch.cuda.empty_cache()
            self.released = released

    def memory(self) -> dict[str, float]:
        from engine.gpu import gpu_memory

        return gpu_memory()


def _err(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg}, "success": False, "message": msg}, status_code=status)


class BodyTooLarge(ValueError):
    pass


async def _raw(request: Request, limit: int) -> bytes:
    """The request body, refused (BodyTooLarge) as soon as it passes `limit` bytes: never read whole first."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body has {int(declared)} bytes; this engine takes at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body passed {limit} bytes, the most this engine takes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _body(request: Request, limit: int) -> dict[str, Any]:
    import json

    raw = await _raw(request, limit)
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the body is not JSON ({e})") from None


#: endpoints that replace the served weights or free its memory (need the admin key, else the API key)
ADMIN = ("/update_weights_from_disk", "/update_weights_from_tensor", "/release_memory_occupation",
         "/resume_memory_occupation", "/pause_generation", "/continue_generation", "/init_weights_update_group",
         "/update_weights_from_distributed", "/destroy_weights_update_group", "/weights_checker")
PUBLIC = ("/health", "/health_generate")
WEIGHTS_BODY_BYTES = 8 * 2**30  # a raw safetensors update may carry a whole model


def create_app(state: EngineState):
    @asynccontextmanager
    async def lifespan(_app):
        state.scheduler = BatchingScheduler(state.generator, state.batch_window_s, state.max_batch,
                                            isolate=state.deterministic, gap_s=state.batch_gap_s,
                                            max_queued=state.max_queued, hold_bursts=state.generator.on_gpu,
                                            max_total_tokens=state.max_total_tokens)
        state.scheduler.start()
        state.unpaused = asyncio.Event()
        state.unpaused.set()
        yield

    app = FastAPI(title="rollflow built-in engine", lifespan=lifespan)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        """SGLang's --api-key / --admin-api-key: `Authorization: Bearer <key>`; weights need a key at all."""
        import hmac

        path = request.url.path
        if path in PUBLIC:
            return await call_next(request)
        given = request.headers.get("authorization", "")

        def ok(key: str | None) -> bool:  # exactly `Bearer <key>`, as SGLang compares it
            return key is not None and hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

        if path in ADMIN:
            key = state.admin_api_key or state.api_key
            if key is None:
                return _err(403, f"{path} is refused: this engine was started without --api-key, so anyone who can "
                                 "reach it could replace its weights; restart it with --api-key KEY")
            if not ok(key):
                return _err(401, f"{path} needs `Authorization: Bearer <{'admin ' if state.admin_api_key else ''}"
                                 "api key>`")
        elif state.api_key is not None and not ok(state.api_key):
            return _err(401, "missing or wrong `Authorization: Bearer <api key>` (the engine runs with --api-key)")
        return await call_next(request)

    def info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "weight_version": state.weight_version, "engine": "rollflow-builtin"}

    def unhealthy() -> JSONResponse | None:
        if state.released:
            return _err(503, "memory released")
        if (stalled := state.stalled_s()) is not None:
            return _err(503, f"the generator has made no decode step for {stalled:.0f} s (--watchdog-timeout "
                             f"{state.watchdog_s:g})")
        return None

    @app.get("/health")
    async def health():
        return unhealthy() or JSONResponse({})

    @app.get("/health_generate")
    async def health_generate():
        if (bad := unhealthy()) is not None:
            return bad
        req = GenRequest(rid=f"HEALTH_CHECK_{time.monotonic_ns()}", input_ids=state.tokenize("1"),
                         max_new_tokens=1, temperature=0.0)
        await state.scheduler.submit([req])
        return JSONResponse({})

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return info()

    @app.get("/weight_version")
    @app.get("/get_weight_version")
    async def weight_version():
        return {"weight_version": state.weight_version}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        sched = state.scheduler
        return {**info(), "device": state.device, "dtype": state.dtype, "pid": os.getpid(),
                "model_impl": state.model_impl, "deterministic": state.deterministic,
                "max_running_requests": state.max_batch,
                "batch_window_s": state.batch_window_s, "batch_sizes": sched.batch_sizes[-100:] if sched else [],
                "batch_seconds": sched.batch_seconds[-100:] if sched else [],
                "continuous_batching": bool(sched and sched.continuous),
                "enable_return_routed_experts": state.generator.routers is not None, **decoder_info(state.generator)}

    requests_seen = itertools.count()

    @app.post("/generate")
    async def generate(request: Request):
        if state.released:
            return _err(503, "memory released: call /resume_memory_occupation first")
        t0 = time.perf_counter()
        try:
            body = await _body(request, state.max_request_bytes)
        except BodyTooLarge as e:
            return _err(413, str(e))
        except ValueError as e:
            return _err(400, str(e))
        if fault := faults.engine_fault(next(requests_seen)):  # ROLLFLOW_ENGINE_FAULT (tests only)
            if fault == "exit":
                os._exit(1)
            await asyncio.Event().wait()  # "hang": never answers; the client's deadline has to end it
        try:
            reqs, batched = to_requests(body, state.tokenize, state.default_max_new, state.limits)
        except (ProtocolError, TypeError, ValueError) as e:
            return _err(400, f"{type(e).__name__}: {e}")
        if state.generator.routers is None and any(r.return_routed_experts for r in reqs):
            return _err(400, "`return_routed_experts`: this engine does not record routed experts; start it with "
                             "--enable-return-routed-experts (a mixture-of-experts model)")
        if not state.unpaused.is_set():  # /pause_generation: held until /continue_generation, as SGLang does
            await state.unpaused.wait()
        try:
            results = await state.scheduler.submit(reqs, parse_burst(request.headers.get(BURST_HEADER)))
        except QueueFull as e:
            return JSONResponse({"error": {"message": str(e)}, "success": False, "message": str(e)},
                                status_code=503, headers={"Retry-After": "1"})
        except Exception as e:
            return _err(500, f"generation failed: {type(e).__name__}: {e}")
        want = body.get("return_logprob")
        wants = want if isinstance(want, list) else [bool(want)] * len(results)
        dt = time.perf_counter() - t0
        compact = request.headers.get(COMPACT_HEADER) == COMPACT_F64
        out = [to_response(r, bool(w), r.weight_version or state.weight_version, dt, compact,
                           state.generator.route_layout) for r, w in zip(results, wants)]
        # a JSONResponse, not the list: FastAPI's jsonable_encoder would walk every log-prob (~30 ms an answer of
        # 8 × 1,024 tokens, holding the GIL the generation thread needs between its decode steps)
        return JSONResponse(out if batched else out[0], headers={COMPACT_HEADER: COMPACT_F64} if compact else None)

    async def small_body(request: Request, limit: int = 2**20) -> dict[str, Any] | JSONResponse:
        try:
            return await _body(request, limit)
        except BodyTooLarge as e:
            return _err(413, str(e))
        except ValueError as e:
            return _err(400, str(e))

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await small_body(request)
        if isinstance(body, JSONResponse):
            return body
        n = state.generator.aborts.abort(None if body.get("abort_all") else (body.get("rid") or None))
        return {"success": True, "aborted": n}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        """SGLang's pause (mode "abort"): every request queued or running returns now with finish_reason abort and
        the tokens it has, and new /generate requests wait until /continue_generation (a weight update in between
        is what partial rollouts continue under). SGLang's "retract" and "in_place" keep requests inside the engine
        (KV cache and all); the built-in engine has no such state to keep and refuses them."""
        body = await small_body(request)
        if isinstance(body, JSONResponse):
            return body
        mode = body.get("mode", "abort")
        if mode != "abort":
            return _err(400, f"mode {mode!r}: the built-in engine pauses with mode 'abort' only (requests return "
                             "their tokens so far; the client continues them)")
        state.unpaused.clear()
        n = state.generator.aborts.abort(None)
        return {"success": True, "message": f"Generation paused; {n} request(s) aborted", "aborted": n}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        body = await small_body(request)
        if isinstance(body, JSONResponse):
            return body
        state.unpaused.set()
        return {"success": True, "message": "Generation continued"}

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache():
        return {"success": True, "message": "Cache flushed (the built-in engine keeps no prefix cache)"}

    async def _update(fn, body: dict[str, Any], *args) -> JSONResponse | dict:
        if body.get("abort_all_requests"):
            state.generator.aborts.abort(None)
        version = body.get("weight_version")
        t0 = time.perf_counter()
        try:
            n = await asyncio.get_running_loop().run_in_executor(
                None, fn, *args, None if version is None else str(version))
        except Exception as e:
            return _err(400, f"{type(e).__name__}: {e}")
        return {"success": True, "message": f"loaded {n / 2**20:.2f} MB in {time.perf_counter() - t0:.3f}s",
                "num_paused_requests": 0, "weight_version": state.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await small_body(request)
        if isinstance(body, JSONResponse):
            return body
        if not body.get("model_path"):
            return _err(400, "`model_path` is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return _err(400, f"load_format {body['load_format']!r}: the built-in engine reads safetensors only")
        return await _update(state.update_from_disk, body, body["model_path"])

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        """SGLang's JSON body (base64 safetensors entries), or one raw safetensors blob with the options in the
        query string (`application/octet-stream`: no base64, no JSON; what rollflow's sync sends)."""
        from engine.weights import TENSOR_LOAD_FORMAT

        try:
            if request.headers.get("content-type", "").startswith("application/octet-stream"):
                q = request.query_params
                body = {"load_format": q.get("load_format", TENSOR_LOAD_FORMAT),
                        "weight_version": q.get("weight_version"),
                        "abort_all_requests": q.get("abort_all_requests") == "true"}
                blobs: list = [await _raw(request, WEIGHTS_BODY_BYTES)]
            else:
                body = await _body(request, WEIGHTS_BODY_BYTES)
                blobs = list(body.get("serialized_named_tensors") or [])
        except BodyTooLarge as e:
            return _err(413, str(e))
        except ValueError as e:
            return _err(400, str(e))
        if body.get("load_format") != TENSOR_LOAD_FORMAT:
            return _err(400, f"load_format {body.get('load_format')!r}: the built-in engine takes "
                             f"load_format={TENSOR_LOAD_FORMAT!r} (safetensors blobs); SGLang's default format is "
                             "pickled CUDA IPC handles, usable only on the same host")
        return await _update(state.update_from_tensors, body, blobs)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await small_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            name = await asyncio.get_running_loop().run_in_executor(None, state.join_group, body)
        except Exception as e:
            return _err(400, f"{type(e).__name__}: {e}")
        return {"success": True, "message": f"joined weight-update group {name!r} as rank {body['rank_offset']}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await small_body(request, 64 * 2**20)  # names, dtypes, shapes: the tensors come by broadcast
        if isinstance(body, JSONResponse):
            return body
        return await _update(state.update_from_distributed, body, body)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await small_body(request)
        if isinstance(body, JSONResponse):
            return body
        from engine.weights.distributed import DEFAULT_GROUP

        name = body.get("group_name") or DEFAULT_GROUP
        if state.groups.pop(name, None) is None:
            return _err(400, f"group_name {name!r} is not joined")
        return {"success": True, "message": f"left weight-update group {name!r}"}

    @app.post("/weights_checker")
    async def weights_checker(request: Request):
        """SGLang's weight checker: {"action": "snapshot" | "reset_tensors" | "compare" | "checksum",
        "skip_tensor_list": [name parts]}; a compare that finds differences answers success false, listing them."""
        body = await small_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                None, state.check_weights, str(body.get("action") or "checksum"), body.get("skip_tensor_list"))
        except Exception as e:
            return _err(400, f"{type(e).__name__}: {e}")
        return out if out["success"] else _err(400, out["message"])

    @app.post("/release_memory_occupation")
    async def release():
        await asyncio.get_running_loop().run_in_executor(None, state.set_released, True)
        return {"success": True}

    @app.post("/resume_memory_occupation")
    async def resume():
        await asyncio.get_running_loop().run_in_executor(None, state.set_released, False)
        return {"success": True}

    return app


class ServerThread:
    """Runs uvicorn for `create_app(state)` in a daemon thread (used inside the Ray engine actor).

    `start` binds and listens on the port itself before uvicorn serves it: a port another process took after the
    allocator checked it free (two runs, each with its own Ray cluster, start engines on one machine at the same
    moment: both registries begin at 30000) is an RF08 error the actor retries with the next port, not a server
    thread that dies in uvicorn's own bind."""

    def __init__(self, state: EngineState, host: str, port: int):
        import uvicorn

        self.host, self.port = host, port
        self.state = state
        self.config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning",
                                     access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(self.config)
        self._sock: socket.socket | None = None
        self.thread = threading.Thread(target=lambda: self.server.run(sockets=[self._sock]), daemon=True,
                                       name="rollflow-engine")
        self.url = f"http://{host}:{port}"

    def _listen(self) -> socket.socket:
        """The server's socket, bound and listening (uvicorn's own options: SO_REUSEADDR, its backlog); RF08 when
        the port is taken."""
        from engine.diagnosis import DiagnosisError
        from engine.rollout.ports import port_in_use

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(self.config.backlog)  # on Linux two SO_REUSEADDR sockets can bind one port; one listens
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise DiagnosisError(port_in_use(self.port, self.host, "built-in engine")) from e
            raise
        return sock

    def start(self, timeout_s: float = 60.0) -> str:
        self._sock = self._listen()
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"engine server on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine server on {self.url} did not start in {timeout_s}s")
            time.sleep(0.05)
        return self.url

    def alive(self) -> bool:
        return self.thread.is_alive()

    def log_tail(self, lines: int = 30) -> str:
        """"": the built-in engine logs into its Ray actor's log, not a file of its own."""
        return ""

    def diagnose(self) -> list:
        """[]: a failure of the built-in engine is a Python exception in the actor, diagnosed where it is raised."""
        return []

    def stop(self) -> None:
        self.state.stop_generating()
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _stopping_server(state: EngineState, config):
    """uvicorn's server, whose SIGTERM / SIGINT handler first aborts every request: uvicorn then waits at most
    `timeout_graceful_shutdown` for in-flight requests, and a generation in progress ends at its next step."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # a signal handler, run between two bytecodes of the main thread, which may be holding the abort book's
            # lock then (it serves the requests): stop() takes no lock, unlike stop_generating()
            state.generator.aborts.stop()
            super().handle_exit(sig, frame)

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    """`rollflow serve` / `python -m engine.rollout.server`: the built-in engine in the foreground.

    Takes SGLang's `launch_server` flags (`--model-path`, `--host`, `--port`, `--tp-size`, …) so the SGLang
    launcher can run it; flags it has no use for are listed on stderr, not silently dropped.
    """
    import argparse
    import sys

    import uvicorn

    from engine.config.data import BUNDLED_MODEL
    from engine.diagnosis import DiagnosisError
    from engine.rollout.ports import is_port_free, port_in_use

    p = argparse.ArgumentParser(prog="rollflow serve", description="The built-in engine: SGLang's HTTP API over a "
                                "Hugging Face model (CPU or GPU; --model-impl). Accepts SGLang's launch_server flags.")
    p.add_argument("--model-path", "--hf-checkpoint", dest="model_path", default=BUNDLED_MODEL,
                   help="model directory (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default: 30000)")
    p.add_argument("--tp-size", "--tp", type=int, default=1, help="tensor-parallel size (the built-in engine: 1)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and compute (SGLang's flag; auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                   help="the model code: rollflow's native Llama-family code (Qwen2, Qwen3, Llama on the CPU), "
                        "transformers' classes, or auto (native where it can run the model; the log says which). "
                        "SGLang's flag of this name takes its own values")
    p.add_argument("--max-running-requests", type=int, default=256,
                   help="most sequences generated as one batch (SGLang's flag; default 256)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="SGLang's flag: the KV-cache tokens one batch may take (rows × prompt + max_new_tokens, "
                        "rounded up); a call that would exceed it starts the next batch (default: no limit but "
                        "--max-running-requests)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default max_new_tokens (SGLang's: 128)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="generate every request as its own batch (batch-invariant results)")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="on a GPU, decode eagerly instead of through captured CUDA graphs (SGLang's flag)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="on a GPU, compile the decode step (fused kernels inside the CUDA graph; ~30 s per new "
                        "batch shape) (SGLang's flag)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="SGLang's flag: a request with `return_routed_experts` gets the experts each token was "
                        "routed to (meta_info.routed_experts; a mixture-of-experts model; recorded inside the CUDA "
                        "graphs too, except under --enable-torch-compile)")
    p.add_argument("--api-key", default=None,
                   help="SGLang's flag: every endpoint but /health* needs `Authorization: Bearer KEY`; required to "
                        "serve on a non-loopback address and for the weight / memory endpoints")
    p.add_argument("--admin-api-key", default=None,
                   help="SGLang's flag: the key of the weight / memory endpoints (default: --api-key)")
    p.add_argument("--weight-dir", action="append", default=[],
                   help="a directory /update_weights_from_disk may load from (repeatable; default: none)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="SGLang's flag: rows that may wait for the generator; more get 503 (default 4 × "
                        "--max-running-requests)")
    p.add_argument("--watchdog-timeout", type=float, default=300.0,
                   help="SGLang's flag: seconds without a decode step after which /health answers 503")
    p.add_argument("--max-request-mb", type=float, default=16.0,
                   help="largest /generate body in MiB (413 above it; weight updates may be larger)")
    a, unknown = p.parse_known_args(argv)
    if a.tp_size != 1:
        print(f"rollflow serve: --tp-size {a.tp_size} is not supported by the built-in engine (1 only)",
              file=sys.stderr)
        return 2
    if a.max_total_tokens is not None and a.max_total_tokens < 1:
        print(f"rollflow serve: --max-total-tokens {a.max_total_tokens} must be at least 1 (or left out: no limit)",
              file=sys.stderr)
        return 2
    if unknown:
        print(f"rollflow serve: SGLang flags with no effect on the built-in engine: {' '.join(unknown)}",
              file=sys.stderr, flush=True)
    if not is_port_free(a.port, a.host, reuse=True):  # uvicorn binds with SO_REUSEADDR: a restart may reuse it
        print(DiagnosisError(port_in_use(a.port, a.host, "rollflow serve")), file=sys.stderr)
        return 1
    if a.api_key is None and not is_loopback(a.host):
        print(f"rollflow serve: --host {a.host} serves to the network, and anyone who can reach it could use it: pass "
              "--api-key KEY (clients send `Authorization: Bearer KEY`), or --host 127.0.0.1", file=sys.stderr)
        return 2
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    state = EngineState(a.model_path, device=device, dtype=dtype, threads=a.threads, max_new_tokens=a.max_new_tokens,
                        max_batch=a.max_running_requests, deterministic=a.enable_deterministic_inference,
                        api_key=a.api_key, admin_api_key=a.admin_api_key, weight_dirs=a.weight_dir,
                        max_queued=a.max_queued_requests, watchdog_s=a.watchdog_timeout,
                        max_request_bytes=int(a.max_request_mb * 2**20), cuda_graphs=not a.disable_cuda_graph,
                        compile_decode=a.enable_torch_compile, max_total_tokens=a.max_total_tokens,
                        model_impl=a.model_impl, return_routed_experts=a.enable_return_routed_experts)
    print(f"rollflow built-in engine serving {a.model_path} on http://{a.host}:{a.port} ({device}, {dtype}, "
          f"{state.model_impl} model code)",
          flush=True)
    config = uvicorn.Config(create_app(state), host=a.host, port=a.port, log_level="warning",
                            timeout_graceful_shutdown=5)
    _stopping_server(state, config).run()
    return 0


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
