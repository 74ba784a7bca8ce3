"""Batched sampling over a transformers causal LM, with per-token log-probs, stops and abort.

One call generates a whole batch with a KV cache: prompts are left-padded, positions come from the attention
mask, and each row has its own temperature / top-p / top-k / stop set / max_new_tokens / seed. The log-prob
returned for a token is log softmax(logits / T) of the full vocabulary (T = 1 when greedy), i.e. the
quantity the trainer recomputes, so the train–inference mismatch is only numerical.
"""
from __future__ import annotations

import inspect
import threading
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


@dataclass
class GenResult:
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    text: str
    prompt_tokens: int


def _cache_of(out) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


class Generator:
    """Owns the served model; `generate` is called from one thread at a time (the scheduler's)."""

    def __init__(self, model, tokenizer, eos_ids: list[int], device: str = "cpu"):
        self.model, self.tokenizer, self.eos_ids, self.device = model, tokenizer, list(eos_ids), device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        self.aborted: set[str] = set()
        self.abort_all = False
        self.lock = threading.Lock()  # weight updates vs generation
        # transformers ≥ 5.2x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def abort(self, rid: str | None) -> None:
        if rid:
            self.aborted.add(rid)
        else:
            self.abort_all = True

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    @torch.no_grad()
    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        with self.lock:
            self.abort_all = False
            return self._generate(reqs)

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
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=self.device)
        gens = [torch.Generator().manual_seed(r.seed) if r.seed is not None else None for r in reqs]
        stop_ids = [set(r.stop_token_ids) | (set() if r.ignore_eos else set(self.eos_ids)) for r in reqs]
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_lp: list[list[float]] = [[] for _ in reqs]
        finish: list[dict[str, Any] | None] = [None] * b
        max_new = max(r.max_new_tokens for r in reqs)

        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        past, logits = _cache_of(out), out.logits[:, -1, :].float()  # [b, V]
        last_pos = pos[:, -1]
        for step in range(max_new):
            toks = self._sample(logits, temps, reqs, gens)  # [b]
            greedy = temps == 0
            scaled = torch.where(greedy[:, None], logits, logits / temps.clamp(min=1e-6)[:, None])
            lps = torch.log_softmax(scaled, dim=-1).gather(-1, toks[:, None]).squeeze(-1)  # [b]
            for i, r in enumerate(reqs):
                if finish[i] is not None:
                    continue
                if self.abort_all or r.rid in self.aborted:
                    finish[i] = {"type": "abort", "message": "aborted by /abort_request"}
                    continue
                t = int(toks[i])
                out_ids[i].append(t)
                out_lp[i].append(float(lps[i]))
                if t in stop_ids[i]:
                    finish[i] = {"type": "stop", "matched": t}
                elif r.stop and (hit := self._stop_string(out_ids[i], r)):
                    finish[i] = {"type": "stop", "matched": hit}
                elif len(out_ids[i]) >= r.max_new_tokens:
                    finish[i] = {"type": "length", "length": r.max_new_tokens}
            if all(f is not None for f in finish):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=toks[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                             use_cache=True, **{self._cache_kw: past})
            past, logits = _cache_of(out), out.logits[:, -1, :].float()
        for rid in [r.rid for r in reqs]:
            self.aborted.discard(rid)
        return [self._result(r, out_ids[i], out_lp[i], finish[i] or {"type": "abort"}) for i, r in enumerate(reqs)]

    def _sample(self, logits: torch.Tensor, temps: torch.Tensor, reqs: list[GenRequest],
                gens: list[torch.Generator | None]) -> torch.Tensor:
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

    def _result(self, r: GenRequest, ids: list[int], lps: list[float], finish: dict[str, Any]) -> GenResult:
        text = self._decode(ids, r.skip_special_tokens)
        matched = finish.get("matched")
        if isinstance(matched, str) and not r.no_stop_trim:
            text = text[: text.find(matched)]
        return GenResult(r.rid, ids, lps, finish, text, len(r.input_ids))
