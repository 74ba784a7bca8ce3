"""CUDA graphs for the decoder of the megatron backend (TP = PP = 1, local layers without Transformer Engine).

Why: without TE every layer is a dozen small eager kernels issued from Python; on the 1.5B shape the GPU waited
for the CPU ~28% of each train step. Here one graph replays the forward of all decoder layers of a micro-batch
and another their backward, each one launch instead of thousands: GPU idle per step fell from 1.09 s to 0.10 s
and train MFU rose from 33.7% to 54.4% (bench/results/gpu_megatron.md).

How:
- A graph needs fixed shapes. A micro-batch of T tokens in S samples is padded to the key (T_pad, S_pad):
  T rounded up to a multiple of `token_bucket`, S + 1 (one pad segment) rounded up to a power of two (≥ 8).
  Pad tokens form their own causal segment, the extra cu_seqlens entries repeat T_pad (empty samples), and
  max_seqlen is T_pad, so attention never crosses a real sample and the logits of real tokens are unchanged;
  the backend drops the pad positions' logits before the loss.
- Graph inputs: the decoder's input hidden states [T_pad, 1, h], cu_seqlens [S_pad + 1], and every decoder
  parameter whose gradient autograd returns (norm weights, biases; all weights when wgrad fusion is off). The
  linear weights with wgrad fusion add into their fp32 `main_grad` inside the backward graph: Megatron's grad
  buffer never moves, so the captured GEMM keeps writing the right place.
- Capture (warm-up, forward, backward) runs between steps, before `zero_grad_buffer`, and on the backend's
  own CUDA stream: DDP made the parameters' gradient accumulators on that stream, and a capture must not make
  another stream (the legacy default one, say) wait on it. All graphs share one memory pool: without
  pipelining a micro-batch's forward and backward run back to back, never interleaved with another's.
- At most `max_graphs` shapes are captured; a micro-batch of another shape runs eagerly, and that is logged.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("rollflow.megatron")

MIN_SEGMENTS = 8


def graph_key(num_tokens: int, num_samples: int, token_bucket: int) -> tuple[int, int]:
    """(T_pad, S_pad) of a micro-batch: tokens up to a multiple of token_bucket, samples + 1 pad segment up to
    a power of two (≥ MIN_SEGMENTS)."""
    if num_tokens < 1 or num_samples < 1:
        raise ValueError(f"a micro-batch needs tokens and samples, got {num_tokens} tokens, {num_samples} samples")
    t_pad = -(-num_tokens // token_bucket) * token_bucket
    s_pad = max(MIN_SEGMENTS, 1 << num_samples.bit_length())  # > num_samples: room for the pad segment
    return t_pad, s_pad


def pad_micro_batch(tokens: torch.Tensor, cu_seqlens: torch.Tensor, position_ids: torch.Tensor,
                    key: tuple[int, int], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens / position_ids [T] → [T_pad]; cu_seqlens [S+1] → [S_pad+1]: [cu…, T_pad, T_pad, …].
    The pad tokens (positions 0…) are one segment after the real ones; the remaining entries are empty."""
    t_pad, s_pad = key
    t, s = tokens.numel(), cu_seqlens.numel() - 1
    if t > t_pad or s >= s_pad:
        raise ValueError(f"micro-batch of {t} tokens / {s} samples does not fit the graph shape {key}")
    tok = torch.full((t_pad,), pad_id, dtype=tokens.dtype, device=tokens.device)
    tok[:t] = tokens
    pos = torch.arange(t_pad, dtype=position_ids.dtype, device=position_ids.device) - t
    pos[:t] = position_ids
    cu = torch.full((s_pad + 1,), t_pad, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    cu[: s + 1] = cu_seqlens
    return tok, cu, pos


class DecoderGraphs:
    """Routes `decoder.forward` through a captured graph when the micro-batch has a captured shape."""

    def __init__(self, decoder: torch.nn.Module, *, dtype: torch.dtype, hidden_size: int,
                 fused_weights: list[torch.nn.Parameter], max_graphs: int = 8, token_bucket: int = 1024):
        self.dtype, self.hidden_size = dtype, hidden_size
        self.max_graphs, self.token_bucket = max_graphs, token_bucket
        fused = {id(p) for p in fused_weights}
        # autograd returns these gradients (DDP's hooks add them to main_grad); fused weights write main_grad
        self.params = tuple(p for p in decoder.parameters() if p.requires_grad and id(p) not in fused)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.eager_shapes: set[tuple[int, int]] = set()
        self.replays = 0
        self.pool = torch.cuda.graph_pool_handle()
        self._eager = decoder.forward
        decoder.forward = self._forward

    def key(self, num_tokens: int, num_samples: int) -> tuple[int, int] | None:
        """The graph shape this micro-batch runs with, or None (eager) when no graph of it can be kept."""
        k = graph_key(num_tokens, num_samples, self.token_bucket)
        if k in self.graphs or len(self.graphs) < self.max_graphs:
            return k
        if k not in self.eager_shapes:
            self.eager_shapes.add(k)
            log.warning("CUDA graphs: %d shapes captured (the most kept); micro-batches of shape %s run eagerly",
                        len(self.graphs), k)
        return None

    def prepare(self, keys) -> None:
        """Capture every missing shape. Call between steps: warm-up passes write the fp32 main grads."""
        for k in dict.fromkeys(k for k in keys if k is not None):
            if k not in self.graphs:
                try:
                    self._capture(k)
                except Exception as e:
                    raise RuntimeError(
                        f"capturing the Megatron decoder in a CUDA graph failed for micro-batch shape {k} (tokens, "
                        f"samples): {type(e).__name__}: {e}. Train without graphs with --no-megatron-cuda-graphs "
                        "(same results, slower), and report this with the model's config.json") from e

    def _capture(self, key: tuple[int, int]) -> None:
        """Warm up, then capture the forward and the backward on the current stream: the backend's own
        stream, on which DDP created the parameters' gradient accumulators (a capture that makes another
        stream wait on it is invalid; torch's make_graphed_callables captures on a side stream)."""
        import time

        from megatron.core.packed_seq_params import PackedSeqParams

        t_pad, s_pad = key
        dev = torch.cuda.current_device()
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            raise RuntimeError("decoder CUDA graphs must be captured on the backend's own stream, not the default")
        hidden = torch.randn(t_pad, 1, self.hidden_size, device=dev, dtype=self.dtype).mul_(0.1).requires_grad_()
        cu = torch.full((s_pad + 1,), t_pad, dtype=torch.int32, device=dev)
        cu[0] = 0
        inputs = (hidden, *self.params)

        def run():
            # A new PackedSeqParams per pass: the packed attention caches RoPE cos/sin on it, and the captured
            # pass must compute them in the graph from the replayed cu_seqlens, not read a warm-up's tensors.
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=t_pad,
                                  max_seqlen_kv=t_pad)
            return self._eager(hidden_states=hidden, attention_mask=None, packed_seq_params=psp)

        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved()
        for _ in range(2):  # lazy initialisation (cuBLAS handles, kernel selection) before the capture
            out = run()
            torch.autograd.grad(out, inputs, torch.zeros_like(out))
            del out
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd, pool=self.pool, stream=stream):
            out = run()
        grad_out = torch.zeros_like(out)
        with torch.cuda.graph(bwd, pool=self.pool, stream=stream):
            grads = torch.autograd.grad(out, inputs, grad_out)
        self.graphs[key] = _Captured(fwd, bwd, hidden.detach(), cu, out.detach(), grad_out, grads)
        log.info("CUDA graphs: captured shape %s in %.1f s (+%.2f GiB reserved)", key, time.perf_counter() - t0,
                 (torch.cuda.memory_reserved() - before) / 2 ** 30)

    def _forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kw: Any):
        psp = packed_seq_params
        graph = None
        if psp is not None and attention_mask is None and all(v is None or v is False for v in kw.values()):
            key = (hidden_states.shape[0], psp.cu_seqlens_q.numel() - 1)
            if psp.max_seqlen_q == key[0] and hidden_states.shape[1:] == (1, self.hidden_size):
                graph = self.graphs.get(key)
        if graph is None:
            return self._eager(hidden_states=hidden_states, attention_mask=attention_mask,
                               packed_seq_params=psp, **kw)
        self.replays += 1
        return _Replay.apply(graph, hidden_states, psp.cu_seqlens_q, *self.params)


class _Captured:
    """One shape's graphs and their static buffers (inputs are copied in, outputs read out)."""

    def __init__(self, fwd, bwd, hidden, cu, out, grad_out, grads):
        self.fwd, self.bwd = fwd, bwd
        self.hidden, self.cu, self.out, self.grad_out, self.grads = hidden, cu, out, grad_out, grads


class _Replay(torch.autograd.Function):
    """The decoder as one autograd node: forward replays the forward graph, backward the backward graph and
    returns d(hidden) and the listed parameters' gradients (the fused-wgrad weights were written in-graph)."""

    @staticmethod
    def forward(ctx, graph: _Captured, hidden, cu, *params):
        graph.hidden.copy_(hidden)
        graph.cu.copy_(cu)
        graph.fwd.replay()
        ctx.graph = graph
        return graph.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        graph = ctx.graph
        graph.grad_out.copy_(grad)
        graph.bwd.replay()
        return (None, graph.grads[0], None, *graph.grads[1:])


def fused_wgrad_weights(decoder: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Weights of Megatron linear layers whose gradient the wgrad-fusion GEMM writes into main_grad."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [m.weight for m in decoder.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.gradient_accumulation_fusion
            and m.weight is not None and m.weight.requires_grad]
