"""Rollout benchmark of the built-in engine on CPU: batching, engine scaling, weight-sync cost.

    python bench/rollout.py --out bench/results/rollout-cpu.json [--repeats 3] [--quick]

Models: the bundled tiny Qwen2 (0.8 M params, 3.1 MB) and a ~50 M-parameter Qwen2 config with random weights (same
tokenizer; 16 layers, hidden 512, MLP 1536: 16 · (0.79 M attention + 2.36 M MLP) ≈ 50.4 M, 201 MB in fp32).
Every request samples exactly `max_new` tokens (ignore_eos), so tokens/s counts the same work in every mode.

1. batched vs one by one: 64 requests sent concurrently (the engine's batching window merges them) vs the same 64
   requests one after another; generated tokens per second.
2. engines: 1 engine vs 2 engines (each with --threads torch threads, default 1), 16 groups × 4 samples through
   the rollout loop (least-outstanding spread). On a 2-core machine this is the demo's layout question: one engine
   per core, or one engine. (More threads than free cores makes OpenMP spin: measured 3x slower under load.)
3. weight sync: seconds per MB to give an engine the full state dict: through Ray's object store to the engine
   actor (the run's default, `--weight-sync-method tensor`; includes putting the arrays into the store), from disk
   (save safetensors dir + /update_weights_from_disk, `--weight-sync-method disk`), and as a raw safetensors body
   POSTed to /update_weights_from_tensor (HTTP; measures uvicorn's request-body path).
Engines run as separate processes (`python -m engine.rollout.server`), as in a run. Each measurement is repeated;
the JSON has every repeat, and the median, min and max.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
KEY = "bench-key"  # the engines answer only to requests carrying it; weight updates need one
AUTH = {"Authorization": f"Bearer {KEY}"}
sys.path.insert(0, str(ROOT))

from engine.config.data import BUNDLED_MODEL  # noqa: E402


from engine.rollout.ports import free_loopback_port  # noqa: E402
free_port = free_loopback_port  # engine/rollout/ports.py


def make_50m(path: Path) -> str:
    """Random-weight Qwen2 of ~50 M parameters with the bundled tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (path / "model.safetensors").is_file():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(Path(BUNDLED_MODEL) / f, path / f)
    cfg = AutoConfig.from_pretrained(BUNDLED_MODEL)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 512, 1536, 16
    cfg.num_attention_heads, cfg.num_key_value_heads = 8, 4
    cfg.layer_types = ["full_attention"] * 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


def n_params(model_path: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_path) / "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


class Engine:
    def __init__(self, model: str, threads: int, log_dir: Path):
        from engine.rollout.sglang import LaunchedEngine

        port = free_port()
        cmd = [sys.executable, "-m", "engine.rollout.server", "--model-path", model, "--host", "127.0.0.1",
               "--port", str(port), "--threads", str(threads), "--device", "cpu", "--api-key", KEY,
               "--weight-dir", str(log_dir / "weights")]
        self.proc = LaunchedEngine(cmd, url=f"http://127.0.0.1:{port}", log_path=str(log_dir / f"engine-{port}.log"),
                                   ports=[port], mem_fraction_static=None,
                                   env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)})
        self.url = self.proc.start(timeout_s=300)

    def stop(self) -> None:
        self.proc.stop()


def prompts(k: int) -> list[list[int]]:
    from engine.modeling import load_tokenizer

    tok = load_tokenizer(BUNDLED_MODEL)
    rows = [json.loads(x) for x in (ROOT / "examples/data/arith/train.jsonl").read_text().splitlines()[:k]]
    return [tok(f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\n",
                add_special_tokens=False)["input_ids"] for r in rows]


def body(ids: list[int], max_new: int, seed: int) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True,
                                                  "sampling_seed": seed}}


async def _concurrent(url: str, ps: list[list[int]], max_new: int) -> int:
    async with httpx.AsyncClient(timeout=600, headers=AUTH) as c:
        rs = await asyncio.gather(*[c.post(url + "/generate", json=body(p, max_new, i)) for i, p in enumerate(ps)])
    return sum(r.json()["meta_info"]["completion_tokens"] for r in rs)


def batched_vs_sequential(url: str, ps: list[list[int]], max_new: int) -> dict[str, float]:
    asyncio.run(_concurrent(url, ps[:4], 2))  # warm-up
    t0 = time.perf_counter()
    toks = asyncio.run(_concurrent(url, ps, max_new))
    batched = toks / (time.perf_counter() - t0)
    batch_sizes = httpx.get(url + "/get_server_info", headers=AUTH).json()["batch_sizes"]
    t0 = time.perf_counter()
    toks = 0
    with httpx.Client(timeout=600, headers=AUTH) as c:
        for i, p in enumerate(ps):
            toks += c.post(url + "/generate", json=body(p, max_new, i)).json()["meta_info"]["completion_tokens"]
    sequential = toks / (time.perf_counter() - t0)
    return {"batched_tok_s": batched, "sequential_tok_s": sequential, "speedup": batched / sequential,
            "last_batch_sizes": batch_sizes[-6:]}


def engines_tok_s(urls: list[str], max_new: int) -> float:
    from engine.data import PromptRow
    from engine.rewards import RewardModel
    from engine.rollout.loop import Prompt, SamplingParams, StaticEngines, generate_rollout

    ps = prompts(16)
    it = iter(range(10**6))

    def draw(k):
        return [Prompt(PromptRow(i, "", "x", {}), ps[i % len(ps)]) for i in (next(it) for _ in range(k))]

    # a real rollout: samples stop at EOS (the engine's own), so count the tokens actually generated
    t0 = time.perf_counter()
    res = generate_rollout(draw, rollout_id=0, batch_size=16, n=4, seed=0, engines=StaticEngines(urls, api_key=KEY),
                           params=SamplingParams(max_new_tokens=max_new, temperature=1.0),
                           reward_model=RewardModel("exact_match", None), concurrency=64, timeout_s=600)
    secs = time.perf_counter() - t0
    return sum(s.response_length for g in res.groups for s in g) / secs


def sync_s_per_mb(url: str, model: str, weight_dir: Path) -> dict[str, float]:
    from engine.modeling import load_causal_lm
    from engine.weights import save_weights_dir
    from engine.weights.sync import push_disk, push_tensors

    state = {k: v.detach() for k, v in load_causal_lm(model).state_dict().items()}
    t0 = time.perf_counter()
    st = push_tensors([url], state, 1, bucket_bytes=512 * 2**20, timeout_s=600, api_key=KEY)
    http_s = time.perf_counter() - t0
    weight_dir.mkdir(parents=True, exist_ok=True)  # the engine loads only from its --weight-dir
    with tempfile.TemporaryDirectory(dir=weight_dir) as d:
        t0 = time.perf_counter()
        path = save_weights_dir(state, Path(d) / "v000002")
        push_disk([url], str(path), 2, timeout_s=600, api_key=KEY)
        disk_s = time.perf_counter() - t0
    return {"mb": st["mb"], "http_tensor_s_per_mb": http_s / st["mb"], "disk_s_per_mb": disk_s / st["mb"],
            "http_tensor_s": http_s, "disk_s": disk_s}


def object_store_sync(model: str, threads: int, repeats: int, log_dir: Path) -> dict:
    """The run's path: the arrays into Ray's object store, the engine actor copies them into its model."""
    import ray

    from engine.cluster import port_registry, worker_env
    from engine.cluster.placement import place, rollout_layout
    from engine.modeling import load_causal_lm
    from engine.rollout.actor import EngineSpec
    from engine.rollout.engines import EngineGroup
    from engine.weights import numpy_state
    from engine.weights.sync import push_object_store

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**worker_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}})
    try:
        layout = rollout_layout(cluster_gpus=0, train_gpus=1, colocate=False, rollout_num_gpus=None,
                                gpus_per_engine=1, num_engines=1)
        group = EngineGroup(EngineSpec(kind="builtin", model_path=model, log_dir=str(log_dir), threads=threads,
                                       start_timeout_s=600, api_key=KEY), place(layout), port_registry()).start()
        state = {k: v.detach() for k, v in load_causal_lm(model).state_dict().items()}
        runs = []
        for i in range(repeats):
            t0 = time.perf_counter()
            arrays = numpy_state(state)
            ref = ray.put(arrays)
            push_object_store(group.serving_slots(), ref, 10 + i, timeout_s=600)
            secs = time.perf_counter() - t0
            mb = arrays.nbytes / 2**20
            runs.append({"object_store_s": secs, "object_store_s_per_mb": secs / mb, "mb": mb})
            del ref
        group.stop()
        return runs
    finally:
        ray.shutdown()


def summarize(runs: list[dict]) -> dict:
    out = {}
    for k, v in runs[0].items():
        if isinstance(v, (int, float)):
            vals = [r[k] for r in runs]
            out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def load_average() -> list[float]:
    return list(os.getloadavg())


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the engine processes
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench/results/rollout-cpu.json"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat, fewer tokens (smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")
    a = ap.parse_args()
    repeats = 1 if a.quick else a.repeats
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-"))
    models = {"tiny (bundled, 0.8M)": (BUNDLED_MODEL, 32 if not a.quick else 8),
              "qwen2-50M (random)": (make_50m(Path(tempfile.gettempdir()) / "rollflow-bench-50m"),
                                     16 if not a.quick else 4)}
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": {
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "load_average_before": load_average()}, "models": {}}
    ps = prompts(64)
    for name, (model, max_new) in models.items():
        entry: dict = {"path_hint": Path(model).name, "params": n_params(model), "max_new_tokens": max_new}
        eng = Engine(model, a.threads, work)
        try:
            runs = [batched_vs_sequential(eng.url, ps, max_new) for _ in range(repeats)]
            entry["batched_vs_sequential"] = {"runs": runs, **summarize(runs)}
            runs = [sync_s_per_mb(eng.url, model, work / "weights") for _ in range(repeats)]
            entry["weight_sync_http_and_disk"] = {"runs": runs, **summarize(runs)}
            one = [engines_tok_s([eng.url], max_new) for _ in range(repeats)]
        finally:
            eng.stop()
        two_engines = [Engine(model, a.threads, work), Engine(model, a.threads, work)]
        try:
            two = [engines_tok_s([e.url for e in two_engines], max_new) for _ in range(repeats)]
        finally:
            for e in two_engines:
                e.stop()
        entry["engines"] = {f"1 engine x {a.threads} threads tok/s": summarize([{"v": x} for x in one])["v"],
                            f"2 engines x {a.threads} threads tok/s": summarize([{"v": x} for x in two])["v"],
                            "runs_1": one, "runs_2": two}
        runs = object_store_sync(model, a.threads, repeats, work)
        entry["weight_sync_object_store"] = {"runs": runs, **summarize(runs)}
        result["models"][name] = entry
        print(json.dumps({name: {k: v for k, v in entry.items() if k != "path_hint"}}, indent=1, default=str))
    result["machine"]["load_average_after"] = load_average()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
