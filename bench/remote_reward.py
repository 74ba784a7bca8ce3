"""--rm-type remote_rm: how rollflow sends a group (engine/rewards.py `RemoteReward`: a client and an event loop of
the calling thread per group) against one event-loop thread and one kept-open client for the run (the variant first
written, here inline).

    python bench/remote_reward.py --out bench/results/remote_reward.json      # CPU, ~20 s

A keep-alive reward service on loopback (`http.server`, HTTP/1.1, a thread per connection, a listen backlog of 128;
reward = exact match)
scores --groups groups of --n samples, --repeats times per way, the ways interleaved; recorded: the seconds per
pass (all groups, one after the other, as the rollout loop hands them over).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps(float(body["response"].strip() == str(body["label"]).strip())).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


async def _client(httpx):
    return httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64))


def main() -> None:
    import httpx

    from engine.rewards import RemoteReward, RewardModel
    from engine.samples import Sample, Status

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "remote_reward.json"))
    a = p.parse_args()

    ThreadingHTTPServer.request_queue_size = 128  # socketserver's 5 drops connections that arrive together
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/score"
    groups = [[Sample(index=i, group_index=g, rollout_id=0, prompt="p", response="2", label="2",
                      status=Status.COMPLETED) for i in range(a.n)] for g in range(a.groups)]
    rollflow = RewardModel("remote_rm", None, rm_url=url)
    one = RemoteReward(url)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    client = asyncio.run_coroutine_threadsafe(_client(httpx), loop).result()

    async def on_shared(samples):
        return await asyncio.gather(*(one._one(client, s) for s in samples))

    def shared_pass():
        for g in groups:
            for s, r in zip(g, asyncio.run_coroutine_threadsafe(on_shared(g), loop).result()):
                s.reward = float(r)

    def per_group_pass():
        for g in groups:
            rollflow.score_group(g)

    times: dict[str, list[float]] = {"shared_loop_and_client": [], "client_and_loop_per_group": []}
    for _ in range(a.repeats):
        for name, fn in (("shared_loop_and_client", shared_pass), ("client_and_loop_per_group", per_group_pass)):
            t0 = time.perf_counter()
            fn()
            times[name].append(round(time.perf_counter() - t0, 4))
    server.shutdown()
    assert all(s.reward == 1.0 for g in groups for s in g)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    result = {"command": "python bench/remote_reward.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.platform()})",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "groups": a.groups, "n": a.n,
              "seconds_per_pass": times, "median_s": med,
              "per_group_over_shared_median": round(med["client_and_loop_per_group"] / med["shared_loop_and_client"],
                                                    2)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
