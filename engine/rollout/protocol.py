"""SGLang's `/generate` protocol for the built-in engine: request JSON → GenRequests, GenResult → response JSON.

Checked against SGLang's source (python/sglang/srt/managers/io_struct.py `GenerateReqInput`,
sampling/sampling_params.py `SamplingParams`, tokenizer_manager.py `meta_info`):
- request: `text` or `input_ids` (one prompt or a list), `sampling_params` (one dict or one per prompt), `rid`
  (str or list), `return_logprob`, `logprob_start_len` (-1 = output tokens only), `stream`,
  `return_routed_experts` (a server started with --enable-return-routed-experts; a MoE model) and
  `routed_experts_start_len` (their first position, in [0, prompt tokens]);
- sampling params: `max_new_tokens` (SGLang's default 128), `temperature`, `top_p`, `top_k`, `stop`,
  `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `no_stop_trim`, `sampling_seed`, `min_new_tokens`; other
  SGLang params are accepted at their neutral value and refused (HTTP 400, naming the param) otherwise — never
  silently ignored;
- response: `text`, `output_ids`, `meta_info` with `id`, `finish_reason` ({"type": "stop", "matched": id | str},
  {"type": "length", "length": n}, {"type": "abort", "message": …}), `prompt_tokens`, `completion_tokens`,
  `cached_tokens`, `weight_version`, `e2e_latency`, and with `return_logprob` `output_token_logprobs` /
  `input_token_logprobs` as `[logprob, token_id, None]` triples (SGLang puts the token text third only with
  `return_text_in_logprobs`); with `return_routed_experts`, `meta_info.routed_experts`: base64 of int32
  [prompt + output tokens − 1 − routed_experts_start_len, num_hidden_layers, num_experts_per_tok] (SGLang's
  routed_experts_capturer; a dense layer's ids are -1 here).
A batched request (a list of inputs) gets a list of responses in the same order.

Compact log-probs (the built-in engine only): a request with the header `X-Rollflow-Logprobs: f64-base64` gets
its output log-probs as one base64 string of little-endian float64 per answer (`meta_info.output_token_logprobs_f64`,
the token ids in `output_ids`) instead of the triples, and the answer carries the same header. rollflow's rollout
loop always sends it; SGLang ignores an unknown header and answers in its JSON, which the loop reads as well.
An 8-sample answer of 1,024 tokens: ~1.5 ms to build and ~0.8 ms to read instead of ~49 and ~10 (2-core VM).

Limits (`Limits`, HTTP 400 naming the field, the value and the bound; SGLang refuses the same requests):
token ids are integers in [0, vocab); a prompt is shorter than the model's context; prompt + max_new_tokens fits
in the context (an unset max_new_tokens is the default capped to what fits); temperature and top_p are finite
numbers, top_k an integer; a text input is at most CHARS_PER_TOKEN × context characters before it is tokenized;
at most `max_inputs` prompts and MAX_STOPS stop strings of MAX_STOP_CHARS characters per request.
"""
from __future__ import annotations

import base64
import math
import uuid
from dataclasses import dataclass
from typing import Any

from engine.rollout.generation import GenRequest, GenResult

SUPPORTED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
             "skip_special_tokens", "no_stop_trim", "sampling_seed", "spaces_between_special_tokens",
             "min_new_tokens"}
#: SGLang sampling params the built-in engine does not implement: accepted only at these neutral values.
NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
           "n": 1, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
           "stop_regex": None, "logit_bias": None, "custom_params": None, "stream_interval": None}


class ProtocolError(ValueError):
    """The request breaks the protocol (HTTP 400): the message names the field and the fix."""


CHARS_PER_TOKEN = 32  # a text longer than 32 characters a token of context cannot fit: refused before tokenizing
MAX_STOPS, MAX_STOP_CHARS = 64, 512


@dataclass(frozen=True)
class Limits:
    context_len: int = 2**31  # the model's max_position_embeddings
    vocab_size: int = 2**31  # ids must be below this
    max_inputs: int = 4096  # prompts in one request


def _int(v: Any, name: str) -> int:
    """An integer (JSON 3 or 3.0), never a bool or 2.5."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ProtocolError(f"`{name}` must be an integer, got {v!r}")
    return int(v)


def _finite(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProtocolError(f"`{name}` must be a finite number, got {v!r}")
    return float(v)


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    items = value if isinstance(value, list) else [value] * n
    if len(items) != n:
        raise ProtocolError(f"`{name}` has {len(items)} entries for {n} inputs")
    return items


def _sampling(p: dict[str, Any], default_max_new: int, prompt_len: int = 0, limits: Limits = Limits()
              ) -> dict[str, Any]:
    if not isinstance(p, dict):
        raise ProtocolError(f"`sampling_params` must be an object, got {type(p).__name__}")
    for k, v in p.items():
        if k in SUPPORTED:
            continue
        if k not in NEUTRAL:
            raise ProtocolError(f"unknown sampling param {k!r}")
        if v != NEUTRAL[k]:
            raise ProtocolError(f"sampling param {k}={v!r} is not supported by the built-in engine "
                                f"(only {NEUTRAL[k]!r}); use --rollout-engine sglang")
    temperature = _finite(p.get("temperature", 1.0), "temperature")
    top_p, top_k = _finite(p.get("top_p", 1.0), "top_p"), _int(p.get("top_k", -1), "top_k")
    room = limits.context_len - prompt_len  # tokens the context has left for the completion
    max_new = p.get("max_new_tokens")
    max_new = min(default_max_new, room) if max_new is None else _int(max_new, "max_new_tokens")
    if temperature < 0 or not 0 < top_p <= 1 or (top_k == 0 or top_k < -1) or max_new < 0:
        raise ProtocolError(f"bad sampling params: temperature={temperature} (≥ 0), top_p={top_p} (0, 1], "
                            f"top_k={top_k} (-1 or ≥ 1), max_new_tokens={max_new} (≥ 0)")
    min_new = _int(p.get("min_new_tokens", 0), "min_new_tokens")
    if not 0 <= min_new <= max_new:
        raise ProtocolError(f"min_new_tokens={min_new} must be between 0 and max_new_tokens={max_new}")
    if max_new > room:
        raise ProtocolError(f"Requested token count exceeds the model's maximum context length of "
                            f"{limits.context_len} tokens: {prompt_len} tokens of input and max_new_tokens={max_new} "
                            f"(at most {room} here)")
    stop = p.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or any(
            not isinstance(x, str) or len(x) > MAX_STOP_CHARS for x in stop):
        raise ProtocolError(f"`stop` must be a string or a list of at most {MAX_STOPS} strings of at most "
                            f"{MAX_STOP_CHARS} characters")
    stop_ids = p.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOPS:
        raise ProtocolError(f"`stop_token_ids` must be a list of at most {MAX_STOPS} token ids")
    return dict(max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop,
                stop_token_ids=[_token_id(t, "stop_token_ids", limits) for t in stop_ids],
                ignore_eos=bool(p.get("ignore_eos", False)), no_stop_trim=bool(p.get("no_stop_trim", False)),
                skip_special_tokens=bool(p.get("skip_special_tokens", True)),
                seed=None if p.get("sampling_seed") is None else _int(p["sampling_seed"], "sampling_seed"),
                min_new_tokens=min_new)


def _token_id(t: Any, field: str, limits: Limits) -> int:
    if isinstance(t, bool) or not isinstance(t, int):
        raise ProtocolError(f"`{field}` must hold integer token ids, got {t!r}")
    if not 0 <= t < limits.vocab_size:
        raise ProtocolError(f"`{field}` holds token id {t}, outside the model's vocabulary [0, {limits.vocab_size})")
    return t


def to_requests(body: dict[str, Any], tokenize, default_max_new: int, limits: Limits = Limits()
                ) -> tuple[list[GenRequest], bool]:
    """GenerateReqInput JSON → GenRequests; returns (requests, batched). `tokenize(text) -> ids`; every value is
    checked against `limits` (module docstring) before anything is tokenized or queued."""
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    if body.get("stream"):
        raise ProtocolError("`stream` is not supported by the built-in engine; send stream=false")
    if body.get("top_logprobs_num") or body.get("token_ids_logprob"):
        raise ProtocolError("`top_logprobs_num` / `token_ids_logprob` are not supported by the built-in engine")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if not isinstance(ids, list):
            raise ProtocolError("`input_ids` must be a list of token ids (or a list of such lists)")
        batched = bool(ids) and isinstance(ids[0], list)
        inputs = ids if batched else [ids]
        _check_count(len(inputs), limits)
        for k, x in enumerate(inputs):
            if not isinstance(x, list):
                raise ProtocolError(f"`input_ids[{k}]` must be a list of token ids")
            _check_prompt_len(len(x), limits)
            inputs[k] = [_token_id(t, "input_ids", limits) for t in x]
    elif body.get("text") is not None:
        text = body["text"]
        batched = isinstance(text, list)
        texts = text if batched else [text]
        _check_count(len(texts), limits)
        if not all(isinstance(t, str) for t in texts):
            raise ProtocolError("`text` must be a string or a list of strings")
        for t in texts:
            if len(t) > CHARS_PER_TOKEN * limits.context_len:
                raise ProtocolError(f"`text` of {len(t)} characters cannot fit the model's context of "
                                    f"{limits.context_len} tokens")
        inputs = [tokenize(t) for t in texts]
        for x in inputs:
            _check_prompt_len(len(x), limits)
    else:
        raise ProtocolError("either `text` or `input_ids` is required")
    if not inputs or any(len(x) == 0 for x in inputs):
        raise ProtocolError("every input needs at least one token")
    n = len(inputs)
    sps = _per_item(body.get("sampling_params") or {}, n, "sampling_params")
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [rid] * n if not batched or rid is None else \
        [f"{rid}_{i}" for i in range(n)]
    rids = _per_item(rids, n, "rid")
    rids = [r or uuid.uuid4().hex for r in rids]
    if len(set(rids)) != n:
        raise ProtocolError("`rid` values must be unique within a request")
    starts = _per_item(body.get("logprob_start_len", -1) if body.get("logprob_start_len") is not None else -1, n,
                       "logprob_start_len")
    routed = _per_item(body.get("return_routed_experts") or False, n, "return_routed_experts")
    if not all(isinstance(v, bool) for v in routed):
        raise ProtocolError("`return_routed_experts` must be true / false (or one per input)")
    route_starts = _per_item(body.get("routed_experts_start_len") or 0, n, "routed_experts_start_len")
    reqs = []
    for x, p, r, start, rr, rs in zip(inputs, sps, rids, starts, routed, route_starts):
        rs = _int(rs, "routed_experts_start_len")
        if not 0 <= rs <= len(x):
            raise ProtocolError(f"`routed_experts_start_len` {rs} must be in [0, {len(x)}] (the prompt's tokens)")
        reqs.append(GenRequest(rid=str(r), input_ids=list(x), logprob_start_len=_int(start, "logprob_start_len"),
                               return_routed_experts=rr, routed_experts_start_len=rs,
                               **_sampling(p, default_max_new, len(x), limits)))
    return reqs, batched


def _check_count(n: int, limits: Limits) -> None:
    if n > limits.max_inputs:
        raise ProtocolError(f"{n} inputs in one request; at most {limits.max_inputs} (send several requests)")


def _check_prompt_len(n: int, limits: Limits) -> None:
    if n >= limits.context_len:
        raise ProtocolError(f"The input ({n} tokens) is longer than the model's context length "
                            f"({limits.context_len} tokens)")


def _triples(lps: list[float | None], ids: list[int]) -> list[list[Any]]:
    return [[lp, int(t), None] for lp, t in zip(lps, ids)]


#: the request header asking for compact output log-probs, and its one value (the answer echoes both)
COMPACT_HEADER = "X-Rollflow-Logprobs"
COMPACT_F64 = "f64-base64"


def encode_f64(xs: list[float]) -> str:
    """Floats as base64 of little-endian float64: exact (a float64 round-trips bit for bit)."""
    import numpy as np

    return base64.b64encode(np.asarray(xs, dtype="<f8").tobytes()).decode("ascii")


def decode_f64(s: str) -> list[float]:
    import numpy as np

    return np.frombuffer(base64.b64decode(s), dtype="<f8").tolist()


def output_logprobs(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    """One /generate answer's output token ids and their log-probs, from SGLang's triples or the compact form
    (empty log-probs when the answer has neither)."""
    meta = answer.get("meta_info") or {}
    if (packed := meta.get("output_token_logprobs_f64")) is not None:
        ids, lps = [int(t) for t in answer.get("output_ids", [])], decode_f64(packed)
        if len(ids) != len(lps):
            raise ValueError(f"output_token_logprobs_f64 has {len(lps)} log-probs for {len(ids)} output_ids")
        return ids, lps
    if triples := meta.get("output_token_logprobs"):
        return [int(t[1]) for t in triples], [float(t[0]) for t in triples]
    return [int(t) for t in answer.get("output_ids", [])], []


def to_response(res: GenResult, return_logprob: bool, weight_version: str, latency_s: float,
                compact: bool = False, route_layout=None) -> dict[str, Any]:
    """SGLang's answer for one result; `compact`: output log-probs as `output_token_logprobs_f64` (COMPACT_HEADER);
    `route_layout` (engine.train.routing.RouteLayout): the engine's, for a result that carries routed experts."""
    meta: dict[str, Any] = {"id": res.rid, "finish_reason": res.finish_reason, "prompt_tokens": res.prompt_tokens,
                            "completion_tokens": len(res.output_ids), "cached_tokens": 0,
                            "weight_version": weight_version, "e2e_latency": latency_s}
    if return_logprob:
        if compact:
            meta["output_token_logprobs_f64"] = encode_f64(res.logprobs)
        else:
            meta["output_token_logprobs"] = _triples(res.logprobs, res.output_ids)
        meta["input_token_logprobs"] = [] if res.input_logprobs is None else \
            _triples(res.input_logprobs, res.input_ids[res.input_start:])
    if res.routed_experts is not None:
        from engine.train.routing import encode_routes

        meta["routed_experts"] = encode_routes(res.routed_experts, list(route_layout.moe_layers), route_layout)
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}
