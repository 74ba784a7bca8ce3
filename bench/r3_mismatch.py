"""Rollout routing replay (--use-rollout-routing-replay) against the train–inference mismatch it is for.

The CPU demo's flow (examples/demo.yaml) on a random mixture of experts (tests/model_families.py's Qwen3-MoE: 2
layers, 4 experts, top 2), the engine in bfloat16 (--rollout-dtype bfloat16) and the trainer in float32, so the two
route some tokens differently; run with and without the flag, in interleaved pairs, each a fresh `rollflow train`
process. Per run: train/mismatch (mean |log π_engine − log π_trainer| over the trained tokens, before the update),
train/mismatch_max, and with the flag train/routing_replay_diff (the share of routings where the trainer's routers
alone disagree with the engine's, which it replays instead).

    python bench/r3_mismatch.py --num-rollout 10 --out bench/results --name r3_mismatch
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(model: str, work: Path, num_rollout: int, r3: bool, extra: list[str]) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    summary = work / "summary.json"
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", "examples/demo.yaml", "--hf-checkpoint", model,
           "--rollout-dtype", "bfloat16", "--num-rollout", str(num_rollout), "--eval-prompt-data", "",
           "--rollout-max-truncated-share", "1", "--work-dir", str(work / "w"), "--save", str(work / "ck"),
           "--save-interval", "1000", "--summary-json", str(summary), *extra,
           *(["--use-rollout-routing-replay"] if r3 else [])]
    t0 = time.time()
    with open(work / "console.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{'r3' if r3 else 'plain'} run exited {rc}; see {work / 'console.log'}")
    h = json.loads(summary.read_text())["history"]

    def series(key: str) -> list[float]:
        return [h[key][str(i)] for i in range(num_rollout)] if key in h else []

    return {"r3": r3, "wall_s": round(time.time() - t0, 1), "mismatch": series("train/mismatch"),
            "mismatch_max": series("train/mismatch_max"), "routing_replay_diff": series("train/routing_replay_diff"),
            "reward_mean": series("rollout/reward_mean")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=1,
                   help="runs per side (a side is deterministic on the CPU: its seeds are fixed)")
    p.add_argument("--num-rollout", type=int, default=4)
    p.add_argument("--work", default="/tmp/r3_mismatch")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default="r3_mismatch")
    p.add_argument("--extra", default="", help="more `rollflow train` flags for both sides")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from model_families import save_model

    work = Path(a.work)
    model = save_model(work / "qwen3moe", "qwen3moe", str(ROOT / "examples" / "tiny-qwen2-arith"))
    runs = []
    for k in range(a.pairs):
        for r3 in (False, True):
            res = run(model, work / f"pair{k}_{'r3' if r3 else 'plain'}", a.num_rollout, r3, a.extra.split())
            runs.append(res)
            print(f"pair {k + 1}/{a.pairs} {'r3   ' if r3 else 'plain'}: mismatch "
                  f"{[f'{x:.2e}' for x in res['mismatch']]}, max {[f'{x:.2e}' for x in res['mismatch_max']]}"
                  + (f", routing diff {[round(x, 4) for x in res['routing_replay_diff']]}" if r3 else ""),
                  flush=True)

    def med(r3: bool, key: str) -> float:
        return statistics.median(x for r in runs if r["r3"] == r3 for x in r[key])

    rows = [("train/mismatch (median over rollouts and runs)", med(False, "mismatch"), med(True, "mismatch")),
            ("train/mismatch_max (median)", med(False, "mismatch_max"), med(True, "mismatch_max")),
            ("train/routing_replay_diff (median)", None, med(True, "routing_replay_diff"))]
    cmd = " ".join(["python", "bench/r3_mismatch.py", *sys.argv[1:]])
    lines = [f"# {a.name}", "", f"`{cmd}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| | without --use-rollout-routing-replay | with |", "|---|---|---|"]
    lines += [f"| {name} | {'—' if x is None else f'{x:.3g}'} | {y:.3g} |" for name, x, y in rows]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"command": cmd, "runs": runs}, indent=1))
    (out / f"{a.name}_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
