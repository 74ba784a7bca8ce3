"""Routed experts (--enable-return-routed-experts, R3) recorded inside the built-in engine's CUDA graphs, against the
eager loop that such batches ran on before.

    python bench/gpu_r3_decode.py --out bench/results/gpu_r3_decode.json      # on a CUDA machine

A random Qwen3-MoE (hidden 1024, 12 layers, 16 heads / 4 KV heads, 64 experts of 384, top 8, vocab 151,936; bf16;
the cost of a step does not depend on the weights' values), batch --batch, --prompt-len random prompt tokens,
--new-tokens new ones (ignore_eos), T = 1, each row its seed. Rows, ms per decode step = (time for N new tokens −
time for 1) / (N − 1), median of --repeats:

- `graphs_r3`: the engine started with the flag, every request asking for its routed experts: the CUDA graphs copy
  each step's top-k ids to the host (engine/rollout/cuda_graphs.py);
- `graphs_r3_not_asked`: the same engine, requests that do not ask (its graphs fill the buffer; no host copy);
- `graphs_no_flag`: an engine without the flag (graphs without the copy): the cost of recording is the difference;
- `eager_r3`: the eager loop (cuda_graphs=False) with every request asking: what an R3 batch ran on before.

`agreement`: over the rows where the graphs and the eager loop drew the same tokens, the share of (token, router)
rows whose expert sets are equal; and against one forward of each sequence through transformers' model (bf16: a
near-tie may round either way).
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

SHAPE = dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
             vocab_size=151936, norm_topk_prob=True, tie_word_embeddings=True, max_position_embeddings=4096)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_r3_decode.json"))
    a = p.parse_args()

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.rollout.generation import GenRequest, Generator
    from engine.train.routing import TorchRouters
    from gpu_engine_decode import StandInTokenizer

    if not torch.cuda.is_available():
        print("gpu_r3_decode: no CUDA device; this benchmark runs on a GPU machine", file=sys.stderr)
        return 2

    def build():  # seeded: the same weights each time (one graph decoder per model: it switches its attention)
        torch.manual_seed(0)
        with torch.device("cuda"):
            return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, torch_dtype="bfloat16")).to(torch.bfloat16).eval()

    model = build()
    B, P, N = a.batch, a.prompt_len, a.new_tokens
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, SHAPE["vocab_size"] - 100, (B, P), generator=g).tolist()
    eos = [151643]
    gens = {"graphs_r3": Generator(model, StandInTokenizer(), eos, device="cuda", return_routed_experts=True),
            "graphs_no_flag": Generator(build(), StandInTokenizer(), eos, device="cuda"),
            "eager_r3": Generator(model, StandInTokenizer(), eos, device="cuda", cuda_graphs=False,
                                  return_routed_experts=True)}
    assert gens["graphs_r3"].graphs.tape is not None and gens["eager_r3"].graphs is None

    def reqs(n: int, ask: bool) -> list:
        return [GenRequest(rid=f"r{i}", input_ids=prompts[i], max_new_tokens=n, ignore_eos=True, seed=1000 + i,
                           return_routed_experts=ask) for i in range(B)]

    def timed(gen, n: int, ask: bool) -> tuple[float, list]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = gen.generate(reqs(n, ask))
        torch.cuda.synchronize()
        assert all(len(r.output_ids) == n for r in out) and all((r.routed_experts is not None) == ask for r in out)
        return time.perf_counter() - t, out

    runs = {"graphs_r3": ("graphs_r3", True), "graphs_r3_not_asked": ("graphs_r3", False),
            "graphs_no_flag": ("graphs_no_flag", False), "eager_r3": ("eager_r3", True)}
    outs, res = {}, {}
    for name, (gname, ask) in runs.items():  # warm-up (captures) first, then the measured repeats
        timed(gens[gname], N, ask)
        timed(gens[gname], 1, ask)
    for name, (gname, ask) in runs.items():
        full, one = [], []
        for _ in range(a.repeats):
            t, outs[name] = timed(gens[gname], N, ask)
            full.append(t)
            one.append(timed(gens[gname], 1, ask)[0])
        ms = (statistics.median(full) - statistics.median(one)) / (N - 1) * 1e3
        res[name] = {"ms_per_step": round(ms, 3), "s_for_all": round(statistics.median(full), 3)}
        print(name, res[name], flush=True)

    def same_sets(x, y) -> torch.Tensor:
        return (x.long().sort(-1).values == y.long().sort(-1).values).all(-1)

    hooks = TorchRouters(model)
    same_eager = same_alone = rows_eager = rows_alone = identical = 0
    for r_g, r_e in zip(outs["graphs_r3"], outs["eager_r3"]):
        if r_g.output_ids == r_e.output_ids:
            identical += 1
            hit = same_sets(r_g.routed_experts.cpu(), r_e.routed_experts.cpu())
            same_eager, rows_eager = same_eager + int(hit.sum()), rows_eager + hit.numel()
    for r_g in outs["graphs_r3"][:16]:
        seq = r_g.input_ids + r_g.output_ids[:-1]
        with torch.no_grad(), hooks.recording() as seen:
            model(input_ids=torch.tensor([seq], device="cuda"))
        alone = torch.stack(seen, 1).view(len(seq), len(seen), -1).cpu()
        hit = same_sets(r_g.routed_experts.cpu(), alone)
        same_alone, rows_alone = same_alone + int(hit.sum()), rows_alone + hit.numel()
    hooks.remove()
    agreement = {"rows_with_identical_tokens": identical, "rows": B,
                 "same_experts_as_eager": round(same_eager / max(rows_eager, 1), 5),
                 "same_experts_as_one_forward_first_16_rows": round(same_alone / max(rows_alone, 1), 5)}
    print("agreement", agreement, flush=True)
    speed = {"eager_r3_over_graphs_r3": round(res["eager_r3"]["ms_per_step"] / res["graphs_r3"]["ms_per_step"], 2),
             "graphs_r3_over_no_flag": round(res["graphs_r3"]["ms_per_step"] / res["graphs_no_flag"]["ms_per_step"],
                                             3)}
    print("speed", speed, flush=True)
    out = {"command": "python " + " ".join(sys.argv), "shape": SHAPE, "batch": B, "prompt_len": P, "new_tokens": N,
           "repeats": a.repeats, "runs": res, "agreement": agreement, "speed": speed,
           "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "python": platform.python_version()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
