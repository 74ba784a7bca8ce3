"""Multi-turn RL with a tool: the arithmetic task where the model may call a `calc` tool.

The bundled `examples/tiny-qwen2-calc` model (examples/build_tool_model.py) answers "37+48=" either directly
("85<|im_end|>", right ~31% of the time) or by calling the tool:

    <calc>37+48</calc>      the model's tokens (loss_mask 1); generation stops on the stop string "</calc>"
    <out>85</out>           the tool's tokens, appended to the context here (loss_mask 0: never trained on)
    85<|im_end|>            the model's tokens again (loss_mask 1), generated in a second engine call

GRPO raises the reward by making the tool call more likely. Run it (examples/tool.yaml):

    rollflow train --config examples/tool.yaml

The hooks follow slime's contracts (engine/rollout/hooks.py): `generate` is a --custom-generate-function-path,
`reward` a --custom-rm-path.
"""
from __future__ import annotations

import re

from engine.samples import Status

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
OUT_OPEN, OUT_CLOSE = "<out>", "</out>"
MAX_CALLS = 2


def calc(expression: str) -> str:
    """The tool: integer + and - only (anything else is an error message the model sees)."""
    if not re.fullmatch(r"\s*\d{1,6}\s*([+-]\s*\d{1,6}\s*)*", expression):
        return "error"
    terms = re.findall(r"([+-]?)\s*(\d+)", expression)  # "28+09" → [("", "28"), ("+", "09")]
    return str(sum(-int(n) if sign == "-" else int(n) for sign, n in terms))


async def generate(args, sample, sampling_params):
    """One trajectory: model turn, then (when it called the tool) the tool's output, then the model again.

    `sample.tokens` holds the prompt's ids; on return it holds prompt + every turn, with `loss_mask` 1 on the
    model's tokens and 0 on the tool's, and the engine's log-probs for the model's tokens (0.0 for the tool's).
    """
    tok = args.tokenizer
    budget = sampling_params["max_new_tokens"]
    response, mask, logps, text = [], [], [], ""
    status = "completed"
    for turn in range(MAX_CALLS + 1):
        params = {**sampling_params, "max_new_tokens": budget - len(response),
                  "stop": list(sampling_params.get("stop", [])) + ([CALL_CLOSE] if turn < MAX_CALLS else [])}
        if sampling_params.get("sampling_seed") is not None:  # the sample's seed, a different draw per turn
            params["sampling_seed"] = (sampling_params["sampling_seed"] + turn) % 2**32
        out = await args.engine.generate(sample.tokens + response, params)
        meta = out["meta_info"]
        new = [int(t[1]) for t in meta["output_token_logprobs"]]
        response += new
        mask += [1] * len(new)
        logps += [float(t[0]) for t in meta["output_token_logprobs"]]
        said = tok.decode(new, skip_special_tokens=True)
        text += said
        finish = meta["finish_reason"] or {}
        if finish.get("type") == "length" or len(response) >= budget:
            status = "truncated"
            break
        if finish.get("type") != "stop" or finish.get("matched") != CALL_CLOSE:
            status = "completed" if finish.get("type") == "stop" else "aborted"
            break
        call = said[said.rfind(CALL_OPEN) + len(CALL_OPEN):] if CALL_OPEN in said else ""
        if said.endswith(CALL_CLOSE):
            call = call[: -len(CALL_CLOSE)]
        obs = f"{OUT_OPEN}{calc(call)}{OUT_CLOSE}"
        obs_ids = tok.encode(obs, add_special_tokens=False)
        response += obs_ids
        mask += [0] * len(obs_ids)  # the tool's tokens: context, never trained on
        logps += [0.0] * len(obs_ids)
        text += obs
        if len(response) >= budget:
            status = "truncated"
            break
    sample.tokens = sample.tokens + response
    sample.response_length = len(response)
    sample.loss_mask, sample.rollout_log_probs, sample.response = mask, logps, text
    sample.status = Status(status)
    sample.metadata["tool_calls"] = text.count(OUT_OPEN)
    sample.metadata["round_number"] = turn + 1  # the model's turns (slime's key, read by --log-multi-turn)
    return sample


def final_answer(response: str) -> str:
    """What the model said after its last tool output (the whole response when it called no tool)."""
    return response[response.rfind(OUT_CLOSE) + len(OUT_CLOSE):] if OUT_CLOSE in response else response


def reward(sample) -> dict:
    """1 when the final answer is the label; the tool-call count is logged beside it (rollout/reward_tool_calls_mean)."""
    return {"score": float(final_answer(sample.response).strip() == str(sample.label).strip()),
            "tool_calls": float(sample.metadata.get("tool_calls", 0))}
