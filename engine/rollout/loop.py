"""One rollout: B prompts × n samples on the engines, rewards, and the rollout's metrics.

Each group (one prompt, n samples) is one batched `/generate` request; groups are spread over the engines by
least outstanding requests, at most `concurrency` samples in flight. Every sample carries its own sampling seed
(seed, rollout_id, index), so a redone rollout samples the same tokens given the same weights and batch.

The batch is the catch: the built-in engine merges requests that arrive within a few ms, and which ones meet
depends on timing, so padding and batched matmuls (and from there sampled tokens) can differ between two runs.
`deterministic=True` sends each engine ONE request holding its contiguous share of the groups (groups 0..k-1 to
engine 0, …), so a redone rollout meets exactly the same batch: what bitwise-equal resume needs.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.data import PromptRow
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

    def to_sglang(self, seed: int | None) -> dict[str, Any]:
        d: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                             "top_p": self.top_p, "top_k": self.top_k, "skip_special_tokens": True}
        if self.stop:
            d["stop"] = list(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if seed is not None:
            d["sampling_seed"] = seed
        return d


def sample_seed(seed: int, rollout_id: int, index: int) -> int:
    h = hashlib.sha256(f"{seed}:{rollout_id}:{index}".encode()).digest()
    return int.from_bytes(h[:4], "little")


_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class RolloutTimeout(TimeoutError):
    """The rollout did not finish within --rollout-timeout (retryable)."""


def split_in_order(num_groups: int, num_engines: int) -> list[range]:
    """Contiguous group ranges per engine, sizes differing by at most one: 10 groups, 3 engines → 4, 3, 3."""
    q, r = divmod(num_groups, num_engines)
    starts = [e * q + min(e, r) for e in range(num_engines + 1)]
    return [range(starts[e], starts[e + 1]) for e in range(num_engines)]


async def _generate_per_engine(urls: list[str], prompts: list[list[int]], n: int, params: SamplingParams,
                               seeds: list[list[int | None]], timeout_s: float) -> list[list[dict]]:
    """One batched request per engine with its contiguous share of the groups (deterministic batches)."""
    async def one(client: httpx.AsyncClient, url: str, groups: range) -> list[dict]:
        if not groups:
            return []
        body = {"input_ids": [prompts[gi] for gi in groups for _ in range(n)], "return_logprob": True,
                "sampling_params": [params.to_sglang(s) for gi in groups for s in seeds[gi]]}
        r = await client.post(url + "/generate", json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"{url}/generate → HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    shares = split_in_order(len(prompts), len(urls))
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            flat = await asyncio.wait_for(asyncio.gather(*[one(client, u, g) for u, g in zip(urls, shares)]),
                                          timeout_s)
        except asyncio.TimeoutError:
            raise RolloutTimeout(f"rollout did not finish within {timeout_s:.0f}s (--rollout-timeout) on "
                                 f"engines {urls}") from None
    outs = [o for part in flat for o in part]  # [groups·n] in group order
    return [outs[gi * n:(gi + 1) * n] for gi in range(len(prompts))]


async def _generate_groups(urls: list[str], prompts: list[list[int]], n: int, params: SamplingParams,
                           seeds: list[list[int | None]], concurrency: int, timeout_s: float) -> list[list[dict]]:
    outstanding = {u: 0 for u in urls}
    sem = asyncio.Semaphore(max(1, concurrency // max(n, 1)))

    async def one(client: httpx.AsyncClient, gi: int) -> list[dict]:
        async with sem:
            url = min(outstanding, key=outstanding.get)  # least outstanding requests
            outstanding[url] += n
            try:
                body = {"input_ids": [prompts[gi]] * n, "return_logprob": True,
                        "sampling_params": [params.to_sglang(s) for s in seeds[gi]]}
                r = await client.post(url + "/generate", json=body)
                if r.status_code >= 400:
                    raise RuntimeError(f"{url}/generate → HTTP {r.status_code}: {r.text[:300]}")
                return r.json()
            finally:
                outstanding[url] -= n

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        tasks = [one(client, gi) for gi in range(len(prompts))]
        try:
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        except asyncio.TimeoutError:
            raise RolloutTimeout(f"rollout did not finish within {timeout_s:.0f}s (--rollout-timeout) on "
                                 f"engines {urls}") from None


def generate_rollout(rows: list[PromptRow], *, rollout_id: int, prompt_ids: list[list[int]], urls: list[str],
                     n: int, params: SamplingParams, reward_model: RewardModel, seed: int,
                     concurrency: int = 64, timeout_s: float = 600.0,
                     deterministic: bool = False) -> list[list[Sample]]:
    """Generate and score `len(rows)` groups of n samples; groups come back in prompt order."""
    seeds = [[sample_seed(seed, rollout_id, gi * n + j) if params.temperature > 0 else None for j in range(n)]
             for gi in range(len(rows))]
    if deterministic:
        outs = asyncio.run(_generate_per_engine(urls, prompt_ids, n, params, seeds, timeout_s))
    else:
        outs = asyncio.run(_generate_groups(urls, prompt_ids, n, params, seeds, concurrency, timeout_s))
    groups = []
    for gi, (row, pids, out) in enumerate(zip(rows, prompt_ids, outs)):
        group = []
        for j, o in enumerate(out if isinstance(out, list) else [out]):
            meta = o["meta_info"]
            triples = meta.get("output_token_logprobs") or []
            resp_ids = [int(t[1]) for t in triples] if triples else list(o.get("output_ids", []))
            group.append(Sample(
                index=gi * n + j, group_index=gi, rollout_id=rollout_id, prompt=row.prompt,
                tokens=list(pids) + resp_ids, response_length=len(resp_ids), response=o.get("text", ""),
                label=row.label, loss_mask=[1] * len(resp_ids),
                rollout_log_probs=[float(t[0]) for t in triples],
                status=_STATUS.get(meta["finish_reason"]["type"], Status.FAILED) if meta.get("finish_reason")
                else Status.FAILED,
                metadata={**row.metadata, "row": row.row, "finish_reason": meta.get("finish_reason"),
                          "weight_version": meta.get("weight_version")}))
        reward_model.score_group(group)
        groups.append(group)
    return groups


def rollout_metrics(groups: list[list[Sample]], seconds: float, max_response_len: int) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    rewards = [s.scalar_reward for s in samples]
    lens = [s.response_length for s in samples]
    n = max(len(samples), 1)
    mean = sum(rewards) / n
    out = {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/response_len_mean": sum(lens) / n,
        "rollout/response_len_max": float(max(lens, default=0)),
        "rollout/truncated_share": sum(s.status == Status.TRUNCATED for s in samples) / n,
        "rollout/failed_share": sum(s.status in (Status.FAILED, Status.ABORTED) for s in samples) / n,
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": sum(lens) / max(seconds, 1e-9),
    }
    keys = {k for s in samples if isinstance(s.reward, dict) for k in s.reward}
    for k in sorted(keys):
        vals = [float(s.reward[k]) for s in samples if isinstance(s.reward, dict) and k in s.reward]
        out[f"rollout/reward_{k}_mean"] = sum(vals) / max(len(vals), 1)
    return out


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
