"""A fake backend state and small helpers shared by the checkpoint tests (also imported by their subprocesses)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from engine import checkpoint
from engine.checkpoint import Store


def fake_state(rollout_id: int):
    """A backend's write_state: model/ and optim/ files whose bytes depend on the rollout id."""
    def write(path: str) -> None:
        p = Path(path)
        (p / "model").mkdir(parents=True)
        (p / "model" / "model.safetensors").write_bytes(bytes([rollout_id % 256]) * 4096)
        (p / "optim").mkdir()
        (p / "optim" / "state.pt").write_bytes(b"optim-%d" % rollout_id)
    return write


def save(where, it: int, keep_last_n=None, **manifest):
    store = where if isinstance(where, Store) else Store(where)
    body = {"data_state": {"epoch": 0, "offset": it + 1}, "origin": checkpoint.origin_of(None, None), **manifest}
    return checkpoint.save_iteration(store, it, fake_state(it), body, keep_last_n=keep_last_n,
                                     staging=Path(os.environ.get("TMPDIR", "/tmp")) / f"stage-{os.getpid()}")


def start(save_dir, **kw):
    args = dict(load=None, save=str(save_dir), ckpt_step=None, load_optim=True, staging=Path(save_dir) / "_stage")
    args.update(kw)
    return checkpoint.resolve_start(**args)


def damage(d: Path, how: str) -> str:
    if how == "missing_dir":
        shutil.rmtree(d)
        return "does not exist"
    if how == "no_manifest":
        (d / "manifest.json").unlink()
        return "no readable manifest.json"
    if how == "bad_manifest":
        (d / "manifest.json").write_text('{"rollout_id": 2, "files": {"mod')
        return "no readable manifest.json"
    if how == "missing_file":
        (d / "optim" / "state.pt").unlink()
        return "optim/state.pt is missing"
    if how == "truncated":
        (d / "model" / "model.safetensors").write_bytes(b"\x02" * 100)
        return "has 100 bytes, the manifest says 4096"
    if how == "bitflip":  # same size: only the sha256 can tell
        (d / "model" / "model.safetensors").write_bytes(b"\x02" * 4095 + b"\x03")
        return "sha256"
    raise AssertionError(how)
