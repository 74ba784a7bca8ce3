"""Do a fused RMSNorm and a fused rotary embedding speed up the engine's decode step? (issue 17, GPU;
engine/rollout/fused.py)

    python bench/gpu_fused_norm.py --out $OUT/gpu_fused_norm.json        # a CUDA GPU, ~1 min

The model and batch of bench/gpu_engine_decode.py (0.5B Qwen2 shape, bf16, random weights; 64 rows × 128 + 128
tokens, T = 1, the engine's CUDA graphs) and the RL rollout's rows (512 × 32 + 256): ms per decode step with
transformers' modules, with `fuse_rotary` alone (bitwise transformers' result: every row must draw the same tokens
with the same log-probs), with `fuse_rms_norms(exact=True)`, with `exact=False` (the engine's), and with both fused
(the engine's default), each on a freshly built model of the same seed; how many rows drew the same tokens as
with transformers' modules (sampling, per-row seeds). First, `fuse_rotary`'s kernel against transformers'
`apply_rotary_pos_emb` on decode and prefill shapes (torch.equal).
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch

    from gpu_engine_decode import SHAPE, StandInTokenizer, cuda_model, HBM_MEASURED
    from engine.rollout.fused import fuse_rms_norms, fuse_rotary, unfuse_rotary
    from engine.rollout.generation import GenRequest, Generator

    if cuda_model("gpu_fused_norm") is None:
        return 2
    res: dict = {}
    from transformers.models.qwen2 import modeling_qwen2 as mq

    model = cuda_model("gpu_fused_norm")
    orig = mq.apply_rotary_pos_emb
    res["rotary_installed"] = fuse_rotary(model)  # False (and a warning why) if its self-check failed here
    checks = {}
    for B, S in ((64, 1), (512, 1), (8, 37)):
        hs = torch.randn(B, S, 16 * 64, device="cuda", dtype=torch.bfloat16)
        q = hs[..., :14 * 64].view(B, S, 14, 64).transpose(1, 2)  # a view, as Qwen2Attention makes it
        k = hs[..., 14 * 64:].view(B, S, 2, 64).transpose(1, 2)
        pos = torch.randint(0, 4000, (B, S), device="cuda")
        cos, sin = model.model.rotary_emb(hs, pos)
        with torch.no_grad():
            want, got = orig(q, k, cos, sin), mq.apply_rotary_pos_emb(q, k, cos, sin)
        checks[f"{B}x{S}"] = bool(torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]))
    unfuse_rotary(model)
    res["rotary_bitwise_equal"] = checks
    print("rotary kernel equals transformers':", checks, flush=True)
    del model
    for B, P, N in ((64, 128, 128), (512, 32, 256)):
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(100, SHAPE["vocab_size"] - 100, (B, P), generator=g).tolist()
        ref = None
        for variant in ("transformers", "rotary", "fused_exact", "fused", "fused+rotary"):
            model = cuda_model("gpu_fused_norm")
            swapped = fuse_rms_norms(model, exact=variant == "fused_exact") if "fused" in variant else 0
            if "rotary" in variant and not fuse_rotary(model):
                continue
            gen = Generator(model, StandInTokenizer(), eos_ids=[151643], device="cuda", fuse_ops=False)

            def run(n: int, gen=gen):
                reqs = [GenRequest(rid=f"r{i}", input_ids=prompts[i], max_new_tokens=n, ignore_eos=True, seed=i)
                        for i in range(B)]
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = gen.generate(reqs)
                torch.cuda.synchronize()
                return time.perf_counter() - t, out

            _, out = run(N)  # capture, warm; its tokens are compared
            steps = [(run(N)[0] - run(1)[0]) / (N - 1) * 1e3 for _ in range(a.repeats)]
            row = {"ms_per_step": round(statistics.median(steps), 3), "runs": [round(x, 3) for x in steps],
                   "norms_swapped": swapped}
            toks = [o.output_ids for o in out]
            lps = [o.logprobs for o in out]
            if ref is None:
                ref = (toks, lps)
            else:
                row["rows_identical_share"] = round(sum(x == y for x, y in zip(toks, ref[0])) / B, 4)
                row["first_token_identical_share"] = round(sum(x[0] == y[0] for x, y in zip(toks, ref[0])) / B, 4)
                row["max_abs_logprob_diff_first_token"] = round(max(abs(x[0] - y[0]) for x, y in zip(lps, ref[1])),
                                                                5)
            if (B, P, N) == (64, 128, 128):
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                kv = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 64 * (P + N // 2) * B * 2
                row["floor_ratio"] = round(row["ms_per_step"] / ((weights + kv) / HBM_MEASURED * 1e3), 2)
            res[f"{B}x{P}+{N}/{variant}"] = row
            print(f"{B}x{P}+{N} {variant}: {row}", flush=True)
            row["logprobs_identical_share"] = round(sum(x == y for x, y in zip(lps, ref[1])) / B, 4)
            unfuse_rotary(model)
            del gen, model
            torch.cuda.empty_cache()
    out = {"command": "python bench/gpu_fused_norm.py " + " ".join(sys.argv[1:]),
           "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": SHAPE, **res}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
