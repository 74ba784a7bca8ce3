"""One rollout: B groups of n samples (over-sampled and filtered when asked), scored, in prompt order.

A rollout runs in rounds. A round draws `round_size` prompts (`--over-sampling-batch-size`; B without a filter);
each prompt's group of n samples is one batched `/generate` (n inputs, one sampling seed each) sent to the serving
engine with the fewest outstanding samples, at most `concurrency` samples in flight. As a group finishes it is
scored and the filter decides whether to keep it. The round ends as soon as the first k groups *in draw order*
are all finished and hold the groups still needed; groups after k are cancelled and aborted on their engine
(`/abort_request` by rid prefix). Rounds repeat until B groups are kept.

Determinism: sample seeds are sha256(seed, rollout_id, draw index, j), and what is kept depends only on groups
0..k in draw order, never on which finished first — so given the same weights, prompts and engine batches, a
redone rollout returns the same samples. (Engine batching across requests is the remaining source of variation:
see engine/rollout/server.py, `--sglang-enable-deterministic-inference`.)

Fault tolerance: when a request fails at the connection level (engine died or was killed), a fault-tolerant engine
pool is told, and the group is sent again — same seeds — to another serving engine (or the restarted one).
"""
from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import httpx

from engine.data import PromptRow
from engine.diagnosis import Diagnosis, DiagnosisError
from engine.rollout.client import BURST_HEADER, alone, generate_async, run_on_rollout_loop
from engine.rollout.protocol import COMPACT_F64, COMPACT_HEADER, output_logprobs
from engine.rewards import RewardModel
from engine.samples import Sample, Status


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True  # --rollout-skip-special-tokens (SGLang's default)
    max_context_len: int | None = None  # --rollout-max-context-len: prompt + response; not sent (budget())
    min_new_tokens: int = 0  # --eval-min-new-tokens (SGLang's; at most each request's max_new_tokens)

    def budget(self, prompt_len: int) -> int:
        """New tokens a sample of this prompt may have: max_new_tokens, less what the context cap leaves (≥ 1)."""
        if self.max_context_len is None:
            return self.max_new_tokens
        return max(1, min(self.max_new_tokens, self.max_context_len - prompt_len))

    def to_sglang(self, seed: int | None) -> dict[str, Any]:
        d: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                             "top_p": self.top_p, "top_k": self.top_k,
                             "skip_special_tokens": self.skip_special_tokens}
        if self.stop:
            d["stop"] = list(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if seed is not None:
            d["sampling_seed"] = seed
        if self.min_new_tokens:
            d["min_new_tokens"] = self.min_new_tokens
        return d

    @staticmethod
    def fit(d: dict[str, Any], done: int = 0) -> dict[str, Any]:
        """A request's params once its max_new_tokens is set for it (a context cap, a continued segment that has
        `done` tokens already): min_new_tokens what is left of it, within max_new_tokens (SGLang refuses more)."""
        if "min_new_tokens" in d:
            d["min_new_tokens"] = max(0, min(d["min_new_tokens"] - done, d["max_new_tokens"]))
        return d


@dataclass
class Prompt:
    row: PromptRow
    ids: list[int]  # [P] rendered prompt token ids
    samples: list[Sample] | None = None  # the group a --data-source-path class handed out (a generate hook gets them)


class EnginePool(Protocol):
    fault_tolerant: bool
    api_key: str | None  # sent as `Authorization: Bearer` (SGLang's --api-key)
    # optional `join_rows` (int, default 0): engines that answer a request only once all its rows are done (the
    # built-in engine on a CPU runs each batch to its end): the groups a round sends at once then share one
    # /generate per engine of at most this many rows (_Round._send): the same engine work, one HTTP exchange

    def serving(self) -> list[str]: ...

    def report_failure(self, url: str) -> None: ...


class StaticEngines:
    """Fixed URLs, no restarts: a failed engine fails the rollout."""

    fault_tolerant = False

    def __init__(self, urls: list[str], api_key: str | None = None):
        self.urls, self.api_key = list(urls), api_key

    def serving(self) -> list[str]:
        return self.urls

    def report_failure(self, url: str) -> None:
        pass


def sample_seed(seed: int, rollout_id: int, index: int) -> int:
    h = hashlib.sha256(f"{seed}:{rollout_id}:{index}".encode()).digest()
    return int.from_bytes(h[:4], "little")


# SGLang's finish_reason types. Any other (or none) is FAILED with the reason in metadata["failure"]: never
# trained, counted in rollout/failed_share and shown in the failure report. (slime leaves such a sample PENDING,
# which its trainer also skips, but silently.)
_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


MAX_SEGMENTS = 16  # a partial rollout continues an aborted sample at most this many times


@dataclass
class Partial:
    """One sample's generation so far. Without --partial-rollout one request makes it; with it, a request aborted
    by a pause (a weight sync) leaves `finish_reason` None and the sample is continued from its tokens, each
    segment under the weights then served (`versions`)."""
    ids: list[int] = field(default_factory=list)  # [R] response tokens so far
    logprobs: list[float] = field(default_factory=list)  # [R] the engine's log-probs of them
    text: str = ""
    versions: list = field(default_factory=list)  # the weight_version of each segment
    finish_reason: dict | None = None  # None: not finished yet
    lengths: list[int] = field(default_factory=list)  # tokens of each segment
    routes: str | None = None  # the last segment's meta_info.routed_experts (--use-rollout-routing-replay)

    def to_json(self) -> dict[str, Any]:
        return {"ids": self.ids, "logprobs": self.logprobs, "text": self.text, "versions": self.versions,
                "finish_reason": self.finish_reason, "lengths": self.lengths,
                **({"routes": self.routes} if self.routes is not None else {})}

    def copy(self) -> "Partial":
        return Partial(list(self.ids), list(self.logprobs), self.text, list(self.versions), self.finish_reason,
                       list(self.lengths), self.routes)


def offpolicy_mask(segment_lengths: list[int], response_length: int) -> list[int]:
    """The loss mask of a continued sample under --mask-offpolicy-in-partial-rollout (slime's flag): 0 on every
    segment but the last, which the current weights generated. [3, 2] → [0, 0, 0, 1, 1]."""
    last = segment_lengths[-1] if segment_lengths else response_length
    return [0] * (response_length - last) + [1] * last


class PartialBuffer:
    """A rollout's samples as far as they got, by (draw index, j): shared by the rollout's thread, which updates
    it as requests return, and the driver, which writes a snapshot into the checkpoint taken while the rollout is
    in flight (--partial-rollout), so that a resumed run continues those samples instead of redrawing them."""

    def __init__(self, rollout_id: int, rows: dict[tuple[int, int], Partial] | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        import threading

        self.rollout_id, self._rows, self._lock = rollout_id, dict(rows or {}), threading.Lock()
        # response ids → text as the engines decode them (skip_special_tokens): finds a stop string that spans the
        # pause between two segments, which neither segment's engine saw whole (`stop_across_segments`)
        self.decode = decode
        # --mask-offpolicy-in-partial-rollout: a continued sample trains on its last segment only (the tokens of
        # the weights that finished it); the earlier segments get loss mask 0
        self.mask_offpolicy = False

    def get(self, draw: int, j: int) -> Partial:
        with self._lock:
            p = self._rows.get((draw, j))
            return p.copy() if p else Partial()

    def put(self, draw: int, j: int, p: Partial) -> None:
        with self._lock:
            self._rows[(draw, j)] = p.copy()

    def __len__(self) -> int:
        return len(self._rows)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"rollout_id": self.rollout_id,
                    "rows": [{"draw": d, "j": j, **p.to_json()} for (d, j), p in sorted(self._rows.items())]}

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> "PartialBuffer":
        rows = {(int(r["draw"]), int(r["j"])): Partial(list(r["ids"]), [float(x) for x in r["logprobs"]],
                                                        r.get("text", ""), list(r.get("versions", [])),
                                                        r.get("finish_reason"), list(r.get("lengths", [])),
                                                        r.get("routes"))
                for r in snap.get("rows", [])}
        return cls(int(snap["rollout_id"]), rows)


def stop_across_segments(row: Partial, ids_before: int, stops: list[str],
                         decode: Callable[[list[int]], str]) -> dict | None:
    """A stop string that spans the pause before the segment just added to `row` (its first `ids_before` tokens
    came before): the engine that generated the segment saw only its own tokens, so it could not match it (SGLang
    neither). Where one request would have stopped — after the first token whose text completes a stop string
    (the first such string in `stops` order, as the engines check) — the row is cut, its text set to the
    response's text before the string (SGLang's default trim), and the finish reason {"type": "stop", "matched": s}
    returned; None when no stop string spans the pause. Texts come from decoding the response's ids whole (the
    segments' texts, decoded apart, may split a character)."""
    before = len(decode(row.ids[:ids_before]))
    # a spanning string ends within its length of the pause; a token adds ≥ 1 character, or a byte of one (≤ 4)
    reach = 4 * max(len(s) for s in stops) + 4
    for k in range(ids_before + 1, min(len(row.ids), ids_before + reach) + 1):
        text = decode(row.ids[:k])
        hit = next((s for s in stops if s in text[max(0, before - len(s) + 1):]), None)
        if hit is None:
            continue
        at = text.find(hit, max(0, before - len(hit) + 1))
        if at >= before:  # inside the new segment: its engine saw it whole and stopped there
            return None
        del row.ids[k:], row.logprobs[k:]
        row.lengths[-1] = k - ids_before
        row.text = text[:at]
        return {"type": "stop", "matched": hit}
    return None


class RolloutTimeout(TimeoutError):
    """The rollout did not finish within --rollout-timeout (retryable)."""


class NothingToTrain(RuntimeError):
    """Every sample of the rollout FAILED or was ABORTED (retryable: e.g. a reward service that was down)."""


class EngineFailure(RuntimeError):
    """An engine stopped answering and the pool cannot replace it (retryable: the next attempt may find it back)."""


@dataclass
class RolloutResult:
    groups: list[list[Sample]]  # [B][n], in draw order
    stats: dict[str, float]  # drawn / kept / filtered / aborted groups, rounds, retried requests
    all_groups: list[list[Sample]] | None = None  # every finished group, the filter's dropped ones too (None: groups)


class _Round:
    """One round of groups on the engines (see the module docstring)."""

    def __init__(self, prompts: list[Prompt], *, first_draw: int, needed: int, rollout_id: int, nonce: str, n: int,
                 params: SamplingParams, seed: int, engines: EnginePool, reward_model: RewardModel,
                 keep: Callable[[list[Sample]], bool] | None, concurrency: int,
                 generate: Callable | None = None, hook_args: Any = None, hook_path: str = "",
                 partial: PartialBuffer | None = None, sample_hooks: list[tuple[str, Callable]] | None = None,
                 routed_experts: bool = False):
        self.prompts, self.first_draw, self.needed, self.n = prompts, first_draw, needed, n
        self.routed = {"return_routed_experts": True} if routed_experts else {}  # --use-rollout-routing-replay
        self.sample_hooks = sample_hooks or []
        self.partial, self.continued = partial, 0
        self.generate, self.hook_args, self.hook_path = generate, hook_args, hook_path
        self.rollout_id, self.nonce, self.params, self.seed = rollout_id, nonce, params, seed
        self.engines, self.reward_model, self.keep = engines, reward_model, keep
        slots = max(1, concurrency // max(n, 1))  # groups in flight at once
        self.sem = asyncio.Semaphore(slots)
        # the groups' first requests go out together: announced to the engines (engine/rollout/server.py:
        # BatchingScheduler) so that a built-in engine runs them as one batch; SGLang ignores the header
        self.burst = {BURST_HEADER: f"rf{rollout_id}-{nonce}-d{first_draw} {min(len(prompts), slots)}"}
        self.client: httpx.AsyncClient | None = None  # set by run
        self.done: list[list[Sample] | None] = [None] * len(prompts)
        self.kept = [False] * len(prompts)
        self.cutoff = len(prompts)  # groups at or after it are not needed
        self.outstanding: dict[str, int] = {}
        self.inflight: dict[int, str] = {}  # group → engine url
        self.hook_urls: dict[int, set[str]] = {}  # group → engines a generate hook sent its requests to
        self.retries = 0
        self.tasks: list[asyncio.Task] = []
        # EnginePool.join_rows: what the groups send in one event-loop turn goes out as one /generate per engine
        # (_flush, split where it would pass join_rows rows); each group gets its own slice of the answer
        self.join_rows = int(getattr(engines, "join_rows", 0) or 0)
        self._queued: dict[str, list[tuple[dict, asyncio.Future]]] = {}
        self._flushes: set[asyncio.Task] = set()

    def rid(self, gi: int) -> str:
        return f"rf{self.rollout_id}-{self.nonce}-d{self.first_draw + gi}-"

    def _pick(self) -> str | None:
        urls = self.engines.serving()
        for u in urls:
            self.outstanding.setdefault(u, 0)
        return min(urls, key=lambda u: self.outstanding[u]) if urls else None  # ties: first in order

    def _seeds(self, gi: int) -> list[int | None]:
        draw = self.first_draw + gi
        return [sample_seed(self.seed, self.rollout_id, draw * self.n + j) if self.params.temperature > 0 else None
                for j in range(self.n)]

    def _urls(self, gi: int) -> set[str]:
        return ({self.inflight[gi]} if gi in self.inflight else set()) | self.hook_urls.get(gi, set())

    def _engine_client(self, client: httpx.AsyncClient, gi: int):
        """The engines for a hook working on group gi: its requests carry the group's rid prefix (a cut round
        aborts them) and count in the load balance."""
        from engine.rollout.hooks import EngineClient

        return EngineClient(client, self.engines, self.outstanding, rid_prefix=self.rid(gi),
                            on_send=lambda url: self.hook_urls.setdefault(gi, set()).add(url))

    async def _sample_hooks(self, client: httpx.AsyncClient, gi: int, group: list[Sample]) -> list[Sample]:
        """--rollout-sample-hook-path on each sample of the group, concurrently (hooks.apply_sample_hooks)."""
        from engine.rollout.hooks import apply_sample_hooks

        engine = self._engine_client(client, gi)
        args = self.hook_args.with_engine(engine)
        try:
            return list(await asyncio.gather(*(apply_sample_hooks(self.sample_hooks, args, s) for s in group)))
        finally:
            self.retries += engine.retries

    async def _hooked(self, client: httpx.AsyncClient, gi: int) -> list[Sample]:
        """The group through --custom-generate-function-path: one call per sample, concurrently (the engine
        batches them), each with its own sampling seed; what comes back is checked (hooks.check_sample)."""
        import copy

        from engine.rollout.hooks import accepts, call_async_hook, check_sample, new_samples

        flag, fn, p = "--custom-generate-function-path", self.generate, self.prompts[gi]
        draw = self.first_draw + gi
        if p.samples is not None:
            group = [copy.deepcopy(s) for s in p.samples]
            for s in group:
                s.tokens = s.tokens or list(p.ids)
        else:
            group = new_samples(p.ids, p.row, n=self.n, group_index=gi, rollout_id=self.rollout_id, draw_index=draw)
        engine = self._engine_client(client, gi)
        args = self.hook_args.with_engine(engine)
        kw = {"evaluation": args.evaluation} if accepts(fn, "evaluation") else {}
        prompt_ids = [list(s.tokens) for s in group]

        async def one(j: int, s: Sample) -> Sample:
            params = SamplingParams.fit({**self.params.to_sglang(seeds[j]),
                                         "max_new_tokens": self.params.budget(len(prompt_ids[j]))})
            out = await call_async_hook(flag, self.hook_path, fn, args, s, params, **kw)
            return check_sample(out, flag, self.hook_path, prompt_ids=prompt_ids[j])

        seeds = self._seeds(gi)
        try:
            done = await asyncio.gather(*(one(j, s) for j, s in enumerate(group)))
        finally:
            self.retries += engine.retries
        for j, s in enumerate(done):
            s.index, s.group_index, s.rollout_id = gi * self.n + j, gi, self.rollout_id
            s.metadata = {**s.metadata, "draw_index": draw}
        return list(done)

    def _params(self, gi: int, j: int, row: Partial, seed0: int | None) -> dict[str, Any]:
        """Sampling params of sample j's next segment: the first uses the sample's seed; a continuation (a partial
        rollout) a seed of its own and the tokens still allowed."""
        segment = len(row.versions)
        seed = seed0 if segment == 0 or seed0 is None else \
            sample_seed(self.seed, self.rollout_id, ((self.first_draw + gi) * self.n + j) * MAX_SEGMENTS + segment)
        d = self.params.to_sglang(seed)
        d["max_new_tokens"] = self.params.budget(len(self.prompts[gi].ids)) - len(row.ids)
        return SamplingParams.fit(d, done=len(row.ids))

    def _extend(self, row: Partial, o: dict, budget: int | None = None) -> None:
        """Append one /generate answer to the sample's row; budget: the new tokens its group may have (default
        max_new_tokens; less under --rollout-max-context-len)."""
        budget = self.params.max_new_tokens if budget is None else budget
        meta = o.get("meta_info", {})
        new, lps = output_logprobs(o)
        before = len(row.ids) if row.versions else None  # a continuation: where its tokens start
        row.ids += new
        row.lengths.append(len(new))
        row.logprobs += lps
        row.text += o.get("text", "")
        row.versions.append(meta.get("weight_version"))
        row.routes = meta.get("routed_experts")  # the last call's: its prompt holds the earlier segments
        fr = meta.get("finish_reason") or {}
        if before is not None and self.params.stop and self.partial is not None and self.partial.decode is not None \
                and (hit := stop_across_segments(row, before, self.params.stop, self.partial.decode)):
            fr = hit
        if fr.get("type") == "abort" and self.partial is not None and len(row.versions) < MAX_SEGMENTS:
            if len(row.ids) < budget:
                return  # paused at a weight sync: continued under the new weights
            fr = {"type": "length", "length": budget}
        row.finish_reason = fr

    async def _post(self, client: httpx.AsyncClient, gi: int) -> list[Partial]:
        """The group's n samples: one batched /generate, then (partial rollout) one per round of continuations."""
        draw, prompt = self.first_draw + gi, self.prompts[gi].ids
        seeds = self._seeds(gi)
        rows = [self.partial.get(draw, j) if self.partial is not None else Partial() for j in range(self.n)]
        while todo := [j for j in range(self.n) if rows[j].finish_reason is None]:
            if gi >= self.cutoff:  # the round was cut: no continuation (_one drops the group)
                break
            self.continued += sum(bool(rows[j].versions) for j in todo)
            body = {"input_ids": [prompt + rows[j].ids for j in todo], "return_logprob": True, **self.routed,
                    "rid": [f"{self.rid(gi)}{j}" for j in todo],
                    "sampling_params": [self._params(gi, j, rows[j], seeds[j]) for j in todo]}
            first = not any(rows[j].versions for j in todo)  # continuations (partial rollout) are not a burst
            headers = {COMPACT_HEADER: COMPACT_F64, **(self.burst if first else {})}  # SGLang ignores both
            for j, o in zip(todo, await self._send(client, gi, body, len(todo), headers)):
                self._extend(rows[j], o, self.params.budget(len(prompt)))
                if self.partial is not None:
                    self.partial.put(draw, j, rows[j])
        return rows

    async def _send(self, client: httpx.AsyncClient, gi: int, body: dict, count: int,
                    headers: dict[str, str] | None = None) -> list[dict]:
        while True:
            url = self._pick()
            if url is None:
                if not self.engines.fault_tolerant:
                    raise EngineFailure("no rollout engine is serving")
                await asyncio.sleep(0.2)  # the health monitor is restarting them; the rollout deadline bounds this
                continue
            self.outstanding[url] += count
            self.inflight[gi] = url
            try:
                if self.join_rows:
                    return await self._queue(client, url, body)
                return await generate_async(client, url, body, headers)
            except httpx.TransportError as e:
                if not self.engines.fault_tolerant:
                    raise EngineFailure(f"engine {url} failed during /generate ({type(e).__name__}: {e}); "
                                        "--use-fault-tolerance restarts dead engines and resends their requests") from e
                self.engines.report_failure(url)
                self.retries += 1
                continue
            finally:
                self.outstanding[url] -= count
                self.inflight.pop(gi, None)

    def _queue(self, client: httpx.AsyncClient, url: str, body: dict) -> asyncio.Future:
        """`body` (one group's /generate) joins what goes to `url` at the end of this event-loop turn: the groups
        that start together (every group of a round, when the concurrency allows) are one request."""
        fut = asyncio.get_running_loop().create_future()
        if not any(self._queued.values()):
            asyncio.get_running_loop().call_soon(self._flush, client)
        self._queued.setdefault(url, []).append((body, fut))
        return fut

    def _flush(self, client: httpx.AsyncClient) -> None:
        queued, self._queued = self._queued, {}
        for url, parts in queued.items():
            chunks: list[list[tuple[dict, asyncio.Future]]] = [[]]
            rows = 0
            for part in parts:
                k = len(part[0]["input_ids"])
                if chunks[-1] and rows + k > self.join_rows:
                    chunks.append([])
                    rows = 0
                chunks[-1].append(part)
                rows += k
            for chunk in chunks:
                task = asyncio.get_running_loop().create_task(self._post_joined(client, url, chunk))
                self._flushes.add(task)
                task.add_done_callback(self._flushes.discard)

    async def _post_joined(self, client: httpx.AsyncClient, url: str, parts: list[tuple[dict, asyncio.Future]]
                           ) -> None:
        """One /generate holding every part's rows in order (a batch by itself: the engine starts it at once);
        each part gets its rows' answers, or the failure."""
        keys = ("input_ids", "rid", "sampling_params")
        body = {"return_logprob": True, **self.routed, **{k: [x for b, _ in parts for x in b[k]] for k in keys}}
        try:
            answers = await generate_async(client, url, body, {COMPACT_HEADER: COMPACT_F64, **alone()})
            if len(answers) != len(body["input_ids"]):
                raise EngineFailure(f"engine {url} answered {len(answers)} results for {len(body['input_ids'])} "
                                    "inputs")
        except BaseException as e:  # the engine's failure is each group's; a cancelled post cancels them
            for _, fut in parts:
                if not fut.done():
                    fut.cancel() if isinstance(e, asyncio.CancelledError) else fut.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        at = 0
        for b, fut in parts:
            k = len(b["input_ids"])
            if not fut.done():
                fut.set_result(answers[at:at + k])
            at += k

    def _samples(self, gi: int, rows: list[Partial]) -> list[Sample]:
        p, group = self.prompts[gi], []
        for j, row in enumerate(rows):
            fr = row.finish_reason or {}
            status = _STATUS.get(fr.get("type"), Status.FAILED)
            versions = {"weight_versions": list(row.versions), "segment_lengths": list(row.lengths)} \
                if len(row.versions) > 1 else {}
            group.append(Sample(
                index=gi * self.n + j, group_index=gi, rollout_id=self.rollout_id, prompt=p.row.prompt,
                tokens=list(p.ids) + row.ids, response_length=len(row.ids), response=row.text,
                label=p.row.label, loss_mask=offpolicy_mask(row.lengths, len(row.ids)) if len(row.versions) > 1
                and self.partial is not None and self.partial.mask_offpolicy else [1] * len(row.ids),
                rollout_log_probs=list(row.logprobs), rollout_routed_experts=row.routes,
                status=status,
                metadata={**p.row.metadata, "row": p.row.row, "draw_index": self.first_draw + gi,
                          "finish_reason": fr, "weight_version": row.versions[0] if row.versions else None,
                          **versions}))
            if fr.get("type") not in _STATUS:  # see _STATUS
                group[-1].metadata["failure"] = (f"the engine's finish_reason {fr!r} is none of stop / length / "
                                                 "abort: the sample is not trained on")
        return group

    async def _one(self, client: httpx.AsyncClient, gi: int) -> None:
        async with self.sem:
            if gi >= self.cutoff:
                return
            if self.generate is not None:
                group = await self._hooked(client, gi)
            else:
                group = self._samples(gi, await self._post(client, gi))
            if self.sample_hooks and gi < self.cutoff:
                group = await self._sample_hooks(client, gi, group)
            if gi >= self.cutoff:  # the round was cut while this group ran
                return
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.reward_model.score_group, group)
            keep = True if self.keep is None else await loop.run_in_executor(None, self.keep, group)
            self.done[gi], self.kept[gi] = group, bool(keep)
            await self._maybe_cut()

    async def _maybe_cut(self) -> None:
        """Cut the round after the shortest all-finished prefix that holds `needed` kept groups."""
        count = 0
        for gi in range(self.cutoff):
            if self.done[gi] is None:
                return
            count += self.kept[gi]
            if count >= self.needed:
                break
        else:
            return
        cut, self.cutoff = gi + 1, gi + 1
        late = [g for g in range(cut, len(self.prompts)) if not self.tasks[g].done()]
        for g in late:
            for url in self._urls(g):  # tell its engines: SGLang (and the built-in engine) match rids by prefix
                await self._abort(url, self.rid(g))
            self.tasks[g].cancel()

    async def _abort(self, url: str, rid: str) -> None:
        try:
            await self.client.post(url + "/abort_request", json={"rid": rid}, timeout=10)
        except httpx.HTTPError:
            pass  # the engine is gone: nothing left to abort there

    async def run(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """All groups of the round on `client` (the run's pool, its headers carry the API key) within timeout_s."""
        self.client = client
        self.tasks = [asyncio.create_task(self._one(client, gi)) for gi in range(len(self.prompts))]
        pending = set(self.tasks)
        deadline = time.monotonic() + timeout_s
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutTimeout(f"rollout {self.rollout_id} did not finish within its deadline "
                                         f"(--rollout-timeout) on engines {self.engines.serving()}")
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if not t.cancelled() and t.exception() is not None:
                        raise t.exception()
        finally:
            left_over = {gi: self._urls(gi) for gi, t in enumerate(self.tasks) if not t.done()}
            for t in [*self.tasks, *self._flushes]:
                t.cancel()
            await asyncio.gather(*self.tasks, *self._flushes, return_exceptions=True)
            for gi, urls in left_over.items():  # requests still on an engine (error or deadline)
                for url in urls:
                    await self._abort(url, self.rid(gi))


def generate_rollout(draw: Callable[[int], list[Prompt]], *, rollout_id: int, batch_size: int, n: int,
                     params: SamplingParams, reward_model: RewardModel, seed: int, engines: EnginePool,
                     round_size: int | None = None, keep: Callable[[list[Sample]], bool] | None = None,
                     concurrency: int = 64, timeout_s: float = 600.0, max_prompts: int | None = None,
                     generate: Callable | None = None, hook_args: Any = None, hook_path: str = "",
                     partial: PartialBuffer | None = None,
                     sample_hooks: list[tuple[str, Callable]] | None = None,
                     routed_experts: bool = False) -> RolloutResult:
    """`batch_size` kept groups of n samples, in draw order. `draw(k)` returns the next k prompts of the data.
    `generate`: a --custom-generate-function-path hook called per sample with `hook_args` (engine/rollout/hooks.py).
    `partial` (--partial-rollout): samples aborted by a pause are continued, and the buffer records how far every
    sample got (it may start non-empty: a resumed run's samples from the checkpoint). `sample_hooks`
    (--rollout-sample-hook-path): (path, fn) applied to each generated sample before its reward, with `hook_args`.
    `routed_experts` (--use-rollout-routing-replay): every /generate asks for the experts each token was routed to,
    kept in Sample.rollout_routed_experts."""
    round_size = round_size or batch_size
    nonce = uuid.uuid4().hex[:6]  # rids of a redone rollout never collide with a previous attempt's
    deadline = time.monotonic() + timeout_s
    kept: list[list[Sample]] = []
    every: list[list[Sample]] = []  # kept and filtered, in draw order (--rollout-all-samples-process-path)
    stats = {"drawn": 0, "filtered": 0, "aborted": 0, "rounds": 0, "retried_requests": 0}
    if partial is not None:
        stats["continued"] = 0
    while len(kept) < batch_size:
        if max_prompts is not None and stats["drawn"] >= max_prompts:
            raise DiagnosisError(Diagnosis(
                code="DATA", severity="error",
                what=f"rollout {rollout_id}: the dynamic filter kept {len(kept)} of {batch_size} groups after "
                     f"drawing {stats['drawn']} prompts (the whole dataset)",
                fix="relax --dynamic-sampling-filter-path, or lower --rollout-batch-size",
                facts={"kept": len(kept), "drawn": stats["drawn"]}))
        prompts = draw(round_size)
        rnd = _Round(prompts, first_draw=stats["drawn"], needed=batch_size - len(kept), rollout_id=rollout_id,
                     nonce=nonce, n=n, params=params, seed=seed, engines=engines, reward_model=reward_model,
                     keep=keep, concurrency=concurrency, generate=generate, hook_args=hook_args, hook_path=hook_path,
                     partial=partial, sample_hooks=sample_hooks, routed_experts=routed_experts)
        left = deadline - time.monotonic()
        run_on_rollout_loop(lambda client: rnd.run(client, left), getattr(engines, "api_key", None))
        finished = [g for g in range(rnd.cutoff) if rnd.done[g] is not None]
        kept += [rnd.done[g] for g in finished if rnd.kept[g]]
        every += [rnd.done[g] for g in finished]
        stats["drawn"] += len(prompts)
        stats["filtered"] += sum(not rnd.kept[g] for g in finished)
        stats["aborted"] += len(prompts) - rnd.cutoff
        stats["rounds"] += 1
        stats["retried_requests"] += rnd.retries
        if partial is not None:
            stats["continued"] += rnd.continued
    for gi, group in enumerate(kept):  # positions in the returned rollout
        for j, s in enumerate(group):
            s.group_index, s.index = gi, gi * n + j
    samples = [s for g in kept for s in g]
    if samples and all(s.status in (Status.FAILED, Status.ABORTED) for s in samples):
        reasons = sorted({str(s.metadata.get("failure") or s.metadata.get("finish_reason")) for s in samples})
        raise NothingToTrain(f"rollout {rollout_id}: all {len(samples)} samples failed or were aborted, nothing to "
                             f"train on; reasons: {reasons[:3]}")
    return RolloutResult(kept, {k: float(v) for k, v in stats.items()}, every)


def _quantile(xs: list[int], q: float) -> float:
    """The q-quantile of xs, linear between order statistics (numpy's default); 0 for no samples."""
    if not xs:
        return 0.0
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return float(ys[lo] + (ys[hi] - ys[lo]) * (pos - lo))


def rollout_metrics(result: RolloutResult, seconds: float) -> dict[str, float]:
    samples = [s for g in result.groups for s in g]
    rewards = [s.scalar_reward for s in samples]
    lens = [s.response_length for s in samples]
    n = max(len(samples), 1)
    mean = sum(rewards) / n
    out = {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/response_len_mean": sum(lens) / n,
        "rollout/response_len_max": float(max(lens, default=0)),
        **{f"rollout/response_len_p{q}": _quantile(lens, q / 100) for q in (10, 50, 90)},
        "rollout/truncated_share": sum(s.status == Status.TRUNCATED for s in samples) / n,
        "rollout/failed_share": sum(s.status in (Status.FAILED, Status.ABORTED) for s in samples) / n,
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": sum(lens) / max(seconds, 1e-9),
        "rollout/groups_drawn": result.stats["drawn"],
        "rollout/groups_filtered": result.stats["filtered"],
        "rollout/groups_aborted": result.stats["aborted"],
        "rollout/retried_requests": result.stats["retried_requests"],
        **({"rollout/continued_samples": result.stats["continued"]} if "continued" in result.stats else {}),
    }
    keys = {k for s in samples if isinstance(s.reward, dict) for k in s.reward}
    for k in sorted(keys):
        vals = [float(s.reward[k]) for s in samples if isinstance(s.reward, dict) and k in s.reward]
        out[f"rollout/reward_{k}_mean"] = sum(vals) / max(len(vals), 1)
    return out
