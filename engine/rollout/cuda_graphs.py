"""The built-in engine's decode step on a GPU: a preallocated KV cache and CUDA graphs per batch shape.

Eager decoding launches every op of every layer from Python each step, and a cache that grows by `torch.cat`
reallocates (measured on an H200, 0.5B shape, batch 64: ~19-24 ms a step, ~70-90× the HBM floor, bench/results/
gpu_engine_decode.md). Here a batch runs in four parts:

1. a `SlotCache` holds K/V for every layer at fixed addresses: [B, H_kv, L, D] per layer, written at the slots the
   step names (`index_copy_` with a device tensor), read up to the current span with a mask;
2. the prompt's prefill runs eagerly into it (left padding; a [B, 1, P, span] mask: causal, padding left out);
3. the first token is drawn from the prefill's logits as before (engine/rollout/sampling.py);
4. every later step is one replay of a CUDA graph that marks the new slot valid, runs the model on the last
   tokens, draws the next ones with the counter-based sampler (step number on the device), computes their
   log-probs and advances its own counters. Attention reads the slots written so far, rounded up to a multiple
   of 256: one graph per such span, so a step's attention costs what the length so far needs, not the cache's
   full length (measured: a full-length read made a 1,024-token RL rollout 1.9× slower than eager). The host
   reads back tokens and log-probs once a step (stop tokens, stop strings, aborts and max_new_tokens stay on the
   host, as in the eager loop).

Graph sets are keyed by (rows bucket, cache length bucket, the batch's filter shape): rows round up to a power of
two (padding rows decode alongside and are dropped), the cache length to a multiple of 256; the two most recent
shapes are kept, and all are dropped when the weights move (a release of GPU memory re-allocates them). The model
is driven through its ordinary forward with a 4D mask (transformers uses a 4D mask as given) and a cache object
whose `update` writes at the step's slot, so no transformers internals are patched.

Same draws as the eager path: the uniforms are a function of (row seed, step) only and the filters are the same
code, so a row's tokens depend on the logits alone; the logits differ from the eager path's by float rounding
(attention over a masked span of a preallocated cache instead of a growing one).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine.rollout.sampling import counter_uniform, sample_tokens

#: cache lengths are rounded up to a multiple of this (fewer graphs; the masked tail costs little)
LEN_BUCKET = 256
#: graphs (and their caches) kept per engine
KEEP = 2


def rows_bucket(b: int) -> int:
    return 1 << max(0, (b - 1).bit_length())


def len_bucket(n: int) -> int:
    return -(-n // LEN_BUCKET) * LEN_BUCKET


try:  # transformers checks isinstance(cache, Cache) in places; the class is only a marker here
    from transformers.cache_utils import Cache as _CacheBase
except Exception:  # pragma: no cover - transformers without cache_utils
    _CacheBase = object


class SlotCache(_CacheBase):
    """K/V of every layer at fixed addresses; `update` writes at `self.write` (a device tensor of slots)."""

    def __init__(self, layers: int, rows: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        self.layers = []  # (transformers' Cache keeps its layers here; none of its methods are used)
        self.k = [torch.zeros(rows, kv_heads, length, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.write = torch.zeros(1, dtype=torch.long, device=device)
        self.span = length  # attention reads slots [0, span): a graph per span keeps its cost ∝ the length so far

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.k[layer_idx].index_copy_(2, self.write, key_states)
        self.v[layer_idx].index_copy_(2, self.write, value_states)
        return self.k[layer_idx][:, :, :self.span], self.v[layer_idx][:, :, :self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only used when positions are not given (never here)
        raise NotImplementedError("SlotCache: pass position_ids")


@dataclass
class _Graph:
    rows: int
    length: int
    cache: SlotCache
    valid: torch.Tensor  # [B, L] bool: slots a query may attend to
    ids: torch.Tensor  # [B, 1] the last tokens
    pos: torch.Tensor  # [B, 1] their positions
    slot: torch.Tensor  # [1] the slot they are written to
    step: torch.Tensor  # [1] the sampler's step number
    seeds: torch.Tensor  # [B]
    temperature: torch.Tensor  # [B] (0 = greedy)
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    out_tokens: torch.Tensor  # [B]
    out_logprobs: torch.Tensor  # [B]
    graphs: dict = None  # span → the CUDA graph of a step that attends over slots [0, span)
    pool: Any = None  # one memory pool for all of them (they never run at once)


class GraphDecoder:
    """Prefill eagerly, then decode by replaying a captured step (see the module docstring)."""

    def __init__(self, model, cache_kw: str, capture: bool = True, compile: bool = False):
        """capture=False runs the same steps eagerly over the same cache (the CPU tests of this logic); compile:
        the decode step's model call goes through torch.compile first (fused kernels inside the graph; SGLang's
        --enable-torch-compile), compiled once per batch shape."""
        cfg = model.config
        self.model, self.cache_kw, self.capture = model, cache_kw, capture
        self.step_model = torch.compile(model, dynamic=False) if compile else model
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.captures = 0  # graphs captured so far (tests, the benchmark)
        self._weights: tuple[int, ...] = ()  # the parameters' addresses the graphs were captured with

    def clear(self) -> None:
        """Drop every graph and its cache (their memory goes back to the allocator). A graph reads the weights at
        the addresses it was captured with: /release_memory_occupation moves them, so it clears first."""
        self.graphs.clear()
        self._current = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _addresses(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    @staticmethod
    def filters(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> tuple[bool, int, bool]:
        """The batch's filter shape, fixed in a graph: (any top-k, the largest k, any top-p)."""
        use_k = (top_k > 0) & (top_k < vocab)
        any_k = bool(use_k.any())
        return any_k, int(top_k[use_k].max()) if any_k else 0, bool((top_p < 1).any())

    def _model(self, g: _Graph, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, model=None
               ) -> torch.Tensor:
        out = (self.model if model is None else model)(input_ids=ids, position_ids=pos, attention_mask=mask,
                                                       use_cache=True, logits_to_keep=1, **{self.cache_kw: g.cache})
        return out.logits[:, -1, :].float()  # [B, V]

    @staticmethod
    def _draw(g: _Graph, logits: torch.Tensor, step: int | torch.Tensor, flt: tuple[bool, int, bool]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B] drawn from logits [B, V] at `step`, and their log-probs at each row's temperature."""
        toks = sample_tokens(logits, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                             uniforms=counter_uniform(g.seeds, step), filters=flt)
        temps = torch.where(g.temperature > 0, g.temperature, torch.ones_like(g.temperature))
        return toks, torch.log_softmax(logits / temps[:, None], dim=-1).gather(-1, toks[:, None]).squeeze(-1)

    def _step(self, g: _Graph, flt: tuple[bool, int, bool], span: int) -> None:
        """One decode step on the graph's buffers, attending over slots [0, span) (what a graph records)."""
        g.valid.index_fill_(1, g.slot, True)
        g.cache.write, g.cache.span = g.slot, span
        logits = self._model(g, g.ids, g.pos, g.valid[:, None, None, :span], self.step_model)
        toks, lps = self._draw(g, logits, g.step, flt)
        g.out_tokens.copy_(toks)
        g.out_logprobs.copy_(lps)
        g.ids.copy_(toks[:, None])
        g.pos.add_(1)
        g.slot.add_(1)
        g.step.add_(1)

    def _graph(self, rows: int, length: int, flt: tuple[bool, int, bool]) -> _Graph:
        weights = self._addresses()
        if weights != self._weights:  # weights moved (released and resumed, or replaced): recapture everything
            self.clear()
            self._weights = weights
        key = (rows, length, flt)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        while len(self.graphs) >= KEEP:  # free the oldest shape's cache and graph first
            self.graphs.popitem(last=False)
            torch.cuda.empty_cache()
        dev, z = self.device, lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=self.device)
        g = _Graph(rows=rows, length=length,
                   cache=SlotCache(self.layers, rows, self.kv_heads, length, self.head_dim, self.dtype, dev),
                   valid=z(rows, length, dt=torch.bool), ids=z(rows, 1), pos=z(rows, 1), slot=z(1), step=z(1),
                   seeds=z(rows), temperature=torch.ones(rows, device=dev), top_p=torch.ones(rows, device=dev),
                   top_k=z(rows) - 1, out_tokens=z(rows), out_logprobs=z(rows, dt=torch.float32))
        g.valid[:, 0] = True
        g.graphs = {}
        if not self.capture:
            self.graphs[key] = g
            return g
        # one graph per span, all captured now (the buffers are reset per batch; a warm-up writes the cache at the
        # slot it is given, a slot every real step writes before it reads it)
        g.pool = torch.cuda.graph_pool_handle()
        for span in range(LEN_BUCKET, length + 1, LEN_BUCKET):
            g.slot.fill_(span - 1)
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(2):  # warm-up off the capture (allocator, kernels)
                    g.slot.fill_(span - 1)
                    self._step(g, flt, span)
            torch.cuda.current_stream(dev).wait_stream(side)
            g.slot.fill_(span - 1)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=g.pool), torch.no_grad():
                self._step(g, flt, span)
            g.graphs[span] = graph
            self.captures += 1
        self.graphs[key] = g
        return g

    @torch.no_grad()
    def start(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, *, seeds: torch.Tensor,
              temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, max_new: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill b left-padded prompts (ids, mask, pos: [b, P]) and draw step 0; returns its tokens and
        log-probs [b]. Then `next()` gives each further step's."""
        b, P = ids.shape
        V = int(self.model.config.vocab_size)
        flt = self.filters(top_k, top_p, V)
        rows, length = rows_bucket(b), len_bucket(P + max_new)
        g = self._graph(rows, length, flt)
        pad = rows - b

        def rowpad(x: torch.Tensor, fill) -> torch.Tensor:
            return torch.cat([x, torch.full((pad, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)]) if pad \
                else x

        ids_p, pos_p = rowpad(ids, 0), rowpad(pos, 0)
        mask_p = rowpad(mask, 0)
        if pad:
            mask_p[b:, -1] = 1  # padding rows: one real token each (no row without a key to attend to)
        real = mask_p.bool()  # [B, P]
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        prefill = causal[None] & real[:, None, :]  # [B, P(query), P(key)]
        prefill |= torch.eye(P, dtype=torch.bool, device=ids.device)[None]  # pad queries see themselves
        span = len_bucket(P)
        full = torch.zeros(rows, 1, P, span, dtype=torch.bool, device=ids.device)
        full[:, 0, :, :P] = prefill
        g.cache.write, g.cache.span = torch.arange(P, device=ids.device), span
        logits = self._model(g, ids_p, pos_p, full)  # [B, V]
        g.valid.zero_()
        g.valid[:, :P] = real
        g.seeds.copy_(rowpad(seeds, 0))
        g.temperature.copy_(rowpad(temperature, 1.0))
        g.top_p.copy_(rowpad(top_p, 1.0))
        g.top_k.copy_(rowpad(top_k, -1))
        toks, lps = self._draw(g, logits, 0, flt)
        g.ids.copy_(toks[:, None])
        g.pos.copy_(pos_p[:, -1:] + 1)
        g.slot.fill_(P)
        g.step.fill_(1)
        self._current, self._b, self._slot, self._flt = g, b, P, flt  # _slot: the host's copy of g.slot
        return toks[:b], lps[:b]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's tokens and log-probs [b] (views of the graph's buffers: read them before next())."""
        g = self._current
        if self._slot >= g.length:  # callers stop at max_new_tokens, which the cache length covers
            raise RuntimeError(f"CUDA-graph decode past its cache length {g.length}")
        span = len_bucket(self._slot + 1)  # covers the slot this step writes
        self._slot += 1
        if span not in g.graphs:  # capture=False (the CPU tests): the same step, eagerly
            with torch.no_grad():
                self._step(g, self._flt, span)
        else:
            g.graphs[span].replay()
        return g.out_tokens[:self._b], g.out_logprobs[:self._b]
