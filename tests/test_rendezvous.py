"""The process-group store listens before its address is handed out (engine/train/rendezvous.py).

CI once lost a DP-2 run to EADDRINUSE: the train ranks' port was allocated, checked free, and taken by another
process before rank 0's store bound it. These tests take the port on purpose."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
from datetime import timedelta

import pytest

from engine.rollout.ports import free_loopback_port
from engine.train import rendezvous


def _listening(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("0.0.0.0", port))
    s.listen()
    return s


def test_a_port_taken_after_the_check_is_skipped_and_the_store_listens_at_once():
    squatter = _listening(0)
    taken = squatter.getsockname()[1]
    ports = iter([taken, free_loopback_port()])
    try:
        store, port = rendezvous.listen_store("127.0.0.1", 2, timedelta(seconds=10), lambda: next(ports))
        assert port != taken
        with socket.socket() as probe:  # nothing else can have it now: the store holds it
            with pytest.raises(OSError):
                probe.bind(("0.0.0.0", port))
        store.set("k", "v")
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
        assert client.get("k") == b"v"
    finally:
        squatter.close()


def test_every_port_taken_names_them_and_the_fix():
    squatters = [_listening(0) for _ in range(2)]
    taken = [s.getsockname()[1] for s in squatters]
    ports = iter(taken)
    try:
        from engine.diagnosis import DiagnosisError

        with pytest.raises(DiagnosisError, match=rf"ports \[{taken[0]}, {taken[1]}\].*held by pid {os.getpid()}") as e:
            rendezvous.listen_store("127.0.0.1", 2, timedelta(seconds=5), lambda: next(ports), attempts=2)
        assert e.value.codes == ["RF08"] and "ss -ltnp" in str(e.value)
    finally:
        for s in squatters:
            s.close()


def _rank(rank: int, addresses, out) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:  # what TrainWorker.rendezvous does on rank 0's node, then its setup
        master = rendezvous.host_group("127.0.0.1", 2, free_loopback_port, timeout_minutes=1)
        for _ in range(2):
            addresses.put(master)
    else:
        master = addresses.get(timeout=60)
    rendezvous.init_group("gloo", master, rank, 2, timedelta(seconds=60))
    held = master in rendezvous._HELD
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out.put((rank, t.item(), held))
    dist.destroy_process_group()


def test_rank_0_builds_the_group_on_the_store_it_holds_and_rank_1_connects():
    ctx = mp.get_context("spawn")
    addresses, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, addresses, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        master = addresses.get(timeout=120)
        with socket.socket() as probe:  # listening from the moment the address exists
            with pytest.raises(OSError):
                probe.bind(("0.0.0.0", int(master.rsplit(":", 1)[1])))
        got = {r: (v, held) for r, v, held in (out.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == {0: (3.0, False), 1: (3.0, False)}  # rank 0 took its held store: no longer held
