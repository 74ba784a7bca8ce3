"""--async-save against plain saves: the demo flow, a checkpoint after every rollout, local disk and S3.

    PYTHONPATH=. python bench/async_save.py --pairs 3 --num-rollout 30 --out bench/results/async_save.json

Each pair runs `rollflow train --config examples/demo.yaml --save-interval 1` twice, without and with --async-save
(the order alternating per pair), into a fresh --save each time: a local directory, and `s3://` on a moto server
(`moto_server`, its own process, in-memory, on 127.0.0.1: the client path — s3fs, HTTP, hashing — against a
Python server, not a real object store's bandwidth). Read back per run: the loop's wall time (summary.json
loop_wall_s: first rollout to the last step, so start-up is out; with --async-save the last commit runs beside the
final evaluation, after it), the whole process's wall time (start-up included, so noisier), and from MLflow the per-save split —
save/state_seconds (written before the loop goes on, both ways), save/commit_seconds (hash, fsync or upload,
manifest, marker, retention: in the loop without --async-save, beside it with) and save/wait_seconds (how long a
save waited for the previous commit). The final checkpoint of both runs must verify (resolve_start checks every
file's sha256) and name the last rollout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.checkpoint_io import start_moto_process  # noqa: E402


def save_metrics(db: Path) -> dict[str, list[float]]:
    con = sqlite3.connect(db)
    out: dict[str, list[float]] = {}
    for key, value in con.execute("SELECT key, value FROM metrics WHERE key LIKE 'save/%' ORDER BY step"):
        out.setdefault(key, []).append(value)
    con.close()
    return out


def one_run(save: str, num_rollout: int, async_save: bool, work: Path, env: dict[str, str]) -> dict:
    from engine import checkpoint

    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", "examples/demo.yaml", "--num-rollout",
           str(num_rollout), "--save", save, "--save-interval", "1", "--work-dir", str(work), "--summary-json",
           str(work / "summary.json"), "--no-progress", *(["--async-save"] if async_save else [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    summary = json.loads((work / "summary.json").read_text())
    m = save_metrics(work / "mlflow.db")
    start = checkpoint.resolve_start(load=None, save=save, ckpt_step=None, load_optim=True, staging=work / "verify")
    assert start.iteration == num_rollout - 1 and summary["last_checkpoint"] == num_rollout - 1, (start, summary)
    return {"async_save": async_save, "process_wall_s": wall, "loop_wall_s": summary["loop_wall_s"],
            "saves": len(m.get("save/seconds", [])), "state_s_sum": sum(m.get("save/state_seconds", [])),
            "commit_s_sum": sum(m.get("save/commit_seconds", [])), "wait_s_sum": sum(m.get("save/wait_seconds", [])),
            "save_mb": statistics.median(m["save/mb"]), "reward_last": summary["reward_last"],
            "verified_iteration": start.iteration}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--num-rollout", type=int, default=30)
    p.add_argument("--stores", nargs="*", default=["local", "s3"])
    p.add_argument("--out", default=None)
    a = p.parse_args()

    server = None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if "s3" in a.stores:
        import fsspec

        server, url = start_moto_process()
        creds = {"AWS_ENDPOINT_URL_S3": url, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update(creds)
        env.update(creds)
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
    tmp = Path(tempfile.mkdtemp(prefix="async-save-"))
    runs = []
    try:
        for pair in range(a.pairs):
            for store in a.stores:
                order = (False, True) if pair % 2 == 0 else (True, False)
                for async_save in order:
                    tag = f"{store}-{pair}-{'async' if async_save else 'plain'}"
                    save = str(tmp / tag / "ckpt") if store == "local" else f"s3://bench/{tag}"
                    r = one_run(save, a.num_rollout, async_save, tmp / tag / "work", env)
                    r.update(store=store, pair=pair)
                    runs.append(r)
                    print(json.dumps(r), flush=True)
                    shutil.rmtree(tmp / tag, ignore_errors=True)
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    table = {}
    for store in a.stores:
        pairs = []
        for pair in range(a.pairs):
            plain, asy = (next(r for r in runs if r["store"] == store and r["pair"] == pair and r["async_save"] == s)
                          for s in (False, True))
            pairs.append({"pair": pair, "loop_wall_s_plain": plain["loop_wall_s"], "loop_wall_s_async": asy["loop_wall_s"],
                          "process_wall_s_plain": plain["process_wall_s"],
                          "process_wall_s_async": asy["process_wall_s"],
                          "loop_ratio_async_over_plain": asy["loop_wall_s"] / plain["loop_wall_s"],
                          "commit_s_sum_plain": plain["commit_s_sum"], "commit_s_sum_async": asy["commit_s_sum"],
                          "wait_s_sum_async": asy["wait_s_sum"], "state_s_sum_plain": plain["state_s_sum"],
                          "state_s_sum_async": asy["state_s_sum"]})
        table[store] = pairs
    result = {"command": "PYTHONPATH=. python " + " ".join(["bench/async_save.py", *sys.argv[1:]]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "when_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "num_rollout": a.num_rollout,
              "runs": runs, "pairs": table}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    for store, pairs in table.items():
        for q in pairs:
            print(f"{store} pair {q['pair']}: loop {q['loop_wall_s_plain']:.2f} s plain → {q['loop_wall_s_async']:.2f} s "
                  f"async ({q['loop_ratio_async_over_plain']:.3f}×), process {q['process_wall_s_plain']:.2f} → "
                  f"{q['process_wall_s_async']:.2f} s; commits {q['commit_s_sum_plain']:.2f} s in the loop"
                  f" → {q['commit_s_sum_async']:.2f} s beside it, waited {q['wait_s_sum_async']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
