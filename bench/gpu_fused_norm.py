"""Does a fused RMSNorm speed up the engine's decode step? (issue 17, GPU; engine/rollout/fused.py)

    python bench/gpu_fused_norm.py --out $OUT/gpu_fused_norm.json        # a CUDA GPU, ~1 min

The model and batch of bench/gpu_engine_decode.py (0.5B Qwen2 shape, bf16, random weights; 64 rows × 128 + 128
tokens, T = 1, the engine's CUDA graphs) and the RL rollout's rows (512 × 32 + 256): ms per decode step with
transformers' RMSNorm, with `fuse_rms_norms(exact=True)` and with `exact=False`, each on a freshly built model of
the same seed; and how many rows drew the same tokens as transformers' RMSNorm (sampling, per-row seeds) and the
largest log-prob difference.
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
    from engine.rollout.fused import fuse_rms_norms
    from engine.rollout.generation import GenRequest, Generator

    if cuda_model("gpu_fused_norm") is None:
        return 2
    res: dict = {}
    for B, P, N in ((64, 128, 128), (512, 32, 256)):
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(100, SHAPE["vocab_size"] - 100, (B, P), generator=g).tolist()
        ref = None
        for variant in ("transformers", "fused_exact", "fused"):
            model = cuda_model("gpu_fused_norm")
            swapped = 0 if variant == "transformers" else fuse_rms_norms(model, exact=variant == "fused_exact")
            gen = Generator(model, StandInTokenizer(), eos_ids=[151643], device="cuda")

            def run(n: int):
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
