"""Why is a served decode step slower than the same `Generator.generate` in-process? (issue 17, GPU)

    python bench/served_gap.py --out $OUT/served_gap.json        # a CUDA GPU, ~3 min

On an H200 the built-in engine decoded the RL rollout's batch (512 rows, 32 + 1,024 tokens, 0.5B, bf16) at 7.5 ms a
step called in-process, and at 12–13 ms a step served (`rollflow serve`, the rollout loop over HTTP), with the host
waiting for the GPU only ~7 ms of each (bench/results/gpu_rl_step.md). This runs the same batch four ways on the
same random 0.5B model and records, per way, the batch's wall time, its decode steps, the host's wait for the GPU
(`GraphDecoder.wait_s`) and the GPU's own time in those steps (`GraphDecoder.gpu_s`, CUDA events):

1. `inproc`: `Generator.generate` called in this process's main thread (what bench/gpu_engine_profile.py times);
2. `thread`: the same from an executor thread under a running asyncio loop, with a `Feed` and per-request delivery
   (what the server's continuous-batching scheduler does);
3. `server_thread`: the engine's HTTP server (`EngineState` + `ServerThread`) in this process, one rollout of
   64 groups × 8 through the rollout loop (engine/rollout/loop.py);
4. `served`: `rollflow serve` in its own process, the same rollout; while it decodes, `py-spy dump` of the engine
   (when `--py-spy` is given and ptrace is allowed).

If the GPU time per step is the same in all four and only the idle time grows, the host loop is what is slower
when served; if the GPU time grows, the step itself is.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


SWITCH = {"switch": 0.0002, "switch_long": 0.05}  # GIL switch intervals of the server_thread variants


def stats(g, wall: float, host: dict | None = None) -> dict:
    """`g`: the GraphDecoder's counters; `host`: Generator.host_stats (the loop's reading of tokens and stops,
    joining, and the process's garbage collections during the batch)."""
    steps = max(g.steps, 1)
    out = {"wall_s": round(wall, 3), "steps": g.steps, "ms_per_step": round(wall / steps * 1e3, 3),
           "gpu_wait_s": round(g.wait_s, 3), "gpu_busy_s": round(g.gpu_s, 3), "launch_s": round(g.launch_s, 3),
           "gpu_ms_per_step": round(g.gpu_s / steps * 1e3, 3),
           "gpu_idle_ms_per_step": round((wall - g.gpu_s) / steps * 1e3, 3)}
    for k, v in (host or {}).items():
        out[k] = round(v, 3)
        if k.endswith("_s"):
            out[k[:-2] + "_ms_per_step"] = round(v / steps * 1e3, 3)
    if host and "take_s" in host:  # the host's time outside the GPU wait, launch(), reading tokens and joining
        other = wall - g.wait_s - g.launch_s - host["take_s"] - host.get("join_s", 0.0)
        out["other_ms_per_step"] = round(other / steps * 1e3, 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--ways", default="inproc,thread,server_thread,served")
    p.add_argument("--server-variants", default="default",
                   help="server_thread runs, comma-separated: default (uvicorn's uvloop), asyncio (uvicorn on "
                        "asyncio's loop), switch / switch_long (sys.setswitchinterval(0.0002) / (0.05) in this "
                        "process), gc_off (Python's cyclic garbage collector disabled during the rollout)")
    p.add_argument("--py-spy", default=None, help="path of a py-spy binary, to dump the served engine's threads")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("served_gap: no CUDA device; this benchmark runs on a GPU machine", file=sys.stderr)
        return 2
    import httpx

    import engine.rollout.loop as loop
    from engine.config.data import BUNDLED_TRAIN
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import load_tokenizer, render_prompt
    from engine.rewards import RewardModel
    from engine.rollout.generation import Feed, GenRequest
    from engine.rollout.ports import free_loopback_port
    from engine.rollout.server import EngineState, ServerThread
    from engine.rollout.sglang import LaunchedEngine
    from gpu_flow import random_model

    model = str(random_model("0.5b", Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow")) / "qwen2_0.5b"))
    tok = load_tokenizer(model)
    ds = PromptDataset(load_prompts(BUNDLED_TRAIN, input_key="prompt", label_key="label"), shuffle=True, seed=0)
    B, N = a.groups * 8, a.max_new_tokens
    res: dict = {}
    ways = a.ways.split(",")

    def rollout(url: str, rid: int) -> float:
        def draw(k: int) -> list:
            return [loop.Prompt(r, render_prompt(tok, r.prompt, True)) for r in ds.next_batch(k)]

        t = time.perf_counter()
        loop.generate_rollout(draw, rollout_id=rid, batch_size=a.groups, n=8,
                              params=loop.SamplingParams(max_new_tokens=N, temperature=1.0),
                              reward_model=RewardModel("exact_match", None), seed=1,
                              engines=loop.StaticEngines([url]), timeout_s=600, concurrency=B)
        return time.perf_counter() - t

    if any(w in ways for w in ("inproc", "thread", "server_thread")):
        state = EngineState(model, device="cuda", dtype="bfloat16", max_new_tokens=N, max_batch=B)
        gen = state.generator
        prompts = [render_prompt(tok, r.prompt, True) for r in ds.next_batch(a.groups)]

        def reqs(tag: str) -> list:
            return [GenRequest(rid=f"{tag}-{i}", input_ids=prompts[i // 8], max_new_tokens=N, seed=i)
                    for i in range(B)]

        gen.generate(reqs("warm"))  # capture the graphs, warm the allocator
        if "inproc" in ways:
            torch.cuda.synchronize()
            t = time.perf_counter()
            gen.generate(reqs("inproc"))
            torch.cuda.synchronize()
            res["inproc"] = stats(gen.graphs, time.perf_counter() - t, gen.host_stats)
            print("inproc", res["inproc"], flush=True)

        async def threaded() -> float:
            lp = asyncio.get_running_loop()
            got: list = []
            t = time.perf_counter()
            await lp.run_in_executor(None, gen.generate, reqs("thread"), Feed(),
                                     lambda q, r: lp.call_soon_threadsafe(got.append, r))
            return time.perf_counter() - t

        if "thread" in ways:
            res["thread"] = stats(gen.graphs, asyncio.run(threaded()), gen.host_stats)
            print("thread", res["thread"], flush=True)
        if "server_idle" in ways or "server_submit" in ways:
            server = ServerThread(state, "127.0.0.1", free_loopback_port())
            server.start()
            if "server_idle" in ways:  # the server runs, nobody calls it; generate as in `thread`
                res["server_idle"] = stats(gen.graphs, asyncio.run(threaded()), gen.host_stats)
                print("server_idle", res["server_idle"], flush=True)
            if "server_submit" in ways:  # the server's own scheduler, no HTTP: 64 submits of 8 on its loop
                srv_loop = state.scheduler._task.get_loop()
                rq = reqs("submit")

                async def submit_all() -> None:
                    await asyncio.gather(*(state.scheduler.submit(rq[k:k + 8], ("bench", B // 8))
                                           for k in range(0, B, 8)))

                t, batches = time.perf_counter(), len(state.scheduler.batch_seconds)
                asyncio.run_coroutine_threadsafe(submit_all(), srv_loop).result(timeout=600)
                while len(state.scheduler.batch_seconds) == batches:  # requests are answered before it is noted
                    time.sleep(0.01)
                res["server_submit"] = {**stats(gen.graphs, state.scheduler.batch_seconds[-1], gen.host_stats),
                                        "submit_wall_s": round(time.perf_counter() - t, 3),
                                        "batch_sizes": state.scheduler.batch_sizes[-3:]}
                print("server_submit", res["server_submit"], flush=True)
            server.server.should_exit = True
            server.thread.join(timeout=10)
        if "server_thread" in ways:
            for variant in a.server_variants.split(","):  # default | asyncio | switch | switch_long | gc_off
                server = ServerThread(state, "127.0.0.1", free_loopback_port())
                if variant == "asyncio":
                    server.config.loop = "asyncio"
                before = sys.getswitchinterval()
                if variant in SWITCH:
                    sys.setswitchinterval(SWITCH[variant])
                if variant == "gc_off":
                    gc.disable()
                url = server.start()
                batches = len(state.scheduler.batch_seconds)
                wall = rollout(url, 0)
                while len(state.scheduler.batch_seconds) == batches:  # requests are answered before it is noted
                    time.sleep(0.01)
                sys.setswitchinterval(before)
                gc.enable()
                name = "server_thread" if variant == "default" else f"server_thread_{variant}"
                res[name] = {**stats(gen.graphs, state.scheduler.batch_seconds[-1], gen.host_stats),
                             "rollout_wall_s": round(wall, 3), "batch_sizes": state.scheduler.batch_sizes[-3:],
                             "loop": variant, "switch_interval_s": SWITCH.get(variant, before)}
                print(name, res[name], flush=True)
                server.server.should_exit = True
                server.thread.join(timeout=10)
        del state, gen
        torch.cuda.empty_cache()

    if "served" in ways:
        port = free_loopback_port()
        url = f"http://127.0.0.1:{port}"
        log_path = Path(a.out).with_suffix(".engine.log")
        eng = LaunchedEngine([sys.executable, "-m", "flows.cli", "serve", "--model-path", model, "--port", str(port),
                              "--device", "cuda", "--dtype", "bfloat16", "--max-running-requests", str(B)],
                             url=url, log_path=str(log_path), ports=[port], mem_fraction_static=None)
        try:
            eng.start(timeout_s=300)
            rollout(url, 0)  # capture, warm
            raw = Path(a.out).with_suffix(".gil.txt")
            dumps: list[str] = []

            def spy() -> None:  # a dump of every thread, then 3 s of samples of the GIL's holder, then of every thread
                def py_spy(*args: str) -> None:
                    r = subprocess.run([a.py_spy, *args, "--pid", str(eng.proc.pid)], capture_output=True, text=True,
                                       timeout=60)
                    dumps.append(r.stdout[-3000:] + r.stderr[-2000:])

                time.sleep(3.0)
                py_spy("dump")
                for what, path in (("--gil", raw), ("--idle", raw.with_suffix(".all.txt"))):
                    py_spy("record", what, "--threads", "-r", "200", "-d", "3", "--format", "raw", "-o", str(path),
                           "--nonblocking")

            th = threading.Thread(target=spy, daemon=True)
            if a.py_spy:
                th.start()
            wall = rollout(url, 1)
            if a.py_spy:
                th.join(timeout=60)
            info = httpx.get(url + "/get_server_info").json()
            last = SimpleNamespace(steps=info["last_batch_steps"], wait_s=info["last_batch_gpu_wait_s"],
                                   gpu_s=info["last_batch_gpu_busy_s"], launch_s=info["last_batch_launch_s"])
            host = {k: info[f"last_batch_{k}"] for k in ("take_s", "join_s", "gc_s", "gc_collections")
                    if f"last_batch_{k}" in info}
            res["served"] = {**stats(last, info["batch_seconds"][-1], host), "rollout_wall_s": round(wall, 3),
                             "batch_sizes": info["batch_sizes"], "batch_seconds": info["batch_seconds"],
                             "joined_requests": info["joined_requests"], "py_spy_dumps": dumps}
            print("served", {k: v for k, v in res["served"].items() if k != "py_spy_dumps"}, flush=True)
            # collapsed stacks "frame;frame;... count": who held the GIL, and where every thread was, by samples
            for key, path, width in (("gil_top_stacks", raw, 600), ("all_top_stacks", raw.with_suffix(".all.txt"),
                                                                     700)):
                if path.is_file():
                    rows = [ln.rsplit(" ", 1) for ln in path.read_text().splitlines() if " " in ln]
                    top = sorted(((int(c), st) for st, c in rows if c.isdigit()), reverse=True)[:25]
                    res["served"][key.replace("top_stacks", "samples_total")] = sum(int(c) for _, c in rows
                                                                                    if c.isdigit())
                    res["served"][key] = [{"samples": c, "stack": st[-width:]} for c, st in top]
                    for c, st in top[:12]:
                        print(f"{key[:3].upper()} {c:5d}  {st[-400:]}", flush=True)
            for d in dumps:
                print(d, flush=True)
        finally:
            eng.stop()
            res.setdefault("served", {})["engine_log_tail"] = eng.log_tail(40)

    out = {"command": "python bench/served_gap.py " + " ".join(sys.argv[1:]),
           "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "cpus": os.cpu_count()},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": B, "new_tokens": N, **res}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
