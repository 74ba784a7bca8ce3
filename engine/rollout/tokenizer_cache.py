"""The built-in engine's tokenizer without importing transformers (issue 18: start-up and the first steps).

What the engine asks of a tokenizer: a `text` request's ids (`tok(text, add_special_tokens=False)`), every answer's
text (`tok.decode(ids, skip_special_tokens=...)`), and the EOS / pad ids. For a transformers 5 fast tokenizer
(`TokenizersBackend`, the class of every tokenizer with a tokenizer.json) each of the two calls is one call of the
Rust tokenizer the class builds (`_encode_plus` with its `split_special_tokens` flag; `_decode`, whose space clean-up
transformers skips for BPE models). Importing transformers for them cost the engine's process ~1 s of CPU at
start-up, on the two cores the CPU demo's start-up shares (bench/results/trl_race.md).

So a process that loads a model's tokenizer with transformers (the driver, at every run: engine/modeling.py
`load_tokenizer`) keeps what those calls use: the Rust tokenizer exactly as transformers built it
(`backend_tokenizer.to_str()`: transformers 5 builds it from the class's own pipeline and the files' vocabulary, so
tokenizer.json alone would not do), its special tokens and the split flag, in
`$XDG_CACHE_HOME/rollflow/tokenizers/<key>.json` (default `~/.cache/…`). The key hashes the model directory's
tokenizer files (their bytes) and the transformers and tokenizers releases: a changed file or an upgrade is a
new entry. An engine that finds its entry builds the same Rust tokenizer from it (`CachedTokenizer`) and does not
import transformers; one that does not (the first run of a model) loads transformers' tokenizer as before.

Kept only where the two calls are provably those Rust calls: a `TokenizersBackend` whose class does not override
`__call__`, `_encode_plus`, `decode` or `_decode`, and whose decode applies no clean-up. The cache is an
optimisation: an entry that cannot be read is removed and transformers' tokenizer is loaded instead.

Invariant (tests/test_tokenizer_cache.py): on the bundled models, ids, text, EOS / pad / BOS ids and the vocabulary
size equal transformers' tokenizer's, for texts with special tokens, unicode and whitespace, and ids with special
tokens, decoded with and without skip_special_tokens.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger("rollflow.rollout")

#: bump when an entry's content changes meaning
FORMAT = 1
#: what transformers may read to build a tokenizer (config.json: a tokenizer_config without tokenizer_class)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "config.json")
SPECIAL = ("eos_token", "pad_token", "bos_token", "unk_token")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollflow" / "tokenizers"


def cache_key(path: str | os.PathLike) -> str | None:
    """The entry's name for the tokenizer in `path`, or None (no transformers or tokenizers installed, or an
    unreadable file: nothing to key on)."""
    h = hashlib.sha256(f"rollflow-tokenizer-{FORMAT}".encode())
    try:
        for pkg in ("transformers", "tokenizers"):
            h.update(f"\0{pkg}={metadata.version(pkg)}".encode())
        d = Path(path)
        for name in TOKENIZER_FILES:
            f = d / name
            if f.is_file():
                h.update(f"\0{name}\0".encode())
                h.update(f.read_bytes())
    except (OSError, metadata.PackageNotFoundError):
        return None
    return h.hexdigest()[:32]


def why_not_kept(tok: Any) -> str | None:
    """Why the engine could not answer as `tok` does from its Rust tokenizer alone; None when it can."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return "transformers without TokenizersBackend (before 5)"
    cls = type(tok)
    if not isinstance(tok, TokenizersBackend):
        return f"{cls.__name__} is not a TokenizersBackend (a slow tokenizer)"
    for name, base in (("__call__", PreTrainedTokenizerBase), ("decode", PreTrainedTokenizerBase),
                       ("_encode_plus", TokenizersBackend), ("_decode", TokenizersBackend)):
        if getattr(cls, name) is not getattr(base, name):
            return f"{cls.__name__} overrides {name}"
    backend = tok.backend_tokenizer
    bpe = type(backend.model).__name__ == "BPE"
    force = getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if tok.clean_up_tokenization_spaces and (not bpe or force):
        return "its decode cleans up spaces (clean_up_tokenization_spaces)"
    return None


def remember(path: str | os.PathLike, tok: Any) -> bool:
    """Keep `tok` (transformers' tokenizer of the model in `path`, as the run uses it: its pad token set) for the
    engines; True when an entry was written. Never raises."""
    try:
        key = cache_key(path)
        if key is None:
            return False
        target = cache_dir() / f"{key}.json"
        if target.is_file():
            return False
        why = why_not_kept(tok)
        if why is not None:
            log.debug("rollflow: the tokenizer of %s is not cached for the engines (%s)", path, why)
            return False
        entry = {"format": FORMAT, "key": key, "source": str(path), "class": type(tok).__name__,
                 "backend": tok.backend_tokenizer.to_str(), "split_special_tokens": bool(tok.split_special_tokens),
                 "vocab_size": len(tok), **{name: getattr(tok, name) for name in SPECIAL}}
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(entry))
            os.replace(tmp, target)  # readers see the whole entry or none
        finally:
            tmp.unlink(missing_ok=True)
        return True
    except Exception as e:  # noqa: BLE001 — an optimisation: the engine then loads transformers' tokenizer
        log.debug("rollflow: caching the tokenizer of %s failed (%s: %s)", path, type(e).__name__, e)
        return False


def load(path: str | os.PathLike) -> "CachedTokenizer | None":
    """The cached tokenizer of the model in `path`, or None (no entry: load transformers' tokenizer)."""
    key = cache_key(path)
    if key is None:
        return None
    f = cache_dir() / f"{key}.json"
    try:
        entry = json.loads(f.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("rollflow: tokenizer cache entry %s unreadable (%s); removed, transformers' tokenizer is loaded",
                    f, e)
        f.unlink(missing_ok=True)
        return None
    try:
        if entry.get("format") != FORMAT or entry.get("key") != key:
            raise ValueError(f"format {entry.get('format')!r}, key {entry.get('key')!r}")
        return CachedTokenizer(entry, str(path))
    except Exception as e:  # noqa: BLE001 — a damaged entry: the engine loads transformers' tokenizer
        log.warning("rollflow: tokenizer cache entry %s unusable (%s: %s); removed, transformers' tokenizer is "
                    "loaded", f, type(e).__name__, e)
        f.unlink(missing_ok=True)
        return None


class CachedTokenizer:
    """The calls the built-in engine makes of a tokenizer, answered by the Rust tokenizer transformers built (see
    the module docstring): `tok(text, add_special_tokens=...)["input_ids"]`, `decode(ids, skip_special_tokens=...)`,
    the special tokens and their ids, `len(tok)`. Anything else (a caller holding the engine's tokenizer that
    renders a chat template, say) is transformers' tokenizer's, loaded on first use."""

    def __init__(self, entry: dict[str, Any], name_or_path: str):
        from tokenizers import Tokenizer

        self._full = None
        self._full_lock = threading.Lock()
        self._tokenizer = Tokenizer.from_str(entry["backend"])
        self._tokenizer.encode_special_tokens = bool(entry["split_special_tokens"])
        self._size = int(entry["vocab_size"])
        self.name_or_path = name_or_path
        for name in SPECIAL:
            setattr(self, name, entry.get(name))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    def __len__(self) -> int:
        return self._size

    def __call__(self, text, add_special_tokens: bool = True, **kwargs):
        if kwargs or not isinstance(text, str):  # a batch, tensors, padding, …: transformers' own
            return self.full("__call__")(text, add_special_tokens=add_special_tokens, **kwargs)
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if kwargs or not isinstance(token_ids, (list, tuple)) or any(not isinstance(t, int) for t in token_ids):
            return self.full("decode").decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def full(self, why: str):
        """transformers' tokenizer of the same model, loaded on first use (for `why`, a call this class does not
        answer itself)."""
        with self._full_lock:
            if self._full is None:
                from engine.modeling import load_tokenizer

                log.debug("rollflow: %s of the engine's tokenizer: transformers' tokenizer loaded", why)
                self._full = load_tokenizer(self.name_or_path)
        return self._full

    def __getattr__(self, name: str):  # only for what the class does not define
        if name.startswith("__") or name in ("_full", "_full_lock", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self.full(name), name)


def engine_tokenizer(path: str):
    """The built-in engine's tokenizer for the model in `path`: the cached one when there is an entry (transformers
    not imported), else transformers' (engine/modeling.py `load_tokenizer`, which then keeps it for next time)."""
    cached = load(path)
    if cached is not None:
        log.info("built-in engine: tokenizer of %s from rollflow's cache (%s)", path, cache_dir())
        return cached
    from engine.modeling import load_tokenizer

    return load_tokenizer(path)
