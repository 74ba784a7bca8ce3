"""Concurrency limits an rl-train flow run holds for its whole life (Prefect global concurrency limits).

- `rollflow-save-<dir>-<hash>`, 1 slot: one writer per `--save` directory. Two runs on one directory would
  interleave iter_%07d/ saves and markers and log into the same MLflow run. Taken before anything reads --save
  (the MLflow resume reads its manifest). A second run waits up to SAVE_WAIT_S, then fails naming the holder
  (SaveInUse: retryable, so --flow-retries tries again later).
- `rollflow-gpus`, slots = the GPUs the run occupies (RF02's arithmetic: colocated T = nodes × GPUs per node,
  decoupled T + R rollout GPUs; 0 on a cluster without GPUs: not taken). Created on first use with the cluster's
  GPU count. A run that needs more slots than the limit has fails at once (RF02, not retried: it would wait
  forever); otherwise it waits, like a queue, until other runs release enough GPUs.

Slots are held through a lease of LEASE_S seconds that a thread renews every 0.75·LEASE_S. When a holder dies
its lease stops being renewed and the server frees the slots after at most LEASE_S + 15 s (the repossessor's
loop): SAVE_WAIT_S = 60 + 15 + 15 s covers that. A restart on the same machine does not wait: the save slot's
holder (flow run, machine, pid, lease) is kept in a Prefect variable of the limit's name, and a run that finds
the slot held by a finished flow run or a dead process of its own machine releases that lease at once.

Ephemeral API (no PREFECT_API_URL): not taken, with a log line. The ephemeral server keeps leases in the
memory of the process that started it, so a killed run's slot would never be freed and its restart would wait.

Invariants (tests/test_limits.py):
- the save limit's name depends on the normalized --save only: one directory, however spelled → one name;
- a run holds its slots until the flow body returns or raises, then releases them and its holder record;
- a run never waits on GPU slots the limit can never give, and never takes over a live holder's slot;
- a secret in --save (a URL's password, a signed query) reaches no limit name, holder record or message.
"""
from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import re
import socket
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator
from uuid import UUID

import httpx

from engine.config import RunConfig
from engine.doctor.diagnosis import Diagnosis, DiagnosisError
from engine.tracking.secrets import redact_text

GPU_LIMIT = "rollflow-gpus"
LEASE_S = 60.0  # the server's minimum lease
SAVE_WAIT_S = 90.0  # LEASE_S + 15 s repossessor loop + 15 s margin
log = logging.getLogger("rollflow.limits")


class SaveInUse(DiagnosisError):
    """Another flow run writes this --save. Retryable: a flow retry (--flow-retries) may find it free."""

    retryable = True


# ---- pure -------------------------------------------------------------------------------------------------------
def normalize_save(save: str) -> str:
    """One spelling per directory: URLs without a trailing slash, local paths absolute and resolved."""
    if "://" in save:
        return save.rstrip("/")
    return str(Path(save).expanduser().resolve())


def save_limit_name(save: str) -> str:
    """`rollflow-save-<last path part>-<sha256[:12] of the normalized URI>` (letters, digits, dashes only; the
    readable part comes from the redacted URI, so a signed URL's query never reaches the name)."""
    uri = normalize_save(save)
    last = redact_text(uri).split("?", 1)[0].rsplit("/", 1)[-1]
    slug = re.sub(r"[^a-z0-9]+", "-", last.lower()).strip("-")[:32] or "root"
    return f"rollflow-save-{slug}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"


def gpus_occupied(cfg: RunConfig, cluster_gpus: float) -> int:
    """GPUs the run takes from its cluster: 0 without GPUs; colocated T; decoupled T + R (doctor's RF02 check).

    e.g. 2 nodes × 4 GPUs colocated → 8; decoupled with --rollout-num-gpus 4 → 8 + 4 = 12."""
    if cluster_gpus <= 0:
        return 0
    train = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    if cfg.colocate:
        return train
    rollout = cfg.rollout_num_gpus if cfg.rollout_num_gpus is not None else \
        cfg.rollout_num_engines * cfg.rollout_num_gpus_per_engine
    return train + rollout


def holder_gone(holder: dict[str, Any], *, flow_run_final: bool, machine: str,
                process_alive: Callable[[int, float], bool]) -> bool:
    """Whether a recorded save-slot holder can no longer be writing: its flow run ended, or it ran on this machine
    and its process (pid + start time, so a reused pid does not count) is gone. Elsewhere: wait for its lease."""
    if flow_run_final:
        return True
    if holder.get("machine") != machine or holder.get("pid") is None or holder.get("started") is None:
        return False
    return not process_alive(int(holder["pid"]), float(holder["started"]))


# ---- this process -----------------------------------------------------------------------------------------------
def machine_id() -> str:
    """Host name + boot id + pid namespace: two containers or hosts never share one (pids are compared only then)."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    return ":".join(parts)


def process_alive(pid: int, started: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False


def _logger():
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return log


# ---- Prefect ----------------------------------------------------------------------------------------------------
def api_is_ephemeral() -> bool:
    from prefect.settings import get_current_settings

    return not get_current_settings().api.url


@contextmanager
def held(cfg: RunConfig, *, cluster_gpus: float | None = None) -> Iterator[None]:
    """Hold the run's save slot and GPU slots around the flow body (see the module docstring)."""
    logger = _logger()
    if api_is_ephemeral():
        logger.info("concurrency limits not taken: the ephemeral Prefect API would never free a killed run's "
                    "slots; set PREFECT_API_URL to a `prefect server` for the --save and GPU limits")
        yield
        return
    if cluster_gpus is None:
        from engine.doctor.checks import Environment

        cluster_gpus = Environment.for_config(cfg).gpus
    need = gpus_occupied(cfg, cluster_gpus)
    with ExitStack() as stack:
        if cfg.save:
            stack.enter_context(save_slot(cfg.save))
        if need:
            stack.enter_context(gpu_slots(need, cluster_gpus))
        else:
            logger.info("%s not taken: the run uses no GPUs", GPU_LIMIT)
        yield


@contextmanager
def save_slot(save: str, *, wait_s: float = SAVE_WAIT_S) -> Iterator[str]:
    """The one slot of `save`'s limit, for the duration of the block; yields the limit's name."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.variables import Variable

    name = save_limit_name(save)
    logger = _logger()
    with get_client(sync_client=True) as client:
        _ensure_limit(client, name, 1)
        lease = _acquire(client, name, 1, timeout_s=0)
        if lease is None:
            holder = Variable.get(name)
            final = _run_final(client, holder.get("flow_run_id")) if holder else False
            if holder and holder_gone(holder, flow_run_final=final, machine=machine_id(),
                                      process_alive=process_alive):
                logger.warning("%s: releasing the slot of flow run %s (pid %s), which is no longer running",
                               name, holder.get("flow_run_id"), holder.get("pid"))
                client.release_concurrency_slots_with_lease(UUID(holder["lease_id"]))
            else:
                logger.info("%s: --save %s is in use; waiting up to %.0f s", name, redact_text(save), wait_s)
            lease = _acquire(client, name, 1, timeout_s=wait_s)
            if lease is None:
                raise SaveInUse(_save_busy(save, name, Variable.get(name) or holder, wait_s))
    pid, started = _this_process()
    with _renewed(lease, name):  # written and removed while the slot is held: the record is always ours
        Variable.set(name, {"flow_run_id": str(flow_run.id), "flow_run_name": flow_run.name, "machine": machine_id(),
                            "pid": pid, "started": started, "save": redact_text(normalize_save(save)),
                            "lease_id": str(lease)},
                     overwrite=True)
        try:
            yield name
        finally:
            Variable.unset(name)


@contextmanager
def gpu_slots(need: int, cluster_gpus: float) -> Iterator[None]:
    """`need` slots of rollflow-gpus (created with the cluster's GPU count), waiting for them as long as it takes."""
    from prefect.client.orchestration import get_client

    logger = _logger()
    with get_client(sync_client=True) as client:
        limit = _ensure_limit(client, GPU_LIMIT, int(cluster_gpus))
        if need > limit.limit:
            raise DiagnosisError(Diagnosis(
                code="RF02", severity="error",
                what=f"the run occupies {need} GPUs but the Prefect limit {GPU_LIMIT} has {limit.limit} slots: "
                     "it would wait forever",
                fix=f"prefect gcl update {GPU_LIMIT} --limit N (N = the GPUs the work pool's runs share), or a "
                    "smaller topology", facts={"need": need, "limit": limit.limit}))
        lease = _acquire(client, GPU_LIMIT, need, timeout_s=0)
        if lease is None:
            logger.warning("waiting for %d of the %d slots of %s (%d in use by other runs)", need, limit.limit,
                           GPU_LIMIT, client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots)
            lease = _acquire(client, GPU_LIMIT, need, timeout_s=None)
    with _renewed(lease, GPU_LIMIT):
        yield


def _this_process() -> tuple[int, float]:
    import psutil

    return os.getpid(), psutil.Process().create_time()


def _ensure_limit(client, name: str, slots: int):
    """The limit `name`, created with `slots` when missing (another run may create it at the same moment)."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        return client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
        except ObjectAlreadyExists:
            pass
        return client.read_global_concurrency_limit_by_name(name)


def _acquire(client, name: str, slots: int, *, timeout_s: float | None) -> UUID | None:
    """A lease on `slots` of `name`, polling while the server answers 423 (full); None after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            r = client.increment_concurrency_slots_with_lease(names=[name], slots=slots, mode="concurrency",
                                                              lease_duration=LEASE_S)
            body = r.json()
            if not body["limits"]:  # the limit was disabled (`prefect gcl disable`): nothing is enforced
                _logger().warning("%s is inactive: not enforced for this run", name)
            return UUID(body["lease_id"])
        except httpx.HTTPStatusError as e:
            if e.response.status_code != 423:
                raise
            retry_after = float(e.response.headers.get("Retry-After", 1.0))
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        time.sleep(retry_after if left is None else min(retry_after, left))


@contextmanager
def _renewed(lease: UUID, name: str) -> Iterator[None]:
    """Renew the lease every 0.75·LEASE_S from a thread while the block runs; release it afterwards."""
    from prefect.client.orchestration import get_client

    stop = threading.Event()
    logger = _logger()

    def renew() -> None:
        with get_client(sync_client=True) as client:
            while not stop.wait(0.75 * LEASE_S):
                try:
                    client.renew_concurrency_lease(lease, LEASE_S)
                except Exception as e:  # noqa: BLE001 — the run goes on; the next renewal may succeed
                    logger.warning("renewing the lease on %s failed (%s): another run may take the slot", name, e)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(renew,), daemon=True,
                              name=f"lease-{name}")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
        with get_client(sync_client=True) as client:
            client.release_concurrency_slots_with_lease(lease)


def _run_final(client, flow_run_id: str | None) -> bool:
    from prefect.exceptions import ObjectNotFound

    if not flow_run_id or flow_run_id == "None":  # held outside a flow run: only the process tells
        return False
    try:
        state = client.read_flow_run(UUID(flow_run_id)).state
    except ObjectNotFound:
        return True
    return state is not None and state.is_final()


def _save_busy(save: str, name: str, holder: dict[str, Any] | None, wait_s: float) -> Diagnosis:
    who = "another flow run"
    if holder:
        where = f"pid {holder.get('pid')} on {str(holder.get('machine')).split(':')[0]}"
        run = holder.get("flow_run_id")
        who = f"flow run {holder.get('flow_run_name')} ({run}, {where})" if run not in (None, "None") else where
    return Diagnosis(code="CONCURRENCY", severity="error",
                     what=f"--save {redact_text(save)} is being written by {who}; waited {wait_s:.0f} s for the limit "
                          f"{name}",
                     fix="wait for that run to finish, or use another --save; if no run is writing there, free the "
                         f"slot: prefect gcl update {name} --active-slots 0",
                     facts={"limit": name, "save": redact_text(normalize_save(save)), "holder": holder})
