"""The whole flow on one GPU (colocated): `rollflow train` as a user runs it, measured from its own summary.

    python bench/gpu_flow.py demo --backend torch --out DIR               # examples/demo.yaml, 40 rollouts
    python bench/gpu_flow.py demo --backend megatron --bf16 --out DIR
    python bench/gpu_flow.py tool --backend megatron --bf16 --out DIR     # examples/tool.yaml (multi-turn, tool)
    python bench/gpu_flow.py shape --shape 0.5b --backend torch --bf16 --out DIR   # random Qwen2, 3 rollouts of
    python bench/gpu_flow.py shape --shape 1.5b --backend torch --bf16 --out DIR   # 64 prompts × 8 × ≤1,024 tokens
    python bench/gpu_flow.py debug --backend torch --out DIR              # slime's debugging flags on the GPU:
                                            # record 5 demo rollouts, replay them (no engine), --debug-rollout-only
    python bench/gpu_flow.py distill --backend megatron --bf16 --out DIR  # examples/sft.yaml, then examples/opd.yaml
                                            # from its model (colocated), each model's greedy accuracy after
    python bench/gpu_flow.py external --backend torch --out DIR          # the demo on a `rollflow serve` already
                                            # running on the GPU (--rollout-external-engine-addrs), weights as tensors
    python bench/gpu_flow.py report --out DIR --write bench/results       # any machine: copy + a markdown table

Each run writes `gpu_flow_<tag>.json` with: train_backend, precision, state ("Completed" when `rollflow train`
exited 0 and wrote its summary; else "Failed" with the log's tail), accuracy_before / accuracy_after (greedy test
accuracy), rollouts, mismatch_mean / mismatch_max (train/mismatch per rollout), probe_mismatch (after each sync),
peak_memory_gib per stage (the largest memory/<stage>_peak_gib over the rollouts), seconds per stage (mean),
sync GB/s, tokens/s, wall_s, the command and the machine. The shapes' models are random (no weights can be
downloaded): the bundled tokenizer, Qwen2.5-0.5B / 1.5B shapes; responses run to the 1,024-token limit.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TINY = ROOT / "examples" / "tiny-qwen2-arith"
STAGES = ("rollout", "pack", "train", "sync")


def machine() -> dict:
    info = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        info.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
                    if torch.cuda.is_available() else None)
    except Exception as e:  # noqa: BLE001 — report what could not be read
        info["torch_error"] = str(e)
    return info


def random_model(shape: str, path: Path) -> Path:
    """A random Qwen2 of the Qwen2.5-0.5B / 1.5B shape with the bundled tokenizer and chat template (bf16); seeded,
    so a later call (a resumed run) builds the same model, and kept when already there."""
    import torch

    if (path / "model.safetensors").is_file() or any(path.glob("*.safetensors")):
        return path

    from gpu_megatron import QWEN2_05B, QWEN25_15B, make_hf_model

    make_hf_model({"0.5b": QWEN2_05B, "1.5b": QWEN25_15B}[shape], path, torch.bfloat16)
    for f in TINY.iterdir():  # tokenizer, chat template, generation config (EOS): not the weights or config
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "build_metrics.json"):
            shutil.copy(f, path / f.name)
    return path


def run(tag: str, args: list[str], out: Path, timeout_s: float, meta: dict, term_after_s: float | None = None,
        part: str = "", prefix: str = "gpu_flow") -> dict:
    """`rollflow train ARGS` with its own work dir; after term_after_s a SIGTERM (the flow stops between stages and
    keeps its checkpoint: the same command resumes), after timeout_s a SIGKILL."""
    import signal

    work = Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow")) / tag
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    summary = work / "summary.json"
    cmd = [sys.executable, "-m", "flows.cli", "train", *args, "--work-dir", str(work / "w"),
           "--summary-json", str(summary)]
    env = {**os.environ, "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "INFO"}  # task runs and their times in the log
    shown = "rollflow train " + " ".join(args)
    print(f"[{time.strftime('%H:%M:%S')}] {tag}{part}: {shown}", flush=True)
    t0 = time.perf_counter()
    logf = work / "console.log"
    with open(logf, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=term_after_s or timeout_s)
        except subprocess.TimeoutExpired:
            if term_after_s:
                proc.send_signal(signal.SIGTERM)
                print(f"[{time.strftime('%H:%M:%S')}] {tag}: SIGTERM after {term_after_s:g} s", flush=True)
            try:
                rc = proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = 124
                proc.wait()
    log = logf.read_text(errors="replace")
    wall = time.perf_counter() - t0
    tag = tag + part
    (out / f"{prefix}_{tag}.log").write_text(log[-200_000:])
    res = {"tag": tag, "command": shown, "machine": machine(), "wall_s": round(wall, 1), **meta}
    if rc != 0 or not summary.is_file():
        res.update(state="Failed", returncode=rc, log_tail=log[-4000:])
    else:
        res.update(state="Completed", **digest(json.loads(summary.read_text())))
        res["_history"] = json.loads(summary.read_text())["history"]
    (out / f"{prefix}_{tag}.json").write_text(json.dumps({k: v for k, v in res.items() if k != "_history"}, indent=1))
    print(f"[{time.strftime('%H:%M:%S')}] {tag}: {res['state']} in {wall:.0f}s", flush=True)
    return res


def digest(s: dict) -> dict:
    h = s["history"]

    def per(key):  # [value per rollout], in rollout order
        return [round(v, 8) for _, v in sorted(((int(i), v) for i, v in h.get(key, {}).items()))]

    def mean(key):
        v = per(key)
        return round(sum(v) / len(v), 4) if v else None

    return {
        "rollouts": s["rollouts"], "accuracy_before": s["test_accuracy_before"],
        "accuracy_after": s["test_accuracy_after"], "reward_first": s["reward_first"], "reward_last": s["reward_last"],
        "flow_wall_s": round(s["wall_s"], 1), "weight_sync": s.get("weight_sync"), "engine_dtype": s.get("engine_dtype"),
        "mismatch_mean": per("train/mismatch"), "mismatch_max": per("train/mismatch_max"),
        "probe_mismatch": per("sync/probe_mismatch"),
        "peak_memory_gib": {st: max(per(f"memory/{st}_peak_gib"), default=None) for st in ("rollout", "train", "sync")},
        "peak_memory_gib_parts": {f"{st}_{who}": max(per(f"memory/{st}_{who}_gib"), default=None)
                                  for st in ("rollout", "train", "sync") for who in ("train", "engine")},
        "seconds": {st: mean(f"{st}/seconds") for st in STAGES},
        "seconds_per_rollout": {st: per(f"{st}/seconds") for st in STAGES},
        "sync_gb_per_s": mean("sync/gb_per_s"), "sync_mb": mean("sync/mb"),
        "rollout_tokens_per_s": mean("rollout/tokens_per_s"), "train_tokens_per_s": mean("train/tokens_per_s"),
        "response_len_mean": mean("rollout/response_len_mean"), "reward_mean": per("rollout/reward_mean"),
        "loop_wall_s": s.get("loop_wall_s"),
        "save_per_rollout": {k: per(f"save/{k}") for k in ("seconds", "state_seconds", "commit_seconds",
                                                            "wait_seconds", "mb")},
        **({"tool_calls_mean": per("rollout/reward_tool_calls_mean")} if "rollout/reward_tool_calls_mean" in h else {}),
    }


def debug(backend: str, bf16: bool, n: int, out: Path, timeout_s: float) -> int:
    """slime's debugging flags on the GPU, on the demo: record n rollouts (`--save-debug-rollout-data`, colocated),
    replay them (`--load-debug-rollout-data`: no engine placed, the trainer alone on the GPU), then
    `--debug-rollout-only` (the engine alone). Writes gpu_debug_<backend>.json: each run's state, placement-free
    summary, and whether the replay's per-rollout train metrics and final weights equal the recording's."""
    precision = "bf16" if bf16 else "fp32"
    work = Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow"))
    data = work / f"debug_{backend}" / "rollout_{rollout_id}.json.gz"
    shutil.rmtree(data.parent, ignore_errors=True)
    ck = {k: work / f"ck_debug_{backend}_{k}" for k in ("record", "replay")}
    for c in ck.values():
        shutil.rmtree(c, ignore_errors=True)
    base = ["--config", "examples/demo.yaml", "--train-backend", backend, *(["--bf16"] if bf16 else []),
            "--num-rollout", str(n)]
    meta = {"train_backend": backend, "precision": precision, "model": "bundled tiny Qwen2 (examples/)"}
    rec = run(f"record_{backend}_{precision}", [*base, "--colocate", "--save", str(ck["record"]),
                                               "--save-debug-rollout-data", str(data)], out, timeout_s, meta,
              prefix="gpu_debug")
    rep = run(f"replay_{backend}_{precision}", [*base, "--eval-prompt-data", "", "--save", str(ck["replay"]),
                                               "--load-debug-rollout-data", str(data)], out, timeout_s, meta,
              prefix="gpu_debug")
    only = run(f"rollout_only_{precision}", ["--config", "examples/demo.yaml", "--num-rollout", "3", "--save", "",
                                             "--debug-rollout-only", *(["--bf16"] if bf16 else [])], out, timeout_s,
               meta, prefix="gpu_debug")
    res = {"command": f"python bench/gpu_flow.py debug --backend {backend}" + (" --bf16" if bf16 else ""),
           "machine": machine(), "record": rec["state"], "replay": rep["state"], "rollout_only": only["state"],
           "wall_s": {"record": rec["wall_s"], "replay": rep["wall_s"], "rollout_only": only["wall_s"]}}
    if rec["state"] == rep["state"] == "Completed":
        h, r = rec["_history"], rep["_history"]
        keys = ("rollout/reward_mean", "train/loss", "train/pg_loss", "train/grad_norm", "train/mismatch", "pack/tokens")
        res["replay_equal"] = {k: r.get(k) == h.get(k) for k in keys}
        res["replay_train_loss"] = {"record": h.get("train/loss"), "replay": r.get("train/loss")}
        res["replay_mismatch"] = r.get("train/mismatch")
        res["replay_has_sync_metrics"] = any(k.startswith("sync/") for k in r)
        from safetensors.torch import load_file

        from engine import checkpoint

        a, b = (load_file(str(checkpoint.iter_dir(str(ck[k]), n - 1) / "model" / "model.safetensors"))
                for k in ("record", "replay"))
        res["weights_bitwise_equal"] = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
        res["weights_max_abs_diff"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    if only["state"] == "Completed":
        h = only["_history"]
        res["rollout_only_accuracy_before"] = only["accuracy_before"]
        res["rollout_only_reward_mean"] = h.get("rollout/reward_mean")
        res["rollout_only_train_metrics"] = sorted(k for k in h if k.split("/")[0] in ("train", "pack", "sync"))
    (out / f"gpu_debug_{backend}_{precision}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))
    return 0 if all(res[k] == "Completed" for k in ("record", "replay", "rollout_only")) else 1


def distill(backend: str, bf16: bool, out: Path, timeout_s: float) -> int:
    """slime's supervised and distillation recipes on the GPU, as the examples run them: examples/sft.yaml (20
    supervised steps, no engine), then examples/opd.yaml (40 rollouts, colocated, reward 0, the SFT model as the
    --opd-teacher-load teacher), each final model's greedy test accuracy measured by a --debug-rollout-only run.
    Writes gpu_distill_<backend>_<precision>.json."""
    from engine import checkpoint

    precision = "bf16" if bf16 else "fp32"
    work = Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow"))
    ck = {k: work / f"ck_{k}_{backend}" for k in ("sft", "opd")}
    for c in ck.values():
        shutil.rmtree(c, ignore_errors=True)
    train = ["--train-backend", backend, *(["--bf16"] if bf16 else [])]
    meta = {"train_backend": backend, "precision": precision, "model": "bundled tiny Qwen2 (examples/)"}
    runs = {"sft": run(f"sft_{backend}_{precision}",
                       ["--config", "examples/sft.yaml", *train, "--save", str(ck["sft"])], out, timeout_s, meta,
                       prefix="gpu_distill")}
    if runs["sft"]["state"] == "Completed":
        runs["opd"] = run(f"opd_{backend}_{precision}",
                          ["--config", "examples/opd.yaml", *train, "--colocate", "--save", str(ck["opd"]),
                           "--opd-teacher-load", str(ck["sft"])], out, timeout_s, meta, prefix="gpu_distill")
    res = {"command": f"python bench/gpu_flow.py distill --backend {backend}" + (" --bf16" if bf16 else ""),
           "machine": machine(), **{k: r["state"] for k, r in runs.items()}}
    for k, r in runs.items():
        res[f"{k}_wall_s"] = r["wall_s"]
        if r["state"] != "Completed":
            continue
        h = r["_history"]
        res[f"{k}_history"] = {m: h[m] for m in ("train/nll", "train/loss", "train/opd_reverse_kl", "train/mismatch")
                               if m in h}
        last = checkpoint.read_marker(ck[k])
        ev = run(f"eval_{k}_{backend}_{precision}",
                 ["--config", "examples/demo.yaml", "--hf-checkpoint", str(checkpoint.iter_dir(ck[k], last) / "hf"),
                  "--debug-rollout-only", "--num-rollout", "1", "--save", ""], out, timeout_s, meta,
                 prefix="gpu_distill")
        res[f"{k}_accuracy_after"] = ev.get("accuracy_before")  # the only evaluation of a rollout-only run
    (out / f"gpu_distill_{backend}_{precision}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_history") and k != "machine"}, indent=1))
    return 0 if all(r["state"] == "Completed" for r in runs.values()) and len(runs) == 2 else 1


def external(backend: str, bf16: bool, out: Path, timeout_s: float, port: int = 31000) -> int:
    """The demo on a built-in server that already runs (`rollflow serve` on the GPU, as a user starts SGLang), through
    --rollout-external-engine-addrs with the weights sent as HTTP tensors after every step; the server is stopped
    by pid afterwards. Writes gpu_flow_external_<backend>_<precision>.json (run's digest, the server's log tail)."""
    import urllib.request

    precision = "bf16" if bf16 else "fp32"
    work = Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow")) / f"external_{backend}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "weights").mkdir(parents=True)
    log = open(work / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--port", str(port), "--api-key", "k1",
                               "--weight-dir", str(work / "weights"), "--device", "cuda",
                               "--dtype", "bfloat16" if bf16 else "float32"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 120:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    break
                time.sleep(0.5)
        res = run(f"external_{backend}_{precision}",
                  ["--config", "examples/demo.yaml", "--train-backend", backend, *(["--bf16"] if bf16 else []),
                   "--rollout-external-engine-addrs", f"127.0.0.1:{port}", "--sglang-api-key", "k1",
                   "--save", str(work / "ck")], out, timeout_s,
                  {"train_backend": backend, "precision": precision, "model": "bundled tiny Qwen2 (examples/)",
                   "server": f"rollflow serve --port {port} --api-key k1 --weight-dir … --device cuda"})
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/get_server_info",
                                         headers={"Authorization": "Bearer k1"})
            info = json.loads(urllib.request.urlopen(req, timeout=5).read())
        except OSError as e:
            info = {"error": str(e)}
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    f = out / f"gpu_flow_external_{backend}_{precision}.json"
    data = json.loads(f.read_text())
    data.update(server_info={k: info.get(k) for k in ("weight_version", "dtype", "device", "error") if k in info},
                server_log_tail=(work / "serve.log").read_text(errors="replace")[-1500:])
    f.write_text(json.dumps(data, indent=1))
    print(json.dumps({k: data.get(k) for k in ("state", "accuracy_before", "accuracy_after", "server_info",
                                              "mismatch_mean", "weight_sync")}, default=str)[:1500])
    return 0 if res["state"] == "Completed" else 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["demo", "tool", "shape", "debug", "distill", "external", "report"])
    p.add_argument("--backend", default="torch", choices=["torch", "megatron"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b"])
    p.add_argument("--num-rollout", type=int, default=None)
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--out", required=True)
    p.add_argument("--write", default=None, help="report: copy the JSON files and write gpu_flow.md here")
    p.add_argument("--extra", default="", help="more `rollflow train` flags, one string")
    p.add_argument("--term-after", type=float, default=None,
                   help="SIGTERM the run after this many seconds (it stops between stages; the same command resumes "
                        "from its --save, kept in $BENCH_WORK/ck_<tag> for shapes)")
    p.add_argument("--part", default="", help="suffix of this call's result files (a run split over calls)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    precision = "bf16" if a.bf16 else "fp32"
    common = ["--colocate", "--train-backend", a.backend] + (["--bf16"] if a.bf16 else []) + a.extra.split()
    if a.mode == "demo":
        n = a.num_rollout or 40
        ck = Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow")) / f"ck_{a.backend}"
        run(f"demo_{a.backend}_{precision}", ["--config", "examples/demo.yaml", *common, "--num-rollout", str(n),
                                                "--save", str(ck)], out, a.timeout,
            {"train_backend": a.backend, "precision": precision, "model": "bundled tiny Qwen2 (examples/)"},
            part=a.part)
    elif a.mode == "tool":  # the multi-turn tool example: a generate hook, tool tokens masked out of the loss
        n = a.num_rollout or 30
        run(f"tool_{a.backend}_{precision}", ["--config", "examples/tool.yaml", *common, "--num-rollout", str(n),
                                                "--save", f"/tmp/rollflow_gpu_flow/ck_tool_{a.backend}"], out,
            a.timeout, {"train_backend": a.backend, "precision": precision,
                        "model": "bundled tool-use tiny Qwen2 (examples/tiny-qwen2-calc)"})
    elif a.mode == "shape":
        model = random_model(a.shape, Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow")) / f"qwen2_{a.shape}")
        n = a.num_rollout or 3
        tag = f"{a.shape.replace('.', '')}_{a.backend}_{precision}"
        ck = Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow")) / f"ck_{tag}"
        run(tag,
            ["--hf-checkpoint", str(model), "--apply-chat-template", "--rm-type", "exact_match", "--save", str(ck),
             "--keep-last-n", "1",
             "--eval-prompt-data", "", "--rollout-batch-size", "64", "--n-samples-per-prompt", "8",
             "--rollout-max-response-len", "1024", "--rollout-max-truncated-share", "1", "--num-rollout", str(n),
             "--global-batch-size", "512", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
             "--rollout-concurrency", "512", "--sglang-max-running-requests", "512", "--lr", "1e-6", *common],
            out, a.timeout, {"train_backend": a.backend, "precision": precision,
                             "model": f"random Qwen2, Qwen2.5-{a.shape.upper()} shape"},
            term_after_s=a.term_after, part=a.part)
    elif a.mode == "debug":
        return debug(a.backend, a.bf16, a.num_rollout or 5, out, a.timeout)
    elif a.mode == "distill":
        return distill(a.backend, a.bf16, out, a.timeout)
    elif a.mode == "external":
        return external(a.backend, a.bf16, out, a.timeout)
    else:
        rows = [json.loads(f.read_text()) for f in sorted(out.glob("gpu_flow_*.json"))]
        lines = ["| run | state | rollouts | accuracy | mismatch mean (max over rollouts) | peak GiB rollout/train/sync "
                 "| s per rollout / train / sync | sync GB/s | wall s |", "|" + "---|" * 9]
        for r in rows:
            if r["state"] != "Completed":
                lines.append(f"| {r['tag']} | {r['state']} | | | | | | | {r['wall_s']} |")
                continue
            mm = max(r["mismatch_mean"], default=float("nan"))
            pk = r["peak_memory_gib"]
            sec = r["seconds"]
            acc = ("—" if r["accuracy_before"] is None else
                   f"{100 * r['accuracy_before']:.1f}% → {100 * r['accuracy_after']:.1f}%")
            lines.append(f"| {r['tag']} | {r['state']} | {r['rollouts']} | {acc} | {mm:.3g} | "
                         f"{pk['rollout']:.2f} / {pk['train']:.2f} / {pk['sync']:.2f} | {sec['rollout']} / "
                         f"{sec['train']} / {sec['sync']} | {r['sync_gb_per_s']} | {r['wall_s']} |")
        table = "\n".join(lines) + "\n"
        print(table)
        if a.write:
            dst = Path(a.write)
            for f in out.glob("gpu_flow_*.json"):
                shutil.copy(f, dst / f.name)
            (dst / "gpu_flow_table.md").write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
