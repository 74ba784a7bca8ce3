"""Sending weights to engines: through Ray's object store to the engine actors, over HTTP in tensor buckets, or from
a versioned directory on disk.

Every engine is updated in parallel (one thread per engine) and must report the new version afterwards; an
engine that refuses or reports another version fails the sync, naming it.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Callable

import torch

from engine.rollout.client import EngineClient, EngineError
from engine.weights import buckets, pack_tensors


def _each(urls: list[str], fn: Callable[[str], None]) -> None:
    with cf.ThreadPoolExecutor(max(1, len(urls))) as pool:
        for f in [pool.submit(fn, u) for u in urls]:
            f.result()


def check_version(client: EngineClient, version: int, timeout_s: float, reply: dict | None = None) -> None:
    """The engine serves `version`: as its sync reply says (the built-in engine's), else as it answers when asked."""
    got = reply["weight_version"] if reply and "weight_version" in reply else client.weight_version(timeout_s)
    if got != str(version):
        raise EngineError(f"{client.url} reports weight_version {got!r} after the sync, expected {version}")


def push_tensors(urls: list[str], state_dict: dict[str, torch.Tensor], version: int, *, bucket_bytes: int,
                 timeout_s: float, api_key: str | None = None) -> dict[str, float]:
    """Buckets of ≤ bucket_bytes to `/update_weights_from_tensor` (raw safetensors bodies); the last one sets
    `weight_version`."""
    t0 = time.perf_counter()
    parts = buckets(state_dict, bucket_bytes)
    blobs = [pack_tensors(b) for b in parts]  # packed once, sent to every engine
    mb = sum(t.numel() * t.element_size() for b in parts for t in b.values()) / 2**20
    t_encode = time.perf_counter() - t0

    def one(url: str) -> None:
        c = EngineClient(url, timeout_s=timeout_s, api_key=api_key)
        reply: dict = {}
        for k, blob in enumerate(blobs):
            last = k == len(blobs) - 1
            reply = c.update_weights_from_tensor_raw(blob, version=version if last else None, flush_cache=last)
        check_version(c, version, timeout_s, reply)  # no second round trip when the reply says it

    _each(urls, one)
    return {"mb": mb, "buckets": float(len(blobs)), "encode_s": t_encode, "seconds": time.perf_counter() - t0}


def push_object_store(slots: list, ref, version: int, *, timeout_s: float) -> None:
    """Every engine actor copies the state behind `ref` (Ray's object store) into its model as `version`."""
    import ray

    served = ray.get([s.actor.update_weights.remote(ref, str(version)) for s in slots], timeout=timeout_s)
    _check_served(slots, served, version)


def push_in_process(slots: list, version: int, *, timeout_s: float, exported: Callable[[], None],
                    probe: tuple | None = None, scored: dict | None = None) -> int:
    """Every engine served from a train worker's process (engine/rollout/engines.py:HostedEngine) copies that
    worker's weights as `version`; `exported` is called once the copies are asked for (the worker runs what is
    asked after them on the weights it copied). `probe`: the RF14 probe's sequences, scored by both sides in the
    same call (TrainWorker.engine_take_weights); their numbers land in `scored[url]`. Returns the bytes copied
    into one engine."""
    import ray

    calls = [s.actor.host.engine_take_weights.remote(str(version), probe) for s in slots]
    exported()
    replies = ray.get(calls, timeout=timeout_s)
    _check_served(slots, [v for v, _, _ in replies], version)
    for s, (_, _, numbers) in zip(slots, replies):
        if numbers is not None and scored is not None:
            if numbers[2] != str(version):
                raise EngineError(f"{s.url} scored the probe under weight_version {numbers[2]!r}, expected "
                                  f"{version}")
            scored[s.url] = numbers[:2]
    return replies[0][1] if replies else 0


def _check_served(slots: list, served: list[str], version: int) -> None:
    """The version each engine actor says it serves after the update (its reply: the check costs no round trip)."""
    for s, got in zip(slots, served):
        if got != str(version):
            raise EngineError(f"{s.url} reports weight_version {got!r} after the sync, expected {version}")


def push_ipc(slots: list, buckets: dict[int, list], version: int, *, timeout_s: float) -> None:
    """Every colocated engine actor copies its CUDA IPC buckets (`buckets[slot.index]`, from the train rank on its
    GPU; engine/weights/ipc.py) into its model as `version`."""
    import ray

    served = ray.get([s.actor.update_weights_ipc.remote(buckets[s.index], str(version)) for s in slots],
                     timeout=timeout_s)
    _check_served(slots, served, version)


def push_disk(urls: list[str], path: str, version: int, *, timeout_s: float, api_key: str | None = None) -> None:
    """Every engine loads the safetensors directory `path` (`/update_weights_from_disk`)."""
    def one(url: str) -> None:
        c = EngineClient(url, timeout_s=timeout_s, api_key=api_key)
        c.update_weights_from_disk(path, version)
        check_version(c, version, timeout_s)

    _each(urls, one)
