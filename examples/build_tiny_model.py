#!/usr/bin/env python
"""Build the bundled tiny model + arithmetic task used by rollflow's examples and tests.

Everything is generated offline and deterministically from ``--seed``:

* ``examples/data/arith/{train,test}.jsonl``  -- small integer addition ("37+48=" -> "85"),
  disjoint splits, rows ``{"prompt": ..., "label": ...}``.
* ``examples/tiny-qwen2-arith/``             -- a character-level ``PreTrainedTokenizerFast``
  (ChatML chat template) and a tiny ``Qwen2ForCausalLM`` (float32, safetensors) plus
  ``generation_config.json``.

The model is warmed up by supervised training that imitates a *noisy teacher* (TEACHER_EASY /
TEACHER_HARD below): right ~30% of the time, otherwise a near-miss (most often "+1" on sums with a
carry).  The result (seed 0, build_metrics.json) is a base policy right on ~32% of the test prompts
greedily and ~31% when sampling, with pass@8 ~0.93 -- the regime in which GRPO improves quickly.  Both the plain prompt format
("37+48=" -> "85<|im_end|>") and the chat-template format are trained; the loss covers only
the answer tokens and the final ``<|im_end|>``.

Usage (from the repo root, ~10-15 min on 2 CPU cores):

    python examples/build_tiny_model.py --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------
# constants
# --------------------------------------------------------------------------------------

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]

# Same pre-tokenisation as Qwen2's tokenizer (transformers' AutoTokenizer always rebuilds a
# qwen2 checkpoint's tokenizer as ``Qwen2Tokenizer`` with exactly this pipeline, so we build
# the identical pipeline here; with no merges it is character(=byte)-level).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Noisy teacher: answer = true sum + offset, offset drawn from one of two tables.  The teacher
# is right only ~30% of the time overall; its errors are near-misses with a systematic "+1"
# bias that dominates on problems with a carry ("hard", ~70% of prompts), while on carry-free
# problems ("easy", ~30%) the correct answer is still its single most likely answer.  A model
# that imitates this teacher is greedily right on ~the easy 30% only, samples the right answer
# ~30% of the time, and finds it within 8 samples on >90% of prompts.
TEACHER_EASY = {0: 0.40, +1: 0.22, -1: 0.12, +10: 0.10, -10: 0.07, +2: 0.05, -2: 0.04}
TEACHER_HARD = {0: 0.25, +1: 0.38, -1: 0.12, +10: 0.10, -10: 0.06, +2: 0.05, -2: 0.04}


def is_easy(a: int, b: int) -> bool:
    """No carry anywhere: units digits sum < 10 and the result has at most two digits."""
    return (a % 10 + b % 10) < 10 and a + b < 100


OPERAND_MAX = 99  # a, b in 0..99
N_TEST = 256
N_TRAIN = 5000


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------


def make_splits(seed: int):
    rng = np.random.default_rng(seed)
    pairs = [(a, b) for a in range(OPERAND_MAX + 1) for b in range(OPERAND_MAX + 1)]
    order = rng.permutation(len(pairs))
    test = [pairs[i] for i in order[:N_TEST]]
    train = [pairs[i] for i in order[N_TEST : N_TEST + N_TRAIN]]
    to_rows = lambda ps: [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in ps]
    return to_rows(train), to_rows(test)


def write_jsonl(path: str, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def teacher_distribution(a: int, b: int):
    """The teacher's answer distribution for "a+b=": list of (answer_string, probability)."""
    table = TEACHER_EASY if is_easy(a, b) else TEACHER_HARD
    offs = [o for o in table if a + b + o >= 0]
    z = sum(table[o] for o in offs)
    return [(str(a + b + o), table[o] / z) for o in offs]


def teacher_answer(a: int, b: int, rng: np.random.Generator) -> str:
    """One sample from the teacher."""
    dist = teacher_distribution(a, b)
    return dist[rng.choice(len(dist), p=np.array([p for _, p in dist]))][0]


# --------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------


def bytes_to_unicode():
    """GPT-2/Qwen2 byte -> printable unicode char mapping (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer():
    """Character-level tokenizer: one token per byte (ids 0..255 = byte values, so every
    ASCII char -- digits, operators, letters, punctuation, space, newline -- is one token),
    plus <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos).  BPE with an empty merge list
    on top of Qwen2's byte-level pre-tokeniser: any text round-trips exactly."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    for t in SPECIAL_TOKENS:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=PAD,  # never produced (all 256 bytes are in the vocab); Qwen2 convention
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def check_tokenizer(tok):
    for text in ["37+48=", "Hello, World! What is 3*4? (x) [y] {z}\n\tok.", "a  b ", " 12 - 7 =?"]:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == list(text.encode()), (text, ids)  # one token per char, id == byte
        assert tok.decode(ids) == text, (text, tok.decode(ids))
    s = tok.apply_chat_template(
        [{"role": "user", "content": "37+48="}], tokenize=False, add_generation_prompt=True
    )
    assert s == "<|im_start|>user\n37+48=<|im_end|>\n<|im_start|>assistant\n", repr(s)
    ids = tok.encode(s + "85" + IM_END)
    assert tok.decode(ids) == s + "85" + IM_END
    assert tok.decode(ids, skip_special_tokens=True) == "user\n37+48=\nassistant\n85"


def chat_prompt(q: str) -> str:
    return f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n"


# --------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------


def build_model(tok, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # RoPE: no learned positions; room for slime's default 1024-token responses
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        use_cache=True,
        bos_token_id=tok.convert_tokens_to_ids(PAD),
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(PAD),
        dtype="float32",
    )
    model = Qwen2ForCausalLM(cfg)
    return model


# --------------------------------------------------------------------------------------
# supervised warm-up on the noisy teacher
# --------------------------------------------------------------------------------------


class Encoder:
    """Cached char-level encoding (ids are identical to tokenizer.encode)."""

    def __init__(self, tok):
        self.tok = tok
        self.cache = {}

    def __call__(self, s: str):
        if s not in self.cache:
            self.cache[s] = self.tok.encode(s, add_special_tokens=False)
        return self.cache[s]


def make_batch(enc, items, pad_id):
    """items: list of (prompt_text, answer_text_incl_eos). Right padded; loss on answer only."""
    seqs, labs = [], []
    for p, a in items:
        pi, ai = enc(p), enc(a)
        seqs.append(pi + ai)
        labs.append([-100] * len(pi) + ai)
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    lab = torch.full((len(seqs), L), -100, dtype=torch.long)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labs)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
        att[i, : len(s)] = 1
    return ids, att, lab


def sft(model, tok, train_rows, args):
    """Warm-up on the noisy teacher.

    Each step takes ``--prompts-per-step`` training prompts (epoch-wise shuffled), each in the
    plain or the chat format (coin flip).  With ``--targets expected`` (default) the loss is the
    teacher-weighted NLL over *all* of the teacher's answers for the prompt,
    ``sum_ans p_teacher(ans) * NLL(ans + <|im_end|> | prompt)`` -- i.e. distillation of the
    teacher's answer distribution, the noise-free expectation of training on its samples.  With
    ``--targets sampled`` one teacher sample per prompt is used instead (noisier, slower).
    """
    dev = next(model.parameters()).device
    enc = Encoder(tok)
    pad_id = tok.pad_token_id
    rng = np.random.default_rng(args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    pairs = [tuple(int(x) for x in r["prompt"][:-1].split("+")) for r in train_rows]
    prompts = [r["prompt"] for r in train_rows]
    n = len(train_rows)
    perm, pos = rng.permutation(n), 0
    model.train()
    t0 = time.time()
    ema = None
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        lr *= 0.5 * (1 + math.cos(math.pi * step / args.steps)) * 0.95 + 0.05
        for g in opt.param_groups:
            g["lr"] = lr
        items, weights = [], []
        for _ in range(args.prompts_per_step):
            if pos == n:
                perm, pos = rng.permutation(n), 0
            i = perm[pos]
            pos += 1
            p = prompts[i] if rng.random() < 0.5 else chat_prompt(prompts[i])
            if args.targets == "expected":
                for ans, w in teacher_distribution(*pairs[i]):
                    items.append((p, ans + IM_END))
                    weights.append(w)
            else:
                items.append((p, teacher_answer(*pairs[i], rng) + IM_END))
                weights.append(1.0)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        # plain and chat rows are run as separate sub-batches (less padding)
        for chat in (False, True):
            sel = [k for k, (p, _) in enumerate(items) if p.startswith(IM_START) == chat]
            if not sel:
                continue
            ids, att, lab = make_batch(enc, [items[k] for k in sel], pad_id)
            ids, att, lab = ids.to(dev), att.to(dev), lab.to(dev)
            w = torch.tensor([weights[k] for k in sel], dtype=torch.float32, device=dev)
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
            tgt = lab[:, 1:]
            nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1),
                                  reduction="none").view(tgt.shape)
            # per-sequence NLL (answer tokens + eos), teacher-weighted, averaged over prompts
            part = (nll.sum(1) * w).sum() / args.prompts_per_step
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        if (step + 1) % args.log_every == 0 or step == 0:
            print(f"  sft step {step + 1:5d}/{args.steps} loss/prompt {ema:.4f} lr {lr:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            m = evaluate(model, tok, args.eval_rows, fmts=("chat",), n_samples=8)
            print(f"  [eval @ {step + 1}] {fmt_metrics(m)}", flush=True)
            model.train()


# --------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------


@torch.no_grad()
def generate(model, tok, prompts, max_new_tokens=8, do_sample=False, temperature=1.0,
             num_return_sequences=1, batch_size=512):
    """Returns list (len(prompts)*num_return_sequences) of (decoded_answer, stopped)."""
    model.eval()
    eos = tok.eos_token_id
    out = []
    enc = [tok.encode(p, add_special_tokens=False) for p in prompts]
    for s in range(0, len(enc), batch_size):
        chunk = enc[s : s + batch_size]
        L = max(len(x) for x in chunk)
        ids = torch.full((len(chunk), L), tok.pad_token_id, dtype=torch.long)
        att = torch.zeros((len(chunk), L), dtype=torch.long)
        for i, x in enumerate(chunk):  # left padding
            ids[i, L - len(x) :] = torch.tensor(x)
            att[i, L - len(x) :] = 1
        dev = next(model.parameters()).device
        ids, att = ids.to(dev), att.to(dev)
        kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample \
            else dict(do_sample=False)
        gen = model.generate(
            input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens,
            num_return_sequences=num_return_sequences, eos_token_id=eos,
            pad_token_id=tok.pad_token_id, **kw,
        )[:, L:]
        for row in gen.tolist():
            stopped = eos in row
            if stopped:
                row = row[: row.index(eos)]
            out.append((tok.decode(row, skip_special_tokens=False), stopped))
    return out


def evaluate(model, tok, rows, fmts=("plain", "chat"), n_samples=8, max_new_tokens=8):
    res = {}
    for fmt in fmts:
        prompts = [r["prompt"] if fmt == "plain" else chat_prompt(r["prompt"]) for r in rows]
        labels = [r["label"] for r in rows]
        g = generate(model, tok, prompts, max_new_tokens=max_new_tokens)
        greedy = np.mean([a == l for (a, _), l in zip(g, labels)])
        smp = generate(model, tok, prompts, max_new_tokens=max_new_tokens, do_sample=True,
                       temperature=1.0, num_return_sequences=n_samples)
        corr = np.array([a == labels[i // n_samples] for i, (a, _) in enumerate(smp)])
        corr = corr.reshape(len(rows), n_samples)
        stop = np.mean([s for _, s in smp] + [s for _, s in g])
        # "off by +1" rate of greedy answers, to show the teacher bias was imitated
        plus1 = np.mean([a == str(int(l) + 1) for (a, _), l in zip(g, labels)])
        easy = np.array([is_easy(*map(int, r["prompt"][:-1].split("+"))) for r in rows])
        gc = np.array([a == l for (a, _), l in zip(g, labels)])
        res[fmt] = dict(greedy_acc=float(greedy), sample_acc=float(corr.mean()),
                        pass_at_n=float(corr.any(1).mean()), stop_rate=float(stop),
                        greedy_plus1=float(plus1), n=n_samples,
                        greedy_acc_easy=float(gc[easy].mean()), greedy_acc_hard=float(gc[~easy].mean()))
    return res


def fmt_metrics(m):
    return " | ".join(
        f"{k}: greedy {v['greedy_acc']:.3f} (easy {v['greedy_acc_easy']:.2f} hard "
        f"{v['greedy_acc_hard']:.2f}; =sum+1: {v['greedy_plus1']:.3f}) "
        f"sample@T1 {v['sample_acc']:.3f} pass@{v['n']} {v['pass_at_n']:.3f} "
        f"stop {v['stop_rate']:.4f}"
        for k, v in m.items()
    )


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=here, help="examples/ directory to write into")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--targets", choices=["expected", "sampled"], default="expected")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=0, help="0 = only at the end")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    data_dir = os.path.join(args.out_dir, "data", "arith")
    model_dir = os.path.join(args.out_dir, "tiny-qwen2-arith")

    print(f"[1/4] data (seed {args.seed})", flush=True)
    train, test = make_splits(args.seed)
    assert not ({r["prompt"] for r in train} & {r["prompt"] for r in test})
    write_jsonl(os.path.join(data_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(data_dir, "test.jsonl"), test)
    print(f"  train {len(train)}  test {len(test)} -> {data_dir}")
    args.eval_rows = test

    print("[2/4] tokenizer", flush=True)
    tok = build_tokenizer()
    check_tokenizer(tok)
    print(f"  vocab size {len(tok)}  pad {tok.pad_token_id}  eos {tok.eos_token_id}")

    print("[3/4] model + noisy-teacher warm-up", flush=True)
    model = build_model(tok, args.seed).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"  Qwen2ForCausalLM with {n_params / 1e6:.3f}M parameters")
    print(f"  teacher offsets (easy / no carry): {TEACHER_EASY}")
    print(f"  teacher offsets (hard / carry):    {TEACHER_HARD}")
    sft(model, tok, train, args)

    print("[4/4] save + evaluate", flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tok.convert_tokens_to_ids(PAD),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=8,
    )
    model.to("cpu").save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    # Declare the class AutoTokenizer resolves a qwen2 checkpoint to anyway (the saved
    # pipeline is identical to Qwen2Tokenizer's); also keeps older transformers happy.
    tc_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "Qwen2Tokenizer"
    tc["chat_template"] = CHAT_TEMPLATE  # also inline, for tools that only read this file
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2)

    # reload with the generic Auto* classes and evaluate what is on disk
    tok2 = AutoTokenizer.from_pretrained(model_dir)
    model2 = AutoModelForCausalLM.from_pretrained(model_dir).to(args.device)
    check_tokenizer(tok2)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    probe = chat_prompt("Hi there, what is 12+30? ") + "42" + IM_END + "\n\tÄé ok"
    assert tok2.encode(probe) == raw.encode(probe).ids == tok.encode(probe), probe
    assert tok2.decode(tok2.encode(probe)) == probe
    print(f"  AutoTokenizer -> {type(tok2).__name__}: ids identical to tokenizer.json, round-trip ok")
    torch.manual_seed(args.seed + 2)
    m = evaluate(model2, tok2, test, n_samples=8)
    print("  test split (256 prompts, 8 samples/prompt at T=1.0, max 8 new tokens):")
    for k, v in m.items():
        print(f"    {k:5s}: greedy_acc {v['greedy_acc']:.3f}  sample_acc {v['sample_acc']:.3f}  "
              f"pass@8 {v['pass_at_n']:.3f}  stop_rate {v['stop_rate']:.4f}  "
              f"greedy_is_sum+1 {v['greedy_plus1']:.3f}")
    with open(os.path.join(model_dir, "build_metrics.json"), "w") as f:
        json.dump({"seed": args.seed, "teacher_easy": {str(k): v for k, v in TEACHER_EASY.items()},
                   "teacher_hard": {str(k): v for k, v in TEACHER_HARD.items()},
                   "sft_steps": args.steps, "test": m}, f, indent=2)
    size = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir))
    print(f"  {model_dir}: {size / 1e6:.2f} MB")
    print(f"done in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
