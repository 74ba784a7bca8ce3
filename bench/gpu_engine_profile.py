"""Where a decode step of the built-in engine goes at RL batch sizes (issue 17's next bottleneck), on a CUDA GPU.

    python bench/gpu_engine_profile.py --out $OUT/gpu_engine_profile.json            # the lent H200, ~2 min

The RL step's rollout (bench/results/gpu_rl_step.md) decodes 512 rows at ~16 ms a step, against 3.8 ms at 64 rows
(bench/results/gpu_engine_decode.md). This measures, on the same 0.5B shape in bf16 with random weights:

- `generate`: the engine's `Generator.generate` on B rows (prompt P, N new tokens, ignore_eos), through its CUDA
  graphs: ms per step = (time for N tokens - time for 1) / (N - 1);
- `parts` at B rows and a mid-length span, each timed alone with CUDA events (median of --repeats, the same ops
  as one graph step): the model forward on one token per row over the slot cache (`model`), the counter-based
  draw with its log-probs (`draw_and_logprobs`: engine/rollout/sampling.py; with top-p 0.9: `draw_top_p_0.9`),
  the sampler and log-softmax it replaced (`before_sampler`, `before_logprobs`; `draw_equals_before_share`: the
  share of rows where both draw the same token), one replay of the generator's captured step (`graph_replay`),
  and the host's per-row bookkeeping of one step (`host_loop`, CPU);
- `kernels`: torch.profiler over a few eager steps (the same kernels a graph replays), CUDA time per kernel name,
  the top --top.

Needs no bundle (torch and transformers of the device image). Exits 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def sample_before(logits, *, temperature, top_p, top_k, uniforms):
    """The sampler before the two-level draw (engine/rollout/sampling.py until 2026-12-03), without filters: a
    softmax and a full-vocabulary float64 cumsum; the same-call baseline of `draw`."""
    import torch

    greedy = temperature <= 0
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    cdf = torch.softmax(x, dim=-1).double().cumsum(-1)
    tokens = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).clamp(max=x.shape[-1] - 1)
    return torch.where(greedy, logits.argmax(-1), tokens.squeeze(-1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-path", default=None, help="a model directory, loaded as the engine loads it (default: "
                   "the 0.5B shape built in memory)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_engine_profile.json"))
    a = p.parse_args()

    import torch

    from gpu_engine_decode import SHAPE, StandInTokenizer, cuda_model
    from engine.rollout.cuda_graphs import GraphDecoder, len_bucket
    from engine.rollout.generation import GenRequest, Generator
    from engine.rollout.sampling import counter_uniform, draw

    if not torch.cuda.is_available():
        print("gpu_engine_profile: no CUDA device; this benchmark runs on a GPU machine", file=sys.stderr)
        return 2
    if a.model_path:  # as the engine loads a served model (engine/modeling.py)
        from engine.modeling import load_causal_lm

        model = load_causal_lm(a.model_path, dtype="bfloat16", device="cuda").eval()
    else:
        model = cuda_model("gpu_engine_profile")
    B, P, N = a.batch, a.prompt_len, a.new_tokens
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, SHAPE["vocab_size"] - 100, (B, P), generator=g).tolist()
    gen = Generator(model, StandInTokenizer(), eos_ids=[151643], device="cuda")

    def run(n: int) -> float:
        reqs = [GenRequest(rid=f"r{i}", input_ids=prompts[i], max_new_tokens=n, ignore_eos=True, seed=i)
                for i in range(B)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        gen.generate(reqs)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(N)  # capture the graphs, warm the allocator
    run_s, wait_s = run(N), gen.graphs.wait_s  # the host's wait for the GPU within one whole generate
    steps = [(run(N) - run(1)) / (N - 1) * 1e3 for _ in range(max(1, a.repeats // 2))]
    res: dict = {"generate_ms_per_step": round(statistics.median(steps), 3), "model_path": a.model_path,
                 "attn_implementation": model.config._attn_implementation, "folded_gqa": gen.graphs.folded_gqa,
                 "gpu_wait_share": round(wait_s / run_s, 3),
                 "generate_ms_per_step_runs": [round(x, 3) for x in steps]}
    print(f"generate: {res['generate_ms_per_step']} ms/step at {B} rows", flush=True)

    # the parts of one step at a mid-length span, on a decoder that runs its steps eagerly (no capture)
    dec = GraphDecoder(model, gen._cache_kw, capture=False)
    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1)
    knobs = {"temperature": torch.ones(B, device="cuda"), "top_p": torch.ones(B, device="cuda"),
             "top_k": torch.full((B,), -1, device="cuda")}
    dec.start(ids, mask, pos, seeds=torch.arange(B, device="cuda"), max_new=N, **knobs)
    gr = dec._current
    span = len_bucket(P + N // 2)
    gr.valid[:, :span] = True

    def timed(fn) -> float:
        fn()
        out = []
        for _ in range(a.repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e))
        return round(statistics.median(out), 3)

    logits = torch.randn(B, SHAPE["vocab_size"], device="cuda") * 3
    flt = (False, 0, False)
    with torch.no_grad():
        gr.cache.write, gr.cache.span = gr.slot, span
        u = counter_uniform(gr.seeds, gr.step)
        parts = {
            "model": timed(lambda: dec._model(gr.cache, gr.ids, gr.pos, gr.valid[:, None, None, :span])),
            "draw_and_logprobs": timed(lambda: draw(logits, uniforms=u, filters=flt, **knobs)),
            "before_sampler": timed(lambda: sample_before(logits, uniforms=u, **knobs)),
            "before_logprobs": timed(lambda: torch.log_softmax(logits, dim=-1).gather(
                -1, logits.argmax(-1, keepdim=True))),
            "draw_top_p_0.9": timed(lambda: draw(logits, uniforms=u, filters=(False, 0, True),
                                                 **{**knobs, "top_p": torch.full((B,), 0.9, device="cuda")})),
        }
        same = (draw(logits, uniforms=u, **knobs)[0] == sample_before(logits, uniforms=u, **knobs)).float().mean()
        parts["draw_equals_before_share"] = round(float(same), 6)
        g_run = gen.graphs._current  # the generator's own captured graphs (its last batch: B rows)
        if g_run is not None and g_run.graphs and span in g_run.graphs:
            parts["graph_replay"] = timed(lambda: g_run.graphs[span].replay())
    finish = [None] * B
    out_ids: list[list[int]] = [[] for _ in range(B)]
    toks_l = list(range(B))
    t = time.perf_counter()
    for _ in range(100):  # what the generator's loop does per row and step (no stops, no aborts)
        for i in range(B):
            if finish[i] is not None:
                continue
            out_ids[i].append(int(toks_l[i]))
    parts["host_loop"] = round((time.perf_counter() - t) / 100 * 1e3, 3)
    res.update(parts_ms=parts, span=span)
    print(f"parts (ms, {B} rows, span {span}): {parts}", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            dec._step(gr, flt, span)
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 5 / 1e3, e.count // 5) for e in prof.key_averages()),
                  key=lambda r: -r[1])
    res["kernels_ms_per_step"] = [{"name": k[:120], "ms": round(ms, 4), "calls": c} for k, ms, c in rows[:a.top]]
    res["kernels_total_ms_per_step"] = round(sum(r[1] for r in rows), 3)
    for r in res["kernels_ms_per_step"][:12]:
        print(f"  {r['ms']:8.3f} ms  x{r['calls']:<4} {r['name']}", flush=True)
    out = {"command": "python bench/gpu_engine_profile.py " + " ".join(sys.argv[1:]),
           "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "batch": B, "prompt_len": P,
           "new_tokens": N, "shape": SHAPE, **res}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
