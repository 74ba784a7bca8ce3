"""Process-group rendezvous whose store listens before its address is handed out.

A port checked free, handed to the other ranks, and bound only when the group starts seconds later can be taken in
between by any other process of the node (CI saw gloo's store fail with EADDRINUSE after the train ranks' port
had been allocated). So the rank that hosts a group starts the group's TCP store itself, at once, on a port the
caller picks (the cluster's allocator, RF08), and on EADDRINUSE takes the next port; the address it hands out is
already listening. `init_group` then builds the process group on that held store in rank 0's process; the other
ranks connect to it as clients (tcp://), as torch's own tcp:// rendezvous does.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

#: the stores this process started and listens on, until a group is built on them: "host:port" → TCPStore
_HELD: dict[str, Any] = {}


def address(host: str, port: int) -> str:
    """`host:port` (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _in_use(e: BaseException) -> bool:
    text = str(e)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def listen_store(host: str, world_size: int, timeout: timedelta, next_port: Callable[[], int],
                 attempts: int = 8) -> tuple[Any, int]:
    """(a TCPStore server of `world_size` ranks, listening now, its port): the port is `next_port()`, and again
    while the port turns out taken (another process bound it after it was checked free)."""
    import torch.distributed as dist

    if attempts < 1:
        raise ValueError(f"listen_store: attempts={attempts}; it must be at least 1")
    taken: list[int] = []
    for _ in range(attempts):
        port = int(next_port())
        try:
            store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        except RuntimeError as e:  # DistNetworkError
            if not _in_use(e):
                raise
            taken.append(port)
            continue
        return store, port
    from engine.diagnosis import Diagnosis, DiagnosisError
    from engine.rollout.ports import port_holder_pid

    holder = port_holder_pid(taken[-1], listening=True)
    held = f"pid {holder[0]} ({holder[1][:160]})" if holder else "a process this user cannot see"
    raise DiagnosisError(Diagnosis(
        code="RF08", severity="error",
        what=f"the process group's store on {host}: ports {taken} were each taken by another process between the "
             f"check that found them free and the bind ({attempts} tries); port {taken[-1]} is held by {held}",
        fix="stop the program that keeps taking ports on this node (`ss -ltnp` lists who listens where), then "
            "run the same command again (a run resumes from its last checkpoint)",
        facts={"host": host, "ports": taken, "holder_pid": holder[0] if holder else None}))


def host_group(host: str, world_size: int, next_port: Callable[[], int], timeout_minutes: float) -> str:
    """Start (and keep, in this process) the store of a group of `world_size` ranks whose rank 0 runs here;
    returns its address for every rank's `init_group`."""
    store, port = listen_store(host, world_size, timedelta(minutes=timeout_minutes), next_port)
    where = address(host, port)
    _HELD[where] = store
    return where


def init_group(backend: str, master: str, rank: int, world_size: int, timeout: timedelta) -> None:
    """torch.distributed's default process group: rank 0 builds it on the store `host_group` started in this
    process (when it did); every other rank connects to tcp://master."""
    import torch.distributed as dist

    store = _HELD.pop(master, None) if rank == 0 else None
    if store is None:
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world_size,
                                timeout=timeout)
        return
    store.set_timeout(timeout)
    # the prefix torch's tcp:// rendezvous puts on the store the other ranks use (it adds none to a given store)
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
