"""Asynchronous RL against synchronous on the CPU demo task: wall time per rollout, time to a reward, final accuracy.

    python bench/async.py --num-rollout 40 --repeats 2 --out bench/results

Runs `rollflow train --config examples/demo.yaml` (the demo; on a CPU the sync mode serves the engine from the
trainer's process and the async modes give it a process of its own, --rollout-engine-process auto) with
--async-mode off, one-step, bounded (--max-staleness 2) and one-step --partial-rollout, `--repeats` times each,
alternating, same seed, each run with its own work dir, Prefect API and Ray. Per run, from rollflow's own summary:
`loop_wall_s` (the loop over rollout ids: no start-up, no first or last evaluation), per-rollout completion times,
the rollout rewards, the greedy test accuracy before and after. Writes async.json (`speedup_vs_sync` = sync wall per
rollout ÷ one-step wall per rollout, medians over the repeats; `speedup_vs_sync_bounded`, `_partial`; accuracies)
and async_table.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"sync": ["--async-mode", "off"], "one_step": ["--async-mode", "one-step"],
         "bounded": ["--async-mode", "bounded", "--max-staleness", "2"],
         "one_step_partial": ["--async-mode", "one-step", "--partial-rollout"]}


SPEEDUP_KEYS = {"one_step": "speedup_vs_sync", "bounded": "speedup_vs_sync_bounded",
                "one_step_partial": "speedup_vs_sync_partial"}


def machine() -> dict:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def time_to(rewards: list[float], done_s: list[float], threshold: float, window: int = 5) -> float | None:
    """Seconds into the loop when the running mean of the last `window` rollout rewards first reaches threshold."""
    for i in range(len(rewards)):
        lo = max(0, i - window + 1)
        if sum(rewards[lo:i + 1]) / (i + 1 - lo) >= threshold:
            return done_s[i]
    return None


def one(mode: str, n: int, work: Path, extra: list[str]) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args = ["--config", "examples/demo.yaml", "--num-rollout", str(n), *MODES[mode], "--work-dir", str(work / "w"),
            "--save", str(work / "ck"), "--summary-json", str(work / "summary.json"), *extra]
    t0 = time.perf_counter()
    with open(work / "console.log", "w") as log:
        rc = subprocess.run([sys.executable, "-m", "flows.cli", "train", *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{mode}: rollflow train exited {rc}; see {work / 'console.log'}")
    s = json.loads((work / "summary.json").read_text())
    h = s["history"]
    rewards = [h["rollout/reward_mean"][str(i)] for i in range(n)]
    done = [s["rollout_done_s"][str(i)] for i in range(n)]
    st = h.get("async/staleness_mean", {})
    return {"mode": mode, "command": "rollflow train " + " ".join(args), "process_wall_s": round(time.perf_counter() - t0, 1),
            "loop_wall_s": round(s["loop_wall_s"], 2), "wall_per_rollout_s": round(s["loop_wall_s"] / n, 4),
            "accuracy_before": s["test_accuracy_before"], "accuracy_after": s["test_accuracy_after"],
            "reward_first3": s["reward_first"], "reward_last3": s["reward_last"], "rewards": rewards,
            "time_to_reward_s": {str(t): time_to(rewards, done, t) for t in (0.5, 0.6, 0.7, 0.8)},
            "staleness_mean": round(statistics.mean(st.values()), 3) if st else 0.0,
            "stage_seconds_mean": {k: round(statistics.mean(h[f"{k}/seconds"].values()), 4)
                                   for k in ("rollout", "pack", "train", "sync") if f"{k}/seconds" in h}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-rollout", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--work", default="/tmp/rollflow_bench_async")
    p.add_argument("--extra", default="", help="more `rollflow train` flags, one string")
    p.add_argument("--name", default="async", help="results as <out>/<name>.json and <name>_table.md")
    p.add_argument("--modes", default=",".join(MODES), help="which modes, comma-separated (sync is needed: the "
                                                            "speed-ups are against it)")
    a = p.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if "sync" not in modes or any(m not in MODES for m in modes):
        p.error(f"--modes {a.modes!r}: sync plus any of {', '.join(MODES)}")
    runs = []
    for r in range(a.repeats):
        for mode in modes:
            res = one(mode, a.num_rollout, Path(a.work) / f"{mode}_{r}", a.extra.split())
            res["repeat"] = r
            runs.append(res)
            print(f"[{time.strftime('%H:%M:%S')}] {mode} #{r}: {res['wall_per_rollout_s']:.3f} s/rollout, accuracy "
                  f"{res['accuracy_before']:.3f} → {res['accuracy_after']:.3f}, loop {res['loop_wall_s']} s",
                  flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs if x["mode"] == mode)

    out = {
        "command": "python bench/async.py " + " ".join(f"'{x}'" if " " in x else x for x in sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "num_rollout": a.num_rollout,
        "repeats": a.repeats,
        "modes": {m: " ".join(MODES[m]) for m in modes},
        "wall_per_rollout_s": {m: med(m, "wall_per_rollout_s") for m in modes},
        **{key: round(med("sync", "wall_per_rollout_s") / med(m, "wall_per_rollout_s"), 3)
           for m, key in SPEEDUP_KEYS.items() if m in modes},
        **{f"accuracy_{m}": med(m, "accuracy_after") for m in modes},
        "accuracy_before": med("sync", "accuracy_before"),
        "runs": runs,
    }
    dst = Path(a.out)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    rows = ["| mode | wall s per rollout (median) | × vs sync | greedy test accuracy after | time to reward 0.7 / 0.8 "
            "(s into the loop, per repeat) | staleness mean |", "|---|---|---|---|---|---|"]
    for m in modes:
        rs = [x for x in runs if x["mode"] == m]
        tt = "; ".join(f"{x['time_to_reward_s']['0.7']} / {x['time_to_reward_s']['0.8']}" for x in rs)
        accs = ", ".join("%.1f%%" % (100 * x["accuracy_after"]) for x in rs)
        rows.append(f"| {m} | {med(m, 'wall_per_rollout_s'):.3f} | "
                    f"{med('sync', 'wall_per_rollout_s') / med(m, 'wall_per_rollout_s'):.2f} | {accs} | {tt} | "
                    f"{statistics.mean(x['staleness_mean'] for x in rs):.2f} |")
    table = "\n".join([f"`{out['command']}` on {out['machine']['host']} ({out['machine']['cpus']} CPUs, "
                       f"{out['machine']['platform']}), {out['date']}; {a.num_rollout} rollouts of the demo task per "
                       f"run, {a.repeats} runs per mode. Greedy test accuracy before training: "
                       f"{100 * out['accuracy_before']:.1f}%.", "", *rows])
    print(table)
    (dst / f"{a.name}_table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
