"""Weights by collective broadcast: SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`.

How slime feeds SGLang engines that sit on other GPUs (or other hosts): the trainer's rank 0 and every engine's
ranks form one process group outside the trainer's own (a TCP store at `master_address:master_port`, rank 0 the
trainer, an engine's ranks from `rank_offset`), then each update is one HTTP call that names the tensors
(`names`, `dtypes`, `shapes`) while the trainer broadcasts them, in that order, from rank 0.

- `join_group` builds the group on either side without touching the default process group (the trainer has its
  own for FSDP/Megatron; an engine has none): a TCPStore and a ProcessGroupGloo (CPU tensors) or
  ProcessGroupNCCL (CUDA tensors) constructed directly.
- `receive_into` is the engine's side: it receives every announced tensor, even after a bad name, so the
  trainer's broadcasts never hang; the model changes only when every name and shape was right (else RF14, as
  the other transports).
- `DistributedSender` is the trainer's side: it asks each engine to join (HTTP, in a thread: the join blocks
  until every rank is in) while it joins as rank 0, then per update posts the names and broadcasts the tensors.

Field names and defaults are SGLang's (python/sglang/srt/managers/io_struct.py, `InitWeightsUpdateGroupReqInput`
and `UpdateWeightsFromDistributedReqInput`; tests/test_sglang_schema.py checks them).
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch

from engine.rollout.client import EngineError

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
BACKENDS = ("gloo", "nccl")


def dtype_of(name: str) -> torch.dtype:
    """SGLang sends dtypes as strings ("bfloat16" or "torch.bfloat16")."""
    d = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
    return d


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def join_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               timeout_s: float = 600.0, store=None):
    """This process's member of a fresh process group (rank 0 hosts the store: `store`, when it already listens
    (engine/train/rendezvous.py), else one started now). Blocks until all ranks joined."""
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a group of world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, int(master_port), int(world_size), is_master=rank == 0,
                              timeout=timeout)
    else:
        store.set_timeout(timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' for CPU tensors")
    return dist.ProcessGroupNCCL(store, rank, world_size)


def _broadcast(pg, t: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


def receive_into(model: torch.nn.Module, pg, names: list[str], dtypes: list[str], shapes: list[list[int]],
                 device: torch.device | str) -> int:
    """Receive the announced tensors from rank 0 and copy them into `model` (cast to each parameter's dtype);
    returns bytes received. Every tensor is received before anything is checked against the model, so a bad
    update leaves the model as it was and the sender is never left waiting."""
    from engine.weights import check_names

    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must have "
                         "one entry per tensor")
    kinds = [dtype_of(d) for d in dtypes]
    got: dict[str, torch.Tensor] = {}
    for name, dt, shape in zip(names, kinds, shapes):
        t = torch.empty(tuple(int(s) for s in shape), dtype=dt, device=device)
        _broadcast(pg, t)
        got[name] = t
    targets = check_names(model, {k: tuple(t.shape) for k, t in got.items()}, full=False)
    with torch.no_grad():
        for k, t in got.items():
            targets[k].copy_(t.to(targets[k].device, targets[k].dtype))
    return sum(t.numel() * t.element_size() for t in got.values())


class DistributedSender:
    """The trainer's rank 0 of a weight-update group with engines (EngineClient per engine)."""

    def __init__(self, clients: list, master_address: str, master_port: int, *, backend: str = "gloo",
                 group_name: str = DEFAULT_GROUP, timeout_s: float = 600.0, ranks: list[int] | None = None,
                 store=None):
        """ranks: each engine's ranks in the group (its tensor-parallel × pipeline size: SGLang's every rank
        receives the whole tensors; the built-in engine has one), 1 each by default. store: the group's TCP store,
        already listening at master_port (engine/train/rendezvous.listen_store), else started here."""
        self.clients, self.group_name = clients, group_name
        ranks = list(ranks) if ranks is not None else [1] * len(clients)
        if len(ranks) != len(clients) or min(ranks, default=1) < 1:
            raise ValueError(f"ranks {ranks}: one count ≥ 1 per engine ({len(clients)})")
        offsets = [1 + sum(ranks[:i]) for i in range(len(clients))]
        world = 1 + sum(ranks)
        answers: list[Any] = [None] * len(clients)

        def ask(i: int) -> None:
            try:
                answers[i] = clients[i].init_weights_update_group(
                    master_address, master_port, rank_offset=offsets[i], world_size=world, group_name=group_name,
                    backend=backend, timeout_s=timeout_s)
            except Exception as e:  # noqa: BLE001 — reported below, after the join gave up
                answers[i] = e

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(clients))]
        for t in threads:
            t.start()
        self.pg = join_group(master_address, master_port, 0, world, backend, timeout_s, store=store)
        for t in threads:
            t.join()
        bad = [f"{c.url}: {a}" for c, a in zip(clients, answers) if isinstance(a, Exception)]
        if bad:
            raise EngineError("engines did not join the weight-update group: " + "; ".join(bad))

    def push(self, named: dict[str, torch.Tensor], version: int | None = None, flush_cache: bool = True
             ) -> list[dict]:
        """Announce `named` to every engine and broadcast the tensors; returns the engines' answers. An engine
        that refuses (a name or shape it does not serve) still receives everything, then answers with the error."""
        names = list(named)
        body = {"names": names, "dtypes": [dtype_name(named[k].dtype) for k in names],
                "shapes": [list(named[k].shape) for k in names], "group_name": self.group_name,
                "flush_cache": flush_cache, "weight_version": None if version is None else str(version)}
        answers: list[Any] = [None] * len(self.clients)

        def post(i: int) -> None:
            try:
                answers[i] = self.clients[i].update_weights_from_distributed(body)
            except Exception as e:  # noqa: BLE001 — collected and raised below
                answers[i] = e

        threads = [threading.Thread(target=post, args=(i,), daemon=True) for i in range(len(self.clients))]
        for t in threads:
            t.start()
        for k in names:
            _broadcast(self.pg, named[k].detach().contiguous())
        for t in threads:
            t.join()
        bad = [f"{c.url}: {a}" for c, a in zip(self.clients, answers) if isinstance(a, Exception)]
        if bad:
            raise EngineError("weight update refused: " + "; ".join(bad))
        return answers

    def close(self) -> None:
        """Every engine leaves the group (one that is gone, e.g. restarted, is skipped)."""
        for c in self.clients:
            try:
                c.destroy_weights_update_group(self.group_name)
            except Exception:  # noqa: BLE001 — a dead or restarted engine has no group to leave
                pass
        self.pg = None
