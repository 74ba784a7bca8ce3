"""--log-probs-max-tokens-per-gpu on a GPU: time and peak memory of the no-grad log-prob forward before the steps.

    python bench/log_probs_batching.py all --out DIR [--backends torch,megatron] [--caps 0,8192,32768]
    python bench/log_probs_batching.py one --backend torch --cap 8192 --out DIR     # one, in-process
    python bench/log_probs_batching.py one --backend torch --out DIR --profile FILE # + a torch.profiler table

A random Qwen2 of the Qwen2.5-0.5B shape (vocabulary 151,936, tied embeddings), bf16. One rollout of 64 samples of
512 tokens (a 64-token prompt, the rest trained), 32,768 tokens, packed for the step as dynamic batching packs it
under --max-tokens-per-gpu 2048: 16 micro-batches of 4 samples. The old log-probs are computed as the train worker
computes them (`TrainWorker._forward_only`): cap 0 runs the step's 16 micro-batches (the flag unset), a cap of N
re-packs the samples under N tokens. Per backend and cap, each in a fresh process: one warm-up, then the median of
three timed forwards, the peak of torch.cuda.max_memory_allocated above what was allocated before them, and the max
abs difference of the log-probs from the same backend's cap-0 run. Results: DIR/log_probs_batching.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SAMPLES, SAMPLE, PROMPT, STEP_CAP = 64, 512, 64, 2048


def one(args) -> dict:
    from gpu_megatron import QWEN2_05B, make_hf_model, packed_batch, run_config

    from engine.train.worker import TrainWorker

    hf = make_hf_model(QWEN2_05B, Path(args.work) / "hf-0.5b", torch.bfloat16)
    per = STEP_CAP // SAMPLE
    mbs = packed_batch([[SAMPLE] * per] * (SAMPLES // per), QWEN2_05B["vocab_size"], seed=0, prompt_len=PROMPT)
    cfg = run_config(hf, train_backend=args.backend, bf16=True, use_kl_loss=False, kl_loss_coef=0.0,
                     rollout_batch_size=SAMPLES // 4, n_samples_per_prompt=4, global_batch_size=SAMPLES,
                     use_dynamic_batch_size=True, max_tokens_per_gpu=STEP_CAP,
                     log_probs_max_tokens_per_gpu=args.cap or None)
    if args.backend == "torch":
        from engine.train.torch_backend import TorchBackend

        be = TorchBackend(cfg, device="cuda")
    else:
        from engine.train.megatron_backend import MegatronBackend

        be = MegatronBackend(cfg)
    holder = SimpleNamespace(cfg=cfg)  # what _forward_only reads of the worker
    calls: list[int] = []

    def compute(m):
        calls.append(len(m))
        return be.compute_log_probs(m)

    lps = TrainWorker._forward_only(holder, compute, mbs)  # warm-up (compilation, allocator)
    times, peaks = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        lps = TrainWorker._forward_only(holder, compute, mbs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
    if args.profile:  # one more forward under torch.profiler: where the time per micro-batch goes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            TrainWorker._forward_only(holder, compute, mbs)
            torch.cuda.synchronize()
        Path(args.profile).write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40) + "\n"
                                      + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return {"backend": args.backend, "cap": args.cap, "forward_micro_batches": calls[-1],
            "step_micro_batches": len(mbs), "tokens": sum(mb.num_tokens for mb in mbs),
            "forward_s_median": statistics.median(times), "forward_s": times, "peak_gib": max(peaks),
            "log_probs": [x.tolist() for x in lps], "device": torch.cuda.get_device_name()}


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for backend in args.backends.split(","):
        for cap in [int(c) for c in args.caps.split(",")]:
            f = out / f"{backend}_{cap}.json"
            cmd = [sys.executable, __file__, "one", "--backend", backend, "--cap", str(cap), "--out", str(out),
                   "--work", args.work, "--json", str(f)]
            print(" ".join(cmd), flush=True)
            r = subprocess.run(cmd, text=True, capture_output=True)
            if r.returncode != 0:
                rows.append({"backend": backend, "cap": cap, "error": (r.stderr or r.stdout)[-3000:]})
                print(rows[-1]["error"], flush=True)
                continue
            rows.append(json.loads(f.read_text()))
    for row in rows:
        base = next((b for b in rows if b.get("backend") == row["backend"] and b.get("cap") == 0
                     and "error" not in b), None)
        if base is None or "error" in row:
            continue
        row["max_abs_logprob_diff"] = max(abs(a - b) for x, y in zip(row["log_probs"], base["log_probs"])
                                          for a, b in zip(x, y))
        row["time_vs_step_micro_batches"] = row["forward_s_median"] / base["forward_s_median"]
    for row in rows:
        row.pop("log_probs", None)
    (out / "log_probs_batching.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    lines = [f"{SAMPLES} samples of {SAMPLE} tokens ({PROMPT}-token prompts), step micro-batches under {STEP_CAP} "
             "tokens, Qwen2.5-0.5B shape, bf16", "",
             "| backend | --log-probs-max-tokens-per-gpu | forwards | forward time (s, median of 3) | ÷ unset | "
             "peak above start (GiB) | max abs Δ log-prob |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cap = "unset" if r["cap"] == 0 else r["cap"]
        if "error" in r:
            lines.append(f"| {r['backend']} | {cap} | failed: {r['error'].strip().splitlines()[-1][:100]} ||||")
            continue
        lines.append(f"| {r['backend']} | {cap} | {r['forward_micro_batches']} | {r['forward_s_median']:.4f} | "
                     f"{r.get('time_vs_step_micro_batches', float('nan')):.2f} | {r['peak_gib']:.2f} | "
                     f"{r.get('max_abs_logprob_diff', 0):.2e} |")
    (out / "log_probs_batching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["all", "one"])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/rollflow_log_probs_chunk", help="where the random model is saved")
    p.add_argument("--backends", default="torch,megatron")
    p.add_argument("--caps", default="0,8192,32768", help="0: the flag unset (the step's micro-batches)")
    p.add_argument("--backend", default="torch")
    p.add_argument("--cap", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--profile", help="one: also write a torch.profiler table of one more forward to this file")
    args = p.parse_args()
    if args.mode == "all":
        run_all(args)
    else:
        Path(args.json or Path(args.out) / f"{args.backend}_{args.cap}.json").write_text(json.dumps(one(args)))


if __name__ == "__main__":
    main()
