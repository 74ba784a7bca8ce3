"""Benchmark of the train step on CPU (issue 4): tokens/s packed (varlen) vs padded, and why.

Models (Qwen2 architecture, float32, the bundled tokenizer's 259-token vocabulary):
  tiny   the bundled model (examples/tiny-qwen2-arith: 4 layers, h 128)
  50m    12 layers, h 640, 10 heads (d 64), 2 kv heads, MLP 1728 — 51.8M parameters, random init (seed 0)
Lengths: the pack/balance issue's distribution (a) scaled by 1/16: prompts normal(12.5, 6.25) ≥ 1, responses
log-normal with median 62.5 and σ = 1, cut at 1,024 (the original: 200 ± 100, median 1,000, cap 16,384).
Micro-batches: first-fit under --max-tokens tokens (engine.packing.schedule, dynamic mode); every variant
trains the *same* sample sets, so only the layout differs:
  packed   one row per micro-batch, rollflow_varlen attention (what the torch backend runs)
  padded   one right-padded row per sample, attention mask, transformers' sdpa (the skeleton's forward)
  sdpa     one row per micro-batch, transformers' own packed path: position ids restart → dense block-diagonal
           T×T mask through sdpa (what you get without the varlen attention)
A step = forward + RL loss (engine.algorithms.policy_objective, GRPO defaults) + backward for every micro-batch,
then AdamW. tokens/s counts real (unpadded) tokens. Predicted speedup of packed over padded if cost were linear
in tokens: padded tokens / real tokens = 1 / (1 − padding share).

    PYTHONPATH=. python bench/train.py [--repeats 3] [--threads 1] [--out bench/results]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine.algorithms import LossSpec, policy_objective
from engine.packing.microbatch import MicroBatch, make_micro_batch
from engine.packing.schedule import build_dp_schedule
from engine.samples import Sample, Status
from engine.train.forward import packed_forward, use_varlen_attention

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "examples" / "tiny-qwen2-arith"


def lengths_a(n: int, scale: float = 1 / 16, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) lengths of distribution (a) scaled by `scale`."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.round(rng.normal(200 * scale, 100 * scale, n)), 1, None).astype(int)
    resp = np.clip(np.round(rng.lognormal(np.log(1000 * scale), 1.0, n)), 1, 16384 * scale).astype(int)
    return list(zip(prompt.tolist(), resp.tolist()))


def make_samples(lengths, vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        out.append(Sample(index=i, group_index=i // 8, rollout_id=0, prompt="", response_length=r,
                          tokens=torch.randint(0, vocab, (p + r,), generator=g).tolist(), loss_mask=[1] * r,
                          rollout_log_probs=[-1.0] * r, reward=float(i % 2), status=Status.COMPLETED))
    return out


def model_50m():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(BUNDLED)
    cfg.update(dict(hidden_size=640, num_hidden_layers=12, num_attention_heads=10, num_key_value_heads=2,
                    intermediate_size=1728, layer_types=["full_attention"] * 12, max_position_embeddings=2048))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def padded_forward(model, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [T], entropy [T]) via right-padded rows [S, Lmax] with an attention mask (all positions)."""
    cu = mb.cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    ids = torch.zeros((len(lens), max(lens)), dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, (a, L) in enumerate(zip(cu[:-1], lens)):
        ids[i, :L], att[i, :L] = mb.tokens[a:a + L], 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=att, use_cache=False).logits.float()[:, :-1], -1)
    tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [S, Lmax−1]
    ent = -(logp.exp() * logp).sum(-1)
    rows = torch.cat([torch.arange(a + 1, a + L) for a, L in zip(cu[:-1], lens)])
    cols = torch.cat([torch.arange(L - 1) for L in lens])
    sid = torch.cat([torch.full((L - 1,), i) for i, L in enumerate(lens)])
    lp = torch.zeros(mb.num_tokens).index_put((rows,), tok[sid, cols])
    return lp * mb.loss_mask, torch.zeros(mb.num_tokens).index_put((rows,), ent[sid, cols]) * mb.loss_mask


def sdpa_packed_forward(model, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own packing: position ids restart per sample, no cu_seqlens → a dense block-diagonal mask."""
    keep = (mb.loss_mask > 0).nonzero().squeeze(-1)
    out = model(input_ids=mb.tokens[None], position_ids=mb.position_ids[None], use_cache=False,
                logits_to_keep=keep - 1)
    logp = torch.log_softmax(out.logits[0].float(), -1)
    lp = torch.zeros(mb.num_tokens).index_put((keep,), logp.gather(-1, mb.tokens[keep, None]).squeeze(-1))
    ent = torch.zeros(mb.num_tokens).index_put((keep,), -(logp.exp() * logp).sum(-1))
    return lp, ent


def train_step(model, optimizer, mbs: list[MicroBatch], forward, n_samples: int) -> float:
    spec = LossSpec()
    optimizer.zero_grad()
    t0 = time.perf_counter()
    for mb in mbs:
        lp, ent = forward(model, mb)
        old = lp.detach()
        loss, _, _ = policy_objective(spec, log_probs=lp, entropy=ent, old_log_probs=old, ref_log_probs=None,
                                      rollout_log_probs=mb.rollout_log_probs, advantages=mb.advantages,
                                      loss_mask=mb.loss_mask, cu_seqlens=mb.cu_seqlens, denominator=n_samples)
        loss.backward()
    optimizer.step()
    return time.perf_counter() - t0


def bench_model(name: str, model, n_samples: int, cap: int, repeats: int) -> dict:
    lengths = lengths_a(n_samples, seed=1)
    samples = make_samples(lengths, model.config.vocab_size)
    totals = [p + r for p, r in lengths]
    (step,) = build_dp_schedule(totals, dp_size=1, global_batch_size=n_samples, max_tokens_per_gpu=cap)
    groups = step.ranks[0]
    mbs = [make_micro_batch([samples[i] for i in g], [1.0 if i % 2 else -1.0 for i in g]) for g in groups]
    real = sum(totals)
    padded_tokens = sum(len(g) * max(totals[i] for i in g) for g in groups)
    attn_packed = sum(totals[i] ** 2 for g in groups for i in g)  # Σ L_i² (varlen)
    attn_dense = sum(sum(totals[i] for i in g) ** 2 for g in groups)  # Σ (Σ L_i)² (dense block-diag mask)
    attn_padded = sum(len(g) * max(totals[i] for i in g) ** 2 for g in groups)  # Σ S·Lmax²

    base = model.eval()
    varlen = copy.deepcopy(base)
    use_varlen_attention(varlen)
    runs = {"packed": (varlen, packed_forward), "padded": (base, padded_forward), "sdpa": (base, sdpa_packed_forward)}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=0.0) for v, (m, _) in runs.items()}  # lr 0: same weights
    for v, (m, fwd) in runs.items():
        train_step(m, opts[v], mbs[:1], fwd, n_samples)  # warm-up
    secs: dict[str, list[float]] = {v: [] for v in runs}
    for _ in range(repeats):  # interleaved, so a change in machine load hits every variant alike
        for v, (m, fwd) in runs.items():
            secs[v].append(train_step(m, opts[v], mbs, fwd, n_samples))
    variants = {}
    for v, ss in secs.items():
        variants[v] = {"seconds": ss, "seconds_median": statistics.median(ss),
                       "tokens_per_s_median": real / statistics.median(ss), "tokens_per_s_min": real / max(ss),
                       "tokens_per_s_max": real / min(ss)}
        print(f"{name:5s} {v:7s} {real / statistics.median(ss):9.0f} tok/s  (runs: "
              + ", ".join(f"{x:.2f}s" for x in ss) + ")", flush=True)
    share = 1 - real / padded_tokens
    return {"model": name, "parameters": sum(p.numel() for p in base.parameters()), "samples": n_samples,
            "cap_tokens": cap, "micro_batches": len(groups), "real_tokens": real, "padded_tokens": padded_tokens,
            "padding_share": share, "predicted_speedup_linear": 1 / (1 - share),
            "attention_cost_ratio_padded_over_packed": attn_padded / attn_packed,
            "attention_cost_ratio_dense_over_packed": attn_dense / attn_packed,
            "speedup_packed_over_padded": variants["padded"]["seconds_median"] / variants["packed"]["seconds_median"],
            "speedup_packed_over_sdpa": variants["sdpa"]["seconds_median"] / variants["packed"]["seconds_median"],
            "variants": variants}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="directory for train_cpu.json")
    ap.add_argument("--tiny-samples", type=int, default=128)
    ap.add_argument("--big-samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine.modeling import load_causal_lm

    load_before = os.getloadavg()
    t0 = time.time()
    results = [bench_model("tiny", load_causal_lm(str(BUNDLED)), args.tiny_samples, args.max_tokens, args.repeats),
               bench_model("50m", model_50m(), args.big_samples, args.max_tokens, args.repeats)]
    report = {"command": "PYTHONPATH=. python bench/train.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__, "python": platform.python_version(),
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "wall_s": time.time() - t0, "results": results}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "train_cpu.json").write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"{r['model']}: padding share {r['padding_share']:.1%} → linear prediction "
              f"{r['predicted_speedup_linear']:.2f}×; measured packed/padded {r['speedup_packed_over_padded']:.2f}×, "
              f"packed/sdpa-mask {r['speedup_packed_over_sdpa']:.2f}×")


if __name__ == "__main__":
    main()
