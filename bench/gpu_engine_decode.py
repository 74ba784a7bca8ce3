"""The built-in engine's decode step on a GPU against transformers `generate` and the HBM floor (issue 17's table).

    python bench/gpu_engine_decode.py --out bench/results/gpu_engine_decode.json      # on a CUDA machine

A Qwen2 of the 0.5B shape (hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864, vocab 151,936; random weights:
the cost of a step does not depend on their values), bf16, batch 64, 128 prompt + 128 new tokens (ignore_eos, so
every row runs all 128 steps), T = 1:

- `engine_sampling`: `engine.rollout.generation.Generator.generate` as a rollout calls it (per-row seeds, the
  counter-based GPU sampler of engine/rollout/sampling.py, log-probs of every token), decoding through its CUDA
  graphs over a preallocated cache (engine/rollout/cuda_graphs.py), its RMSNorms and rotary embedding fused
  (engine/rollout/fused.py);
- `engine_greedy`: the same, temperature 0;
- `engine_sampling_eager` / `engine_greedy_eager`: the engine with `cuda_graphs=False` (SGLang's
  --disable-cuda-graph): the eager loop over a growing cache, as before;
- `hf_sampling`: transformers `model.generate(do_sample=True, top_k=0)` on the same weights and batch (a copy of the
  model with transformers' own modules and sdpa attention);
- `hf_static_cache_sampling`: the same with `cache_implementation="static"` (transformers compiles that decode
  step: a preallocated cache and CUDA graphs, the library's answer to issue 17's item 1).

ms per decode step = (time for 128 new tokens − time for 1) / 127, median of --repeats. The HBM floor of a step is
the bytes it must read — every weight once plus the KV cache at mid-length — over the H200's 4.8 TB/s peak (the
issue's table used 4.24 TB/s, measured; both are recorded). `floor_ratio` = engine_sampling ms ÷ the floor at
4.24 TB/s. The engine is given a stand-in tokenizer (decode → ""): no stop strings are asked, so text only feeds the
response's `text` field, which this benchmark does not read.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True)
HBM_MEASURED, HBM_PEAK = 4.24e12, 4.8e12  # bytes/s


def cuda_model(script: str):
    """The GPU engine benchmarks' model: a random Qwen2 of SHAPE (seed 0) in bf16 on the GPU; None, after saying
    so, without CUDA (the caller exits 2)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if not torch.cuda.is_available():
        print(f"{script}: no CUDA device; this benchmark runs on a GPU machine", file=sys.stderr)
        return None
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE, torch_dtype="bfloat16")).to(torch.bfloat16).eval()


class StandInTokenizer:
    pad_token_id = 0

    @staticmethod
    def decode(ids, skip_special_tokens=True) -> str:
        return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compiled", action="store_true", help="also the engine with its decode step compiled "
                                                            "(SGLang's --enable-torch-compile)")
    p.add_argument("--engines-only", action="store_true", help="only the engine, graphs against eager (sampling): "
                                                                "long generations without the transformers rows")
    p.add_argument("--unfolded", action="store_true", help="also the graphs on transformers' sdpa (K/V repeated per "
                                                            "query head), to measure the folded decode attention")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_engine_decode.json"))
    a = p.parse_args()

    import torch
    import transformers

    from engine.rollout.generation import GenRequest, Generator

    if (model := cuda_model("gpu_engine_decode")) is None:
        return 2
    params = sum(t.numel() for t in model.parameters())
    B, P, N = a.batch, a.prompt_len, a.new_tokens
    kv_mid = B * (P + N // 2) * SHAPE["num_hidden_layers"] * 2 * SHAPE["num_key_value_heads"] * \
        (SHAPE["hidden_size"] // SHAPE["num_attention_heads"]) * 2  # bf16 K and V at mid-length
    step_bytes = params * 2 + kv_mid
    floor_ms = step_bytes / HBM_MEASURED * 1e3
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, SHAPE["vocab_size"] - 100, (B, P), generator=g).tolist()
    # transformers' rows run on their own copy (same seed, same weights): the engine fuses its model's RMSNorms
    # and rotary embedding (engine/rollout/fused.py), which a user of transformers does not get
    ref_model = cuda_model("gpu_engine_decode")
    gen = Generator(model, StandInTokenizer(), eos_ids=[151643], device="cuda")
    gen_eager = Generator(model, StandInTokenizer(), eos_ids=[151643], device="cuda", cuda_graphs=False)
    assert gen.graphs is not None and gen_eager.graphs is None
    unfolded = None
    if a.unfolded:  # the same graphs on a copy of the model left on transformers' sdpa (K/V repeated per head)
        import copy

        from engine.rollout.cuda_graphs import GraphDecoder

        m2 = copy.deepcopy(model)
        m2.set_attn_implementation("sdpa")
        unfolded = Generator(m2, StandInTokenizer(), eos_ids=[151643], device="cuda", cuda_graphs=False)
        unfolded.cuda_graphs, unfolded.graphs = True, GraphDecoder(m2, unfolded._cache_kw, fold_gqa=False)
    # compiled: on its own copy, as the engine runs it (no fused modules: inductor fuses them itself)
    gen_compiled = Generator(cuda_model("gpu_engine_decode"), StandInTokenizer(), eos_ids=[151643], device="cuda",
                             compile_decode=True) if a.compiled else None

    @contextlib.contextmanager
    def transformers_rotary():
        """transformers' apply_rotary_pos_emb while inside, should the engine's fused one be installed (fuse_rotary
        replaces the modeling module's function, for every model of the class)."""
        from engine.rollout.fused import fuse_rotary, unfuse_rotary

        mod = sys.modules[type(ref_model).__module__]
        fused = getattr(mod.apply_rotary_pos_emb, "_rollflow_fused", False)
        unfuse_rotary(ref_model)
        try:
            yield
        finally:
            if fused:
                fuse_rotary(ref_model)

    def reqs_of(n: int, temperature: float) -> list:
        return [GenRequest(rid=f"r{i}", input_ids=prompts[i], max_new_tokens=n, temperature=temperature,
                           ignore_eos=True, seed=1000 + i) for i in range(B)]

    def engine(n: int, temperature: float, g=gen) -> float:
        reqs = reqs_of(n, temperature)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = g.generate(reqs)
        torch.cuda.synchronize()
        assert all(len(r.output_ids) == n for r in out), "a row stopped early"
        return time.perf_counter() - t

    def teacher_forced_gap(outs) -> float:
        """max |engine log-prob − a fresh full forward's| over the first 8 rows' tokens (bf16 both)."""
        worst = 0.0
        with torch.no_grad():
            for r in outs[:8]:
                seq = torch.tensor([r.input_ids + r.output_ids], device="cuda")
                with transformers_rotary():
                    logp = torch.log_softmax(ref_model(seq).logits[0].float(), -1)[len(r.input_ids) - 1:-1]
                direct = logp.gather(-1, torch.tensor(r.output_ids, device="cuda")[:, None]).squeeze(-1)
                worst = max(worst, float((direct - torch.tensor(r.logprobs, device="cuda")).abs().max()))
        return worst

    # the graphs against the eager loop on the same rows and seeds: the same draws up to the logits' rounding
    # (random weights give nearly flat distributions, so rounding flips tokens often); both checked against a
    # teacher-forced forward of what they generated
    agree = {}
    for name, temp in (("greedy", 0.0), ("sampling", 1.0)):
        ea, gr = gen_eager.generate(reqs_of(N, temp)), gen.generate(reqs_of(N, temp))
        same = [x.output_ids == y.output_ids for x, y in zip(ea, gr)]
        prefix = [next((k for k, (u, v) in enumerate(zip(x.output_ids, y.output_ids)) if u != v), N)
                  for x, y in zip(ea, gr)]
        dlp = max(abs(u - v) for x, y, k in zip(ea, gr, prefix) for u, v in zip(x.logprobs[:k], y.logprobs[:k]))
        agree[name] = {"rows_identical": sum(same), "rows": B, "mean_identical_prefix": statistics.mean(prefix),
                       "max_abs_logprob_diff_on_common_prefix": round(dlp, 5),
                       "teacher_forced_max_abs_diff_eager": round(teacher_forced_gap(ea), 5),
                       "teacher_forced_max_abs_diff_graphs": round(teacher_forced_gap(gr), 5)}
        print(f"graphs vs eager, {name}: {agree[name]}", flush=True)

    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)

    def hf(n: int, **kw) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with transformers_rotary():  # transformers' own modules, sdpa attention, as a user gets them
            with torch.no_grad():
                out = ref_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                         top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw)
            torch.cuda.synchronize()
        assert out.shape[1] == P + n
        return time.perf_counter() - t

    runs = {"engine_sampling": lambda n: engine(n, 1.0), "engine_greedy": lambda n: engine(n, 0.0),
            "engine_sampling_eager": lambda n: engine(n, 1.0, gen_eager),
            "engine_greedy_eager": lambda n: engine(n, 0.0, gen_eager),
            **({"engine_sampling_compiled": lambda n: engine(n, 1.0, gen_compiled)} if gen_compiled else {}),
            **({"engine_sampling_unfolded": lambda n: engine(n, 1.0, unfolded)} if unfolded else {}),
            "hf_sampling": hf,
            # transformers' static KV cache, whose decode step generate compiles (CUDA graphs): what the library
            # gives against writing it (issue 17)
            "hf_static_cache_sampling": lambda n: hf(n, cache_implementation="static")}
    if a.engines_only:
        runs = {k: runs[k] for k in ("engine_sampling", "engine_sampling_eager", "engine_sampling_compiled",
                                     "engine_sampling_unfolded") if k in runs}
    res = {}
    for name, fn in runs.items():
        fn(N)  # warm-up (kernels, allocator)
        steps = []
        for _ in range(a.repeats):
            one, full = fn(1), fn(N)
            steps.append((full - one) / (N - 1) * 1e3)
        ms = statistics.median(steps)
        res[name] = {"ms_per_step": round(ms, 3), "ms_per_step_runs": [round(x, 3) for x in steps],
                     "tokens_per_s": round(B / ms * 1e3, 1), "x_floor": round(ms / floor_ms, 1)}
        print(f"{name}: {ms:.2f} ms/step, {B / ms * 1e3:.0f} tok/s, {ms / floor_ms:.1f}x the HBM floor", flush=True)
    out = {"command": "python bench/gpu_engine_decode.py " + " ".join(sys.argv[1:]),
           "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "transformers": transformers.__version__,
                       "python": platform.python_version()},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "shape": {**SHAPE, "params": params, "dtype": "bfloat16"}, "batch": B, "prompt_len": P, "new_tokens": N,
           "step_bytes": step_bytes, "floor_ms_at_4.24TBps": round(floor_ms, 4),
           "floor_ms_at_4.8TBps": round(step_bytes / HBM_PEAK * 1e3, 4), "runs": res,
           "fused_rms_norms": gen.fused_norms, "fused_rotary": gen.fused_rotary,
           "floor_ratio": round(res["engine_sampling"]["ms_per_step"] / floor_ms, 1),
           "graphs_vs_eager_speedup": round(res["engine_sampling_eager"]["ms_per_step"]
                                            / res["engine_sampling"]["ms_per_step"], 3),
           "graphs_vs_eager_agreement": agree, "graphs_captured": gen.graphs.captures,
           "decode_attention_folded": gen.graphs.folded_gqa}
    if "engine_sampling_unfolded" in res:
        out["folded_vs_unfolded_speedup"] = round(res["engine_sampling_unfolded"]["ms_per_step"]
                                                  / res["engine_sampling"]["ms_per_step"], 3)
    if "hf_sampling" in res:
        out["engine_vs_hf_sampling"] = round(res["hf_sampling"]["ms_per_step"] / res["engine_sampling"]["ms_per_step"],
                                             3)
        out["engine_vs_hf_static_cache"] = round(res["hf_static_cache_sampling"]["ms_per_step"]
                                                 / res["engine_sampling"]["ms_per_step"], 3)
    if "engine_sampling_compiled" in res:
        out["floor_ratio_compiled"] = round(res["engine_sampling_compiled"]["ms_per_step"] / floor_ms, 1)
        if "hf_sampling" in res:
            out["compiled_vs_hf_sampling"] = round(res["hf_sampling"]["ms_per_step"]
                                                   / res["engine_sampling_compiled"]["ms_per_step"], 3)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out.get(k) for k in ("floor_ms_at_4.24TBps", "floor_ratio", "engine_vs_hf_sampling",
                                              "engine_vs_hf_static_cache", "graphs_vs_eager_speedup",
                                              "floor_ratio_compiled", "folded_vs_unfolded_speedup")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
