"""Where checkpoints live: a local directory or `s3://bucket/prefix`, both through fsspec.

A `Store` is one checkpoint root; every path it takes is relative to that root ("iter_0000007/manifest.json").

Known s3fs traps, handled here rather than by every caller:
- `put(dir, "s3://b/p/iter_1", recursive=True)` nests the directory (`iter_1/<dir name>/…`) or not depending on
  trailing slashes and on whether the prefix exists yet; files are therefore uploaded one by one to explicit keys.
- s3fs caches listings: a process polling for the marker through a cached listing never sees it change. Listings
  are not cached (`use_listings_cache=False`), the cache is invalidated before every listing anyway, and the
  marker is read with one GET (never `exists()` then read).
- S3 has no rename: the marker is one PUT of the whole object (atomic on S3), issued after everything else.
Credentials come from botocore's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN,
AWS_PROFILE and ~/.aws/config, instance roles); AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL) points at a non-AWS
server. This module never reads, stores or prints them, and error messages carry only the s3:// URL.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def normalize(url: str | os.PathLike) -> str:
    """'s3://b/p/' → 's3://b/p'; a local path → its absolute form (Ray workers may run in another cwd)."""
    s = str(url)
    if "://" in s and not s.startswith("file://"):
        return s.rstrip("/")
    return str(Path(s.removeprefix("file://")).expanduser().resolve())


def is_remote(url: str | os.PathLike) -> bool:
    s = str(url)
    return "://" in s and not s.startswith("file://")


class Store:
    """One checkpoint root (local or remote) with the few operations checkpoints need."""

    def __init__(self, url: str | os.PathLike):
        from fsspec.core import url_to_fs

        self.url = normalize(url)
        self.remote = is_remote(self.url)
        # one s3fs client per process and options (fsspec's instance cache; creating one costs ~0.3 s), with no
        # listing cache: another process's marker must be visible on the next read
        opts: dict[str, Any] = {"use_listings_cache": False} if self.remote else {}
        self.fs, self.root = url_to_fs(self.url, **opts)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def path(self, rel: str = "") -> str:
        """The filesystem path of `rel` (for a local store, a real path on disk)."""
        return f"{self.root}/{rel}".rstrip("/") if rel else self.root

    def uri(self, rel: str = "") -> str:
        """`rel` as the user would write it (s3://…/rel or /abs/rel), for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    # ---- reads ----------------------------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, or None when it does not exist (one GET on S3; no listing involved)."""
        try:
            return self.fs.cat_file(self.path(rel))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def listdir(self, rel: str = "") -> list[dict[str, Any]]:
        """Entries directly under `rel`: [{"name": basename, "type": "file"|"directory", "size": int}]; [] if none."""
        self.fs.invalidate_cache(self.path(rel))
        try:
            entries = self.fs.ls(self.path(rel), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if name and e["name"].rstrip("/") != self.path(rel).rstrip("/"):
                out.append({"name": name, "type": e["type"], "size": int(e.get("size") or 0)})
        return out

    def files(self, rel: str) -> dict[str, int]:
        """Every file under `rel` (recursively): {path relative to rel: size}."""
        base = self.path(rel).rstrip("/") + "/"
        self.fs.invalidate_cache(self.path(rel))
        try:
            found = self.fs.find(self.path(rel), detail=True)
        except FileNotFoundError:
            return {}
        return {name[len(base):]: int(info.get("size") or 0) for name, info in found.items()
                if name.startswith(base) and info.get("type") == "file"}

    def get_file(self, rel: str, local: str | os.PathLike) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self.path(rel), str(local))

    # ---- writes ---------------------------------------------------------------------------------------------
    def write_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the old content or the new one, never a part: local temp + fsync + rename + fsync of the
        directory; on S3 a single PUT of the whole object."""
        if self.remote:
            self.fs.pipe_file(self.path(rel), data)
            return
        p = Path(self.path(rel))
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        fsync_dir(p.parent)

    def put_file(self, local: str | os.PathLike, rel: str) -> None:
        """Upload one file to exactly `rel` (no directory semantics, so no trailing-slash surprises)."""
        self.fs.put_file(str(local), self.path(rel))

    def rm(self, rel: str) -> None:
        """Remove a file or a whole directory / prefix; missing is fine."""
        p = self.path(rel)
        try:
            if self.remote:
                self.fs.rm(p, recursive=True)
            elif Path(p).is_dir():
                import shutil

                shutil.rmtree(p)
            else:
                Path(p).unlink()
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(p)

    def mkdir(self) -> None:
        if not self.remote:
            Path(self.root).mkdir(parents=True, exist_ok=True)

    # ---- preflight ------------------------------------------------------------------------------------------
    def write_problem(self) -> str | None:
        """Why nothing can be written here (a missing bucket, no permission, a read-only disk), else None. Writes
        and removes one small probe object; local directories are not created (the nearest existing parent is
        checked)."""
        import uuid

        if not self.remote:
            p = Path(self.root)
            while not p.exists():
                p = p.parent
            if not p.is_dir():
                return f"{p} is a file, not a directory"
            return None if os.access(p, os.W_OK | os.X_OK) else f"{p} is not writable by this user"
        bucket = self.root.split("/", 1)[0]
        try:
            if not self.fs.exists(bucket):
                return f"the bucket {bucket!r} does not exist (or these credentials cannot see it)"
            probe = f".rollflow-write-probe-{uuid.uuid4().hex[:8]}"
            self.fs.pipe_file(self.path(probe), b"probe")
            self.fs.rm(self.path(probe))
        except Exception as e:  # noqa: BLE001 — botocore's errors (AccessDenied, NoSuchBucket, endpoint down)
            return f"writing to bucket {bucket!r} failed: {type(e).__name__}: {str(e)[:300]}"
        return None

    def write_fix(self) -> str:
        """The fix for a `write_problem` (or a failed write) here: the bucket and credentials on S3, the directory's
        path and permissions on a local disk."""
        if self.remote:
            return "create the bucket, or check AWS_ENDPOINT_URL_S3 and the AWS credentials"
        return "a --save directory this user can create and write to, or fix the permissions of the path"

    def free_bytes(self) -> int | None:
        """Free bytes on the local disk holding this directory (None on S3)."""
        if self.remote:
            return None
        import shutil

        p = Path(self.root)
        while not p.exists():
            p = p.parent
        return shutil.disk_usage(p).free


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
