"""Writing one iteration, then the marker, then retention; cleaning what crashed saves left behind.

Order of a save of iteration N (each step starts only after the previous one is durable):
    local:  state → iter_N.tmp/ → sha256 + fsync of every file → manifest.json → rename to iter_N/ → fsync(dir)
            → marker (temp + fsync + rename)
    S3:     state → <staging>/iter_N/ → sha256 → delete stale iter_N/ keys → upload every file → upload
            manifest.json (iter_N/ is complete once its manifest exists) → marker (one PUT)
    then:   retention (--keep-last-n) deletes older complete iterations, never the marker's
A kill at any point leaves the previous marker naming a complete iteration, or the new marker naming a complete
one: never a marker naming a partial directory.

Two halves: `stage_iteration` (the state into the temp location) and `commit_iteration` (the rest). A plain save
runs both; --async-save runs the commit in the background while training goes on (flows/train.py).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine import faults
from engine.checkpoint.layout import MANIFEST, MARKER, file_table, iter_name, list_iterations, read_manifest, \
    write_marker
from engine.checkpoint.storage import Store, fsync_dir

FORMAT = 1


@dataclass
class SaveReport:
    iteration: int
    uri: str
    bytes: int
    seconds: float  # the whole save: state + hashing + fsync/upload + manifest + marker + retention
    state_seconds: float = 0.0  # of which the backend writing its files (write_state)
    deleted: list[int] = field(default_factory=list)  # iterations removed by retention after the marker moved
    commit_seconds: float = 0.0  # of which the commit: hashing, fsync/upload, manifest, marker, retention

    @property
    def metrics(self) -> dict[str, float]:
        mb = self.bytes / 2**20
        return {"save/seconds": self.seconds, "save/state_seconds": self.state_seconds,
                "save/commit_seconds": self.commit_seconds, "save/mb": mb,
                "save/mb_per_s": mb / max(self.seconds, 1e-9)}

    def markdown(self) -> str:
        gone = ", ".join(iter_name(i) for i in self.deleted) or "none"
        return (f"### checkpoint {iter_name(self.iteration)}\n\n| | |\n|---|---|\n| where | `{self.uri}` |\n"
                f"| size | {self.bytes / 2**20:.1f} MiB |\n| seconds | {self.seconds:.2f} (backend state "
                f"{self.state_seconds:.2f}, commit {self.commit_seconds:.2f}) |\n"
                f"| marker | {self.iteration} |\n| deleted by --keep-last-n | {gone} |\n")


@dataclass
class Staged:
    """An iteration whose files are written (into `tmp`), not yet committed: `commit_iteration` checksums them, moves
    or uploads them into place and moves the marker. --async-save runs that part while the loop goes on."""
    iteration: int
    tmp: Path
    manifest: dict[str, Any]
    started: float  # time.time() when the save began
    state_seconds: float  # the backend writing its files (write_state)
    free_before: int | None = None  # free bytes of the store when the save began, where known


def stage_iteration(store: Store, iteration: int, write_state: Callable[[str], Any], manifest: dict[str, Any], *,
                    staging: str | Path | None = None) -> Staged:
    """The first half of a save: the backend's files into a temp location (local: <save>/iter_N.tmp/; remote:
    <staging>/iter_N/). Nothing a resume reads has changed yet."""
    store.mkdir()
    if store.remote:
        if staging is None:
            raise ValueError(f"saving to {store.url} needs a local staging directory")
        tmp = Path(staging) / iter_name(iteration)
    else:
        tmp = Path(store.path(iter_name(iteration) + ".tmp"))
    started = time.time()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t_state = time.perf_counter()
    write_state(str(tmp))
    return Staged(iteration, tmp, manifest, started, time.perf_counter() - t_state)


def commit_iteration(store: Store, staged: Staged, *, keep_last_n: int | None = None) -> SaveReport:
    """The second half: sha256 (+ fsync) of every file, manifest.json, the move (local) or upload (remote) into
    iter_N/, then the marker, then retention. Safe to repeat after a failure: when the temp files are gone because
    iter_N/ is already complete, it goes on from the marker."""
    iteration, tmp, name = staged.iteration, staged.tmp, iter_name(staged.iteration)
    t0 = time.perf_counter()
    if tmp.is_dir():
        files = file_table(tmp, fsync=not store.remote)
        body = {**staged.manifest, "format": FORMAT, "rollout_id": iteration, "files": files,
                "saved_at": time.time()}
        body.setdefault("next_rollout_id", iteration + 1)
        with (tmp / MANIFEST).open("w") as f:
            f.write(json.dumps(body, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        if store.remote:
            _upload(store, tmp, name, sorted(files), iteration)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            faults.at("during_save", iteration)
            store.rm(name)  # an iter_N left by an earlier attempt (killed before its marker)
            tmp.rename(store.path(name))
            fsync_dir(store.path())
    else:  # a repeated commit: the earlier attempt moved or uploaded the files, then failed
        body = read_manifest(store, iteration)
        if body is None:
            raise FileNotFoundError(f"commit of {store.uri(name)}: neither its temp files ({tmp}) nor a complete "
                                    f"{name}/ exist; save the rollout again")
        files = body["files"]
    faults.at("before_marker", iteration)
    write_marker(store, iteration)
    faults.at("after_marker", iteration)
    deleted = apply_retention(store, iteration, keep_last_n)
    size = sum(f["size"] for f in files.values())
    return SaveReport(iteration, store.uri(name), size, time.time() - staged.started, staged.state_seconds, deleted,
                      commit_seconds=time.perf_counter() - t0)


def save_iteration(store: Store, iteration: int, write_state: Callable[[str], Any], manifest: dict[str, Any], *,
                   staging: str | Path | None = None, keep_last_n: int | None = None) -> SaveReport:
    """Write iteration N through a temp location, then move the marker to N, then apply retention.

    `write_state(local_dir)` writes the backend's files; `manifest` adds the run's facts (data state, run ids…).
    `staging` is a local scratch directory, needed for remote stores only.
    """
    return commit_iteration(store, stage_iteration(store, iteration, write_state, manifest, staging=staging),
                            keep_last_n=keep_last_n)


def _upload(store: Store, tmp: Path, name: str, rels: list[str], iteration: int) -> None:
    store.rm(name)  # stale keys of a crashed attempt would otherwise sit next to the new files
    for k, rel in enumerate(rels):
        if k == len(rels) // 2:
            faults.at("during_save", iteration)
        store.put_file(tmp / rel, f"{name}/{rel}")
    store.put_file(tmp / MANIFEST, f"{name}/{MANIFEST}")  # last: the iteration is complete once this exists


# ---- retention -------------------------------------------------------------------------------------------------
def retention_plan(iterations: list[int], complete: list[int], marker: int, keep_last_n: int) -> list[int]:
    """Iterations to delete: everything older than the K newest complete ones at or below the marker.

    The marker's iteration is always kept; iterations above the marker (another lineage after --ckpt-step, or
    uncommitted ones) and damaged ones between kept iterations are left alone.
    e.g. iterations 0..5, all complete, marker 5, K = 2 → keep {4, 5}, delete [0, 1, 2, 3]
    """
    kept = sorted(i for i in complete if i <= marker)[-keep_last_n:] + [marker]
    oldest = min(kept)
    return [i for i in iterations if i < oldest]


def apply_retention(store: Store, marker: int, keep_last_n: int | None) -> list[int]:
    if not keep_last_n:
        return []
    its = list_iterations(store)
    complete = [i for i in its if i <= marker and read_manifest(store, i) is not None]
    doomed = retention_plan(its, complete, marker, keep_last_n)
    for i in doomed:
        store.rm(iter_name(i))
    return doomed


# ---- leftovers of crashed saves --------------------------------------------------------------------------------
def clean_leftovers(store: Store, marker: int | None) -> list[str]:
    """Delete temp entries (iter_N.tmp/, marker .tmp) and manifest-less iteration dirs above the marker.

    Both can only come from a save that was killed before its commit point; returns what was deleted.
    """
    gone = []
    for e in store.listdir():
        if e["name"].endswith(".tmp") and (e["name"].startswith("iter_") or e["name"] == MARKER + ".tmp"):
            store.rm(e["name"])
            gone.append(store.uri(e["name"]))
    for i in list_iterations(store):
        if (marker is None or i > marker) and read_manifest(store, i) is None:
            store.rm(iter_name(i))
            gone.append(store.uri(iter_name(i)))
    return gone
