#!/usr/bin/env python
"""Build the bundled tool-use model: the arithmetic model taught to call a `calc` tool some of the time.

Starts from ``examples/tiny-qwen2-arith`` (build it first: ``build_tiny_model.py``) and fine-tunes it on a mixture,
in the chat format, for the prompt "a+b=":

* with weight ``1 - --tool-share``: the noisy teacher's direct answers ("85<|im_end|>"), as the base model;
* with weight ``--tool-share``: a tool transcript

      <calc>37+48</calc>          model tokens (the call; generation stops on the stop string "</calc>")
      <out>85</out>               tool tokens: the environment's answer, appended to the context, no loss
      85<|im_end|>                model tokens: the answer, copied from the tool's output

The loss covers the model's tokens only (the tool's tokens are masked, as they are in RL). The result (seed 0,
``examples/tiny-qwen2-calc/build_metrics.json``) calls the tool on ~20% of the test prompts when sampling and is
right ~95% of the time when it does, versus ~31% without it: a policy whose reward GRPO can raise by learning to
call the tool (``examples/tool_calc.py``, README "Custom rollouts").

Usage (from the repo root, a few minutes on 2 CPU cores):

    python examples/build_tool_model.py --seed 0
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_tiny_model import IM_END, chat_prompt, teacher_distribution  # noqa: E402

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
OUT_OPEN, OUT_CLOSE = "<out>", "</out>"


def tool_turns(a: int, b: int) -> list[tuple[str, bool]]:
    """The tool transcript for "a+b=" as (text, is_model_text) parts."""
    return [(f"{CALL_OPEN}{a}+{b}{CALL_CLOSE}", True), (f"{OUT_OPEN}{a + b}{OUT_CLOSE}", False),
            (f"{a + b}{IM_END}", True)]


def encode_parts(tok, prompt: str, parts: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 where no loss: the prompt and the tool's text)."""
    ids = tok.encode(prompt, add_special_tokens=False)
    labels = [-100] * len(ids)
    for text, trained in parts:
        t = tok.encode(text, add_special_tokens=False)
        ids += t
        labels += t if trained else [-100] * len(t)
    return ids, labels


def sft(model, tok, rows, args) -> None:
    rng = np.random.default_rng(args.seed + 11)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    pairs = [tuple(int(x) for x in r["prompt"][:-1].split("+")) for r in rows]
    model.train()
    t0, ema = time.time(), None
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.5 * (1 + math.cos(math.pi * step / args.steps)) * 0.9 + 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        seqs, weights = [], []
        for i in rng.choice(len(pairs), args.prompts_per_step, replace=False):
            a, b = pairs[i]
            p = chat_prompt(f"{a}+{b}=")
            seqs.append(encode_parts(tok, p, tool_turns(a, b)))
            weights.append(args.tool_share)
            for ans, w in teacher_distribution(a, b):  # the base model's direct answers, kept
                seqs.append(encode_parts(tok, p, [(ans + IM_END, True)]))
                weights.append((1 - args.tool_share) * w)
        L = max(len(s) for s, _ in seqs)
        ids = torch.full((len(seqs), L), tok.pad_token_id, dtype=torch.long)
        lab = torch.full((len(seqs), L), -100, dtype=torch.long)
        att = torch.zeros((len(seqs), L), dtype=torch.long)
        for k, (s, lb) in enumerate(seqs):
            ids[k, :len(s)], lab[k, :len(lb)], att[k, :len(s)] = torch.tensor(s), torch.tensor(lb), 1
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), lab[:, 1:].reshape(-1),
                              reduction="none").view(len(seqs), L - 1)
        loss = (nll.sum(1) * torch.tensor(weights)).sum() / args.prompts_per_step
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if (step + 1) % args.log_every == 0 or step == 0:
            print(f"  step {step + 1:5d}/{args.steps} loss/prompt {ema:.4f} lr {lr:.2e} ({time.time() - t0:.0f}s)",
                  flush=True)


@torch.no_grad()
def rollout_eval(model, tok, rows, n: int, seed: int, max_new_tokens: int = 24) -> dict:
    """Sample n transcripts per prompt at T=1 the way examples/tool_calc.py runs them (call, tool, answer)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopOnClose(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.tensor([tok.decode(r[-len(CALL_CLOSE):]) == CALL_CLOSE for r in input_ids.tolist()])

    torch.manual_seed(seed)
    model.eval()
    eos = tok.eos_token_id
    calls = right = right_call = right_direct = 0
    total = 0
    for r in rows:
        a, b = (int(x) for x in r["prompt"][:-1].split("+"))
        p = tok.encode(chat_prompt(r["prompt"]), add_special_tokens=False)
        out = model.generate(input_ids=torch.tensor([p] * n), attention_mask=torch.ones(n, len(p), dtype=torch.long),
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=tok.pad_token_id,
                             stopping_criteria=StoppingCriteriaList([StopOnClose()]))[:, len(p):]
        for row in out.tolist():
            text = tok.decode([t for t in row if t not in (eos, tok.pad_token_id)])
            total += 1
            if text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE):
                calls += 1
                expr = text[len(CALL_OPEN):-len(CALL_CLOSE)]
                try:
                    x, y = (int(v) for v in expr.split("+"))
                    result = str(x + y)
                except ValueError:
                    result = "error"
                ctx = p + row[:len(tok.encode(text, add_special_tokens=False))] + \
                    tok.encode(f"{OUT_OPEN}{result}{OUT_CLOSE}", add_special_tokens=False)
                ans = model.generate(input_ids=torch.tensor([ctx]), attention_mask=torch.ones(1, len(ctx),
                                     dtype=torch.long), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=8, eos_token_id=eos, pad_token_id=tok.pad_token_id)[0, len(ctx):]
                ok = tok.decode([t for t in ans.tolist() if t not in (eos, tok.pad_token_id)]) == r["label"]
                right_call += ok
            else:
                ok = text == r["label"]
                right_direct += ok
            right += ok
    return {"samples": total, "tool_call_rate": calls / total, "accuracy": right / total,
            "accuracy_when_calling": right_call / max(calls, 1),
            "accuracy_when_direct": right_direct / max(total - calls, 1)}


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", default=os.path.join(here, "tiny-qwen2-arith"), help="the arithmetic model")
    ap.add_argument("--out", default=os.path.join(here, "tiny-qwen2-calc"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--tool-share", type=float, default=0.2, help="weight of the tool transcript per prompt")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-prompts", type=int, default=128)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    data = os.path.join(here, "data", "arith")
    with open(os.path.join(data, "train.jsonl")) as f:
        train = [json.loads(line) for line in f]
    with open(os.path.join(data, "test.jsonl")) as f:
        test = [json.loads(line) for line in f][: args.eval_prompts]
    tok = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base)
    print(f"[1/3] base {args.base}: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M parameters", flush=True)
    before = rollout_eval(model, tok, test, 8, args.seed)
    print(f"  before: {before}", flush=True)
    print(f"[2/3] fine-tune {args.steps} steps, tool share {args.tool_share}", flush=True)
    sft(model, tok, train, args)
    print("[3/3] save + evaluate", flush=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the base's tokenizer, as is
        shutil.copyfile(os.path.join(args.base, name), os.path.join(args.out, name))
    model2 = AutoModelForCausalLM.from_pretrained(args.out)
    after = rollout_eval(model2, AutoTokenizer.from_pretrained(args.out), test, 8, args.seed + 1)
    print(f"  after: {after}", flush=True)
    with open(os.path.join(args.out, "build_metrics.json"), "w") as f:
        json.dump({"seed": args.seed, "base": os.path.basename(args.base), "steps": args.steps,
                   "tool_share": args.tool_share, "test_prompts": len(test), "samples_per_prompt": 8,
                   "base_model": before, "test": after}, f, indent=2)
    print(f"done in {time.time() - t_start:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
