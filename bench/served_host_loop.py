"""Does serving slow the generation thread's host loop? A CPU check of one hypothesis (issue 17).

    python bench/served_host_loop.py                 # CPU, ~10 s

On an H200 the served engine's decode steps took 12–13 ms at 512 rows with the host waiting for the GPU ~7 ms of
each, against 7.5 ms (92% waiting) for the same `Generator.generate` called in-process (bench/results/
gpu_rl_step.md). One explanation is the GIL: every graph replay and wait releases it, and the server's event-loop
thread could take it. This runs the real server (`EngineState` + `ServerThread`, the bundled model) with its
generator replaced by a stand-in that does what the GPU loop does to the GIL — a 7 ms wait that releases it, then
per-row Python bookkeeping for 512 rows — first called in-process, then through 64 /generate calls of 8 inputs
announced as one burst, and prints the bookkeeping's ms per step in both.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = 300


def main() -> int:
    import httpx

    from engine.rollout.generation import GenResult
    from engine.rollout.ports import free_loopback_port
    from engine.rollout.server import EngineState, ServerThread

    stats: dict = {}

    def generate(reqs, feed=None, deliver=None):
        outs: list[list[int]] = [[] for _ in reqs]
        busy = 0.0
        for step in range(STEPS):
            time.sleep(0.007)  # the GPU's step: a wait that releases the GIL
            t = time.perf_counter()
            for i, r in enumerate(reqs):  # the loop's per-row work (append, stop checks)
                outs[i].append(step)
                _ = step in (r.max_new_tokens,) or len(outs[i]) >= r.max_new_tokens + STEPS
            busy += time.perf_counter() - t
        stats["ms_per_step"] = round(busy / STEPS * 1e3, 4)
        res = [GenResult(r.rid, [1], [0.0], {"type": "length", "length": 1}, "", len(r.input_ids)) for r in reqs]
        for q, x in zip(reqs, res):
            if deliver is not None:
                deliver(q, x)
        return res

    state = EngineState(str(ROOT / "examples" / "tiny-qwen2-arith"), threads=1, max_new_tokens=8, max_batch=512)
    state.generator.generate = generate
    from engine.rollout.generation import GenRequest

    generate([GenRequest(rid=f"r{i}", input_ids=[1], max_new_tokens=8) for i in range(512)])
    alone = stats["ms_per_step"]
    server = ServerThread(state, "127.0.0.1", free_loopback_port())
    url = server.start()
    try:
        async def go():
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1000)) as c:
                body = {"input_ids": [[5, 6, 7]] * 8, "sampling_params": {"max_new_tokens": 8}}
                rs = await asyncio.gather(*[c.post(url + "/generate", json=body, headers={"X-Rollflow-Burst": "b 64"})
                                            for _ in range(64)])
                return {r.status_code for r in rs}

        codes = asyncio.run(go())
    finally:
        server.stop()
    print(f"host bookkeeping, 512 rows: {alone} ms a step in-process, {stats['ms_per_step']} ms served "
          f"(batches {state.scheduler.batch_sizes}, HTTP {sorted(codes)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
