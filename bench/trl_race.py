"""rollflow against TRL's GRPOTrainer on the same CPU task, both in one run: time to a reward, per-step cost, start-up.

    pip install -e '.[bench]'          # trl (and its accelerate, datasets) from PyPI
    python bench/trl_race.py --num-rollout 40 --out bench/results

The task is the CPU demo's (examples/demo.yaml): the bundled 1M-parameter Qwen2 (examples/tiny-qwen2-arith), the
arithmetic prompts through its chat template, 8 prompts × 8 samples per step, answers up to 8 tokens at T = 1,
exact-match reward (rollflow's own function on both sides), GRPO advantages (group mean and std), the per-sample
token-mean loss with clip ε = 0.2 and no KL (TRL: loss_type "grpo", beta 0), one optimizer step per rollout over
micro-batches of 16, AdamW lr 3e-4 constant, β = (0.9, 0.98), weight decay 0, grad clip 1.0, seed 1234, fp32 without
activation recompute (TRL's GRPOConfig defaults to bf16 autocast and gradient checkpointing: 3.3 s a step here
instead of 0.2 s, so both are turned off). Neither side
evaluates (TRL has no eval here; rollflow gets `--eval-prompt-data` empty) so the clocks count the same work.

Sides, each a fresh process (start-up counted from the process's creation): `trl` (GRPOTrainer, transformers
generate in-process), `rollflow` (`rollflow train`, sync), `rollflow_async` (`--async-mode one-step`, engine and
trainer overlapping on the two cores), optionally `rollflow_tis` (one-step with --use-tis). Per side: start-up (process
start → first step begins), time from process start to running-mean reward (last 5 steps) 0.5 / 0.8 / 0.9 / 0.95,
seconds per step (median of the steps after the first; the split into rollout / train / sync / other), steps/s, peak
memory (RSS summed over the process tree, sampled every 0.2 s) and its process count.

Writes <out>/<name>.json and <name>_table.md (bench/results/trl_race.md discusses them).
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny-qwen2-arith"
TRAIN = ROOT / "examples" / "data" / "arith" / "train.jsonl"
THRESHOLDS = (0.5, 0.8, 0.9, 0.95)
WINDOW = 5
SIDES = {"trl": [], "rollflow": ["--async-mode", "off"], "rollflow_async": ["--async-mode", "one-step"],
         "rollflow_tis": ["--async-mode", "one-step", "--use-tis"]}


def machine() -> dict:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def time_to(rewards: list[float], done_s: list[float], threshold: float) -> float | None:
    """Seconds (from process start) when the running mean of the last WINDOW step rewards first reaches threshold."""
    for i in range(len(rewards)):
        lo = max(0, i - WINDOW + 1)
        if sum(rewards[lo:i + 1]) / (i + 1 - lo) >= threshold:
            return round(done_s[i], 2)
    return None


class TreeMemory:
    """Peak RSS summed over a process and its descendants (sampled), and how many processes that peak had."""

    def __init__(self, pid: int, every: float = 0.2):
        import psutil

        self.root, self.every = psutil.Process(pid), every
        self.peak_mb, self.procs = 0.0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                ps = [self.root, *self.root.children(recursive=True)]
                total = 0
                for p in ps:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                if total / 2**20 > self.peak_mb:
                    self.peak_mb, self.procs = total / 2**20, len(ps)
            except psutil.Error:
                pass
            self._stop.wait(self.every)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        return {"peak_rss_mb": round(self.peak_mb), "processes": self.procs}


# ---- TRL (runs in its own process: `--side-process trl`) --------------------------------------------------------
def trl_timers(marks: dict, logged: dict[str, str], sync=None):
    """A GRPOTrainer subclass that times each generate-and-score (seconds into marks["gen_s"]) and a callback that
    marks the train's begin and every step's end (wall clock) and copies the logged keys `logged` (TRL's name →
    marks' list). `sync` (e.g. torch.cuda.synchronize) runs before each clock reading: GPU work is counted where
    it ran. Returns (trainer class, callback); bench/gpu_rl_step.py uses it too."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    wait = sync or (lambda: None)

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks["train_begin"] = time.time()

        def on_step_end(self, *a, **k):
            wait()
            marks["step_end"].append(time.time())

        def on_log(self, args, state, control, logs=None, **k):
            for src, dst in logged.items():
                if logs and src in logs:
                    marks[dst].append(float(logs[src]))

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                wait()
                marks["gen_s"].append(time.perf_counter() - t)

    return Timed, Clock()


def trl_side(num_rollout: int, out: Path) -> None:
    t_import = time.time()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from engine.rewards import exact_match

    torch.manual_seed(1234)
    rows = [json.loads(x) for x in TRAIN.read_text().splitlines() if x.strip()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

    def reward(completions, label, **_):
        return [exact_match(c[0]["content"] if isinstance(c, list) else c, y) for c, y in zip(completions, label)]

    cfg = GRPOConfig(output_dir=str(out / "trl_out"), per_device_train_batch_size=16, gradient_accumulation_steps=4,
                     num_generations=8, max_completion_length=8, temperature=1.0, learning_rate=3e-4,
                     lr_scheduler_type="constant", adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-8,
                     weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="grpo",
                     scale_rewards="group", num_iterations=1, max_steps=num_rollout, logging_steps=1,
                     save_strategy="no", report_to=[], use_cpu=True, seed=1234, data_seed=1234,
                     disable_tqdm=True, dataloader_num_workers=0,
                     bf16=False, gradient_checkpointing=False)  # TRL's defaults; rollflow trains fp32, no recompute
    marks: dict = {"step_end": [], "rewards": [], "gen_s": []}
    Timed, clock = trl_timers(marks, {"reward": "rewards"})
    trainer = Timed(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                    callbacks=[clock])
    trainer.train()
    marks["import_started"] = t_import
    (out / "trl_marks.json").write_text(json.dumps(marks))


def spawn(side: str, cmd: list[str], work: Path, env: dict | None = None) -> tuple[float, dict]:
    """Run one side's process to the end (its output in work/console.log) while sampling its memory; returns the
    wall time just before the spawn (start-up and every mark count from it) and the memory peak."""
    t0 = time.time()
    with open(work / "console.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        mem = TreeMemory(proc.pid)
        rc = proc.wait()
    memory = mem.stop()
    if rc != 0:
        raise SystemExit(f"{side}: exited {rc}; see {work / 'console.log'}")
    return t0, memory


def run_trl(num_rollout: int, work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0, memory = spawn("trl", [sys.executable, __file__, "--side-process", "trl", "--num-rollout", str(num_rollout),
                               "--work", str(work)], work, env={**os.environ, "PYTHONPATH": str(ROOT)})
    m = json.loads((work / "trl_marks.json").read_text())
    ends = [e - t0 for e in m["step_end"]]
    begin = m["train_begin"] - t0
    steps = [b - a for a, b in zip([begin, *ends[:-1]], ends)]
    rest = steps[1:] or steps
    gen = m["gen_s"][1:] or m["gen_s"]
    return {"side": "trl", "startup_s": round(begin, 2), "rewards": m["rewards"], "done_s": [round(x, 2) for x in ends],
            "step_s": round(statistics.median(rest), 4), "steps_per_s": round(1 / statistics.median(rest), 2),
            "split_s": {"rollout": round(statistics.median(gen), 4),
                        "train": round(statistics.median(rest) - statistics.median(gen), 4)},
            "time_to_reward_s": {str(t): time_to(m["rewards"], ends, t) for t in THRESHOLDS},
            "process_wall_s": round(time.time() - t0, 1), **memory}


def run_rollflow(side: str, num_rollout: int, work: Path, extra: list[str]) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args = ["--config", "examples/demo.yaml", "--num-rollout", str(num_rollout), "--eval-prompt-data", "",
            *SIDES[side], "--work-dir", str(work / "w"), "--save", str(work / "ck"), "--save-interval", "1000",
            "--summary-json", str(work / "summary.json"), *extra]
    t0, memory = spawn(side, [sys.executable, "-m", "flows.cli", "train", *args], work)
    s = json.loads((work / "summary.json").read_text())
    h = s["history"]
    n = num_rollout
    startup = s["loop_started_unix"] - t0
    rewards = [h["rollout/reward_mean"][str(i)] for i in range(n)]
    ends = [startup + s["rollout_done_s"][str(i)] for i in range(n)]
    steps = [b - a for a, b in zip([startup, *ends[:-1]], ends)]
    rest = steps[1:]

    def stage(k: str) -> float | None:
        v = [h[f"{k}/seconds"][str(i)] for i in range(1, n) if str(i) in h.get(f"{k}/seconds", {})]
        return round(statistics.median(v), 4) if v else None

    split = {k: stage(k) for k in ("rollout", "pack", "train", "sync")}
    # sync mode: the step minus its stages (Prefect, MLflow, the driver); async stages overlap, so no remainder
    split["other"] = round(statistics.median(rest) - sum(v for v in split.values() if v), 4) \
        if "--async-mode" not in SIDES[side] or SIDES[side][1] == "off" else None
    return {"side": side, "command": "rollflow train " + " ".join(args), "startup_s": round(startup, 2),
            "rewards": rewards, "done_s": [round(x, 2) for x in ends], "step_s": round(statistics.median(rest), 4),
            "steps_per_s": round(1 / statistics.median(rest), 2), "split_s": split,
            "time_to_reward_s": {str(t): time_to(rewards, ends, t) for t in THRESHOLDS},
            "process_wall_s": round(time.time() - t0, 1), **memory}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-rollout", type=int, default=40)
    p.add_argument("--sides", default="trl,rollflow,rollflow_async", help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--work", default="/tmp/rollflow_bench_trl_race")
    p.add_argument("--name", default="trl_race", help="results as <out>/<name>.json and <name>_table.md")
    p.add_argument("--extra", default="", help="more `rollflow train` flags for the rollflow sides, one string")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the sides this many times, interleaved (all sides, then all again, ...): each number is "
                        "then the median over the rounds, and the ratios to TRL are given per round (the 2-core VM "
                        "drifts by 15-30%% within minutes; a ratio within one round compares like with like)")
    p.add_argument("--side-process", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side_process == "trl":
        trl_side(a.num_rollout, Path(a.work))
        return 0
    sides = [x for x in a.sides.split(",") if x]
    if any(x not in SIDES for x in sides):
        p.error(f"--sides {a.sides!r}: any of {', '.join(SIDES)}")
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: at least 1")
    rounds = []
    for i in range(a.rounds):
        res = {}
        for side in sides:
            work = Path(a.work) / side
            res[side] = run_trl(a.num_rollout, work) if side == "trl" else run_rollflow(side, a.num_rollout, work,
                                                                                          a.extra.split())
            r = res[side]
            print(f"[{time.strftime('%H:%M:%S')}] round {i + 1}/{a.rounds}, {side}: start-up {r['startup_s']} s, "
                  f"{r['step_s']} s/step, to 0.8: {r['time_to_reward_s']['0.8']} s, peak {r['peak_rss_mb']} MB in "
                  f"{r['processes']} processes", flush=True)
        rounds.append(res)
    out = {"command": "python bench/trl_race.py " + " ".join(f"'{x}'" if " " in x or not x else x
                                                           for x in sys.argv[1:]),
           "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "num_rollout": a.num_rollout, "window": WINDOW,
           "sides": rounds[0] if a.rounds == 1 else {side: median_side([r[side] for r in rounds]) for side in sides}}
    if a.rounds > 1:
        out["rounds"] = rounds
    if "trl" in sides:
        for side in sides:
            if side != "trl":
                steps = [round(r[side]["step_s"] / r["trl"]["step_s"], 3) for r in rounds]
                to = [r[side]["time_to_reward_s"]["0.8"] and r["trl"]["time_to_reward_s"]["0.8"]
                      and round(r[side]["time_to_reward_s"]["0.8"] / r["trl"]["time_to_reward_s"]["0.8"], 3)
                      for r in rounds]
                out[f"{side}_step_ratio_vs_trl"] = statistics.median(steps)
                out[f"{side}_time_to_0.8_ratio_vs_trl"] = statistics.median(to) if None not in to else None
                if a.rounds > 1:  # the same ratios within each round (the medians above are of these)
                    out[f"{side}_step_ratio_vs_trl_rounds"] = steps
                    out[f"{side}_time_to_0.8_ratio_vs_trl_rounds"] = to
    dst = Path(a.out)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    (dst / f"{a.name}_table.md").write_text(table(out) + "\n")
    print(table(out))
    return 0


def median_side(runs: list[dict]) -> dict:
    """One side over several rounds: the median of every number (top-level, per stage, per threshold) and of the
    reward at each step; a threshold counts as not reached (None) when most rounds did not reach it. The per-step
    times (done_s) stay in each round's own record."""
    def med(xs: list):
        got = [x for x in xs if x is not None]
        if len(got) * 2 <= len(xs):
            return None
        m = statistics.median(got)
        return int(round(m)) if all(isinstance(x, int) for x in got) else round(m, 4)

    out: dict = {"rounds": len(runs)}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            out[k] = {kk: med([r[k].get(kk) for r in runs]) for kk in v}
        elif k == "rewards":
            out[k] = [round(statistics.median(xs), 4) for xs in zip(*(r[k] for r in runs))]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = med([r[k] for r in runs])
        elif not isinstance(v, list):
            out[k] = v
    return out


def table(out: dict) -> str:
    res = out["sides"]
    head = "| | " + " | ".join(res) + " |"
    rows = [head, "|---" * (len(res) + 1) + "|"]

    def row(label: str, f) -> None:
        rows.append(f"| {label} | " + " | ".join(f(r) for r in res.values()) + " |")

    row("start-up to the first step (s)", lambda r: f"{r['startup_s']}")
    for t in THRESHOLDS:
        row(f"time to running-mean reward {t} (s from process start)", lambda r, t=t: f"{r['time_to_reward_s'][str(t)]}")
    row("whole step, median (s)", lambda r: f"{r['step_s']}")
    row("steps/s", lambda r: f"{r['steps_per_s']}")
    for k in ("rollout", "pack", "train", "sync", "other"):
        row(f"· {k} (s)", lambda r, k=k: f"{r['split_s'].get(k)}" if r["split_s"].get(k) is not None else "—")
    row("peak memory (MB, process tree)", lambda r: f"{r['peak_rss_mb']} in {r['processes']} processes")
    row("last-5 mean reward", lambda r: f"{sum(r['rewards'][-5:]) / 5:.3f}")
    n = len(out.get("rounds", [])) or 1
    notes = [f"- {side}: whole step ÷ TRL's in each round {out[f'{side}_step_ratio_vs_trl_rounds']}, time to 0.8 ÷ "
             f"TRL's {out[f'{side}_time_to_0.8_ratio_vs_trl_rounds']}"
             for side in res if f"{side}_step_ratio_vs_trl_rounds" in out]  # the VM's noise, measured
    each = f"{n} interleaved rounds, medians; " if n > 1 else ""
    return "\n".join([f"`{out['command']}` on {out['machine']['host']} ({out['machine']['cpus']} CPUs, "
                      f"{out['machine']['platform']}), {out['date']}; {each}{out['num_rollout']} steps per side.",
                      "", *rows, *([""] + notes if notes else [])])


if __name__ == "__main__":
    raise SystemExit(main())
