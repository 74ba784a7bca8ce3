"""Checkpoint save / load throughput (MB/s) against a plain copy of the same bytes, local disk and local S3.

    PYTHONPATH=. python bench/checkpoint_io.py --repeats 5 --out bench/results/checkpoint_io.json

Models: the bundled tiny Qwen2 and a ~50M-parameter Qwen2 config (random weights). The optimizer has taken one
step, so AdamW's two moment buffers exist (state ≈ 3 × the fp32 weights).
    save  = engine.checkpoint.save_iteration with the torch backend's state: serialize (safetensors + torch.save)
            + sha256 of every file (+ fsync locally) + manifest + rename / upload + marker;
            split into `state` (the backend serializing) and `commit` (everything the checkpoint layer adds)
    load  = engine.checkpoint.resolve_start (read marker + manifest, download for S3, sha256 of every file)
            + TorchBackend.load (weights, optimizer, scheduler, RNG); split into `verify` and `backend`
    copy  = the same files: shutil.copyfile + fsync (local), fs.put_file / fs.get_file (S3); no serialization,
            no hashing: the floor for moving those bytes
S3 is a moto server (`moto_server`, its own process, in-memory) on 127.0.0.1: it measures the client path (s3fs,
HTTP, hashing) against a Python server, not a real object store's bandwidth.
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import checkpoint  # noqa: E402
from engine.config import RunConfig  # noqa: E402
from engine.config.data import BUNDLED_MODEL  # noqa: E402
from engine.convert import copy_hf_config  # noqa: E402
from engine.train.torch_backend import TorchBackend  # noqa: E402

# hidden 640, 7 layers, 10 heads (2 KV heads of 64), MLP 1792, vocab 32000, tied embeddings:
# embed 32000·640 = 20.5M; per layer q,o 2·640² = 0.82M + k,v 2·640·128 = 0.16M + MLP 3·640·1792 = 3.44M → 4.42M
# → 20.5M + 7·4.42M ≈ 51.4M parameters (≈ 196 MiB in fp32)
MID = dict(hidden_size=640, num_hidden_layers=7, num_attention_heads=10, num_key_value_heads=2,
           intermediate_size=1792, vocab_size=32000, max_position_embeddings=2048, layer_types=None)


def make_mid_model(dest: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(BUNDLED_MODEL)
    for k, v in MID.items():
        setattr(cfg, k, v)
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(dest)
    AutoTokenizer.from_pretrained(BUNDLED_MODEL).save_pretrained(dest)
    return str(dest)


def backend_with_optimizer_state(model_dir: str) -> TorchBackend:
    b = TorchBackend(RunConfig(hf_checkpoint=model_dir, eval_prompt_data=""))
    for p in b.model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    b.optimizer.step()  # creates exp_avg / exp_avg_sq
    b.optimizer.zero_grad(set_to_none=True)
    return b


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_store(b: TorchBackend, model_dir: str, url: str, scratch: Path, repeats: int) -> dict:
    store = checkpoint.Store(url)
    nbytes = None
    save_s, load_s, copy_up_s, copy_down_s = [], [], [], []
    state_s, commit_s, verify_s, backend_s = [], [], [], []

    def write_state(path: str) -> None:
        b.save(path)
        copy_hf_config(model_dir, Path(path) / "hf_config")

    for r in range(repeats):
        rep = checkpoint.save_iteration(store, r, write_state, {"origin": None}, staging=scratch / "stage")
        save_s.append(rep.seconds)
        state_s.append(rep.state_seconds)
        commit_s.append(rep.seconds - rep.state_seconds)
        nbytes = rep.bytes

        t0 = time.perf_counter()
        s = checkpoint.resolve_start(load=None, save=url, ckpt_step=None, load_optim=True, staging=scratch / "load")
        t1 = time.perf_counter()
        b.load(s.local_dir)
        t2 = time.perf_counter()
        verify_s.append(t1 - t0)
        backend_s.append(t2 - t1)
        load_s.append(t2 - t0)
        # the same files, moved without serialization or hashing
        local = Path(store.path(checkpoint.iter_name(r))) if not store.remote else scratch / "load" / \
            checkpoint.iter_name(r)
        files = [p for p in sorted(local.rglob("*")) if p.is_file()]
        dst = scratch / "copy"

        def copy_up():
            for p in files:
                rel = p.relative_to(local).as_posix()
                if store.remote:
                    store.fs.put_file(str(p), store.path(f"plain/{rel}"))
                else:
                    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(p, dst / rel)
                    with open(dst / rel, "rb+") as f:
                        os.fsync(f.fileno())

        def copy_down():
            for p in files:
                rel = p.relative_to(local).as_posix()
                out = scratch / "down" / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                if store.remote:
                    store.fs.get_file(store.path(f"plain/{rel}"), str(out))
                else:
                    shutil.copyfile(dst / rel, out)

        copy_up_s.append(timed(copy_up))
        copy_down_s.append(timed(copy_down))
        shutil.rmtree(scratch / "copy", ignore_errors=True)
        shutil.rmtree(scratch / "down", ignore_errors=True)
        store.rm(checkpoint.iter_name(r - 1)) if r else None
    mb = nbytes / 2**20

    def stats(xs):
        rates = sorted(mb / x for x in xs)
        return {"mb_per_s_median": round(statistics.median(rates), 1), "mb_per_s_min": round(rates[0], 1),
                "mb_per_s_max": round(rates[-1], 1), "seconds_median": round(statistics.median(xs), 3)}

    return {"mb": round(mb, 1), "save": stats(save_s), "save_state": stats(state_s), "save_commit": stats(commit_s),
            "load": stats(load_s), "load_verify": stats(verify_s), "load_backend": stats(backend_s),
            "copy_write": stats(copy_up_s), "copy_read": stats(copy_down_s)}


def start_moto_process() -> tuple[subprocess.Popen, str]:
    """`moto_server` in its own process (so it does not share this process's GIL) on a free port."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", nargs="*", default=["bundled", "mid50m"])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)

    import fsspec

    server, url = start_moto_process()
    os.environ.update({"AWS_ENDPOINT_URL_S3": url, "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")

    results = {"command": "PYTHONPATH=. python bench/checkpoint_io.py " + " ".join(sys.argv[1:]),
               "machine": f"{platform.node()}, {platform.machine()}, {os.cpu_count()} cores, "
                          f"load average {os.getloadavg()[0]:.1f} at start (shared machine)",
               "torch_threads": 1, "repeats": a.repeats, "models": {}}
    with tempfile.TemporaryDirectory(prefix="rollflow-bench-") as tmp:
        tmp = Path(tmp)
        dirs = {"bundled": BUNDLED_MODEL}
        if "mid50m" in a.models:
            dirs["mid50m"] = make_mid_model(tmp / "mid50m")
        for name in a.models:
            b = backend_with_optimizer_state(dirs[name])
            params = sum(p.numel() for p in b.model.parameters())
            row = {"parameters": params}
            for kind, url in (("local", str(tmp / f"{name}-ckpt")), ("s3", f"s3://bench/{name}")):
                row[kind] = bench_store(b, dirs[name], url, tmp / f"{name}-{kind}-scratch", a.repeats)
                print(name, kind, json.dumps(row[kind]), flush=True)
            results["models"][name] = row
    results["load_average_at_end"] = round(os.getloadavg()[0], 1)
    server.kill()
    server.wait()
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
