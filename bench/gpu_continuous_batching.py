"""Continuous batching in the built-in engine on a GPU (issue 17): requests that arrive while a batch decodes.

    python bench/gpu_continuous_batching.py --out $OUT/gpu_continuous_batching.json      # a CUDA GPU, ~1 min

The 0.5B Qwen2 shape in bf16 with random weights (bench/gpu_engine_decode.py's), the engine's own `Generator`
through its CUDA graphs. Two checks in one run:

- `join`: a batch of 56 rows decodes 256 tokens; 8 more requests are offered after it started and join it (free
  rows of its 64, one group); each joined row's tokens are compared with the same request generated alone (same seed): the
  share of rows identical and the longest common prefix, in fp32 (in bf16, batches of other sizes round
  differently enough to move a draw from a random model's nearly flat distribution);
- `waves`: W waves of R requests (prompt 32, between N/8 and N new tokens, uniform: the spread of response
  lengths EOS gives an RL rollout), one wave every --gap-ms; `sequential` runs what has arrived as one batch after
  another (a request waits for the running batch to end: the engine before continuous batching), `continuous`
  offers each wave to the running batch (engine/rollout/generation.py: Feed), whose rows free up as their
  requests end. Recorded: the makespan and each request's latency (arrival to result), mean and p90.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--rows", type=int, default=64, help="requests per wave")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--gap-ms", type=float, default=300.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_continuous_batching.json"))
    a = p.parse_args()

    import torch

    from gpu_engine_decode import SHAPE, StandInTokenizer, cuda_model
    from engine.rollout.generation import Feed, GenRequest, Generator

    if (model := cuda_model("gpu_continuous_batching")) is None:
        return 2
    gen = Generator(model, StandInTokenizer(), eos_ids=[151643], device="cuda")
    g = torch.Generator().manual_seed(1)

    def reqs(tag: str, k: int, n: int, seed0: int, spread: bool = False) -> list[GenRequest]:
        ids = torch.randint(100, SHAPE["vocab_size"] - 100, (k, 32), generator=g).tolist()
        lens = torch.randint(n // 8, n + 1, (k,), generator=g).tolist() if spread else [n] * k
        return [GenRequest(rid=f"{tag}{i}", input_ids=ids[i], max_new_tokens=lens[i], ignore_eos=True,
                           seed=seed0 + i) for i in range(k)]

    # -- join: 8 requests offered to a running batch of 56, against each alone, in fp32 -------------------------
    # (on a random model the distribution is nearly flat over 151,936 tokens: bf16 rounding of another batch shape
    # moves the inverse CDF by a token or so; fp32 keeps that rare, so identical rows show the join is exact)
    bf16 = gen
    gen = Generator(model.float(), StandInTokenizer(), eos_ids=[151643], device="cuda")
    base, late = reqs("b", 56, 256, 0), reqs("j", 8, 64, 1000)
    gen.generate(base)  # capture, warm
    feed, got = Feed(), {}
    feed.put(late)
    t = time.perf_counter()
    gen.generate(base, feed=feed, deliver=lambda q, r: got.setdefault(q.rid, (r, time.perf_counter() - t)))
    alone = {r.rid: gen.generate([r])[0] for r in late}
    same, prefix = 0, []
    for r in late:
        x, y = got[r.rid][0].output_ids, alone[r.rid].output_ids
        same += x == y
        prefix.append(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)))
    join = {"batch_rows": 56, "joined": len(late), "joined_rows_identical": same,
            "mean_identical_prefix": round(statistics.mean(prefix), 1), "joined_new_tokens": 64,
            "batch_new_tokens": 256, "joined_done_s": round(max(got[r.rid][1] for r in late), 3),
            "batch_done_s": round(max(v[1] for k, v in got.items() if k.startswith("b")), 3),
            "joined_rows_counter": gen.graphs.joined_rows}
    print("join:", join, flush=True)
    del gen
    model.to(torch.bfloat16)
    torch.cuda.empty_cache()
    gen = bf16

    # -- waves: sequential batches against continuous batching --------------------------------------------------
    waves = [reqs(f"w{w}-", a.rows, a.new_tokens, 10_000 * (w + 1), spread=True) for w in range(a.waves)]
    gen.generate(waves[0])  # the shape's graphs (sequential)
    res: dict = {}
    for mode in ("sequential", "continuous"):
        arrived: dict[str, float] = {}
        finished: dict[str, float] = {}
        queue: list[GenRequest] = []
        lock = threading.Lock()
        feed = Feed() if mode == "continuous" else None
        t0 = time.perf_counter()

        def arrive() -> None:
            for w, wave in enumerate(waves[1:], 1):
                time.sleep(max(0.0, t0 + w * a.gap_ms / 1e3 - time.perf_counter()))
                now = time.perf_counter()
                with lock:
                    for r in wave:
                        arrived[r.rid] = now
                    if feed is not None:  # a rollout's calls: one per group of 8 samples
                        for k in range(0, len(wave), 8):
                            feed.put(wave[k:k + 8])
                    else:
                        queue.extend(wave)

        def deliver(q, r) -> None:
            finished[q.rid] = time.perf_counter()

        for r in waves[0]:
            arrived[r.rid] = t0
        th = threading.Thread(target=arrive)
        th.start()
        batch = waves[0]
        while batch:
            gen.generate(batch, feed=feed, deliver=deliver)
            while True:  # the next batch: what has arrived and was not taken
                with lock:
                    if feed is None:
                        batch, queue[:] = list(queue), []
                    else:
                        batch = [r for _ in range(len(feed)) for r in feed.pop()]
                if batch or not th.is_alive():
                    break
                time.sleep(0.001)
        th.join()
        lat = sorted(finished[k] - arrived[k] for k in arrived)
        res[mode] = {"makespan_s": round(max(finished.values()) - t0, 3),
                     "latency_mean_s": round(statistics.mean(lat), 3),
                     "latency_p90_s": round(lat[int(0.9 * (len(lat) - 1))], 3), "requests": len(lat)}
        print(mode, res[mode], flush=True)
    res["continuous_vs_sequential_latency"] = round(res["sequential"]["latency_mean_s"] /
                                                    res["continuous"]["latency_mean_s"], 3)
    out = {"command": "python bench/gpu_continuous_batching.py " + " ".join(sys.argv[1:]),
           "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": "qwen2-0.5b bf16 (random)",
           "waves": a.waves, "rows_per_wave": a.rows, "new_tokens": a.new_tokens, "gap_ms": a.gap_ms,
           "join": join, **res}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    j, sq, co = join, res["sequential"], res["continuous"]
    Path(a.out).with_suffix(".md").write_text("\n".join([
        "# Continuous batching on a GPU (issue 17)", "",
        f"`{out['command']}` on {out['machine']['gpu']} ({out['date']}), {out['shape']}.", "",
        f"**Join, fp32:** {j['joined']} requests ({j['joined_new_tokens']} new tokens) offered to a running batch of "
        f"{j['batch_rows']} ({j['batch_new_tokens']} new tokens) joined it; {j['joined_rows_identical']} of "
        f"{j['joined']} drew exactly the tokens they draw alone (mean identical prefix {j['mean_identical_prefix']} "
        f"of {j['joined_new_tokens']}); they were answered after {j['joined_done_s']} s, the batch after "
        f"{j['batch_done_s']} s.", "",
        f"**Waves, bf16:** {a.waves} waves of {a.rows} requests (prompt 32, {a.new_tokens // 8}–{a.new_tokens} new "
        f"tokens), one every {a.gap_ms:g} ms.", "",
        "| | makespan (s) | latency mean (s) | latency p90 (s) |", "|---|---|---|---|",
        f"| one batch after another | {sq['makespan_s']} | {sq['latency_mean_s']} | {sq['latency_p90_s']} |",
        f"| continuous batching | {co['makespan_s']} | {co['latency_mean_s']} | {co['latency_p90_s']} |", "",
        f"Mean latency {res['continuous_vs_sequential_latency']}× lower with continuous batching.", ""]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
