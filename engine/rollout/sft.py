"""Supervised fine-tuning through the flow: a `--rollout-function-path` that turns the prompt file's rows into
trainable samples without generating (slime's `slime.rollout.sft_rollout.generate_rollout`).

    rollflow train --loss-type sft_loss --debug-train-only --n-samples-per-prompt 1 \\
        --rollout-function-path engine.rollout.sft:generate_rollout --apply-chat-template …

A row is either
- a conversation (`--input-key messages`, a list of chat messages; needs --apply-chat-template): every assistant
  message is trained on — its content and the template's end-of-turn marker — and everything else is masked
  (system and user turns, the template's role headers, whitespace after an end of turn, the row's tools under
  --tool-key); or
- a prompt and its answer (`--label-key`): the prompt rendered as the RL rollout renders it, the answer trained
  on, ended by the template's end of turn (--apply-chat-template: the row becomes [user, assistant]) or by the
  tokenizer's EOS (raw text).

The loss mask is found from the template itself, without a per-model table (slime's --loss-mask-type): the text
the template renders for the messages before assistant turn i (with the generation prompt) and through turn i must
be prefixes of the whole conversation's, and turn i is the text between them. A template that rewrites earlier
turns (e.g. one that drops past reasoning) fails that test, and the row is refused with the turn named. Each piece
is tokenized on its own, so a trained token never straddles a masked one.

The samples carry reward 0 and rollout log-probs 0 (nothing was sampled); --loss-type sft_loss reads neither.
"""
from __future__ import annotations

from typing import Any

from engine.samples import Sample, Status


PATHS = ("engine.rollout.sft:generate_rollout", "engine.rollout.sft.generate_rollout")


def placeholder_rewards(cfg: Any) -> bool:
    """Whether the run's rewards are this module's placeholders (0): the summaries then leave them out."""
    return cfg.rollout_function_path in PATHS


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    """B groups of one sample each, tokens = prompt + answer, the loss mask on the answer's tokens."""
    if evaluation:
        raise ValueError("the SFT rollout makes training samples only; evaluate the fine-tuned model with a run "
                         "that has engines (e.g. `rollflow train --hf-checkpoint <its save_hf dir> --num-rollout 0`)")
    if args.n_samples_per_prompt != 1:
        raise ValueError(f"SFT trains each row once per rollout: pass --n-samples-per-prompt 1 (now "
                         f"{args.n_samples_per_prompt}, which would train every row that many times per step)")
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            fill(args, sample)
    return groups


def fill(args: Any, sample: Sample) -> Sample:
    """The sample's tokens, response length, loss mask and (zero) rollout log-probs from its row."""
    tok = args.tokenizer
    row = sample.metadata.get("row", "?")
    if isinstance(sample.prompt, list):
        if not args.apply_chat_template:
            raise ValueError(f"row {row}: a conversation (chat messages) needs --apply-chat-template")
        messages = sample.prompt
    elif sample.label is None or not str(sample.label):
        raise ValueError(f"row {row}: no answer to train on (--label-key {args.label_key!r} is empty or missing); "
                         "give each row an answer, or a conversation under --input-key")
    elif args.apply_chat_template:
        messages = [{"role": "user", "content": str(sample.prompt)},
                    {"role": "assistant", "content": str(sample.label)}]
    else:
        messages = None
    if messages is None:  # raw text: the prompt as the rollout renders it, the answer, then EOS
        if tok.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token to end the answer with; use --apply-chat-template")
        prompt = list(sample.tokens)
        answer = tok(str(sample.label), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
    else:
        ids, mask = conversation_tokens(tok, messages, args.apply_chat_template_kwargs, row=row,
                                        tools=sample.metadata.get("tools"))
    start = mask.index(1)  # the response starts with the first trained token
    sample.tokens = ids
    sample.response_length = len(ids) - start
    sample.loss_mask = mask[start:]
    sample.rollout_log_probs = [0.0] * sample.response_length
    sample.response = tok.decode(ids[start:])
    sample.reward = 0.0
    sample.status = Status.COMPLETED
    return sample


def conversation_tokens(tok: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None, *,
                        row: Any = "?", tools: list | None = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a whole conversation: 1 on each assistant turn's tokens (see the module doc).
    tools (--tool-key): the row's tool schemas, rendered by the template and never trained on."""
    kw = dict(template_kwargs or {})
    if tools is not None:
        kw["tools"] = tools
    turns = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    if not turns:
        raise ValueError(f"row {row}: the conversation has no assistant message to train on")
    if turns[0] == 0:
        raise ValueError(f"row {row}: the conversation starts with an assistant message; the model needs a "
                         "turn to answer")
    full = tok.apply_chat_template(messages, tokenize=False, **kw)
    spans = []
    for i in turns:
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kw)
        through = tok.apply_chat_template(messages[:i + 1], tokenize=False, **kw)
        if not (full.startswith(through) and through.startswith(before)):
            raise ValueError(f"row {row}: the chat template does not render assistant message {i} as a prefix of "
                             "the conversation (it rewrites earlier turns), so its tokens cannot be told apart; "
                             "split the conversation into one row per assistant turn")
        spans.append((len(before), len(through.rstrip())))  # whitespace after the end of turn is not trained
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for a, b in spans + [(len(full), len(full))]:
        for text, m in ((full[pos:a], 0), (full[a:b], 1)):
            if text:
                piece = tok(text, add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [m] * len(piece)
        pos = b
    return ids, mask
