"""Sending weights to engines over HTTP: from tensors (in buckets) or from a versioned directory on disk.

Every engine is updated in parallel (one thread per engine) and must report the new version afterwards; an
engine that refuses or reports another version fails the sync, naming it.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Callable

import torch

from engine.rollout.client import EngineClient, EngineError
from engine.weights import TENSOR_LOAD_FORMAT, buckets, encode_tensors


def _each(urls: list[str], fn: Callable[[str], None]) -> None:
    with cf.ThreadPoolExecutor(max(1, len(urls))) as pool:
        for f in [pool.submit(fn, u) for u in urls]:
            f.result()


def _check_version(client: EngineClient, version: int, timeout_s: float) -> None:
    got = client.weight_version(timeout_s)
    if got != str(version):
        raise EngineError(f"{client.url} reports weight_version {got!r} after the sync, expected {version}")


def push_tensors(urls: list[str], state_dict: dict[str, torch.Tensor], version: int, *, bucket_bytes: int,
                 timeout_s: float) -> dict[str, float]:
    """Buckets of ≤ bucket_bytes to `/update_weights_from_tensor`; the last one sets `weight_version`."""
    t0 = time.perf_counter()
    parts = buckets(state_dict, bucket_bytes)
    blobs = [encode_tensors(b) for b in parts]  # encoded once, sent to every engine
    mb = sum(t.numel() * t.element_size() for b in parts for t in b.values()) / 2**20
    t_encode = time.perf_counter() - t0

    def one(url: str) -> None:
        c = EngineClient(url, timeout_s=timeout_s)
        for k, blob in enumerate(blobs):
            last = k == len(blobs) - 1
            c.update_weights_from_tensor([blob], load_format=TENSOR_LOAD_FORMAT, version=version if last else None,
                                         flush_cache=last)
        _check_version(c, version, timeout_s)

    _each(urls, one)
    return {"mb": mb, "buckets": float(len(blobs)), "encode_s": t_encode, "seconds": time.perf_counter() - t0}


def push_disk(urls: list[str], path: str, version: int, *, timeout_s: float) -> None:
    """Every engine loads the safetensors directory `path` (`/update_weights_from_disk`)."""
    def one(url: str) -> None:
        c = EngineClient(url, timeout_s=timeout_s)
        c.update_weights_from_disk(path, version)
        _check_version(c, version, timeout_s)

    _each(urls, one)
