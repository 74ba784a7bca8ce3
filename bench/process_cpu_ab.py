"""CPU seconds per process of `rollflow train` in two checkouts, interleaved pairs: what a change costs or saves
in CPU (which a wall-clock A/B on the drifting 2-core VM often cannot show), with the loop's wall time beside it.

    git worktree add /tmp/base <commit>; ln -s "$PWD/.venv" /tmp/base/.venv   # the checkout to compare against
    python bench/process_cpu_ab.py --base /tmp/base --new . --pairs 3 --num-rollout 100 --name process_cpu_<what>

Each pair runs the CPU demo (examples/demo.yaml, no eval set) once per checkout, each a fresh process started from
that checkout's folder, the order alternating from pair to pair (as bench/startup_ab.py). While it runs, every
process of its tree is sampled every 0.2 s (psutil: user + system CPU); a process's last sample is its CPU. The
processes are grouped by kind: the driver (`rollflow train`), the Prefect API server it launched
(plumbing/api_server.py), Ray's workers (`ray::…`: the train worker, an engine of its own), the rest (Ray's own
services). A process's CPU after its last sample (≤ 0.2 s) is not counted. Loop seconds per rollout: the summary's
`loop_wall_s` over its rollouts.

Writes <out>/<name>.json and <name>_table.md.
"""
from __future__ import annotations

import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_ab import ab_args, commit, demo_command, interleaved  # noqa: E402 — bench/ is not a package

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("driver", "api_server", "ray_workers", "ray_services")


def kind(proc: psutil.Process, root_pid: int) -> str | None:
    """The process's kind, None when its command line cannot be read now (starting, exiting)."""
    if proc.pid == root_pid:
        return "driver"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if not cmd:
        return None
    if "api_server.py" in cmd:
        return "api_server"
    return "ray_workers" if cmd.startswith("ray::") or "default_worker.py" in cmd else "ray_services"


def one_run(checkout: Path, work: Path, num_rollout: int, extra: list[str]) -> dict:
    """One `rollflow train` run from `checkout`: CPU seconds per kind of process, the loop's seconds per rollout."""
    cmd = demo_command(work, num_rollout, extra)
    last: dict[int, tuple[str, float]] = {}
    with open(work / "console.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=checkout, stdout=log, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                tree = []
            for p in tree:
                try:
                    t = p.cpu_times()
                    seen = last.get(p.pid, ("ray_services", 0.0))[0]
                    now = kind(p, proc.pid)  # a Ray worker names itself once it holds an actor
                    last[p.pid] = (seen if now is None or seen in ("driver", "api_server", "ray_workers") else now,
                                   t.user + t.system)
                except psutil.Error:
                    pass
            time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: rollflow train exited {proc.returncode}; see {work / 'console.log'}")
    summary = json.loads((work / "summary.json").read_text())
    cpu = {k: round(sum(c for kk, c in last.values() if kk == k), 2) for k in KINDS}
    return {"cpu_s": cpu, "cpu_total_s": round(sum(cpu.values()), 2),
            "loop_s_per_rollout": round(summary["loop_wall_s"] / max(summary["rollouts"], 1), 4)}


def main() -> int:
    a = ab_args(__doc__, pairs=3, num_rollout=100, work="/tmp/rollflow_bench_process_cpu_ab", name="process_cpu_ab")
    base, new = a.base, a.new
    pairs = interleaved(a, lambda path, work: one_run(path, work, a.num_rollout, a.extra.split()))
    med = {side: {**{k: round(statistics.median(q[side]["cpu_s"][k] for q in pairs), 2) for k in KINDS},
                  "total": round(statistics.median(q[side]["cpu_total_s"] for q in pairs), 2),
                  "loop_s_per_rollout": round(statistics.median(q[side]["loop_s_per_rollout"] for q in pairs), 4)}
           for side in ("base", "new")}
    res = {"command": "python bench/process_cpu_ab.py " + shlex.join(sys.argv[1:]),
           "machine": f"{platform.node()} ({platform.platform()}, {psutil.cpu_count()} CPUs)",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "base": commit(base), "new": commit(new),
           "num_rollout": a.num_rollout, "extra": a.extra, "pairs": pairs, "medians": med,
           "loop_faster_in": sum(q["new"]["loop_s_per_rollout"] < q["base"]["loop_s_per_rollout"] for q in pairs)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(res, indent=2))
    cols = [*KINDS, "total"]
    rows = "\n".join(f"| {i + 1} {side} | " + " | ".join(
        str(q[side]["cpu_s"][k] if k != "total" else q[side]["cpu_total_s"]) for k in cols)
        + f" | {q[side]['loop_s_per_rollout']} |" for i, q in enumerate(pairs) for side in ("base", "new"))
    table = (f"`{res['command']}` on {res['machine']}, {res['date']}: base {res['base']}, new {res['new']}, "
             f"{a.num_rollout} rollouts a run.\n\n| pair, side | CPU s: " + " | ".join(cols)
             + " | loop s per rollout |\n|---|" + "---|" * (len(cols) + 1) + f"\n{rows}\n"
             + "| **median base** | " + " | ".join(str(med["base"][k]) for k in cols)
             + f" | {med['base']['loop_s_per_rollout']} |\n| **median new** | "
             + " | ".join(str(med["new"][k]) for k in cols) + f" | {med['new']['loop_s_per_rollout']} |\n\n"
             + f"The loop was faster with the new checkout in {res['loop_faster_in']} of {len(pairs)} pairs.\n")
    (out / f"{a.name}_table.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
