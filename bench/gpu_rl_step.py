"""The whole RL step on one GPU: `rollflow train` (colocated) against TRL's GRPOTrainer on the same model and work.

    python bench/gpu_rl_step.py run --shape 0.5b --backend torch --sides rollflow,trl --out DIR   # a CUDA machine
    python bench/gpu_rl_step.py run --shape 1.5b --backend megatron --sides rollflow,trl --out DIR
    python bench/gpu_rl_step.py report --out DIR --decode DIR/gpu_engine_decode.json --write bench/results

The work (issue 17): a random Qwen2 of the Qwen2.5-0.5B or -1.5B shape (no weights can be downloaded; the bundled
tokenizer and chat template), the bundled arithmetic prompts through the chat template, 64 prompts × 8 samples per
step, responses up to 1,024 tokens at T = 1 (random weights never emit EOS, so every response is 1,024 tokens on both
sides), exact-match reward (rollflow's function on both sides), GRPO advantages, clip ε = 0.2, no KL, one AdamW
step per rollout at lr 1e-6, bf16 autocast over fp32 weights (rollflow's `--bf16`; TRL's `bf16=True`), no activation
recompute on either side, micro-batches of ~16 samples (rollflow: `--max-tokens-per-gpu 16384`; TRL:
`per_device_train_batch_size=16` × 32 accumulation steps).

- `rollflow`: `rollflow train --colocate` through bench/gpu_flow.py (engine and trainer on the one GPU, the built-in
  engine decoding through its CUDA graphs, CUDA-IPC weight sync). Per step: the flow's own stage times, rollout and
  train tokens/s, train MFU (engine/packing/flops.py's FLOPs of the trained sequences ÷ the H200's 989 TFLOP/s
  dense bf16), sync GB/s, peak memory per stage.
- `trl`: GRPOTrainer (trl from PyPI, transformers `generate` in-process, no vLLM), on the same GPU, in its own
  process after rollflow's has exited. Per step: the generate-and-score time and the rest (the train step).

Steps after the first are measured (the first includes CUDA-graph capture, kernel selection and allocator growth);
`trl_ratio` = rollflow steps/s ÷ TRL steps/s. `report` merges the runs of a directory into gpu_rl_step.json (with
`floor_ratio` from bench/gpu_engine_decode.py's JSON of the same call) and gpu_rl_step.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TRAIN = ROOT / "examples" / "data" / "arith" / "train.jsonl"
TINY = ROOT / "examples" / "tiny-qwen2-arith"
H200_BF16_DENSE = 989e12  # FLOP/s, the H200's dense bf16 tensor-core peak (NVIDIA's data sheet)
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/rollflow_gpu_flow"))  # bench/gpu_flow.py's: its runs land there


def work_of(shape: str) -> dict:
    """The step's size: issue 17's on the GPU shapes; a small one for the bundled tiny model (a CPU check of this
    script, not a result)."""
    if shape == "tiny":
        return {"prompts": 8, "samples": 8, "max_response": 16, "micro_batch": 16, "max_tokens": 1024, "lr": 1e-6}
    return {"prompts": 64, "samples": 8, "max_response": 1024, "micro_batch": 16, "max_tokens": 16384, "lr": 1e-6}


def model_dir(shape: str) -> Path:
    if shape == "tiny":
        return TINY
    from gpu_flow import random_model

    return random_model(shape, WORK / f"qwen2_{shape}")


def machine() -> dict:
    from gpu_flow import machine as m

    return m()


# ---- rollflow ---------------------------------------------------------------------------------------------------
def run_rollflow(shape: str, backend: str, steps: int, out: Path, timeout_s: float, extra: list[str],
                 suffix: str = "") -> dict:
    from gpu_flow import run

    w = work_of(shape)
    model = model_dir(shape)
    tag = f"rl_step_{shape.replace('.', '')}_{backend}{suffix}"
    cuda = _cuda()
    args = ["--hf-checkpoint", str(model), "--apply-chat-template", "--rm-type", "exact_match",
            "--eval-prompt-data", "", "--rollout-batch-size", str(w["prompts"]),
            "--n-samples-per-prompt", str(w["samples"]), "--rollout-max-response-len", str(w["max_response"]),
            "--rollout-max-truncated-share", "1", "--num-rollout", str(steps),
            "--global-batch-size", str(w["prompts"] * w["samples"]), "--use-dynamic-batch-size",
            "--max-tokens-per-gpu", str(w["max_tokens"]), "--rollout-concurrency", str(w["prompts"] * w["samples"]),
            "--sglang-max-running-requests", str(w["prompts"] * w["samples"]), "--lr", str(w["lr"]),
            "--train-backend", backend, *(["--colocate", "--bf16"] if cuda else []), *extra]
    res = run(tag, args, out, timeout_s, {"side": "rollflow", "train_backend": backend, "shape": shape,
                                          "precision": "bf16" if cuda else "fp32"})
    if res["state"] != "Completed":
        return res
    s = json.loads((WORK / tag / "summary.json").read_text())
    done = [s["rollout_done_s"][str(i)] for i in range(steps)]
    step_s = [b - a for a, b in zip([0.0, *done[:-1]], done)]
    measured = step_s[1:] or step_s
    h = s["history"]
    last = str(steps - 1)
    train_s, train_tps = h["train/seconds"][last], h["train/tokens_per_s"][last]
    resp = h["rollout/response_len_mean"][last]
    cfg = json.loads((model / "config.json").read_text())
    res.update(
        step_s=[round(x, 3) for x in step_s], measured_step_s=round(statistics.median(measured), 3),
        steps_per_s=round(1 / statistics.median(measured), 5),
        stage_s_measured={st: res["seconds_per_rollout"][st][-1] for st in ("rollout", "pack", "train", "sync")},
        prompt_len_mean=round(prompt_len_mean(model), 1),
        train_mfu=round(train_flops(cfg, w["prompts"] * w["samples"], prompt_len_mean(model), resp)
                        / train_s / H200_BF16_DENSE, 4) if cuda else None,
        train_tokens_per_s_measured=round(train_tps, 1))
    (out / f"gpu_flow_{tag}.json").write_text(json.dumps(res, indent=1))  # gpu_flow.run's file, with the above
    return res


def prompt_len_mean(model: Path) -> float:
    """Mean prompt length in tokens: the training prompts through the model's chat template, as both sides send."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in TRAIN.read_text().splitlines() if x.strip()]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                     add_generation_prompt=True) for r in rows[:512]]
    lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return sum(lens) / len(lens)


def train_flops(cfg: dict, n: int, prompt_len: float, response_len: float) -> float:
    """A train step's FLOPs: 3 × the forward of n sequences of the mean length (forward + backward)."""
    from engine.packing.flops import ModelShape, sequence_flops

    L = int(round(prompt_len + response_len))
    return 3.0 * n * float(sequence_flops(L, ModelShape.from_hf_config(cfg)))


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


# ---- TRL (its own process: `--side-process trl`) ----------------------------------------------------------------
def trl_side(shape: str, steps: int, work: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig
    from trl_race import trl_timers

    from engine.rewards import exact_match

    w = work_of(shape)
    cuda = torch.cuda.is_available()
    torch.manual_seed(1234)
    path = model_dir(shape)
    rows = [json.loads(x) for x in TRAIN.read_text().splitlines() if x.strip()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fp32 weights, bf16 autocast

    def reward(completions, label, **_):
        return [exact_match(c[0]["content"] if isinstance(c, list) else c, y) for c, y in zip(completions, label)]

    n = w["prompts"] * w["samples"]
    cfg = GRPOConfig(output_dir=str(work / "trl_out"), per_device_train_batch_size=w["micro_batch"],
                     gradient_accumulation_steps=n // w["micro_batch"], num_generations=w["samples"],
                     max_completion_length=w["max_response"], temperature=1.0, top_p=1.0,
                     learning_rate=w["lr"], lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                     beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1,
                     max_steps=steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=not cuda,
                     seed=1234, data_seed=1234, disable_tqdm=True, dataloader_num_workers=0,
                     bf16=cuda, gradient_checkpointing=False)
    marks: dict = {"step_end": [], "gen_s": [], "completion_len": []}
    Timed, clock = trl_timers(marks, {"completions/mean_length": "completion_len"},
                              torch.cuda.synchronize if cuda else None)
    trainer = Timed(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                    callbacks=[clock])
    trainer.train()
    if cuda:
        marks["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    import trl
    import transformers

    marks["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    (work / "trl_marks.json").write_text(json.dumps(marks))


def run_trl(shape: str, steps: int, out: Path, timeout_s: float) -> dict:
    work = WORK / f"trl_{shape.replace('.', '')}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model_dir(shape)  # built (or kept) before the clock starts, as for rollflow
    cmd = [sys.executable, __file__, "trl-side", "--shape", shape, "--steps", str(steps), "--work", str(work)]
    tag = f"trl_{shape.replace('.', '')}"
    print(f"[{time.strftime('%H:%M:%S')}] {tag}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    with open(work / "console.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [str(ROOT), os.environ.get("PYTHONPATH", "")])}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = (work / "console.log").read_text(errors="replace")
    (out / f"gpu_rl_step_{tag}.log").write_text(text[-200_000:])
    res = {"tag": tag, "side": "trl", "shape": shape, "machine": machine(), "wall_s": round(time.time() - t0, 1),
           "command": "python bench/gpu_rl_step.py " + " ".join(cmd[2:])}
    if rc != 0 or not (work / "trl_marks.json").is_file():
        res.update(state="Failed", returncode=rc, log_tail=text[-4000:])
    else:
        m = json.loads((work / "trl_marks.json").read_text())
        ends = m["step_end"]
        step_s = [b - a for a, b in zip([m["train_begin"], *ends[:-1]], ends)]
        measured = step_s[1:] or step_s
        gen = m["gen_s"][1:] or m["gen_s"]
        res.update(state="Completed", step_s=[round(x, 3) for x in step_s],
                   measured_step_s=round(statistics.median(measured), 3),
                   steps_per_s=round(1 / statistics.median(measured), 5),
                   stage_s_measured={"generate_and_score": round(statistics.median(gen), 3),
                                     "train": round(statistics.median(measured) - statistics.median(gen), 3)},
                   completion_len_mean=m["completion_len"], peak_memory_gib=m.get("peak_memory_gib"),
                   versions=m.get("versions"))
    (out / f"gpu_rl_step_{tag}.json").write_text(json.dumps(res, indent=1))
    print(f"[{time.strftime('%H:%M:%S')}] {tag}: {res['state']} in {res['wall_s']} s", flush=True)
    return res


# ---- report -----------------------------------------------------------------------------------------------------
def report(dirs: list[Path], decode: Path | None, write: Path | None, command: str | None = None) -> dict:
    """Merge the runs found in `dirs` (one per device call, in order). A rollflow run's `trl_ratio` is against the
    TRL run of the same shape, preferably from the same call (`same_call` says whether it was)."""
    found = []
    for d in dirs:
        for f in sorted(d.glob("gpu_flow_rl_step_*.json")) + sorted(d.glob("gpu_rl_step_trl_*.json")):
            r = json.loads(f.read_text())
            r["call"] = d.name
            found.append(r)
    tags = [r["tag"] for r in found]  # a run repeated in a later call is kept too, as tag@call
    runs = {(r["tag"] if tags.count(r["tag"]) == 1 else f"{r['tag']}@{r['call']}"): r for r in found}
    result: dict = {"command": command or "bash bench/gpu_rl_step_device.sh … (each run has its own command)",
                    "machine": next((r["machine"] for r in runs.values()), None),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "work": work_of("0.5b"), "runs": runs}
    if decode and decode.is_file():
        d = json.loads(decode.read_text())
        result["floor_ratio"] = d["floor_ratio"]
        result["floor_ratio_compiled"] = d.get("floor_ratio_compiled")
        result["decode"] = {k: d.get(k) for k in ("command", "date", "batch", "prompt_len", "new_tokens",
                                                  "floor_ms_at_4.24TBps", "engine_vs_hf_sampling",
                                                  "compiled_vs_hf_sampling", "folded_vs_unfolded_speedup")}
        result["decode"]["ms_per_step"] = {k: v["ms_per_step"] for k, v in d["runs"].items()}
    # MFU on the basis bench/gpu_megatron.py used for its 52–54 % (a bf16 8192³ matmul measured on the H200)
    peak_file = ROOT / "bench" / "results" / "gpu_megatron.json"
    matmul = json.loads(peak_file.read_text()).get("matmul_peak", {}).get("tflops") if peak_file.is_file() else None
    if matmul:
        result["matmul_peak_tflops"] = round(matmul, 1)
        result["matmul_peak_source"] = "bench/results/gpu_megatron.json (bench/gpu_megatron.py, an earlier call)"
        for r in runs.values():
            if r.get("train_mfu") is not None:
                r["train_mfu_vs_matmul_peak"] = round(r["train_mfu"] * H200_BF16_DENSE / (matmul * 1e12), 4)
    ratios = {}
    for tag, r in runs.items():
        if r.get("side") != "rollflow" or r["state"] != "Completed":
            continue
        peers = [p for p in runs.values() if p.get("side") == "trl" and p["shape"] == r["shape"]
                 and p["state"] == "Completed"]
        peer = next((p for p in peers if p["call"] == r["call"]), peers[-1] if peers else None)
        if peer:
            ratios[tag] = {"trl_ratio": round(r["steps_per_s"] / peer["steps_per_s"], 3),
                           "same_call": peer["call"] == r["call"]}
    result["trl_ratio_by_run"] = ratios
    same = {k: v for k, v in ratios.items() if v["same_call"]}
    if same:  # the headline: the newest 0.5B torch run with a same-call peer (the current code), else the first
        key = ([k for k in same if "05b_torch" in k] or [next(iter(same))])[-1]
        result["trl_ratio"], result["trl_ratio_run"] = same[key]["trl_ratio"], key
        result["trl_ratio_min"] = min(v["trl_ratio"] for v in ratios.values())
    lines = ["| run | call | s per step (measured) | rollout / pack / train / sync (s) | steps/s | × TRL | "
             "train MFU (÷ 989 TF/s; ÷ matmul peak) | sync GB/s | peak GiB rollout / train / sync |",
             "|" + "---|" * 9]
    for tag, r in runs.items():
        if r["state"] != "Completed":
            lines.append(f"| {tag} | {r['call']} | {r['state']} | | | | | | |")
            continue
        st = r["stage_s_measured"]
        if r["side"] == "trl":
            lines.append(f"| {tag} | {r['call']} | {r['measured_step_s']} | generate+score "
                         f"{st['generate_and_score']} / train {st['train']} | {r['steps_per_s']} | 1 | | | "
                         f"{r.get('peak_memory_gib')} (torch max allocated) |")
        else:
            pk = r["peak_memory_gib"]
            x = ratios.get(tag)
            xs = "—" if not x else f"{x['trl_ratio']}" + ("" if x["same_call"] else " (TRL from another call)")
            mfu = f"{r['train_mfu']:.3f}" + (f"; {r['train_mfu_vs_matmul_peak']:.3f}"
                                             if r.get("train_mfu_vs_matmul_peak") else "")
            lines.append(f"| {tag} | {r['call']} | {r['measured_step_s']} | {st['rollout']:.2f} / {st['pack']:.2f} / "
                         f"{st['train']:.2f} / {st['sync']:.2f} | {r['steps_per_s']} | {xs} | {mfu} | "
                         f"{r.get('sync_gb_per_s')} | {pk.get('rollout'):.1f} / {pk.get('train'):.1f} / "
                         f"{pk.get('sync'):.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    print(json.dumps({k: result.get(k) for k in ("floor_ratio", "floor_ratio_compiled", "trl_ratio",
                                                 "trl_ratio_min")}))
    if write:
        write.mkdir(parents=True, exist_ok=True)
        (write / "gpu_rl_step.json").write_text(json.dumps(result, indent=1))
        (write / "gpu_rl_step_table.md").write_text(table)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["run", "report", "trl-side"])
    p.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b", "tiny"])
    p.add_argument("--backend", default="torch", choices=["torch", "megatron"])
    p.add_argument("--sides", default="rollflow,trl")
    p.add_argument("--steps", type=int, default=2, help="RL steps per side (the first is not measured)")
    p.add_argument("--timeout", type=float, default=400, help="seconds per side")
    p.add_argument("--extra", default="", help="more `rollflow train` flags, one string")
    p.add_argument("--tag-suffix", default="", help="appended to the rollflow run's tag (a variant of the same run)")
    p.add_argument("--out", default=str(WORK / "out"), help="run: where results go; report: the directories of "
                                                             "the device calls, comma-separated, in order")
    p.add_argument("--command", default=None, help="report: the command that produced the runs (recorded)")
    p.add_argument("--decode", default=None, help="report: bench/gpu_engine_decode.py's JSON from the same call")
    p.add_argument("--write", default=None, help="report: write gpu_rl_step.json and gpu_rl_step_table.md here")
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    out = Path(a.out.split(",")[0])
    if a.mode != "report":
        out.mkdir(parents=True, exist_ok=True)
    if a.mode == "trl-side":
        trl_side(a.shape, a.steps, Path(a.work))
        return 0
    if a.mode == "report":
        report([Path(x) for x in a.out.split(",")], Path(a.decode) if a.decode else None,
               Path(a.write) if a.write else None, a.command)
        return 0
    sides = [s for s in a.sides.split(",") if s]
    bad = [s for s in sides if s not in ("rollflow", "trl")]
    if bad:
        p.error(f"--sides {a.sides!r}: rollflow and/or trl")
    for side in sides:
        if side == "rollflow":
            run_rollflow(a.shape, a.backend, a.steps, out, a.timeout, a.extra.split(), a.tag_suffix)
        else:
            run_trl(a.shape, a.steps, out, a.timeout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
