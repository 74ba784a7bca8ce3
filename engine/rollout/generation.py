"""Batched sampling over a transformers causal LM, with per-token log-probs, stops and abort.

One call generates a whole batch with a KV cache: prompts are left-padded, positions come from the attention
mask, and each row has its own temperature / top-p / top-k / stop set / max_new_tokens / seed. The log-prob
returned for a token is log softmax(logits / T) of the full vocabulary (T = 1 when greedy), i.e. the
quantity the trainer recomputes, so the train–inference mismatch is only numerical. That is also what SGLang
returns by default (post-temperature, before top-k / top-p filtering).

Invariants (tests/test_engine_server.py):
- a row stops at the first token in its stop set (EOS ∪ stop_token_ids, EOS left out with ignore_eos) or at the
  first token whose decoded output contains a stop string; the stopping token stays in `output_ids`; with
  min_new_tokens (SGLang's) neither can end it earlier: the stop set's logits are masked until then (on the eager
  path: such a batch does not use the CUDA graphs, nor joins a running one);
- `max_new_tokens = 0` runs the prefill only (scoring: `input_logprobs` from `logprob_start_len`);
- an aborted rid (exact or by prefix, as SGLang's `/abort_request`) stops at the next step with what it has.

Batch composition changes the floating-point reductions of a row (padding, matmul blocking): measured on the
bundled model, a row's log-probs move by up to ~1.4e-5 between "alone" and "in a batch of 38", which can flip a
sampled token with probability ~1e-5 per token. Per-row seeds make a row reproducible only for a fixed batch.

Sampling: the whole batch draws at once from counter-based noise keyed by (row seed, step) (engine/rollout/
sampling.py), on the CPU too since 2026-12-03 (before, each CPU row drew from its own torch.Generator; batched, the
demo's 64 × 8-token generate went from 34.8 to 19.7 ms). The eager prefill runs one row per distinct prompt and indexes the cache out to its
rows; on a GPU it computes logits of the last prompt position only unless prompt log-probs are asked.
On CUDA the decode steps replay CUDA graphs over a preallocated cache (engine/rollout/cuda_graphs.py) unless
`cuda_graphs=False` (SGLang's --disable-cuda-graph) or the batch asks for prompt log-probs; there, requests offered
through a `Feed` join a running batch in its free rows (continuous batching) and each result is delivered when its
request ends.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.rollout.sampling import counter_uniform, draw

log = logging.getLogger("rollflow.rollout")

#: Seeds of requests that bring none. A generator of its own: the process's `random` is not drawn from, so an
#: engine serving from a train worker's process (--rollout-engine-process trainer) leaves the RNG states that the
#: worker's checkpoints carry as they would be without it (a resumed run's checkpoints stay bitwise the same).
_UNSEEDED = random.Random()


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logprob_start_len: int = -1  # ≥ 0: also return log-probs of the prompt tokens from this position
    min_new_tokens: int = 0  # SGLang's: no stop token or stop string ends the answer before this many tokens
    return_routed_experts: bool = False  # SGLang's: the experts each token but the last was routed to (MoE)
    routed_experts_start_len: int = 0  # SGLang's: those from this prompt position on


@dataclass
class GenResult:
    rid: str
    output_ids: list[int]
    logprobs: list[float]  # [R] log π(output_ids[t] | prefix) at the request's temperature
    finish_reason: dict[str, Any]
    text: str
    prompt_tokens: int
    input_logprobs: list[float | None] | None = None  # [P - start] (None for the first prompt token)
    input_start: int = 0
    input_ids: list[int] = field(default_factory=list)  # [P] the prompt
    weight_version: str | None = None  # the weights the batch ran under (stamped under the generator's lock)
    routed_experts: torch.Tensor | None = None  # [P + R - 1, #routers, k] (return_routed_experts), on the host


def _cache_of(out) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


@contextlib.contextmanager
def _taped(tape, into: list[torch.Tensor], rows: int, length: int, inv: torch.Tensor | None = None):
    """Record the routers' experts of the block's forward (`tape`: engine.train.routing.TorchRouters; None: run
    plainly) into `into` as [rows', length, #routers, k], rows' = len(inv) when the forward ran the distinct prompts
    `inv` indexes out to the batch's rows."""
    if tape is None:
        yield
        return
    with tape.recording() as got:
        yield
    routes = torch.stack(got, dim=1).view(rows, length, len(got), -1)  # routers see the [rows·length] tokens
    into.append(routes[inv] if inv is not None else routes)


def _routes_of(results: list[GenResult], reqs: list[GenRequest], routed: list[torch.Tensor], plen: int) -> None:
    """Each result that asked gets its routed experts, SGLang's rows: the prompt's (the left padding left out), then
    one per output token but the last (no forward saw it) — P + R - 1 rows, from routed_experts_start_len on."""
    prompt = routed[0].cpu()  # [b, plen, #routers, k]
    steps = torch.cat(routed[1:], dim=1).cpu() if len(routed) > 1 else prompt[:, :0]  # [b, steps, …]
    for i, (res, r) in enumerate(zip(results, reqs)):
        if r.return_routed_experts:
            P, R = len(r.input_ids), len(res.output_ids)
            routes = torch.cat([prompt[i, plen - P:], steps[i, :max(R - 1, 0)]])[:P + R - 1]
            res.routed_experts = routes[r.routed_experts_start_len:]


class AbortBook:
    """Which rids are live (queued or running) and which of them were aborted; shared by the HTTP thread and the
    generation thread. An abort only affects rids live at that moment, like SGLang's scheduler (prefix match)."""

    def __init__(self) -> None:
        self._live: set[str] = set()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._stopped = False  # every rid, live or not: the server is stopping

    def add(self, rids: list[str]) -> None:
        with self._lock:
            self._live.update(rids)

    def done(self, rids: list[str]) -> None:
        with self._lock:
            self._live.difference_update(rids)
            self._aborted.difference_update(rids)

    def abort(self, prefix: str | None) -> int:
        """Abort every live rid starting with `prefix` (all of them when None or ""); returns how many."""
        with self._lock:
            hit = {r for r in self._live if not prefix or r.startswith(prefix)}
            self._aborted |= hit
            return len(hit)

    def stop(self) -> None:
        """Abort every request, now and later: the server is stopping. Takes no lock, so a signal handler may call
        it (it runs in the main thread, which may be holding this book's lock at that moment)."""
        self._stopped = True

    def is_aborted(self, rid: str) -> bool:
        return self._stopped or rid in self._aborted


#: a batch that takes joining requests has at least this many rows (a decode step costs about the same up to ~64
#: rows on an H200: 3.5 ms at 64, bench/results/gpu_engine_profile.md)
JOIN_ROWS = 16


class GcClock:
    """Seconds this process spent in Python's cyclic garbage collector, and how many collections (any thread: a
    collection stops every Python thread). One per process, installed on first use; read before and after a batch
    (the graph loop's `host` stats)."""

    _installed: "GcClock | None" = None

    def __init__(self) -> None:
        self.seconds, self.collections, self._t0 = 0.0, 0, None

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1
            self._t0 = None

    @classmethod
    def get(cls) -> "GcClock":
        if cls._installed is None:
            import gc

            cls._installed = GcClock()
            gc.callbacks.append(cls._installed._cb)
        return cls._installed


class Feed:
    """Requests offered to a running batch (continuous batching): the server's scheduler puts groups (one
    /generate call each) from its event loop; the generation thread takes the head group between two decode steps
    when it fits. Thread-safe; a group is taken whole, in arrival order."""

    def __init__(self) -> None:
        self._groups: collections.deque[list[GenRequest]] = collections.deque()
        self._lock = threading.Lock()
        self.rows = 0  # requests in it

    def put(self, reqs: list[GenRequest]) -> None:
        with self._lock:
            self._groups.append(reqs)
            self.rows += len(reqs)

    def peek(self) -> list[GenRequest] | None:
        with self._lock:
            return self._groups[0] if self._groups else None

    def pop(self) -> list[GenRequest]:
        with self._lock:
            self.rows -= len(self._groups[0])
            return self._groups.popleft()

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)


class Generator:
    """Owns the served model; `generate` is called from one thread at a time (the scheduler's)."""

    def __init__(self, model, tokenizer, eos_ids: list[int], device: str = "cpu", cuda_graphs: bool = True,
                 compile_decode: bool = False, fuse_ops: bool = True, return_routed_experts: bool = False):
        self.model, self.tokenizer, self.eos_ids, self.device = model, tokenizer, list(eos_ids), device
        # SGLang's --enable-return-routed-experts: hooks on the MoE routers record the experts of every forward of a
        # batch that asks (request `return_routed_experts`); on CUDA graphs every step records them
        # (engine/rollout/cuda_graphs.py), except under --enable-torch-compile, where such a batch decodes eagerly
        self.routers = self.route_layout = None
        if return_routed_experts:
            from engine.train.routing import RouteLayout, TorchRouters, router_layers

            self.routers = TorchRouters(model, "--enable-return-routed-experts")
            c = getattr(model.config, "text_config", None) or model.config
            self.route_layout = RouteLayout(
                num_layers=int(c.num_hidden_layers), top_k=int(c.num_experts_per_tok),
                moe_layers=tuple(router_layers(model, self.routers.routers)),
                num_experts=int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)))
        self.on_gpu = not str(device).startswith("cpu")
        # on CUDA: decode through captured graphs over a preallocated cache (engine/rollout/cuda_graphs.py), unless
        # SGLang's --disable-cuda-graph says otherwise; batches that ask for prompt log-probs run eagerly
        self.cuda_graphs = bool(cuda_graphs and str(device).startswith("cuda"))
        # why a CUDA engine decodes without graphs (/get_server_info's cuda_graphs_off)
        self.graphs_off = "--sglang-disable-cuda-graph" if str(device).startswith("cuda") and not cuda_graphs else None
        if self.cuda_graphs:
            from engine.rollout.cuda_graphs import graphs_off_reason

            if (why := graphs_off_reason(model)) is not None:  # known before any capture: eager decoding, said once
                log.warning("built-in engine: decoding without CUDA graphs: %s", why)
                self.cuda_graphs, self.graphs_off = False, why
        self.graphs = None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        self.aborts = AbortBook()
        self.lock = threading.Lock()  # weight updates vs generation
        self.waiting = 0  # threads waiting in `exclusive()` (a running batch then takes no more requests)
        # the last graph batch's host time: reading tokens and stops (take_s), joining requests (join_s), and the
        # process's garbage collections meanwhile (gc_s, gc_collections)
        self.host_stats: dict[str, float] = {}
        self.prefill_rows = 0  # rows the eager path prefilled (one per distinct prompt of a batch)
        self._waiting_lock = threading.Lock()
        self.version = "default"  # SGLang's weight_version of the served weights (set under `lock`)
        self.busy_since: float | None = None  # monotonic time the running batch started (None: idle)
        self.last_step = 0.0  # monotonic time of the last decode step (the server's watchdog reads it)
        # transformers ≥ 5.2x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # on CUDA every RMSNorm runs as one fused kernel and the rotary embedding as one kernel each for q and k
        # (engine/rollout/fused.py: 3.53 → 2.34 ms a decode step at 64 rows of the 0.5B shape on an H200,
        # bench/results/gpu_fused_norm.json; fuse_ops=False: transformers' modules, the benchmark's baseline). A
        # compiled decode step is left as measured: inductor fuses these itself
        self.fused_norms, self.fused_rotary = 0, False
        if fuse_ops and str(device).startswith("cuda") and not compile_decode:
            from engine.rollout.fused import fuse_rms_norms, fuse_rotary

            self.fused_norms = fuse_rms_norms(model)
            self.fused_rotary = fuse_rotary(model)
        if self.cuda_graphs:
            from engine.rollout.cuda_graphs import GraphDecoder

            tape = self.routers if not compile_decode else None
            if self.routers is not None and compile_decode:
                log.warning("built-in engine: batches that ask for routed experts decode without CUDA graphs under "
                            "--enable-torch-compile (the routers' hooks are not compiled)")
            self.graphs = GraphDecoder(model, self._cache_kw, compile=compile_decode, tape=tape)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    @contextlib.contextmanager
    def exclusive(self):
        """The generator's lock, for a weight update or a memory move: while one waits for it, a running batch
        takes no more requests (continuous batching), so the batch ends and lets it in."""
        with self._waiting_lock:
            self.waiting += 1
        try:
            with self.lock:
                yield
        finally:
            with self._waiting_lock:
                self.waiting -= 1

    @torch.no_grad()
    def generate(self, reqs: list[GenRequest], feed: Feed | None = None,
                 deliver: Callable[[GenRequest, GenResult], None] | None = None) -> list[GenResult]:
        """Generate a batch; returns the results of `reqs` in order. With the CUDA-graph decoder, `feed` offers
        more requests while the batch runs: they join it in free rows (continuous batching), and `deliver` gets
        every request's result (joined ones included) as soon as that request finishes. The eager path (the CPU;
        a GPU batch asking for prompt log-probs) runs each batch to its end and delivers then: CPU results and the
        demo's numbers stay as recorded."""
        with self.lock:
            self.busy_since = time.monotonic()
            try:
                return self._generate(reqs, feed, deliver)
            finally:
                self.busy_since = None

    def _generate(self, reqs: list[GenRequest], feed: Feed | None = None,
                  deliver: Callable[[GenRequest, GenResult], None] | None = None) -> list[GenResult]:
        b = len(reqs)
        plen = max(len(r.input_ids) for r in reqs)
        ids = torch.full((b, plen), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, plen), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding
            ids[i, plen - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, plen - len(r.input_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P]
        temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in reqs], dtype=torch.float32,
                             device=self.device)  # [b] the T of the returned log-probs (1 when greedy)
        # one counter-based draw per row and step for the whole batch (sampling.py), on the CPU too: a row's token
        # depends on its seed and step only; unseeded rows get a random seed
        seeds = torch.tensor([r.seed if r.seed is not None else _UNSEEDED.getrandbits(62) for r in reqs],
                             dtype=torch.long, device=self.device)
        knobs = {"temperature": torch.tensor([r.temperature for r in reqs], device=self.device),
                 "top_p": torch.tensor([r.top_p for r in reqs], device=self.device),
                 "top_k": torch.tensor([r.top_k for r in reqs], device=self.device)}
        stop_ids = [set(r.stop_token_ids) | (set() if r.ignore_eos else set(self.eos_ids)) for r in reqs]
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_lp: list[list[float]] = [[] for _ in reqs]
        finish: list[dict[str, Any] | None] = [None] * b
        for i, r in enumerate(reqs):
            if self.aborts.is_aborted(r.rid):
                finish[i] = {"type": "abort", "message": "aborted by /abort_request"}
            elif r.max_new_tokens <= 0:
                finish[i] = {"type": "length", "length": 0}

        # every prompt position's logits only when prompt log-probs are asked (on a GPU: [b, P, V] fp32 would be
        # 10 GB at b = 512, P = 32, V = 151,936); the CPU computes them all, as it always has
        prompt_lps = any(r.logprob_start_len >= 0 for r in reqs)
        hold = [r.min_new_tokens for r in reqs]  # min_new_tokens: the stop tokens' logits masked until then
        tape = self.routers if self.routers is not None and any(r.return_routed_experts for r in reqs) else None
        graphs = self.graphs if self.graphs is not None and not prompt_lps and not any(hold) and \
            (tape is None or self.graphs.tape is not None) else None
        if graphs is not None:  # prefill into the graph's cache and draw step 0; later steps replay the graph
            return self._decode_graphs(reqs, ids, mask, pos, seeds, knobs, stop_ids, finish, feed, deliver)
        keep = {"logits_to_keep": 1} if self.on_gpu and not prompt_lps else {}
        # one prefill row per distinct prompt: a GRPO group sends its prompt n times (the CPU demo's 64 rows are 8
        # prompts; the prefill was ~2/3 of the engine's time there, py-spy); the cache is then indexed out to
        # every row. A row's numbers may differ from a full-batch prefill's in the last bits (another GEMM shape),
        # the same way for the same batch every time.
        first: dict[tuple[int, ...], int] = {}
        row_of = torch.tensor([first.setdefault(tuple(r.input_ids), i) for i, r in enumerate(reqs)])
        share = len(first) < b
        routed: list[torch.Tensor] = []  # return_routed_experts: [b, P] then [b, 1] per forward, [·, #routers, k]
        if share:
            uniq = torch.tensor(sorted(first.values()))
            inv = torch.searchsorted(uniq, row_of).to(self.device)  # row → its prompt's place among the distinct
            uniq = uniq.to(self.device)
            with _taped(tape, routed, len(uniq), plen, inv):
                out = self.model(input_ids=ids[uniq], attention_mask=mask[uniq], position_ids=pos[uniq],
                                 use_cache=True, **keep)
            _cache_of(out).reorder_cache(inv)  # [u, …] → [b, …] (DynamicCache: index_select over the batch)
            all_logits = out.logits.float()[inv]
        else:
            with _taped(tape, routed, b, plen):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **keep)
            all_logits = out.logits.float()  # [b, P, V] (or [b, 1, V])
        self.prefill_rows += len(first)
        input_lps = [self._input_logprobs(all_logits[i], r, plen, float(temps[i])) for i, r in enumerate(reqs)]
        past, logits = _cache_of(out), all_logits[:, -1, :]  # [b, V]
        last_pos = pos[:, -1]
        step = 0
        while not all(f is not None for f in finish):
            if any(hold):
                for i in range(b):
                    if finish[i] is None and len(out_ids[i]) < hold[i] and stop_ids[i]:
                        logits[i, sorted(stop_ids[i])] = float("-inf")  # the log-probs follow the masked logits
            toks, lps = draw(logits, uniforms=counter_uniform(seeds, step), **knobs)  # [b], [b]
            step += 1
            self.last_step = time.monotonic()
            # one device → host copy per step (not one per row)
            toks_l, lps_l = torch.stack([toks.double(), lps.double()]).tolist()
            for i, r in enumerate(reqs):
                if finish[i] is None:
                    finish[i] = self._take(r, int(toks_l[i]), lps_l[i], out_ids[i], out_lp[i], stop_ids[i])
            if all(f is not None for f in finish):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            with _taped(tape, routed, b, 1):
                out = self.model(input_ids=toks[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                                 use_cache=True, **{self._cache_kw: past})
            past, logits = _cache_of(out), out.logits[:, -1, :].float()
        results = [self._result(r, out_ids[i], out_lp[i], finish[i], input_lps[i]) for i, r in enumerate(reqs)]
        if tape is not None:
            _routes_of(results, reqs, routed, plen)
        for q, res in zip(reqs, results):
            res.weight_version = self.version
            if deliver is not None:
                deliver(q, res)
        return results

    def _take(self, r: GenRequest, t: int, lp: float, ids: list[int], lps: list[float], stop_ids: set[int]
              ) -> dict[str, Any] | None:
        """Append a drawn token to a running request; its finish reason when it ends here (abort, stop token, stop
        string, length), else None."""
        if self.aborts.is_aborted(r.rid):
            return {"type": "abort", "message": "aborted by /abort_request"}
        ids.append(t)
        lps.append(lp)
        if t in stop_ids:
            return {"type": "stop", "matched": t}
        if r.stop and len(ids) >= r.min_new_tokens and (hit := self._stop_string(ids, r)):
            return {"type": "stop", "matched": hit}
        if len(ids) >= r.max_new_tokens:
            return {"type": "length", "length": r.max_new_tokens}
        return None

    def _decode_graphs(self, reqs: list[GenRequest], ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                       seeds: torch.Tensor, knobs: dict[str, torch.Tensor], stop_ids: list[set[int]],
                       finish: list[dict[str, Any] | None], feed: Feed | None,
                       deliver: Callable[[GenRequest, GenResult], None] | None) -> list[GenResult]:
        """The CUDA-graph decode loop (engine/rollout/cuda_graphs.py), with continuous batching when `feed` is
        given. Each step's tokens reach the host one step late: step t+1 is launched before the host reads step
        t (stops, aborts), so the GPU decodes while the host works. A row is free once its request finished (or
        was padding); between two steps, requests from `feed` join free rows (`GraphDecoder.can_join`), and the
        batch runs while any row has a request. `at_row` maps each busy row to its request; a launched step's
        outputs count only for the rows whose request is still the one it ran for. A request that asks for its
        routed experts gets its prompt's (from its prefill) and its row's at the steps it ran
        (`GraphDecoder.step_routes`)."""
        graphs = self.graphs
        reqs = list(reqs)  # joined requests are appended
        n0 = len(reqs)
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_lp: list[list[float]] = [[] for _ in reqs]
        stop_ids, finish = list(stop_ids), list(finish)
        results: list[GenResult | None] = [None] * n0

        # request → (its row, the first step that ran it, its prompt's routed experts) for those that ask for them
        routes: dict[int, tuple[int, int, torch.Tensor]] = {}

        def done(i: int) -> None:
            res = self._result(reqs[i], out_ids[i], out_lp[i], finish[i], None)
            res.weight_version = self.version
            if i in routes:  # SGLang's rows: the prompt's, then one per output token but the last
                row, first, prompt = routes.pop(i)
                r, n = reqs[i], len(out_ids[i])
                rows = torch.cat([prompt, graphs.step_routes(row, first, max(n - 1, 0))])[:len(r.input_ids) + n - 1]
                res.routed_experts = rows[r.routed_experts_start_len:]
            if i < n0:
                results[i] = res
            if deliver is not None:
                deliver(reqs[i], res)

        # the host's time per part of the loop (bench/served_gap.py: where a served step's milliseconds go)
        gc_clock = GcClock.get()
        gc0, gcn0, take_s, join_s = gc_clock.seconds, gc_clock.collections, 0.0, 0.0
        toks, lps = graphs.start(ids, mask, pos, seeds=seeds, max_new=max(r.max_new_tokens for r in reqs),
                                 min_rows=JOIN_ROWS if feed is not None else 1, **knobs)
        if graphs.tape is not None:
            plen = ids.shape[1]
            routes.update({i: (i, 0, graphs.prompt_routes[i, plen - len(r.input_ids):]) for i, r in enumerate(reqs)
                           if r.return_routed_experts})
            graphs.recording = bool(routes)  # (a request that asks and joins later turns it on)
        for i in range(n0):
            if finish[i] is not None:  # aborted before it started, or max_new_tokens 0
                done(i)
        at_row = {i: i for i in range(n0) if finish[i] is None}  # row → request
        ready = (at_row.copy(), torch.stack([toks.double(), lps.double()]).tolist())  # step 0, from the prefill
        launched: dict[int, int] | None = None  # the rows of the step in flight and their requests
        while True:
            if launched is not None:
                ready, launched = (launched, graphs.collect()), None
            got, (toks_l, lps_l) = ready if ready is not None else ({}, ([], []))
            ready = None
            if any(len(out_ids[i]) + (got.get(row) == i) < reqs[i].max_new_tokens for row, i in at_row.items()):
                graphs.launch()  # the next step, before this one is read
                launched = at_row.copy()
            self.last_step = t0 = time.monotonic()
            for row, i in got.items():
                if at_row.get(row) == i and (f := self._take(reqs[i], int(toks_l[row]), lps_l[row], out_ids[i],
                                                              out_lp[i], stop_ids[i])):
                    finish[i] = f
                    del at_row[row]
                    done(i)
            t1 = time.monotonic()
            take_s += t1 - t0
            if feed is not None and not self.waiting:
                self._join(feed, reqs, at_row, out_ids, out_lp, stop_ids, finish, done, routes)
                join_s += time.monotonic() - t1
            if launched is None and not at_row:
                break
        graphs.settle()
        self.host_stats = {"take_s": take_s, "join_s": join_s, "gc_s": gc_clock.seconds - gc0,
                           "gc_collections": gc_clock.collections - gcn0}
        return results

    def _join(self, feed: Feed, reqs: list[GenRequest], at_row: dict[int, int], out_ids: list[list[int]],
              out_lp: list[list[float]], stop_ids: list[set[int]], finish: list[dict[str, Any] | None],
              done: Callable[[int], None], routes: dict[int, tuple[int, int, torch.Tensor]]) -> None:
        """Move the requests `feed` offers into free rows while they fit: whole groups (one /generate call), in
        arrival order; a group that does not fit now waits (for a later step, or the next batch). A joined row's
        steps count from the next launch on (the one in flight ran the row's old contents)."""
        graphs = self.graphs
        free = [row for row in range(graphs.rows) if row not in at_row]
        taken: list[GenRequest] = []
        while (head := feed.peek()) is not None and len(taken) + len(head) <= len(free):
            if not all(r.max_new_tokens > 0 and r.logprob_start_len < 0 and r.min_new_tokens == 0 and
                       (not r.return_routed_experts or graphs.tape is not None) and
                       graphs.can_join(len(r.input_ids), r.max_new_tokens, r.top_k, r.top_p) for r in head):
                break
            taken += feed.pop()
        if not taken:
            return
        rows = free[:len(taken)]
        dev = self.device
        toks, lps = graphs.join(
            rows, [r.input_ids for r in taken],
            seeds=torch.tensor([r.seed if r.seed is not None else _UNSEEDED.getrandbits(62) for r in taken],
                               device=dev),
            temperature=torch.tensor([r.temperature for r in taken], device=dev),
            top_p=torch.tensor([r.top_p for r in taken], device=dev),
            top_k=torch.tensor([r.top_k for r in taken], device=dev))
        toks_l, lps_l = torch.stack([toks.double(), lps.double()]).tolist()
        plen = max(len(r.input_ids) for r in taken)
        for j, (row, r, t, lp) in enumerate(zip(rows, taken, toks_l, lps_l)):
            i = len(reqs)
            if r.return_routed_experts:
                routes[i] = (row, graphs.launched, graphs.prompt_routes[j, plen - len(r.input_ids):])
                graphs.recording = True
            reqs.append(r)
            out_ids.append([])
            out_lp.append([])
            stop_ids.append(set(r.stop_token_ids) | (set() if r.ignore_eos else set(self.eos_ids)))
            finish.append(self._take(r, int(t), lp, out_ids[i], out_lp[i], stop_ids[i]))
            if finish[i] is None:
                at_row[row] = i
            else:
                done(i)

    @staticmethod
    def _input_logprobs(logits: torch.Tensor, r: GenRequest, plen: int, temp: float) -> list[float | None] | None:
        """log π(prompt[k] | prompt[:k]) for k ≥ logprob_start_len; prompt[0] has no prediction (None)."""
        if r.logprob_start_len < 0:
            return None
        P = len(r.input_ids)
        cols = logits[plen - P:]  # [P, V]: column k predicts prompt[k + 1]
        targets = torch.tensor(r.input_ids[1:], device=logits.device)[:, None]  # [P-1, 1]
        lp = torch.log_softmax(cols[:-1] / temp, dim=-1).gather(-1, targets)
        full = [None] + [float(x) for x in lp.squeeze(-1)]  # [P]
        return full[r.logprob_start_len:]

    def _stop_string(self, ids: list[int], r: GenRequest) -> str | None:
        text = self._decode(ids, r.skip_special_tokens)
        return next((s for s in r.stop if s in text), None)

    def _result(self, r: GenRequest, ids: list[int], lps: list[float], finish: dict[str, Any],
                input_lps: list[float | None] | None) -> GenResult:
        matched = finish.get("matched")
        # SGLang's trim_matched_stop: a stop token id leaves the text (it stays in output_ids), a stop string is cut
        trim_id = isinstance(matched, int) and not isinstance(matched, bool) and not r.no_stop_trim and ids
        text = self._decode(ids[:-1] if trim_id else ids, r.skip_special_tokens)
        if isinstance(matched, str) and not r.no_stop_trim:
            text = text[: text.find(matched)]
        return GenResult(r.rid, ids, lps, finish, text, len(r.input_ids), input_lps,
                         max(r.logprob_start_len, 0), list(r.input_ids))
