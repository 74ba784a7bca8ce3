"""Load test of the built-in engine under valid and hostile traffic (issue 24's target).

    python bench/serve_load.py [--clients 200] [--seconds 60] [--out bench/results/serve_load.json]

Starts `python -m engine.rollout.server` (the bundled tiny model, --api-key, one --weight-dir) on 127.0.0.1 and runs
`--clients` concurrent httpx clients for `--seconds`. Each client loops over a weighted mix:

- valid (70%): /generate of a short prompt, max_new_tokens 8, with the key — must answer 200 with tokens;
- hostile (30%): a body over the size limit (17 MiB, sent whole), malformed JSON, max_new_tokens 10^9, float and
  out-of-vocabulary token ids, temperature Infinity, a 10 MB text, /generate without the key, weight loads without
  the key (disk and raw tensor), a weight load from a path outside --weight-dir, /release_memory_occupation
  without the key — each must get a 4xx.

Every second the server's RSS (with its children) and /health are sampled. The result: counts per kind and status,
p50/p99 latency of the valid requests, whether every valid request was answered and every hostile one refused with
a 4xx, the server's RSS at start and its peak, and whether /health stayed 200.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config.data import BUNDLED_MODEL  # noqa: E402

KEY = "serve-load-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}


from engine.rollout.ports import free_loopback_port  # noqa: E402
free_port = free_loopback_port  # engine/rollout/ports.py


def hostile_requests(weight_dir: Path, outside: Path) -> dict[str, tuple[str, str, dict, bytes]]:
    """kind → (method, path, headers, body): each must be refused with a 4xx."""
    big = b'{"text": "' + b"a" * (17 * 2**20) + b'"}'
    return {
        "oversize_body": ("POST", "/generate", {**AUTH, **JSON}, big),
        "malformed_json": ("POST", "/generate", {**AUTH, **JSON}, b'{"text": "1+1=", "sampling_params": {'),
        "huge_max_new_tokens": ("POST", "/generate", {**AUTH, **JSON},
                                json.dumps({"text": "1+1=", "sampling_params": {"max_new_tokens": 10**9}}).encode()),
        "float_ids": ("POST", "/generate", {**AUTH, **JSON}, json.dumps({"input_ids": [1.5, 2.25]}).encode()),
        "out_of_vocab_ids": ("POST", "/generate", {**AUTH, **JSON}, json.dumps({"input_ids": [10**9]}).encode()),
        "infinite_temperature": ("POST", "/generate", {**AUTH, **JSON},
                                 json.dumps({"text": "1", "sampling_params": {"temperature": float("inf")}}).encode()),
        "10mb_text": ("POST", "/generate", {**AUTH, **JSON}, json.dumps({"text": "7+" * 5_000_000}).encode()),
        "no_key_generate": ("POST", "/generate", JSON, json.dumps({"text": "1+1="}).encode()),
        "no_key_weights_disk": ("POST", "/update_weights_from_disk", JSON,
                                json.dumps({"model_path": str(outside)}).encode()),
        "no_key_weights_tensor": ("POST", "/update_weights_from_tensor?load_format=flattened_bucket",
                                  {"content-type": "application/octet-stream"}, b"\0" * 4096),
        "weights_outside_dir": ("POST", "/update_weights_from_disk", {**AUTH, **JSON},
                                json.dumps({"model_path": str(outside)}).encode()),
        "no_key_release_memory": ("POST", "/release_memory_occupation", JSON, b"{}"),
    }


async def client(c: httpx.AsyncClient, url: str, until: float, hostile: dict, rng: random.Random,
                 results: list) -> None:
    kinds = list(hostile)
    while time.monotonic() < until:
        t0 = time.perf_counter()
        if rng.random() < 0.7:
            kind = "valid"
            body = {"text": f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=",
                    "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}}
            try:
                r = await c.post(url + "/generate", json=body, headers=AUTH)
                ok = r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0
                status = r.status_code
            except httpx.HTTPError as e:
                ok, status = False, type(e).__name__
        else:
            kind = rng.choice(kinds)
            method, path, headers, raw = hostile[kind]
            try:
                r = await c.request(method, url + path, headers=headers, content=raw)
                status = r.status_code
                ok = 400 <= status < 500
            except httpx.HTTPError as e:
                ok, status = False, type(e).__name__
        results.append((kind, status, ok, time.perf_counter() - t0))


async def sampler(proc: psutil.Process, url: str, until: float, samples: list) -> None:
    async with httpx.AsyncClient(timeout=10) as c:
        while time.monotonic() < until:
            rss = proc.memory_info().rss + sum(ch.memory_info().rss for ch in proc.children(recursive=True))
            try:
                healthy = (await c.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                healthy = False
            samples.append({"t": time.monotonic(), "rss_mib": rss / 2**20, "healthy": healthy})
            await asyncio.sleep(1.0)


async def run_load(url: str, proc: psutil.Process, clients: int, seconds: float, hostile: dict) -> tuple[list, list]:
    results: list = []
    samples: list = []
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        await asyncio.gather(sampler(proc, url, until, samples),
                             *(client(c, url, until, hostile, random.Random(i), results) for i in range(clients)))
    return results, samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the engine (default 2)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/serve_load.json"))
    a = ap.parse_args()

    import tempfile

    work = Path(tempfile.mkdtemp(prefix="rollflow-serve-load-"))
    weight_dir, outside = work / "weights", work / "elsewhere"
    weight_dir.mkdir()
    outside.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (work / "engine.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "engine.rollout.server", "--model-path", BUNDLED_MODEL,
                               "--host", "127.0.0.1", "--port", str(port), "--threads", str(a.threads),
                               "--device", "cpu", "--api-key", KEY, "--weight-dir", str(weight_dir)],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the engine did not start: {(work / 'engine.log').read_text()[-2000:]}")
            time.sleep(0.3)
        proc = psutil.Process(server.pid)
        rss_start = proc.memory_info().rss / 2**20
        t0 = time.monotonic()
        results, samples = asyncio.run(run_load(url, proc, a.clients, a.seconds, hostile_requests(weight_dir,
                                                                                                  outside)))
        wall = time.monotonic() - t0
        alive_after = server.poll() is None and httpx.get(url + "/health_generate", timeout=60).status_code == 200
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()

    by_kind: dict[str, Counter] = defaultdict(Counter)
    for kind, status, ok, _ in results:
        by_kind[kind][str(status)] += 1
    valid = [(ok, dt) for kind, _, ok, dt in results if kind == "valid"]
    lat = sorted(dt for ok, dt in valid if ok)
    hostile = [ok for kind, _, ok, _ in results if kind != "valid"]
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [float("nan")] * 99
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "clients": a.clients, "seconds": round(wall, 1), "engine_threads": a.threads,
        "requests": len(results), "valid_requests": len(valid), "valid_answered": sum(ok for ok, _ in valid),
        "every_valid_answered": all(ok for ok, _ in valid),
        "hostile_requests": len(hostile), "hostile_refused_4xx": sum(hostile),
        "every_hostile_refused_4xx": all(hostile),
        "valid_p50_s": round(q[49], 4), "valid_p99_s": round(q[98], 4),
        "valid_per_s": round(len(lat) / wall, 1),
        "rss_start_mib": round(rss_start, 1), "rss_peak_mib": round(max(s["rss_mib"] for s in samples), 1),
        "health_samples": len(samples), "health_always_200": all(s["healthy"] for s in samples),
        "alive_and_generating_after": alive_after,
        "status_by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    good = out["every_valid_answered"] and out["every_hostile_refused_4xx"] and out["health_always_200"] \
        and alive_after
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
