"""--log-probs-chunk-size on a GPU: peak memory and time of a train step with the LM head run whole or in chunks.

    python bench/log_probs_chunk.py all --out DIR [--tokens 16384] [--chunks -1,4096,1024,recompute]   # variants
    python bench/log_probs_chunk.py one --backend torch --chunk 4096 --tokens 16384 --out DIR  # one, in-process

`recompute` among --chunks is the whole head with --recompute-loss-function (the log-softmax recomputed in the
backward from the logits), compared with the whole head like the chunks.

A random Qwen2 of the Qwen2.5-0.5B shape (vocabulary 151,936, tied embeddings), bf16, one micro-batch of
`--tokens` tokens in samples of 2,048 (a 128-token prompt, the rest trained). Per backend (torch, megatron) and
chunk size, each in a fresh process: `compute_log_probs` once (the old log-probs), one warm-up step, then three
optimizer steps. Reported: the peak of torch.cuda.max_memory_allocated over a step above what was allocated before
it (`step_peak_gib`; the megatron backend's decoder CUDA graphs replay in their own pool, which the allocator does
not count: there it is what runs outside the graphs, the head and the loss among it), the process's peak reserved
memory (`peak_reserved_gib`, graph pools included: what decides an out-of-memory), the median step time, and the
log-probs' and grad norms' agreement with the same backend's unchunked run (`max_abs_logprob_diff`,
`first_step_grad_norm_rel_diff`, `grad_norm_rel_diff`). Results: DIR/log_probs_chunk.json and a markdown table
DIR/log_probs_chunk.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SAMPLE, PROMPT = 2048, 128


def one(args) -> dict:
    from gpu_megatron import QWEN2_05B, make_hf_model, packed_batch, run_config

    hf = make_hf_model(QWEN2_05B, Path(args.work) / "hf-0.5b", torch.bfloat16)
    mbs = packed_batch([[SAMPLE] * (args.tokens // SAMPLE)], QWEN2_05B["vocab_size"], seed=0, prompt_len=PROMPT)
    cfg = run_config(hf, train_backend=args.backend, bf16=True, log_probs_chunk_size=args.chunk, use_kl_loss=False,
                     recompute_loss_function=args.recompute,
                     kl_loss_coef=0.0, entropy_coef=0.0, rollout_batch_size=1, n_samples_per_prompt=len(mbs[0].sample_ids),
                     global_batch_size=len(mbs[0].sample_ids), micro_batch_size=len(mbs[0].sample_ids))
    if args.backend == "torch":
        from engine.train.torch_backend import TorchBackend

        be = TorchBackend(cfg, device="cuda")
    else:
        from engine.train.megatron_backend import MegatronBackend

        be = MegatronBackend(cfg)
    G = len(mbs[0].sample_ids)
    old = be.compute_log_probs(mbs)
    first = be.train_step(mbs, old, None, G)["grad_norm"]  # warm-up: compilation, graph capture, optimizer state
    times, peaks, reserved, norms = [], [], [], []
    for _ in range(3):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = be.train_step(mbs, old, None, G)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
        reserved.append(torch.cuda.max_memory_reserved() / 2**30)
        norms.append(out["grad_norm"])
    return {"backend": args.backend, "chunk": "recompute" if args.recompute else args.chunk, "tokens": args.tokens,
            "trained_tokens": int(sum(float(mb.loss_mask.sum()) for mb in mbs)),
            "step_s_median": statistics.median(times), "step_s": times, "step_peak_gib": max(peaks),
            "peak_reserved_gib": max(reserved),
            "allocated_gib": torch.cuda.memory_allocated() / 2**30, "first_grad_norm": first, "grad_norms": norms,
            "old_log_probs": [x.tolist() for x in old], "device": torch.cuda.get_device_name()}


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for backend in args.backends.split(","):
        for chunk in [c if c == "recompute" else int(c) for c in args.chunks.split(",")]:
            f = out / f"{backend}_{chunk}.json"
            variant = ["--chunk", "-1", "--recompute"] if chunk == "recompute" else ["--chunk", str(chunk)]
            cmd = [sys.executable, __file__, "one", "--backend", backend, *variant, "--tokens",
                   str(args.tokens), "--out", str(out), "--work", args.work, "--json", str(f)]
            print(" ".join(cmd), flush=True)
            r = subprocess.run(cmd, text=True, capture_output=True)
            if r.returncode != 0:
                err = (r.stderr or r.stdout)[-4000:]
                rows.append({"backend": backend, "chunk": chunk, "error": err,
                             "oom": "OutOfMemoryError" in err or "CUDA out of memory" in err})
                print(rows[-1]["error"], flush=True)
                continue
            rows.append(json.loads(f.read_text()))
    for row in rows:  # agreement with the same backend's unchunked run
        base = next((b for b in rows if b.get("backend") == row.get("backend") and b.get("chunk") == -1
                     and "error" not in b), None)
        if base is None or "error" in row:
            continue
        row["max_abs_logprob_diff"] = max(abs(a - b) for x, y in zip(row["old_log_probs"], base["old_log_probs"])
                                          for a, b in zip(x, y))
        # the first step starts from the same weights; the later ones from weights that Adam's first step (≈
        # lr·sign(g)) may have moved differently where a gradient is at bf16 rounding level
        row["first_step_grad_norm_rel_diff"] = abs(row["first_grad_norm"] - base["first_grad_norm"]) / \
            abs(base["first_grad_norm"])
        row["grad_norm_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["grad_norms"], base["grad_norms"]))
        row["peak_vs_unchunked"] = row["step_peak_gib"] / base["step_peak_gib"]
        row["time_vs_unchunked"] = row["step_s_median"] / base["step_s_median"]
    for row in rows:
        row.pop("old_log_probs", None)
    (out / "log_probs_chunk.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    lines = [f"{args.tokens} tokens in one micro-batch ({args.tokens // SAMPLE} samples of {SAMPLE}, {PROMPT}-token "
             "prompts), Qwen2.5-0.5B shape, bf16", "",
             "| backend | chunk | step's allocated peak above its start (GiB) | ÷ unchunked | peak reserved (GiB) "
             "| step (s, median of 3) | ÷ unchunked | max abs Δ log-prob | first step's grad norm rel. Δ "
             "| later steps' grad norm rel. Δ |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            why = "CUDA out of memory" if r["oom"] else r["error"].strip().splitlines()[-1][:120]
            lines.append(f"| {r['backend']} | {'whole' if r['chunk'] == -1 else r['chunk']} | failed: {why} "
                         "||||||||")
            continue
        lines.append(f"| {r['backend']} | {'whole' if r['chunk'] == -1 else r['chunk']} | {r['step_peak_gib']:.2f} | "
                     f"{r.get('peak_vs_unchunked', float('nan')):.2f} | {r.get('peak_reserved_gib', float('nan')):.2f} | "
                     f"{r['step_s_median']:.3f} | "
                     f"{r.get('time_vs_unchunked', float('nan')):.2f} | {r.get('max_abs_logprob_diff', 0):.2e} | "
                     f"{r.get('first_step_grad_norm_rel_diff', 0):.2e} | {r.get('grad_norm_rel_diff', 0):.2e} |")
    (out / "log_probs_chunk.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["all", "one"])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--work", default="/tmp/rollflow_log_probs_chunk", help="where the random model is saved")
    p.add_argument("--backends", default="torch,megatron")
    p.add_argument("--chunks", default="-1,4096,1024")
    p.add_argument("--backend", default="torch")
    p.add_argument("--chunk", type=int, default=-1)
    p.add_argument("--recompute", action="store_true", help="--recompute-loss-function (with --chunk -1)")
    p.add_argument("--json")
    args = p.parse_args()
    if args.mode == "all":
        run_all(args)
    else:
        res = one(args)
        Path(args.json or Path(args.out) / f"{args.backend}_{args.chunk}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
