"""Batched sampling over a transformers causal LM, with per-token log-probs, stops and abort.

One call generates a whole batch with a KV cache: prompts are left-padded, positions come from the attention
mask, and each row has its own temperature / top-p / top-k / stop set / max_new_tokens / seed. The log-prob
returned for a token is log softmax(logits / T) of the full vocabulary (T = 1 when greedy), i.e. the
quantity the trainer recomputes, so the train–inference mismatch is only numerical. That is also what SGLang
returns by default (post-temperature, before top-k / top-p filtering).

Invariants (tests/test_engine_server.py):
- a row stops at the first token in its stop set (EOS ∪ stop_token_ids, EOS left out with ignore_eos) or at the
  first token whose decoded output contains a stop string; the stopping token stays in `output_ids`;
- `max_new_tokens = 0` runs the prefill only (scoring: `input_logprobs` from `logprob_start_len`);
- an aborted rid (exact or by prefix, as SGLang's `/abort_request`) stops at the next step with what it has.

Batch composition changes the floating-point reductions of a row (padding, matmul blocking): measured on the
bundled model, a row's log-probs move by up to ~1.4e-5 between "alone" and "in a batch of 38", which can flip a
sampled token with probability ~1e-5 per token. Per-row seeds make a row reproducible only for a fixed batch.

Sampling: on the CPU each row draws from its own torch.Generator (the results every CPU run and test has recorded);
on a GPU the whole batch draws at once from counter-based noise keyed by (row seed, step) (engine/rollout/
sampling.py), and the prefill computes logits of the last prompt position only unless prompt log-probs are asked.
On CUDA the decode steps replay CUDA graphs over a preallocated cache (engine/rollout/cuda_graphs.py) unless
`cuda_graphs=False` (SGLang's --disable-cuda-graph) or the batch asks for prompt log-probs.
"""
from __future__ import annotations

import inspect
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch


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


def _cache_of(out) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


class AbortBook:
    """Which rids are live (queued or running) and which of them were aborted; shared by the HTTP thread and the
    generation thread. An abort only affects rids live at that moment, like SGLang's scheduler (prefix match)."""

    def __init__(self) -> None:
        self._live: set[str] = set()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()

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

    def is_aborted(self, rid: str) -> bool:
        return rid in self._aborted


class Generator:
    """Owns the served model; `generate` is called from one thread at a time (the scheduler's)."""

    def __init__(self, model, tokenizer, eos_ids: list[int], device: str = "cpu", cuda_graphs: bool = True,
                 compile_decode: bool = False):
        self.model, self.tokenizer, self.eos_ids, self.device = model, tokenizer, list(eos_ids), device
        self.on_gpu = not str(device).startswith("cpu")
        # on CUDA: decode through captured graphs over a preallocated cache (engine/rollout/cuda_graphs.py), unless
        # SGLang's --disable-cuda-graph says otherwise; batches that ask for prompt log-probs run eagerly
        self.cuda_graphs = bool(cuda_graphs and str(device).startswith("cuda"))
        self.graphs = None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        self.aborts = AbortBook()
        self.lock = threading.Lock()  # weight updates vs generation
        self.version = "default"  # SGLang's weight_version of the served weights (set under `lock`)
        self.busy_since: float | None = None  # monotonic time the running batch started (None: idle)
        self.last_step = 0.0  # monotonic time of the last decode step (the server's watchdog reads it)
        # transformers ≥ 5.2x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        if self.cuda_graphs:
            from engine.rollout.cuda_graphs import GraphDecoder

            self.graphs = GraphDecoder(model, self._cache_kw, compile=compile_decode)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    @torch.no_grad()
    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        with self.lock:
            self.busy_since = time.monotonic()
            try:
                out = self._generate(reqs)
                for r in out:
                    r.weight_version = self.version
                return out
            finally:
                self.busy_since = None

    def _generate(self, reqs: list[GenRequest]) -> list[GenResult]:
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
        if self.on_gpu:  # one counter-based draw per row and step (sampling.py); unseeded rows get a random seed
            seeds = torch.tensor([r.seed if r.seed is not None else random.getrandbits(62) for r in reqs],
                                 dtype=torch.long, device=self.device)
            knobs = {"temperature": torch.tensor([r.temperature for r in reqs], device=self.device),
                     "top_p": torch.tensor([r.top_p for r in reqs], device=self.device),
                     "top_k": torch.tensor([r.top_k for r in reqs], device=self.device)}
        else:
            gens = [torch.Generator().manual_seed(r.seed) if r.seed is not None else None for r in reqs]
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
        graphs = self.graphs if self.graphs is not None and not prompt_lps else None
        if graphs is not None:  # prefill into the graph's cache and draw step 0; later steps replay the graph
            toks, lps = graphs.start(ids, mask, pos, seeds=seeds, max_new=max(r.max_new_tokens for r in reqs),
                                     **knobs)
            input_lps = [None] * b
        else:
            keep = {"logits_to_keep": 1} if self.on_gpu and not prompt_lps else {}
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **keep)
            all_logits = out.logits.float()  # [b, P, V] (or [b, 1, V])
            input_lps = [self._input_logprobs(all_logits[i], r, plen, float(temps[i])) for i, r in enumerate(reqs)]
            past, logits = _cache_of(out), all_logits[:, -1, :]  # [b, V]
            last_pos = pos[:, -1]
        step = 0
        longest = max(r.max_new_tokens for r in reqs)
        while not all(f is not None for f in finish):
            if graphs is not None:
                # this step's tokens on the host; the next step is launched before the host reads them (stops,
                # aborts), so the GPU decodes while the host works
                toks_l, lps_l = graphs.collect() if step else torch.stack([toks.double(), lps.double()]).tolist()
                if step + 1 < longest:
                    graphs.launch()
            elif self.on_gpu:
                from engine.rollout.sampling import counter_uniform, sample_tokens

                toks = sample_tokens(logits, uniforms=counter_uniform(seeds, step), **knobs)  # [b]
            else:
                toks = self._sample(logits, reqs, gens)  # [b]
            step += 1
            self.last_step = time.monotonic()
            if graphs is None:
                lps = torch.log_softmax(logits / temps[:, None], dim=-1).gather(-1, toks[:, None]).squeeze(-1)
                # one device → host copy per step (not one per row)
                toks_l, lps_l = torch.stack([toks.double(), lps.double()]).tolist()
            for i, r in enumerate(reqs):
                if finish[i] is not None:
                    continue
                if self.aborts.is_aborted(r.rid):
                    finish[i] = {"type": "abort", "message": "aborted by /abort_request"}
                    continue
                t = int(toks_l[i])
                out_ids[i].append(t)
                out_lp[i].append(lps_l[i])
                if t in stop_ids[i]:
                    finish[i] = {"type": "stop", "matched": t}
                elif r.stop and (hit := self._stop_string(out_ids[i], r)):
                    finish[i] = {"type": "stop", "matched": hit}
                elif len(out_ids[i]) >= r.max_new_tokens:
                    finish[i] = {"type": "length", "length": r.max_new_tokens}
            if all(f is not None for f in finish) or graphs is not None:
                continue
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=toks[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                             use_cache=True, **{self._cache_kw: past})
            past, logits = _cache_of(out), out.logits[:, -1, :].float()
        if graphs is not None:
            graphs.settle()  # a step launched for rows that all stopped meanwhile: done before the lock is released
        return [self._result(r, out_ids[i], out_lp[i], finish[i], input_lps[i]) for i, r in enumerate(reqs)]

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

    def _sample(self, logits: torch.Tensor, reqs: list[GenRequest], gens: list[torch.Generator | None]) -> torch.Tensor:
        toks = logits.argmax(-1)
        for i, r in enumerate(reqs):
            if r.temperature == 0:
                continue
            row = logits[i] / r.temperature
            if r.top_k > 0:
                kth = torch.topk(row, min(r.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, -1)
            if r.top_p < 1.0:
                sp, si = probs.sort(descending=True)
                drop = sp.cumsum(-1) - sp > r.top_p  # keep the smallest prefix with mass >= top_p
                probs = probs.scatter(0, si, sp.masked_fill(drop, 0.0))
                probs = probs / probs.sum()
            toks[i] = torch.multinomial(probs.cpu(), 1, generator=gens[i]).to(toks.device)[0]
        return toks

    def _stop_string(self, ids: list[int], r: GenRequest) -> str | None:
        text = self._decode(ids, r.skip_special_tokens)
        return next((s for s in r.stop if s in text), None)

    def _result(self, r: GenRequest, ids: list[int], lps: list[float], finish: dict[str, Any],
                input_lps: list[float | None] | None) -> GenResult:
        text = self._decode(ids, r.skip_special_tokens)
        matched = finish.get("matched")
        if isinstance(matched, str) and not r.no_stop_trim:
            text = text[: text.find(matched)]
        return GenResult(r.rid, ids, lps, finish, text, len(r.input_ids), input_lps,
                         max(r.logprob_start_len, 0), list(r.input_ids))
