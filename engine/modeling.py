"""Loading Hugging Face model directories: once per node behind a file lock (RF04), and stop tokens (RF10).

Many processes calling `from_pretrained` on the same files at once is what makes transformers report "cannot
find model" on multi-node runs; here every load of a directory on a node holds `<dir>/.rollflow.lock` (or a lock
under the temp dir when the model directory is read-only).
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock

log = logging.getLogger("rollflow")


@contextmanager
def model_dir_lock(path: str | os.PathLike) -> Iterator[None]:
    digest = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:16]
    lock = Path(tempfile.gettempdir()) / f"rollflow-model-{digest}.lock"
    with FileLock(str(lock), timeout=600):
        yield


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_tokenizer(path: str):
    """transformers' tokenizer of the model in `path` (its pad token the EOS where it has none), kept for the
    built-in engines, which then answer without importing transformers (engine/rollout/tokenizer_cache.py)."""
    from transformers import AutoTokenizer

    from engine.rollout import tokenizer_cache

    _quiet_transformers()
    with model_dir_lock(path):
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tokenizer_cache.remember(path, tok)
    return tok


def load_causal_lm(path: str, *, dtype: str = "float32", device: str = "cpu", impl: str = "auto"):
    """The causal LM in `path` on `device`: rollflow's native code (engine/native_model.py) or transformers' class,
    as --model-impl says (auto: native where `native_model.unsupported` finds nothing against it). `impl_of(model)`
    tells which; the choice and its reason are logged."""
    import torch

    from engine import native_model

    why = native_model.unsupported(path, device) if impl != "transformers" else "--model-impl transformers"
    if why is None:
        try:
            with model_dir_lock(path):
                model = native_model.load(path, getattr(torch, dtype))
            log.info("model code: rollflow's native %s (%s)", model.config.shape.family, path)
            return model.to(device)
        except native_model.WeightsMismatch as e:  # transformers' loader may know the key renames it needs
            why = str(e)
    if impl == "native":
        from engine.diagnosis import ConfigError, Diagnosis

        raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                    what=f"--model-impl native: rollflow's model code cannot run {path}: {why}",
                                    fix="--model-impl auto (transformers' class where native cannot) or transformers",
                                    facts={"field": "model_impl", "value": "native", "reason": why}))
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    with model_dir_lock(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    log.info("model code: transformers' %s (%s; native: %s)", type(model).__name__, path, why)
    return model.to(device)


def impl_of(model) -> str:
    """"native" (rollflow's engine/native_model.py) or "transformers"."""
    from engine.native_model import NativeCausalLM

    return "native" if isinstance(model, NativeCausalLM) else "transformers"


def weight_numel(path: str | os.PathLike) -> int | None:
    """Parameters stored in a model directory's safetensors files (from their headers: nothing is loaded); None
    when it has none."""
    import json
    import struct

    total, found = 0, False
    for f in sorted(Path(path).glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                numel = 1
                for d in t["shape"]:
                    numel *= d
                total, found = total + numel, True
    return total if found else None


def read_model_json(path: str | os.PathLike, name: str, flag: str = "--hf-checkpoint") -> dict[str, Any] | None:
    """A JSON file of a model directory (config.json, generation_config.json, …): None when absent; one that is not
    valid JSON is a MODEL error naming the file, the line and column, and the fix."""
    import json

    from engine.diagnosis import ConfigError, Diagnosis

    f = Path(path) / name
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ConfigError(Diagnosis(code="MODEL", severity="error", what=f"{flag} {path}: {name} is not valid JSON "
                                    f"({where})", fix=f"repair {f}, or copy it again from the model's source",
                                    facts={"file": str(f)})) from None
    if not isinstance(data, dict):
        raise ConfigError(Diagnosis(code="MODEL", severity="error", what=f"{flag} {path}: {name} holds a "
                                    f"{type(data).__name__}, not a JSON object", fix=f"repair {f}",
                                    facts={"file": str(f)}))
    return data


def eos_token_ids(path: str, tokenizer=None) -> list[int]:
    """EOS ids the model stops on: generation_config.json's eos_token_id, else the tokenizer's EOS."""
    ids: list[int] = []
    eos = (read_model_json(path, "generation_config.json") or {}).get("eos_token_id")
    ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


def render_row(tokenizer, row: Any, cfg: Any) -> list[int]:
    """A prompt row's token ids as the run renders it everywhere (rollout, evaluation, the length checks, the
    doctor): --apply-chat-template with --apply-chat-template-kwargs and the row's tools (--tool-key)."""
    return render_prompt(tokenizer, row.prompt, cfg.apply_chat_template, cfg.apply_chat_template_kwargs,
                         tools=getattr(row, "tools", None))


def render_prompt(tokenizer, prompt: Any, apply_chat_template: bool,
                  template_kwargs: dict[str, Any] | None = None, tools: list | None = None) -> list[int]:
    """Token ids of a prompt: chat messages (or a string as one user message) through the template, or raw text.

    Raw text is encoded as the tokenizer encodes text by default, so a tokenizer that prepends a BOS (Llama,
    Gemma, Mistral) gets it, as the model saw in pre-training; an EOS some tokenizers append is dropped (the
    model must continue the prompt). slime encodes raw prompts without special tokens; the review that found
    this measured greedy accuracy 0.172 with the BOS and 0.024 without on a Llama-family model. The chat
    template's text is encoded as is: the template writes the special tokens it wants (the doctor warns when a
    tokenizer adds a BOS to text and the template's prompts lack it). template_kwargs: --apply-chat-template-kwargs,
    passed to the template (e.g. enable_thinking). tools (--tool-key): the row's tool schemas, the template's
    `tools` (a raw-text prompt has no place for them: they stay in the sample's metadata only)."""
    if apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        extra = {"tools": tools} if tools is not None else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **extra, **(template_kwargs or {}))
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(prompt, list):
        raise ValueError("a chat-message prompt needs --apply-chat-template")
    ids = tokenizer(str(prompt))["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None and len(ids) > 1 and ids[-1] == eos and not str(prompt).endswith(tokenizer.eos_token or "\0"):
        ids = ids[:-1]
    return ids
