"""The bar for the megatron backend, on the same machine: plain transformers (SDPA attention) training the
Qwen2.5-1.5B shape in bf16, as the issue's probe did (b=2, s=2048: 4,096 tokens a step), and with the megatron
benchmark's step (8 such micro-batches, 32,768 tokens, one optimizer step).

    python bench/gpu_hf_baseline.py --out DIR      # writes DIR/hf_baseline.json

MFU as bench/gpu_megatron.py: design.md forward FLOPs × 3 / step time / the measured bf16 matmul peak.
A plain loop: bf16 parameters, torch's fused AdamW on them, the model's own cross-entropy (no fp32 master
weights or grads, which the megatron backend keeps).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_megatron import QWEN25_15B, log, matmul_peak, model_flops, save_json  # noqa: E402


def step_time(model, opt, batches: list[torch.Tensor], repeats: int = 5) -> list[float]:
    def one():
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        one()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    peak = matmul_peak()
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN25_15B, rope_theta=1e6, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    out_attn = model.config._attn_implementation
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                   "transformers": __import__("transformers").__version__, "attention": out_attn},
           "matmul_peak": peak, "runs": {}}
    for name, n_mbs in (("probe_b2_s2048", 1), ("step_8x_b2_s2048", 8)):
        batches = [torch.randint(0, cfg.vocab_size, (2, 2048), device="cuda", generator=g) for _ in range(n_mbs)]
        times = step_time(model, opt, batches)
        t = statistics.median(times)
        fwd = model_flops(QWEN25_15B, [2048] * 2 * n_mbs)
        out["runs"][name] = {"micro_batches": n_mbs, "tokens_per_step": 4096 * n_mbs, "step_s": times,
                             "median_s": t, "tokens_per_s": 4096 * n_mbs / t,
                             "mfu": 3 * fwd / t / 1e12 / peak["tflops"],
                             "max_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
        log(name, {k: v for k, v in out["runs"][name].items() if k != "step_s"})
        save_json(Path(a.out) / "hf_baseline.json", out)


if __name__ == "__main__":
    main()
