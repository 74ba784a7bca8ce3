"""Names and small reads of the checkpoint layout: the marker, iteration directories, manifests, file hashes."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from engine.checkpoint.storage import Store

MARKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
RUN_FILE = "rollflow_run.json"  # the run's identity before its first checkpoint (MLflow run id, config hash)
_ITER = re.compile(r"^iter_(\d{7})$")


def as_store(where: str | os.PathLike | Store) -> Store:
    return where if isinstance(where, Store) else Store(where)


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iter_dir(save: str | os.PathLike, iteration: int) -> Path:
    """The local path of an iteration directory (local stores only; see Store.uri for any store)."""
    return Path(save) / iter_name(iteration)


def read_marker(where: str | os.PathLike | Store) -> int | None:
    """The iteration named by the marker; None when there is no marker or it is not '<int>\\n'."""
    data = as_store(where).read_bytes(MARKER)
    text = data.decode(errors="replace").strip() if data is not None else ""
    return int(text) if text.isdigit() else None


def marker_text(where: str | os.PathLike | Store) -> str | None:
    """The marker file's raw content (None when there is no marker file): tells an unreadable marker from none."""
    data = as_store(where).read_bytes(MARKER)
    return data.decode(errors="replace") if data is not None else None


def write_marker(where: str | os.PathLike | Store, iteration: int) -> None:
    as_store(where).write_atomic(MARKER, f"{iteration}\n".encode())


def list_iterations(where: str | os.PathLike | Store) -> list[int]:
    """Numbers of every iter_%07d directory (complete or not), ascending."""
    return sorted(int(m[1]) for e in as_store(where).listdir()
                  if e["type"] == "directory" and (m := _ITER.match(e["name"])))


def read_manifest(where: str | os.PathLike | Store, iteration: int) -> dict[str, Any] | None:
    """The iteration's manifest, or None when it is missing or not valid JSON (a half-written iteration)."""
    data = as_store(where).read_bytes(f"{iter_name(iteration)}/{MANIFEST}")
    if data is None:
        return None
    try:
        m = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("files"), dict) else None


def hf_files(where: str | os.PathLike | Store) -> list[str]:
    """Hugging Face model files at the root (config.json and weights), empty when it is not an HF directory."""
    names = {e["name"] for e in as_store(where).listdir() if e["type"] == "file"}
    weights = sorted(n for n in names if n.endswith(".safetensors") or (n.startswith("pytorch_model")
                                                                         and n.endswith(".bin")))
    return (["config.json"] if "config.json" in names else []) + weights


def is_hf_dir(where: str | os.PathLike | Store) -> bool:
    files = hf_files(where)
    return "config.json" in files and len(files) > 1


def sha256_file(path: str | os.PathLike, *, fsync: bool = False) -> str:
    """sha256 of a local file, read in 1 MiB chunks; with fsync=True its data is also forced to disk."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def file_table(root: str | os.PathLike, *, fsync: bool = False) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file under a local directory (the manifest's `files`)."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p, fsync=fsync)}
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def read_run_file(where: str | os.PathLike | Store) -> dict[str, Any] | None:
    """The run identity written at a fresh start (before any checkpoint exists), or None."""
    data = as_store(where).read_bytes(RUN_FILE)
    try:
        return json.loads(data) if data is not None else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def write_run_file(where: str | os.PathLike | Store, identity: dict[str, Any]) -> None:
    store = as_store(where)
    store.mkdir()
    store.write_atomic(RUN_FILE, json.dumps(identity, indent=1, sort_keys=True).encode())
