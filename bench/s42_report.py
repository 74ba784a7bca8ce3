"""What bench/gpu_flow_device.sh step s42 found, from the demos' own summaries under /tmp/g/<work>/demo_*/:

    python bench/s42_report.py mis_t mis_m det_t_a:det_t_b

A name alone: a run with slime's mis.yaml — its greedy accuracy and the per-rollout rejection / normalisation
metrics. `a:b`: two runs of one command — how many of their per-rollout train / rollout / eval metrics are equal
at every rollout, and the largest difference of each one that is not.
"""
from __future__ import annotations

import glob
import json
import sys

MIS_KEYS = ("rollout/reward_mean", "train/mismatch", "train/tis_clipfrac", "train/tis_norm", "train/rs_rejected",
            "train/rs_vetoed")


def summary(work: str) -> dict | None:
    found = glob.glob(f"/tmp/g/{work}/*/summary.json")  # the run's own work dir, named by its tag
    return json.load(open(found[0])) if found else None


def per_rollout(h: dict, key: str) -> list[float]:
    return [v for _, v in sorted((int(i), v) for i, v in h.get(key, {}).items())]


def main(args: list[str]) -> None:
    for arg in args:
        if ":" not in arg:
            s = summary(arg)
            if s is None:
                print(arg, "no summary (the run failed: see its log)")
                continue
            print(arg, "greedy accuracy", s["test_accuracy_before"], "->", s["test_accuracy_after"])
            for k in MIS_KEYS:
                print("  ", k, [round(v, 5) for v in per_rollout(s["history"], k)])
            continue
        a, b = arg.split(":")
        x, y = summary(a), summary(b)
        if x is None or y is None:
            print(a, b, "a summary is missing (a run failed: see its log)")
            continue
        keys = sorted(k for k in x["history"] if k.split("/")[0] in ("train", "rollout", "eval"))
        diff = {}
        for k in keys:
            xs, ys = per_rollout(x["history"], k), per_rollout(y["history"], k)
            diff[k] = max((abs(p - q) for p, q in zip(xs, ys)), default=0.0) if len(xs) == len(ys) else float("inf")
        same = [k for k, d in diff.items() if d == 0]
        print(f"{a} vs {b}: {len(same)} of {len(keys)} train/rollout/eval metrics equal at every rollout; greedy "
              f"accuracy {x.get('test_accuracy_after')} and {y.get('test_accuracy_after')}")
        print("   differing (largest difference):", {k: d for k, d in diff.items() if d != 0})


if __name__ == "__main__":
    main(sys.argv[1:])
