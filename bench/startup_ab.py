"""Start-up of `rollflow train` in two checkouts, interleaved pairs: what a start-up change gains on this machine.

    git worktree add /tmp/base <commit>; ln -s "$PWD/.venv" /tmp/base/.venv   # the checkout to compare against
    python bench/startup_ab.py --base /tmp/base --new . --pairs 10 --name startup_ab_<what>

Each pair runs the CPU demo (examples/demo.yaml, no eval set, `--num-rollout 2` unless told) once per checkout,
each a fresh process started from that checkout's folder (its own `flows`, `engine` and `plumbing` come first on
the path; the virtual environment is this one's), the order alternating from pair to pair. Start-up is the time
from the process's creation to the first step (the summary's `loop_started_unix`), as in bench/trl_race.py. The
2-core VM drifts by 15-30% within minutes, so only a pair compares like with like: the result says in how many
pairs the new checkout started sooner, with both sides' medians.

Writes <out>/<name>.json and <name>_table.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit(checkout: Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "?") + ("+changes" if dirty else "")


def demo_command(work: Path, num_rollout: int, extra: list[str]) -> list[str]:
    """`rollflow train` on the CPU demo without its eval set, everything under `work` (emptied first), one save at
    the end, as this interpreter's module (the checkout it runs from comes first on the path)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return [sys.executable, "-m", "flows.cli", "train", "--config", "examples/demo.yaml", "--num-rollout",
            str(num_rollout), "--eval-prompt-data", "", "--work-dir", str(work / "w"), "--save", str(work / "ck"),
            "--save-interval", "1000", "--summary-json", str(work / "summary.json"), *extra]


def start_up(checkout: Path, work: Path, num_rollout: int, extra: list[str]) -> float:
    """One `rollflow train` run from `checkout`; seconds from its spawn to its first step."""
    cmd = demo_command(work, num_rollout, extra)
    t0 = time.time()
    with open(work / "console.log", "w") as log:
        rc = subprocess.run(cmd, cwd=checkout, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{checkout}: rollflow train exited {rc}; see {work / 'console.log'}")
    return round(json.loads((work / "summary.json").read_text())["loop_started_unix"] - t0, 2)


def write(res: dict, out: Path, name: str) -> None:
    pairs = res["pairs"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=2))
    rows = "\n".join(f"| {i + 1} | {q['first']} | {q['base']} | {q['new']} | {q['new'] - q['base']:+.2f} |"
                     for i, q in enumerate(pairs))
    table = (f"`{res['command']}` on {res['machine']}, {res['date']}: base {res['base']}, new {res['new']}.\n\n"
             f"| pair | ran first | base start-up (s) | new start-up (s) | new − base (s) |\n|---|---|---|---|---|\n"
             f"{rows}\n\nNew sooner in {res['new_sooner_in']} of {len(pairs)} pairs; medians "
             f"{res['median_base_s']} → {res['median_new_s']} s (median difference {res['median_pair_difference_s']:+.2f} s).\n")
    (out / f"{name}_table.md").write_text(table)
    print(table)


def ab_args(description: str, *, pairs: int, num_rollout: int, work: str, name: str) -> argparse.Namespace:
    """The arguments of an interleaved A/B of two checkouts (this script, bench/process_cpu_ab.py), checked:
    --base and --new are rollflow checkouts (resolved to paths), at least one pair and one rollout."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the checkout to compare against (a git worktree)")
    p.add_argument("--new", default=str(ROOT), help="the checkout with the change (default: this one)")
    p.add_argument("--pairs", type=int, default=pairs)
    p.add_argument("--num-rollout", type=int, default=num_rollout)
    p.add_argument("--extra", default="", help="more `rollflow train` flags for both sides, one string")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--work", default=work)
    p.add_argument("--name", default=name)
    a = p.parse_args()
    a.base, a.new = Path(a.base).resolve(), Path(a.new).resolve()
    for side, path in (("--base", a.base), ("--new", a.new)):
        if not (path / "flows" / "cli.py").is_file():
            p.error(f"{side} {path}: not a rollflow checkout (no flows/cli.py)")
    if a.pairs < 1 or a.num_rollout < 1:
        p.error(f"--pairs {a.pairs} / --num-rollout {a.num_rollout}: at least 1 each")
    return a


def interleaved(a: argparse.Namespace, run) -> list[dict]:
    """`run(checkout, work_dir)` once per side in each of `a.pairs` pairs, the side run first alternating."""
    pairs = []
    for i in range(a.pairs):
        order = [("base", a.base), ("new", a.new)] if i % 2 == 0 else [("new", a.new), ("base", a.base)]
        got = {side: run(path, Path(a.work) / side) for side, path in order}
        pairs.append({"first": order[0][0], **got})
        print(f"pair {i + 1}/{a.pairs}: base {got['base']}, new {got['new']}", file=sys.stderr, flush=True)
    return pairs


def main() -> int:
    a = ab_args(__doc__, pairs=10, num_rollout=2, work="/tmp/rollflow_bench_startup_ab", name="startup_ab")
    base, new = a.base, a.new
    pairs = interleaved(a, lambda path, work: start_up(path, work, a.num_rollout, a.extra.split()))
    sooner = sum(q["new"] < q["base"] for q in pairs)
    res = {"command": "python bench/startup_ab.py " + shlex.join(sys.argv[1:]),
           "machine": f"{platform.node()} ({platform.platform()}, {__import__('os').cpu_count()} CPUs)",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "base": commit(base), "new": commit(new),
           "num_rollout": a.num_rollout, "pairs": pairs, "new_sooner_in": sooner,
           "median_base_s": round(statistics.median(q["base"] for q in pairs), 2),
           "median_new_s": round(statistics.median(q["new"] for q in pairs), 2),
           "median_pair_difference_s": round(statistics.median(q["new"] - q["base"] for q in pairs), 2)}
    write(res, Path(a.out), a.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
