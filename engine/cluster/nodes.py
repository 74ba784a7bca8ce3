"""What each node can see. rollflow assumes no filesystem shared by the driver and the nodes of a Ray cluster:

- the model (--hf-checkpoint) is read where it is used: every engine and train rank checks it on its own node
  first and fails with the node's address and the fix (`require_model`) instead of a loader traceback;
- a directory the driver hands to the train ranks (a checkpoint to load, one to write, reference weights) is
  probed: the driver writes a random token into it and each rank says whether it reads the same token
  (`Probe`, `sees`). A rank that does not see it gets the files through Ray's object store (`pack_dir` →
  `unpack_dir` into a node-local temporary directory), or sends back what it wrote (`written`), which the driver
  puts in place; disk weight sync is allowed only where every engine sees rank 0's directory.

- a model given as `s3://bucket/prefix` (--hf-checkpoint) is downloaded once per node into a local cache
  (`local_model`: $ROLLFLOW_MODEL_CACHE, else ~/.cache/rollflow/models; keyed by the URI and the objects' names and
  sizes, so a changed model is fetched again), under a file lock that the processes of one node share.

Fault injection (tests, engine/faults.py): ROLLFLOW_HIDDEN_PATHS=/a:/b in a node's environment (e.g.
`Cluster.add_node(env_vars=...)`) makes rollflow's checks on that node treat paths under /a or /b as absent, as
on a node that does not mount the driver's filesystem. Unset, nothing is hidden.
"""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from engine.diagnosis import ConfigError, Diagnosis

HIDDEN_ENV = "ROLLFLOW_HIDDEN_PATHS"


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        import socket

        return socket.gethostname()


def _hidden(path: str | os.PathLike) -> bool:
    p = os.path.abspath(os.fspath(path))
    return any(p == h or p.startswith(h.rstrip("/") + "/")
               for h in filter(None, os.environ.get(HIDDEN_ENV, "").split(":")))


def visible(path: str | os.PathLike) -> bool:
    """`path` exists on this node (and is not hidden by ROLLFLOW_HIDDEN_PATHS)."""
    return not _hidden(path) and os.path.exists(path)


def require_model(path: str, *, flag: str = "--hf-checkpoint", who: str) -> None:
    """The model directory must be readable on this node (its config.json): else a ConfigError naming the node."""
    if visible(Path(path) / "config.json"):
        return
    ip = node_ip()
    raise ConfigError(Diagnosis(
        code="CONFIG", severity="error",
        what=f"{flag} {path} is not there on node {ip} ({who}): every node that runs an engine or a train rank "
             f"reads the model from the same path, and this one has no {Path(path) / 'config.json'}",
        fix=f"make {path} visible on every node at the same path: a filesystem all nodes mount (NFS, a "
            "ReadWriteMany volume on every KubeRay pod), the same container image with the model baked in, or a "
            "copy on each node (e.g. `srun --ntasks-per-node=1 rsync ...` in the Slurm recipe); see docs/cluster.md",
        facts={"field": flag.lstrip("-").replace("-", "_"), "value": path, "node": ip, "who": who}))


def _fingerprint(directory: str | os.PathLike) -> str:
    """The names and sizes of a directory's entries, hashed: the same directory seen from two nodes."""
    import hashlib

    entries = sorted((e.name, e.stat().st_size if e.is_file() else -1) for e in os.scandir(directory))
    return "dir:" + hashlib.sha256(repr(entries).encode()).hexdigest()


class Probe:
    """A token file the driver writes into `directory`; `sees(file, token)` on a node says whether that node reads
    the same directory. Removed by `remove` (or as a context manager). A directory the driver cannot write (a
    read-only --load mount) is probed by its entries' names and sizes instead."""

    def __init__(self, directory: str | os.PathLike):
        d = Path(directory)
        self.written = False
        try:
            d.mkdir(parents=True, exist_ok=True)
            self.token = secrets.token_hex(16)
            self.file = str(d / f".rollflow-probe-{self.token[:8]}")
            Path(self.file).write_text(self.token)
            self.written = True
        except OSError:
            self.file, self.token = str(d), _fingerprint(d)

    def remove(self) -> None:
        if self.written:
            Path(self.file).unlink(missing_ok=True)

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def sees(file: str, token: str) -> bool:
    """On a node: whether `file` is visible here with `token` in it (the driver's file, not a namesake)."""
    try:
        if token.startswith("dir:"):
            return visible(file) and _fingerprint(file) == token
        return visible(file) and Path(file).read_text() == token
    except OSError:
        return False


def pack_dir(path: str | os.PathLike) -> dict[str, bytes]:
    """Every file under `path` by relative name (for Ray's object store)."""
    root = Path(path)
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def unpack_dir(files: dict[str, bytes], path: str | os.PathLike) -> list[str]:
    root = Path(path)
    for rel, data in files.items():
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    return sorted(files)


def local_copy(files: dict[str, bytes], use: Callable[[str], Any]) -> Any:
    """`use(dir)` on a node-local temporary copy of `files` (removed afterwards)."""
    tmp = tempfile.mkdtemp(prefix="rollflow-in-")
    try:
        unpack_dir(files, tmp)
        return use(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def written(write: Callable[[str], Any]) -> tuple[Any, dict[str, bytes]]:
    """`write(dir)` into a node-local temporary directory; returns (its result, the files it wrote)."""
    tmp = tempfile.mkdtemp(prefix="rollflow-out-")
    try:
        out = write(tmp)
        return out, pack_dir(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- models in S3: one download per node -------------------------------------------------------------------------
MODEL_CACHE_ENV = "ROLLFLOW_MODEL_CACHE"
_local_models: dict[str, str] = {}  # uri → this process's local copy


def model_cache_root() -> Path:
    return Path(os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "rollflow" / "models")


def local_model(uri: str) -> str:
    """A local directory holding the model at `uri`: `uri` itself unless it is s3://, else this node's cached copy
    (downloaded now when missing; the first process of the node downloads, the others wait on its lock)."""
    import fcntl
    import hashlib
    import json
    import logging
    import time

    from engine.checkpoint.storage import Store

    if not str(uri).startswith("s3://"):
        return uri
    if uri in _local_models:
        return _local_models[uri]
    try:
        store = Store(uri)
        files = store.files("")
    except Exception as e:  # credentials, endpoint, bucket: s3fs raises many kinds
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"--hf-checkpoint {uri} cannot be listed from node {node_ip()}: {type(e).__name__}: {e}",
            fix="check the bucket and prefix, and that this node has S3 credentials (AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or an instance role) and, for a non-AWS store, AWS_ENDPOINT_URL_S3",
            facts={"field": "hf_checkpoint", "value": uri})) from None
    if "config.json" not in files:
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"--hf-checkpoint {uri} has no config.json ({len(files)} objects under it) on node {node_ip()}",
            fix="point --hf-checkpoint at the prefix where save_pretrained's files are (config.json, *.safetensors, "
                "tokenizer files), e.g. `aws s3 ls " + uri.rstrip("/") + "/`",
            facts={"field": "hf_checkpoint", "value": uri, "objects": len(files)}))
    key = hashlib.sha256(json.dumps([uri, sorted(files.items())]).encode()).hexdigest()[:16]
    root = model_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / f"{uri.rstrip('/').rsplit('/', 1)[-1]}-{key}"
    with open(root / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download per node; the others find it complete
        if not (dest / ".complete").is_file():
            t0, mb = time.perf_counter(), sum(files.values()) / 2**20
            logging.getLogger("rollflow.cluster").info("downloading %s (%d files, %.1f MiB) into %s", uri,
                                                      len(files), mb, dest)
            part = dest.with_name(dest.name + ".part")
            shutil.rmtree(part, ignore_errors=True)
            for rel in files:
                store.get_file(rel, part / rel)
            got = {rel: (part / rel).stat().st_size for rel in files}
            if got != files:
                raise OSError(f"download of {uri} into {part} is incomplete: sizes {got} != {files}")
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(part, dest)
            (dest / ".complete").write_text(json.dumps({"uri": uri, "files": files,
                                                        "seconds": time.perf_counter() - t0}))
    _local_models[uri] = str(dest)
    return str(dest)


def local_file(uri: str) -> str:
    """A local path holding the file at `uri`: `uri` itself unless it is s3://, else this node's cached copy
    (<cache root>/files/<key>-<name>, keyed by the URI, the object's size and ETag; downloaded now when missing)."""
    import fcntl
    import hashlib

    from fsspec.core import url_to_fs

    if not str(uri).startswith("s3://"):
        return uri
    fs, path = url_to_fs(uri, use_listings_cache=False)
    info = fs.info(path)  # FileNotFoundError for a missing object
    key = hashlib.sha256(repr((uri, info.get("size"), info.get("ETag"))).encode()).hexdigest()[:16]
    root = model_cache_root() / "files"
    root.mkdir(parents=True, exist_ok=True)
    dest = root / f"{key}-{path.rsplit('/', 1)[-1]}"
    with open(root / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not dest.is_file():
            part = dest.with_name(dest.name + ".part")
            fs.get_file(path, str(part))
            if part.stat().st_size != int(info.get("size") or 0):
                raise OSError(f"download of {uri} into {part} is incomplete")
            os.replace(part, dest)
    return str(dest)
