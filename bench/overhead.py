"""Prefect's overhead per RL iteration: the demo's rollouts through the `rl-train` flow vs the same engine calls.

    python bench/overhead.py --out bench/results/overhead.json [--num-rollout 12] [--repeats 2]

Both modes run the demo config (examples/demo.yaml: B = 8 prompts × n = 8 samples, one optimizer step per rollout)
with the same seed on the same machine, without eval and with one save at the end. The five stage functions
(engine.stages.rollout / pack / train / save / sync) are wrapped with timers, so each iteration splits into
    stage seconds     time inside the stages (identical work in both modes: same seeds, same weights)
    other seconds     iteration wall time (start of rollout k → start of rollout k+1) minus stage seconds
In direct mode "other" is the driver's own bookkeeping (recording metrics, MLflow calls); in flow mode it also holds
Prefect: task-run creation, state transitions, artifacts, the logger. Prefect's overhead per iteration is
other(flow) − other(direct), reported in seconds and as a share of the flow's iteration time; per task it is that
divided by the 5 task runs of an iteration. The first iteration of each mode is left out (warm-up: first batch,
first optimizer step). Modes alternate per repeat so load drifts hit both.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")

STAGES = ("rollout", "pack", "train", "save", "sync")


class StageTimer:
    """Wraps engine.stages' stage functions; records (stage, rollout_id, start, end)."""

    def __init__(self):
        from engine import stages

        self.events: list[tuple[str, int, float, float]] = []
        self.originals = {name: getattr(stages, name) for name in STAGES}
        for name, fn in self.originals.items():
            setattr(stages, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def timed(run, arg, *a, **kw):
            rid = arg if isinstance(arg, int) else arg.rollout_id
            t0 = time.perf_counter()
            try:
                return fn(run, arg, *a, **kw)
            finally:
                self.events.append((name, rid, t0, time.perf_counter()))
        return timed

    def restore(self):
        from engine import stages

        for name, fn in self.originals.items():
            setattr(stages, name, fn)

    def iterations(self) -> list[dict]:
        """Per rollout id k (except the last, which has no next start): wall, stage and other seconds."""
        starts = {rid: t0 for name, rid, t0, _ in self.events if name == "rollout"}
        out = []
        for k in sorted(starts)[:-1]:
            wall = starts[k + 1] - starts[k]
            inside = sum(t1 - t0 for _, rid, t0, t1 in self.events if rid == k)
            out.append({"rollout_id": k, "wall_s": wall, "stage_s": inside, "other_s": wall - inside})
        return out


def config(work: Path, num_rollout: int):
    from engine.config import RunConfig
    from engine.config.cli import load_yaml

    raw = load_yaml(str(ROOT / "examples" / "demo.yaml"))
    raw.update(work_dir=str(work), save=str(work / "ckpt"), summary_json=None, num_rollout=num_rollout,
               save_interval=None, eval_prompt_data="", progress=False, experiment_name="bench-overhead")
    return RunConfig(**raw)


def run_direct(cfg) -> None:
    """The flow's loop without Prefect: the same stage calls (each stage records its own metrics and MLflow
    records, so nothing here copies what a task does)."""
    from engine import stages
    from engine.tracking.record import finish

    tracker = stages.track(cfg)
    run = stages.place(cfg, tracker=tracker)
    try:
        start = stages.convert(run)
        for k in range(start, cfg.num_rollout):
            batch = stages.rollout(run, k)
            packed = stages.pack(run, batch)
            stages.train(run, packed)
            if stages.should_save(cfg, k):
                stages.save(run, k)
            stages.sync(run, k)
        finish(tracker, run.history)
    finally:
        run.close()


def run_flow(cfg) -> None:
    from flows.train import rl_train

    rl_train(cfg)


def noop_task_floor(n: int = 50) -> float:
    """Seconds per call of a task that does nothing (same options as the stage tasks), inside a flow: Prefect's own
    floor per task run on this machine."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    @task(name="noop", task_run_name="noop-{i}", cache_policy=NO_CACHE)
    def noop(handle, i: int) -> dict:
        return {"i": float(i)}

    @flow(name="noop-floor")
    def many() -> float:
        handle = object()
        noop(handle, -1)  # warm-up
        t0 = time.perf_counter()
        for i in range(n):
            noop(handle, i)
        return (time.perf_counter() - t0) / n

    return many()


def summarize(iters: list[dict]) -> dict:
    body = iters[1:]  # iteration 0 is warm-up
    med = lambda key: statistics.median(i[key] for i in body)  # noqa: E731
    return {"iterations": len(body), "wall_s": med("wall_s"), "stage_s": med("stage_s"), "other_s": med("other_s"),
            "other_s_min": min(i["other_s"] for i in body), "other_s_max": max(i["other_s"] for i in body)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    ap.add_argument("--num-rollout", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    results: dict[str, list] = {"direct": [], "flow": []}
    with prefect_test_harness(server_startup_timeout=180), tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode in (("direct", "flow") if rep % 2 == 0 else ("flow", "direct")):
                cfg = config(Path(tmp) / f"{mode}-{rep}", args.num_rollout)
                timer = StageTimer()
                t0 = time.perf_counter()
                try:
                    (run_direct if mode == "direct" else run_flow)(cfg)
                finally:
                    timer.restore()
                s = summarize(timer.iterations())
                s["total_s"] = time.perf_counter() - t0
                results[mode].append(s)
                print(f"{mode:6s} repeat {rep}: iteration {s['wall_s']:.3f} s (stages {s['stage_s']:.3f}, other "
                      f"{s['other_s']:.3f}), run {s['total_s']:.1f} s", flush=True)

        floor = noop_task_floor()
    print(f"a no-op task run costs {floor * 1000:.1f} ms here")
    other = {m: statistics.median(r["other_s"] for r in results[m]) for m in results}
    wall = statistics.median(r["wall_s"] for r in results["flow"])
    overhead = other["flow"] - other["direct"]
    report = {
        "command": "python bench/overhead.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "num_rollout": args.num_rollout, "repeats": args.repeats, "runs": results,
        "prefect_overhead_s_per_iteration": overhead,
        "prefect_overhead_share": overhead / wall,
        "prefect_overhead_s_per_task": overhead / len(STAGES),
        "flow_iteration_s": wall, "direct_iteration_s": statistics.median(r["wall_s"] for r in results["direct"]),
        "noop_task_s": floor, "target_share": 0.03,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"Prefect overhead: {overhead:.3f} s per iteration = {100 * overhead / wall:.2f}% of {wall:.3f} s "
          f"({overhead / len(STAGES) * 1000:.1f} ms per task run); target ≤ 3%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
