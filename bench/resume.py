"""The resume proof for longer runs: SIGKILL the training process at every boundary, restart the same command.

    PYTHONPATH=. python bench/resume.py --num-rollout 6 --s3-boundaries during_save --out bench/results/resume.json

1. Train --num-rollout rollouts uninterrupted (fixed seed, --sglang-enable-deterministic-inference, a save after every rollout).
2. For each boundary (after_rollout, during_train, during_save, before_marker, after_marker), a fresh run of the
   same command with ROLLFLOW_FAULT=<boundary>@<k> (k = the middle rollout): it SIGKILLs itself there; the exact
   same command (same flags, same environment) is started again until it exits 0 (ROLLFLOW_FAULT_STATE makes the
   fault fire once). `--chained` instead puts every fault into ONE run, at successive rollouts.
3. Required: every restarted run finishes; every iteration 0..N-1 exists and verifies (sha256); each iteration's
   weights (and optimizer state) are bitwise equal to the uninterrupted run's; one MLflow run id throughout.

Each launch is a new session; once it has exited (killed or not), whatever is left in its process group (the
ephemeral Prefect server, Ray's agents) is killed by that group id. The functions here are also used by
tests/test_resume_faults.py with a smaller config.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import checkpoint, faults  # noqa: E402

SMALL = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2",
         "--rollout-max-response-len", "8", "--apply-chat-template", "--lr", "1e-4", "--micro-batch-size", "4",
         "--eval-prompt-data", "", "--save-interval", "1", "--sglang-enable-deterministic-inference", "--no-progress",
         "--experiment-name", "resume-proof", "--run-name", "resume-proof"]


def train_command(num_rollout: int, work: Path, save: str, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train", *SMALL, "--num-rollout", str(num_rollout),
            "--work-dir", str(work), "--save", save, "--summary-json", str(work / "summary.json"), *extra]


def _reap(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)  # only the group this launcher created
    except ProcessLookupError:
        pass


def run_until_done(cmd: list[str], env: dict[str, str], log: Path, *, max_launches: int = 12,
                   timeout_s: float = 900) -> list[dict[str, Any]]:
    """Start `cmd` again and again (same argv, same env) until it exits 0; each launch's exit code and seconds."""
    launches = []
    log.parent.mkdir(parents=True, exist_ok=True)
    while len(launches) < max_launches:
        t0 = time.time()
        with log.open("a") as out:
            out.write(f"\n===== launch {len(launches) + 1}: {' '.join(cmd)}\n")
            out.flush()
            p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=timeout_s)
            finally:
                _reap(p.pid)
        launches.append({"rc": rc, "seconds": round(time.time() - t0, 1)})
        if rc == 0:
            return launches
        if rc != -signal.SIGKILL:
            raise RuntimeError(f"launch {len(launches)} exited {rc} (not SIGKILL): see {log}")
    raise RuntimeError(f"{cmd} did not finish in {max_launches} launches: see {log}")


def fingerprint(save: str, staging: Path) -> dict[str, Any]:
    """Per iteration: is it complete (every sha256 verified), the model's and optimizer's sha256, the run ids."""
    store = checkpoint.Store(save)
    out: dict[str, Any] = {"marker": checkpoint.read_marker(store), "iterations": {}}
    for it in checkpoint.list_iterations(store):
        _, m, problem = checkpoint.materialize(store, it, staging)
        out["iterations"][it] = {"problem": problem} if problem else {
            "model": m["files"]["model/model.safetensors"]["sha256"],
            "optim": m["files"].get("optim/state.pt", {}).get("sha256"),
            "mlflow_run_id": m.get("mlflow_run_id"),
            "reward_mean": m.get("history", {}).get("rollout/reward_mean", {}).get(str(it))}
    return out


def compare(base: dict[str, Any], got: dict[str, Any], num_rollout: int) -> dict[str, Any]:
    """The required properties, each as a boolean (plus the run ids seen)."""
    its = got["iterations"]
    ids = {v.get("mlflow_run_id") for v in its.values()}
    return {
        "all_iterations_present": sorted(its) == list(range(num_rollout)),
        "all_iterations_verify": all("problem" not in v for v in its.values()),
        "final_weights_bitwise_equal": its.get(num_rollout - 1, {}).get("model")
        == base["iterations"][num_rollout - 1]["model"],
        "every_iteration_bitwise_equal": all(its.get(i, {}).get(k) == base["iterations"][i][k]
                                             for i in range(num_rollout) for k in ("model", "optim")),
        "one_mlflow_run_id": len(ids) == 1 and None not in ids,
        "mlflow_run_ids": sorted(str(i) for i in ids),
        "marker": got["marker"],
    }


def mlflow_runs(work: Path) -> list[dict[str, Any]]:
    """Every MLflow run in the work dir's store: id, status and its resume tags."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    out = []
    for exp in client.search_experiments():
        for r in client.search_runs([exp.experiment_id]):
            out.append({"run_id": r.info.run_id, "status": r.info.status,
                        "resume_tags": sorted(k for k in r.data.tags if k.startswith("rollflow.resume."))})
    return out


def faulted_run(name: str, spec: str, num_rollout: int, base_dir: Path, save: str, env: dict[str, str],
                extra: list[str] = ()) -> dict[str, Any]:
    """One lineage: the same command with ROLLFLOW_FAULT=spec, restarted until it finishes."""
    work = base_dir / name / "work"
    state = base_dir / name / "fired"
    env = {**env, faults.ENV: spec, faults.STATE_ENV: str(state)}
    t0 = time.time()
    launches = run_until_done(train_command(num_rollout, work, save, extra), env, base_dir / name / "log.txt")
    fired = state.read_text().split() if state.exists() else []
    return {"fault": spec, "launches": launches, "seconds": round(time.time() - t0, 1), "fired": fired,
            "fingerprint": fingerprint(save, base_dir / name / "verify"), "mlflow": mlflow_runs(work)}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, faults.STATE_ENV)}
    env.update({"PYTHONPATH": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "TOKENIZERS_PARALLELISM": "false"}, **(extra or {}))
    return env


def start_moto() -> tuple[object, dict[str, str]]:
    """A moto S3 server on 127.0.0.1 in this process, a bucket `rollflow-bench`, and the env pointing at it."""
    import logging

    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per S3 request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL_S3": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("rollflow-bench")
    return server, env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-rollout", type=int, default=6)
    p.add_argument("--boundaries", nargs="*", default=list(faults.BOUNDARIES), choices=faults.BOUNDARIES)
    p.add_argument("--s3-boundaries", nargs="*", default=[], choices=faults.BOUNDARIES,
                   help="also run these with --save on a local moto S3 server (compared with the same baseline)")
    p.add_argument("--at", type=int, default=None, help="rollout id to kill at (default: the middle one)")
    p.add_argument("--chained", action="store_true", help="every fault in one run, at successive rollouts")
    p.add_argument("--dir", default="/tmp/rollflow-resume-bench")
    p.add_argument("--out", default=None, help="write the results JSON here")
    a = p.parse_args()

    base_dir = Path(a.dir) / time.strftime("%Y%m%d-%H%M%S")
    env, server = child_env(), None
    n, k = a.num_rollout, a.at if a.at is not None else a.num_rollout // 2
    t0 = time.time()
    base_launches = run_until_done(train_command(n, base_dir / "baseline" / "work", str(base_dir / "baseline" /
                                                 "ckpt")), env, base_dir / "baseline" / "log.txt")
    base = fingerprint(str(base_dir / "baseline" / "ckpt"), base_dir / "baseline" / "verify")
    results = {"command": "PYTHONPATH=. python " + " ".join(sys.argv), "machine": f"{platform.node()}, "
               f"{platform.machine()}, {os.cpu_count()} cores (shared), load average {os.getloadavg()[0]:.1f} at "
               "start", "num_rollout": n, "kill_at_rollout": k,
               "baseline": {"seconds": round(time.time() - t0, 1), "launches": base_launches,
                            "model_sha256": {i: v["model"] for i, v in base["iterations"].items()}},
               "runs": []}
    plan = [(b, f"{b}@{k}", "local") for b in a.boundaries] + [(f"s3-{b}", f"{b}@{k}", "s3")
                                                               for b in a.s3_boundaries]
    if a.chained:
        plan = [("chained", ",".join(f"{b}@{min(i, n - 1)}" for i, b in enumerate(a.boundaries)), "local")]
    for name, spec, kind in plan:
        if kind == "s3" and server is None:
            server, s3env = start_moto()
            env = {**env, **s3env}
        save = f"s3://rollflow-bench/{base_dir.name}/{name}" if kind == "s3" else str(base_dir / name / "ckpt")
        r = faulted_run(name, spec, n, base_dir, save, env)
        r["storage"] = kind
        r["checks"] = compare(base, r.pop("fingerprint"), n)
        r["checks"]["every_fault_fired"] = sorted(r["fired"]) == sorted(spec.split(","))
        r["checks"]["one_mlflow_run_in_store"] = len(r["mlflow"]) == 1
        results["runs"].append(r)
        print(json.dumps({name: r["checks"], "launches": r["launches"]}), flush=True)
    if server:
        server.stop()
    ok = all(v for r in results["runs"] for v in r["checks"].values() if isinstance(v, bool))
    results["all_ok"] = ok
    results["load_average_at_end"] = round(os.getloadavg()[0], 1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps({"all_ok": ok, "dir": str(base_dir)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
