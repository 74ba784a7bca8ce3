"""Prompt data: JSONL or Parquet rows → prompts with labels, with a resumable position.

`path@[a:b]` slices rows a..b-1 (Python slice semantics: negative ends count from the end). A row is an object
with the prompt under `--input-key` (text, or chat messages for `--apply-chat-template`), the label under
`--label-key`, optionally a metadata object under `--metadata-key` and a list of tools under `--tool-key`
(rendered by the chat template, kept in the metadata as `tools`); a bad row is an error naming its line
(JSONL) or row (Parquet, 1-based). The dataset walks epochs in order (or shuffled per epoch by the seed); its
`state()` (epoch, offset) goes into checkpoints so a resumed run continues with the next unseen prompts.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.diagnosis import ConfigError, Diagnosis

_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<a>-?\d*):(?P<b>-?\d*)\]$")


@dataclass
class PromptRow:
    row: int  # 1-based line (JSONL) or row number (Parquet) in the file
    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any]
    tools: list | None = None  # --tool-key: the row's tool schemas (also in metadata["tools"])


def _data_error(what: str, fix: str, **facts) -> ConfigError:
    return ConfigError(Diagnosis(code="DATA", severity="error", what=what, fix=fix, facts=facts))


def _read_rows(path: Path, flag: str) -> list[tuple[int, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _data_error(f"{flag} {path}: line {lineno} is not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                  f"{e.start + 1})", f"re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 "
                                  f"{path.name} > {path.stem}.utf8{path.suffix}`", path=str(path),
                                  line=lineno) from None
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise _data_error(f"{flag} {path}: line {lineno} is not valid JSON ({e.msg})",
                                  f"fix or remove line {lineno}", path=str(path), line=lineno) from None
    return rows


def load_prompts(spec: str, *, input_key: str, label_key: str | None, metadata_key: str | None = None,
                 flag: str = "--prompt-data", tool_key: str | None = None) -> list[PromptRow]:
    """Read and validate every row; a bad row is an error naming its line number and the key."""
    from engine.cluster.nodes import local_file

    m = _SLICE.match(spec)
    name = m["path"] if m else spec  # as the user wrote it, for messages
    try:
        path = Path(local_file(name))  # s3://bucket/key: this machine's cached copy
    except Exception as e:  # a missing object, credentials, the endpoint
        raise _data_error(f"{flag} {name}: cannot be read ({type(e).__name__}: {e})",
                          f"pass an existing .jsonl or .parquet object or file to {flag}; for S3 check the key and "
                          "this machine's credentials (AWS_* or its role; AWS_ENDPOINT_URL_S3 for other stores)",
                          path=name) from None
    if not path.is_file():
        raise _data_error(f"{flag} {name}: no such file", f"pass an existing .jsonl or .parquet file to {flag}",
                          path=name)
    rows = _read_rows(path, flag)
    if m:
        a = int(m["a"]) if m["a"] else None
        b = int(m["b"]) if m["b"] else None
        rows = rows[a:b]
    out = []
    for lineno, obj in rows:
        if not isinstance(obj, dict):
            raise _data_error(f"{flag} {name}: line {lineno} is a {type(obj).__name__}, not an object",
                              "write one JSON object per line", path=str(path), line=lineno)
        if input_key not in obj:
            raise _data_error(f"{flag} {name}: line {lineno} has no key {input_key!r} (keys: {sorted(obj)})",
                              f"--input-key one of {sorted(obj)}, or fix line {lineno}", path=str(path),
                              line=lineno)
        if label_key and label_key not in obj:
            raise _data_error(f"{flag} {name}: line {lineno} has no key {label_key!r} (keys: {sorted(obj)})",
                              f"--label-key one of {sorted(obj)}, or fix line {lineno}", path=str(path),
                              line=lineno)
        meta = obj.get(metadata_key) if metadata_key else None
        if meta is not None and not isinstance(meta, dict):
            raise _data_error(f"{flag} {name}: line {lineno} has {metadata_key!r} = {str(meta)[:60]!r}, a "
                              f"{type(meta).__name__}, not an object", f"--metadata-key a key holding an object "
                              f"(e.g. {{\"source\": \"gsm8k\"}}), or fix line {lineno}", path=str(path), line=lineno)
        prompt = obj[input_key]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in prompt))):
            raise _data_error(f"{flag} {name}: line {lineno} has {input_key!r} = {str(prompt)[:60]!r}: neither text "
                              "nor a list of chat messages ({\"role\", \"content\"})",
                              f"fix line {lineno}", path=str(path), line=lineno)
        meta = dict(meta or {})
        tools = _row_tools(obj, tool_key, flag, name, lineno)
        if tools is not None:
            meta["tools"] = tools  # where slime's custom functions find them
        out.append(PromptRow(lineno, prompt, obj.get(label_key) if label_key else None, meta, tools))
    if not out:
        raise _data_error(f"{flag} {spec}: no rows", "point it at a file (or slice) with at least one row",
                          path=str(path))
    return out


def _row_tools(obj: dict, tool_key: str | None, flag: str, name: str, lineno: int) -> list | None:
    """--tool-key: the row's tools, a list (of tool schemas) or its JSON text (as Parquet often stores it); None
    when the row has no such key (or it is null)."""
    if not tool_key or obj.get(tool_key) is None:
        return None
    tools = obj[tool_key]
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise _data_error(f"{flag} {name}: line {lineno} has {tool_key!r} = {tools[:60]!r}, text that is not "
                              f"JSON ({e})", "a list of tool schemas (or its JSON text), or --tool-key '' to read "
                              "no tools", path=name, line=lineno) from None
    elif hasattr(tools, "tolist"):  # a Parquet list column read through numpy
        tools = tools.tolist()
    if not isinstance(tools, list):
        raise _data_error(f"{flag} {name}: line {lineno} has {tool_key!r} = {str(tools)[:60]!r}, a "
                          f"{type(tools).__name__}, not a list of tools",
                          'a list of tool schemas (e.g. [{"type": "function", "function": {...}}]), '
                          "or --tool-key '' to read no tools", path=name, line=lineno)
    return tools


class PromptDataset:
    """Epoch-wise walk over the rows; `next_batch(B)` never repeats a row within an epoch."""

    def __init__(self, rows: list[PromptRow], *, shuffle: bool, seed: int):
        self.rows, self.shuffle, self.seed = rows, shuffle, seed
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptRow]:
        out = []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            out.append(self.rows[self._order[self.offset]])
            self.offset += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._epoch_order(self.epoch)
