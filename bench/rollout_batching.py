"""How the built-in engine batches a rollout's requests, with and without the burst header (issue 17).

    python bench/rollout_batching.py --out bench/results/rollout_batching.json      # CPU, ~1 min
    python bench/rollout_batching.py --device cuda --model 0.5b --max-new-tokens 1024 --modes announced \
        --rollouts 3 --out $OUT/rollout_batching_gpu.json                          # a CUDA GPU: issue 17's rollout

The engine runs in its own process (`rollflow serve`, CPU, the bundled model), as in a run; this process runs the
rollout loop (engine/rollout/loop.py) for --rollouts rollouts of --groups groups × 8 samples, first with the
`X-Rollflow-Burst` header left off (how the loop sent before it announced its bursts), then as the loop sends now
(one request per group, the burst announced), then `joined`: as the loop sends to a run's built-in CPU engine (the
groups that start together in one /generate of at most --join-rows rows, the run's --sglang-max-running-requests
default; engine/rollout/engines.py:EngineGroup.join_rows).
Recorded per rollout: the engine's batch sizes and each batch's generation time (its /get_server_info) and the
rollout's wall time. Each batch is a whole generation, so a rollout split into k batches generates k times in a
row; the wall time less the generation time is what HTTP, JSON and the loop cost.

`--model 0.5b` / `1.5b` is a random Qwen2 of that shape (bench/gpu_flow.py, bf16; the rollout of
bench/gpu_rl_step.py without the trainer), served on --device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--model", default="tiny", help="tiny (the bundled model), 0.5b or 1.5b (random, bf16)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", default="unannounced,announced,joined")
    p.add_argument("--join-rows", type=int, default=256)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "rollout_batching.json"))
    a = p.parse_args()

    import httpx

    import engine.rollout.loop as loop
    from engine.config.data import BUNDLED_TRAIN
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import load_tokenizer, render_prompt
    from engine.rewards import RewardModel
    from engine.rollout.ports import free_loopback_port

    if a.model == "tiny":
        model = str(ROOT / "examples" / "tiny-qwen2-arith")
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        from gpu_flow import random_model

        model = str(random_model(a.model, Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow")) /
                                 f"qwen2_{a.model}"))
    port = free_loopback_port()
    extra = ["--threads", "1"] if a.device == "cpu" else ["--dtype", "bfloat16"]
    engine = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--model-path", model, "--port", str(port),
                               "--device", a.device, *extra, "--max-running-requests", str(8 * a.groups)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    res: dict = {}
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or engine.poll() is not None:
                raise SystemExit("the engine did not start")
            time.sleep(0.3)
        tok = load_tokenizer(model)
        ds = PromptDataset(load_prompts(BUNDLED_TRAIN, input_key="prompt", label_key="label"), shuffle=True, seed=0)

        def draw(k: int) -> list:
            return [loop.Prompt(r, render_prompt(tok, r.prompt, True)) for r in ds.next_batch(k)]

        init = loop._Round.__init__
        for mode in a.modes.split(","):
            if mode == "unannounced":  # the loop as it sent before it announced its bursts
                def no_header(self, *args, **kw):
                    init(self, *args, **kw)
                    self.burst = {}

                loop._Round.__init__ = no_header
            else:
                loop._Round.__init__ = init
            pool = loop.StaticEngines([url])
            pool.join_rows = a.join_rows if mode == "joined" else 0
            rows = []
            for i in range(a.rollouts):
                before = len(httpx.get(url + "/get_server_info").json()["batch_sizes"])  # (batch_seconds alike)
                t = time.perf_counter()
                loop.generate_rollout(draw, rollout_id=i, batch_size=a.groups, n=8,
                                      params=loop.SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0),
                                      reward_model=RewardModel("exact_match", None), seed=1,
                                      engines=pool, timeout_s=600, concurrency=8 * a.groups)
                wall = time.perf_counter() - t
                info = httpx.get(url + "/get_server_info").json()
                sizes, secs = info["batch_sizes"][before:], info["batch_seconds"][before:]
                rows.append({"rollout": i, "batch_sizes": sizes, "batch_seconds": secs, "wall_s": round(wall, 3),
                             "outside_generation_s": round(wall - sum(secs), 3),
                             **{k: info[k] for k in ("folded_gqa", "joined_requests", "last_batch_steps",
                                                     "last_batch_gpu_wait_s") if k in info}})
                print(f"{mode} rollout {i}: batches {sizes}, generating {sum(secs):.2f} s of {wall:.2f} s", flush=True)
            res[mode] = rows
        loop._Round.__init__ = init
    finally:
        engine.terminate()
        engine.wait()
    import torch

    gpu = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None
    out = {"command": "python bench/rollout_batching.py " + " ".join(sys.argv[1:]),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "gpu": gpu}, "model": a.model, "device": a.device,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "groups": a.groups, "samples_per_group": 8,
           "max_new_tokens": a.max_new_tokens, **res}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
