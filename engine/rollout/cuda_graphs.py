"""The built-in engine's decode step on a GPU: a preallocated KV cache and CUDA graphs per batch shape.

Eager decoding launches every op of every layer from Python each step, and a cache that grows by `torch.cat`
reallocates (measured on an H200, 0.5B shape, batch 64: ~19-24 ms a step, ~70-90× the HBM floor, bench/results/
gpu_engine_decode.md). Here a batch runs in four parts:

1. a `SlotCache` holds K/V for every layer at fixed addresses: [B, H_kv, L, D] per layer, written at the slots the
   step names (`index_copy_` with a device tensor), read up to the current span with a mask;
2. the prompt's prefill runs eagerly into it (left padding; a [B, 1, P, span] mask: causal, padding left out),
   once per distinct prompt: a GRPO rollout sends each prompt n times, and the rows that share a prompt get
   copies of its K/V;
3. the first token is drawn from the prefill's logits as before (engine/rollout/sampling.py);
4. every later step is one replay of a CUDA graph that marks the new slot valid, runs the model on the last
   tokens, draws the next ones with the counter-based sampler (step number on the device), computes their
   log-probs and advances its own counters. Attention reads the slots written so far, rounded up to a multiple
   of 256: one graph per such span, so a step's attention costs what the length so far needs, not the cache's
   full length (measured: a full-length read made a 1,024-token RL rollout 1.9× slower than eager). Under
   grouped-query attention the query heads are folded onto their K/V head (`decode_attention`): K/V are read once,
   not copied per query head as transformers' sdpa does under a mask. The host reads back tokens and log-probs
   once a step, one step behind: step t+1 is launched before the host looks at step t (stop tokens, stop strings,
   aborts and max_new_tokens stay on the host, as in the eager loop).

Graph sets are keyed by (rows bucket, cache length bucket, the batch's filter shape): rows round up to a power of
two (padding rows decode alongside and are dropped), the cache length to a multiple of 256; the two most recent
shapes are kept, and all are dropped when the weights move (a release of GPU memory re-allocates them). The model
is driven through its ordinary forward with a 4D mask (transformers uses a 4D mask as given, for every layer) and a
cache object whose `update` writes at the step's slot, so no transformers internals are patched; the attention
function it registers (`decode_attention`) narrows that mask on sliding-window layers and applies Gemma 2's logit
softcapping, which transformers would have done on masks of its own.

Routed experts (SGLang's --enable-return-routed-experts, a mixture of experts): the routers' hooks
(engine.train.routing.TorchRouters) record the prefill eagerly, and inside the captured step a copy of every
router's top-k ids into a buffer of the graph ([B, #routers, k], int16); while a request of the batch asks for them,
that buffer goes to pinned host memory after each replay with the step's tokens (one small copy, no extra wait), one
slot per step, so a request's routing is read from its row at the steps it ran.

Same draws as the eager path: the uniforms are a function of (row seed, step) only and the filters are the same
code, so a row's tokens depend on the logits alone; the logits differ from the eager path's by float rounding
(attention over a masked span of a preallocated cache instead of a growing one).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine.rollout.sampling import counter_uniform, draw
from engine.train.attention import masked_rows_attention

#: cache lengths are rounded up to a multiple of this (fewer graphs; the masked tail costs little)
LEN_BUCKET = 256
#: graphs (and their caches) kept per engine
KEEP = 2
#: decode steps per host buffer of routed experts (--enable-return-routed-experts)
ROUTE_CHUNK = 64


def rows_bucket(b: int) -> int:
    return 1 << max(0, (b - 1).bit_length())


def len_bucket(n: int) -> int:
    return -(-n // LEN_BUCKET) * LEN_BUCKET


try:  # transformers checks isinstance(cache, Cache) in places; the class is only a marker here
    from transformers.cache_utils import Cache as _CacheBase
except Exception:  # pragma: no cover - transformers without cache_utils
    _CacheBase = object


#: the attention implementation the decoder switches an sdpa model to (registered with transformers), and an eager
#: one (Gemma 2: transformers runs it eagerly, having no sdpa for it, and checks any name with "sdpa" in it)
DECODE_ATTENTION = "rollflow_decode_sdpa"
DECODE_ATTENTION_EAGER = "rollflow_decode_eager"
#: what transformers' attention layers pass to the attention function that changes nothing in it (the model's
#: forward flags travel down with them: Qwen3-MoE's output_router_logits)
PLAIN_KWARGS = frozenset({"use_cache", "position_ids", "cache_position", "is_causal", "return_dict",
                          "output_attentions", "output_hidden_states", "output_router_logits"})


def decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except one query token under grouped-query attention: the query's heads are
    folded onto their key/value head ([B, H, 1, D] → [B, H_kv, H/H_kv, D]), so SDPA reads each K/V head once
    instead of a copy repeated H/H_kv times. Under a mask, transformers repeats K/V (the memory-efficient kernel
    takes no `enable_gqa`); at 512 rows × 1,280 slots that copy is ~56 GB of traffic a step on a 0.5B Qwen2 (14
    query heads on 2 K/V heads). The mask [B, 1, 1, S] broadcasts over the folded heads; the maths is unchanged.

    transformers uses the decoder's 4D masks as given, for every layer, so two things of its own masks are done here:
    a sliding-window layer (`sliding_window` W: Mistral, Gemma 2, Qwen2 with use_sliding_window) narrows the mask to
    the W slots up to each query's own (`window_mask`), and attention-logit softcapping (`softcap`, Gemma 2, whose
    transformers attention is eager) runs as transformers' eager attention does, on the bool mask. An argument that
    would change the maths in a way this function does not know is refused, naming it."""
    other = sorted(k for k, v in kwargs.items() if v is not None and k not in PLAIN_KWARGS)
    if other:
        raise NotImplementedError(f"the built-in engine's CUDA-graph decoder does not implement {type(module).__name__}"
                                  f"'s attention arguments {other}; run the engine with --sglang-disable-cuda-graph "
                                  "(transformers' own attention, eager decoding)")
    if sliding_window and attention_mask is not None and attention_mask.shape[-1] > sliding_window:
        attention_mask = window_mask(attention_mask, sliding_window)
    if softcap is not None:
        if attention_mask is None:  # transformers left the mask out: causal, the queries the last Q keys
            q_len, k_len = query.shape[2], key.shape[2]
            attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        out = masked_rows_attention(query, key, value, attention_mask, scaling, dropout, softcap)
        return out.transpose(1, 2).contiguous(), None
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups <= 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, _, d = query.shape
    q = query.reshape(b, h // groups, groups, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling)
    return out.reshape(b, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def graphs_off_reason(model) -> str | None:
    """Why a model's decode step cannot be held in a CUDA graph, where that is known before trying (None: capture
    it). A mixture of experts in float32: transformers runs its experts through torch's grouped_mm, which copies from
    the host in float32 (seen on an H100 with Qwen3-MoE; bfloat16 captures). Any other failure to capture stays an
    error naming --sglang-disable-cuda-graph."""
    c = getattr(model, "config", None)
    c = getattr(c, "text_config", None) or c
    experts = max((getattr(c, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    dtype = next(model.parameters()).dtype
    if experts and dtype == torch.float32:
        return (f"{type(model).__name__} has {experts} experts per MoE layer, which transformers runs through torch's "
                "grouped_mm: in float32 that copies from the host, which a CUDA graph cannot hold (bfloat16 captures)")
    return None


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A bool mask [B, 1, Q, K] narrowed to a sliding window: each query sees only keys in slots (its own − W, its
    own]. Its own slot is its last visible key: true of the decoder's masks (a row's slots hold its tokens in order,
    the step's own slot the last one marked valid; a prefill's mask is causal) and of transformers' causal masks,
    which already carry the window (narrowing them again changes nothing). A query that sees nothing stays so."""
    if mask.dtype != torch.bool:
        raise TypeError(f"window_mask: a bool mask (True = attend) expected, got {mask.dtype}")
    slots = torch.arange(mask.shape[-1], device=mask.device)
    own = torch.where(mask, slots, -1).amax(-1, keepdim=True)  # [B, 1, Q, 1]
    return mask & (slots > own - window)


def use_decode_attention(model) -> bool:
    """Switch an sdpa or eager model to `decode_attention` (the same results; no K/V copies in decode; windows and
    softcapping on the decoder's masks); False when the model runs another implementation (left as it is)."""
    name = {"sdpa": DECODE_ATTENTION, "eager": DECODE_ATTENTION_EAGER}.get(
        getattr(model.config, "_attn_implementation", None))
    if name is None:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, decode_attention)
    AttentionMaskInterface.register(name, sdpa_mask)  # 2D masks (the eager path) become sdpa's bool masks
    model.set_attn_implementation(name)
    return model.config._attn_implementation == name


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
    step: torch.Tensor  # [B] each row's sampler step (a row that joined later counts its own steps)
    seeds: torch.Tensor  # [B]
    temperature: torch.Tensor  # [B] (0 = greedy)
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    out_tokens: torch.Tensor  # [B]
    out_logprobs: torch.Tensor  # [B]
    routes: torch.Tensor | None = None  # [B, #routers, k] int16: the step's routed experts (a recording decoder)
    graphs: dict = None  # span → the CUDA graph of a step that attends over slots [0, span)
    pool: Any = None  # one memory pool for all of them (they never run at once)


class GraphDecoder:
    """Prefill eagerly, then decode by replaying a captured step (see the module docstring)."""

    def __init__(self, model, cache_kw: str, capture: bool = True, compile: bool = False, fold_gqa: bool = True,
                 tape=None):
        """capture=False runs the same steps eagerly over the same cache (the CPU tests of this logic); compile:
        the decode step's model call goes through torch.compile first (fused kernels inside the graph; SGLang's
        --enable-torch-compile), compiled once per batch shape; fold_gqa: switch an sdpa model to
        `decode_attention` (False: the benchmark's before/after, only for a model without sliding-window layers or
        softcapping, whose masks transformers' sdpa takes as they are); tape: engine.train.routing.TorchRouters, whose
        routers every prefill and step records (`prompt_routes`, `step_routes`)."""
        cfg = model.config
        self.model, self.cache_kw, self.capture = model, cache_kw, capture
        self.folded_gqa = use_decode_attention(model) if fold_gqa else False
        if fold_gqa and not self.folded_gqa:
            raise NotImplementedError(
                f"the built-in engine's CUDA-graph decoder drives transformers' sdpa or eager attention; "
                f"{type(model).__name__} runs {getattr(cfg, '_attn_implementation', None)!r}: run the engine with "
                "--sglang-disable-cuda-graph")
        self.step_model = torch.compile(model, dynamic=False) if compile else model
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.captures = 0  # graphs captured so far (tests, the benchmark)
        self.prefill_rows = 0  # prompt rows run through a prefill (distinct prompts only), for tests and stats
        self.joined_rows = 0  # requests put into a running batch (continuous batching), for tests and stats
        self.steps = 0  # the running (or last) batch's decode steps, and the host's time waiting for them: a batch
        self.wait_s = 0.0  # whose host waited little was bound by the host's loop, not by the GPU
        self.gpu_s = 0.0  # the GPU's time inside those steps (CUDA events): steps × step time less this is idle GPU
        self.launch_s = 0.0  # the host's time inside launch() (a graph replay should only enqueue)
        self._current: _Graph | None = None
        self._host: torch.Tensor | None = None  # [2, b] tokens and log-probs of the launched step (pinned)
        self._ready = None  # the CUDA event after its copy
        self._pending = False
        self._weights: tuple[int, ...] = ()  # the parameters' addresses the graphs were captured with
        self.tape = tape
        if tape is not None:
            self.top_k = int(getattr(cfg, "num_experts_per_tok"))
        self.prompt_routes: torch.Tensor | None = None  # host [b, P, #routers, k] of the last start() / join()
        self.launched = 0  # steps launched in the running batch: step t's routes are at slot t
        self.recording = False  # whether launch() copies the steps' routes to the host (a request asks for them)
        self._route_chunks: list[torch.Tensor] = []  # host [ROUTE_CHUNK, B, #routers, k] (pinned on a GPU)
        self._routes_of_prompts: torch.Tensor | None = None  # the last _run_prompts' [b, P, #routers, k] (device)

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

    def _model(self, cache: SlotCache, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, model=None
               ) -> torch.Tensor:
        out = (self.model if model is None else model)(input_ids=ids, position_ids=pos, attention_mask=mask,
                                                       use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        return out.logits[:, -1, :].float()  # [B, V]

    @staticmethod
    def _draw(g: _Graph, logits: torch.Tensor, step: int | torch.Tensor, flt: tuple[bool, int, bool]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B] drawn from logits [B, V] at `step`, and their log-probs at each row's temperature."""
        return draw(logits, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                    uniforms=counter_uniform(g.seeds, step), filters=flt)

    def _step(self, g: _Graph, flt: tuple[bool, int, bool], span: int) -> None:
        """One decode step on the graph's buffers, attending over slots [0, span) (what a graph records)."""
        g.valid.index_fill_(1, g.slot, True)
        g.cache.write, g.cache.span = g.slot, span
        if self.tape is None:
            logits = self._model(g.cache, g.ids, g.pos, g.valid[:, None, None, :span], self.step_model)
        else:  # (under a capture the hooks see the graph's own outputs: the copy below is part of the graph)
            with self.tape.recording() as got:
                logits = self._model(g.cache, g.ids, g.pos, g.valid[:, None, None, :span], self.step_model)
            g.routes.copy_(torch.stack(got, dim=1).view(g.rows, len(got), -1))
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
                   valid=z(rows, length, dt=torch.bool), ids=z(rows, 1), pos=z(rows, 1), slot=z(1), step=z(rows),
                   seeds=z(rows), temperature=torch.ones(rows, device=dev), top_p=torch.ones(rows, device=dev),
                   top_k=z(rows) - 1, out_tokens=z(rows), out_logprobs=z(rows, dt=torch.float32),
                   routes=None if self.tape is None else z(rows, len(self.tape.routers), self.top_k, dt=torch.int16))
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
            try:
                with torch.cuda.graph(graph, pool=g.pool), torch.no_grad():
                    self._step(g, flt, span)
            except RuntimeError as e:  # a forward that syncs with the host (SGLang stops the same way)
                raise RuntimeError(
                    f"the built-in engine could not capture {type(self.model).__name__}'s decode step in a CUDA graph "
                    f"({self.dtype}, {rows} rows): {str(e).splitlines()[0]}; run the engine with "
                    "--sglang-disable-cuda-graph (eager decoding)") from e
            g.graphs[span] = graph
            self.captures += 1
        self.graphs[key] = g
        return g

    @torch.no_grad()
    def start(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, *, seeds: torch.Tensor,
              temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, max_new: int, min_rows: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill b left-padded prompts (ids, mask, pos: [b, P]) and draw step 0; returns its tokens and
        log-probs [b]. Then `launch()` and `collect()` give each further step's. The graph has at least `min_rows`
        rows (room for requests that join later; a step costs about the same up to ~64 rows)."""
        b, P = ids.shape
        V = int(self.model.config.vocab_size)
        flt = self.filters(top_k, top_p, V)
        rows, length = rows_bucket(max(b, min_rows)), len_bucket(P + max_new)
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
        logits = self._prefill(g, ids_p, pos_p, real)  # [B, V]
        if self.tape is not None:
            self.prompt_routes = self._routes_of_prompts[:b].to("cpu", torch.int16)
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
        self.steps, self.wait_s, self.gpu_s, self.launch_s = 0, 0.0, 0.0, 0.0
        self._pending = False
        self.launched, self.recording = 0, False
        return toks[:b], lps[:b]

    @property
    def rows(self) -> int:
        """Rows of the running batch's graph (free ones included: padding rows, rows whose request finished)."""
        return self._current.rows

    def can_join(self, prompt_len: int, max_new: int, top_k: int, top_p: float) -> bool:
        """Whether a request fits the running batch now (continuous batching): its prompt goes into the slots just
        before the one the next step writes, so it must be no longer than that slot; its tokens are written at the
        following slots, which the batch's cache must hold; and its filters must be ones the graph was captured
        with (top-k at most the graph's largest k; top-p only in a graph that has it)."""
        g = self._current
        if g is None or prompt_len > self._slot or self._slot + max_new - 1 > g.length:
            return False
        any_k, kmax, any_p = self._flt
        V = int(self.model.config.vocab_size)
        if 0 < top_k < V and not (any_k and top_k <= kmax):
            return False
        return top_p >= 1 or any_p

    @torch.no_grad()
    def join(self, rows: list[int], prompts: list[list[int]], *, seeds: torch.Tensor, temperature: torch.Tensor,
             top_p: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put new requests into free rows of the running batch (each passed `can_join`): prefill their prompts
        (left-padded to P, once per call) and copy the K/V into slots [s - P, s) of their rows, s being the slot
        the next step writes; the rows attend to their own prompt's slots only. Their first token is drawn here at
        step 0 of their own counters, so a row draws what it would have drawn in a batch of its own (up to the
        float rounding of a different batch). Returns those tokens and log-probs [k].

        A step launched before this call (launch-ahead) still runs on the rows' old contents: it is queued first on
        the same stream, and these writes follow it; the caller ignores that step's outputs for these rows."""
        g, dev = self._current, self.device
        k, P = len(rows), max(len(p) for p in prompts)
        s = self._slot
        ids = torch.full((k, P), 0, dtype=torch.long)
        mask = torch.zeros((k, P), dtype=torch.long)
        for j, p in enumerate(prompts):  # left padding, as a batch's own prompts
            ids[j, P - len(p):] = torch.tensor(p)
            mask[j, P - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        real = mask.bool()
        into = SlotCache(self.layers, k, self.kv_heads, len_bucket(P), self.head_dim, self.dtype, dev)
        logits = self._run_prompts(into, ids, pos, real)  # [k, V]
        if self.tape is not None:
            self.prompt_routes = self._routes_of_prompts.to("cpu", torch.int16)
        r = torch.tensor(rows, device=dev)
        for gk, gv, uk, uv in zip(g.cache.k, g.cache.v, into.k, into.v):
            gk[r, :, s - P:s] = uk[:, :, :P]  # padding positions land on slots the row does not attend to
            gv[r, :, s - P:s] = uv[:, :, :P]
        g.valid[r] = False
        g.valid[r, s - P:s] = real
        g.seeds[r], g.temperature[r], g.top_p[r], g.top_k[r] = seeds, temperature, top_p, top_k
        toks, lps = draw(logits, temperature=temperature, top_p=top_p, top_k=top_k,
                         uniforms=counter_uniform(seeds, 0), filters=self._flt)
        g.ids[r] = toks[:, None]
        g.pos[r] = pos[:, -1:] + 1
        g.step[r] = 1
        self._b = max(self._b, max(rows) + 1)  # launch() copies rows [0, _b) to the host
        self.joined_rows += k
        return toks, lps

    def _run_prompts(self, into: SlotCache, ids: torch.Tensor, pos: torch.Tensor, real: torch.Tensor
                     ) -> torch.Tensor:
        """Run left-padded prompts [b, P] into slots [0, P) of `into` (its span: P rounded up to 256) under a
        causal mask that leaves the padding out (a padding query sees itself only); the last position's logits
        [b, V]."""
        b, P = ids.shape
        dev = ids.device
        span = len_bucket(P)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        mask = torch.zeros(b, 1, P, span, dtype=torch.bool, device=dev)
        mask[:, 0, :, :P] = causal[None] & real[:, None, :]  # [b, P(query), P(key)]
        mask[:, 0, :, :P] |= torch.eye(P, dtype=torch.bool, device=dev)[None]  # pad queries see themselves
        into.write, into.span = torch.arange(P, device=dev), span
        if self.tape is None:
            return self._model(into, ids, pos, mask)
        with self.tape.recording() as got:
            out = self._model(into, ids, pos, mask)
        self._routes_of_prompts = torch.stack(got, dim=1).view(b, P, len(got), -1)  # routers see [b·P] tokens
        return out

    def _prefill(self, g: _Graph, ids: torch.Tensor, pos: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Run the prompts [B, P] into the cache's slots [0, P) and return the last position's logits [B, V].
        Rows with the same prompt (a GRPO rollout sends each prompt n times) are run once: the distinct prompts
        go through a cache of their own, whose K/V are then copied to every row that has them."""
        rows, P = ids.shape
        dev = ids.device
        uniq, inv = torch.unique(torch.cat([ids, real.long()], 1), dim=0, return_inverse=True)
        u = uniq.shape[0]
        self.prefill_rows += u
        span = len_bucket(P)
        if u < rows:
            first = torch.full((u,), rows, dtype=torch.long, device=dev).scatter_reduce_(
                0, inv, torch.arange(rows, device=dev), "amin")  # one row per distinct prompt
            into = SlotCache(self.layers, u, self.kv_heads, span, self.head_dim, self.dtype, dev)
            ids, pos, real = ids[first], pos[first], real[first]
        else:
            into = g.cache
        out = self._run_prompts(into, ids, pos, real)
        if into is g.cache:
            return out
        for k, v, uk, uv in zip(g.cache.k, g.cache.v, into.k, into.v):
            k[:, :, :P].copy_(uk[inv, :, :P])
            v[:, :, :P].copy_(uv[inv, :, :P])
        if self.tape is not None:
            self._routes_of_prompts = self._routes_of_prompts[inv]
        return out[inv]

    def launch(self) -> None:
        """Run the next step (a graph replay) and queue the copy of its tokens and log-probs to the host, without
        waiting: the host reads the previous step (stops, aborts) while the GPU runs this one. `collect()` waits."""
        t0 = time.perf_counter()
        g = self._current
        if self._slot >= g.length:  # callers stop at max_new_tokens, which the cache length covers
            raise RuntimeError(f"CUDA-graph decode past its cache length {g.length}")
        span = len_bucket(self._slot + 1)  # covers the slot this step writes
        self._slot += 1
        if self.device.type == "cuda":
            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        if span not in g.graphs:  # capture=False (the CPU tests): the same step, eagerly
            with torch.no_grad():
                self._step(g, self._flt, span)
        else:
            g.graphs[span].replay()
        out = torch.stack([g.out_tokens[:self._b].double(), g.out_logprobs[:self._b].double()])  # [2, b]
        if g.routes is not None and self.recording:  # its routed experts to their host slot (read once collected)
            self._route_slot(g, self.launched).copy_(g.routes, non_blocking=True)
        self.launched += 1
        if self.device.type == "cuda":
            if self._host is None or self._host.shape != out.shape:
                self._host = torch.empty(out.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(out, non_blocking=True)
            self._ready = torch.cuda.Event(enable_timing=True)
            self._ready.record()
        else:
            self._host, self._ready = out, None
        self._pending = True
        self.launch_s += time.perf_counter() - t0

    def collect(self) -> tuple[list[float], list[float]]:
        """The launched step's tokens and log-probs as host lists [b] (waits for that step only)."""
        if not self._pending:
            raise RuntimeError("GraphDecoder.collect() without a launch()")
        if self._ready is not None:
            t = time.perf_counter()
            self._ready.synchronize()
            self.wait_s += time.perf_counter() - t
            self.gpu_s += self._began.elapsed_time(self._ready) / 1e3
        self.steps += 1
        self._pending = False
        toks, lps = self._host.tolist()
        return toks, lps

    def _route_slot(self, g: _Graph, step: int) -> torch.Tensor:
        """The host slot [B, #routers, k] of the running batch's step `step` (chunks of ROUTE_CHUNK steps, kept for
        later batches of the same rows)."""
        c, at = divmod(step, ROUTE_CHUNK)
        shape = (ROUTE_CHUNK, *g.routes.shape)
        if self._route_chunks and self._route_chunks[0].shape != shape:
            self._route_chunks = []
        while len(self._route_chunks) <= c:
            self._route_chunks.append(torch.empty(shape, dtype=torch.int16, pin_memory=self.device.type == "cuda"))
        return self._route_chunks[c][at]

    def step_routes(self, row: int, first: int, n: int) -> torch.Tensor:
        """Row `row`'s routed experts at the running batch's steps [first, first + n): host [n, #routers, k]. Only
        steps already collected are complete."""
        if first + n > self.launched:
            raise RuntimeError(f"routed experts of steps up to {first + n - 1}: only {self.launched} were launched")
        parts, t = [], first
        while t < first + n:
            c, at = divmod(t, ROUTE_CHUNK)
            take = min(ROUTE_CHUNK - at, first + n - t)
            parts.append(self._route_chunks[c][at:at + take, row])
            t += take
        if not parts:
            return torch.empty((0, len(self.tape.routers), self.top_k), dtype=torch.int16)
        return torch.cat(parts)

    def settle(self) -> None:
        """Wait for a launched step nobody will read (the batch finished first), so nothing runs after it."""
        if self._pending:
            self.collect()
