"""Checkpoints in the Megatron-compatible layout (design.md, "Checkpoints").

    <save>/iter_%07d/manifest.json   rollout_id, data state, run ids, config hash, every file with size + sha256
    <save>/iter_%07d/model/ optim/   the backend's state
    <save>/latest_checkpointed_iteration.txt   "<N>\\n", written LAST and atomically (temp + fsync + rename)

An iteration is first written to `iter_%07d.tmp/`, hashed, then renamed into place; only then the marker moves.
A crash at any point leaves either the previous marker or the new one, never a marker naming a partial dir.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

MARKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7})$")


def iter_dir(save: str | os.PathLike, iteration: int) -> Path:
    return Path(save) / f"iter_{iteration:07d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_marker(save: str | os.PathLike) -> int | None:
    p = Path(save) / MARKER
    if not p.is_file():
        return None
    text = p.read_text().strip()
    return int(text) if text.isdigit() else None


def write_marker(save: str | os.PathLike, iteration: int) -> None:
    p = Path(save) / MARKER
    tmp = p.with_name(MARKER + ".tmp")
    with tmp.open("w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    _fsync_dir(p.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_iterations(save: str | os.PathLike) -> list[int]:
    root = Path(save)
    if not root.is_dir():
        return []
    return sorted(int(m[1]) for p in root.iterdir() if p.is_dir() and (m := _ITER.match(p.name)))


def save_checkpoint(save: str | os.PathLike, iteration: int, write_state: Callable[[str], Any],
                    manifest: dict[str, Any]) -> Path:
    """Write `iter_%07d/` through a temp dir, hash every file into manifest.json, then move the marker."""
    final = iter_dir(save, iteration)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_state(str(tmp))
    files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    body = {**manifest, "rollout_id": iteration, "files": files, "saved_at": time.time()}
    (tmp / "manifest.json").write_text(json.dumps(body, indent=1, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    write_marker(save, iteration)
    return final


def load_manifest(save: str | os.PathLike, iteration: int) -> dict[str, Any]:
    return json.loads((iter_dir(save, iteration) / "manifest.json").read_text())
