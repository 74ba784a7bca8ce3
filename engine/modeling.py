"""Loading Hugging Face model directories: once per node behind a file lock (RF04), and stop tokens (RF10).

Many processes calling `from_pretrained` on the same files at once is what makes transformers report "cannot
find model" on multi-node runs; here every load of a directory on a node holds `<dir>/.rollflow.lock` (or a lock
under the temp dir when the model directory is read-only).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock


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
    from transformers import AutoTokenizer

    _quiet_transformers()
    with model_dir_lock(path):
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, *, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    with model_dir_lock(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device)


def eos_token_ids(path: str, tokenizer=None) -> list[int]:
    """EOS ids the model stops on: generation_config.json's eos_token_id, else the tokenizer's EOS."""
    import json

    ids: list[int] = []
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


def render_prompt(tokenizer, prompt: Any, apply_chat_template: bool) -> list[int]:
    """Token ids of a prompt: chat messages (or a string as one user message) through the template, or raw text."""
    if apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(prompt, list):
        raise ValueError("a chat-message prompt needs --apply-chat-template")
    return tokenizer(str(prompt), add_special_tokens=False)["input_ids"]
