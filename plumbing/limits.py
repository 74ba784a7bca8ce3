"""What an rl-train flow run holds for its whole life: --save's writer lock and its GPUs' concurrency slots.

- --save's writer lock (engine/checkpoint/writer.py): a lock file in the save location itself, so it holds with or
  without a Prefect server. Taken before anything reads --save (the MLflow resume reads its manifest); a second run
  fails at once naming the holder (SaveInUse: retryable, so --flow-retries tries again later), or waits
  --wait-for-save-lock seconds first.
- `rollflow-gpus`, a Prefect global concurrency limit with slots = the GPUs the run occupies (RF02's arithmetic:
  colocated T = nodes × GPUs per node, decoupled T + R rollout GPUs; 0 on a cluster without GPUs: not taken).
  Created on first use with the cluster's GPU count. A run that needs more slots than the limit has fails at once
  (RF02, not retried: it would wait forever); otherwise it waits, like a queue, until other runs release enough
  GPUs. Slots are held through a lease of LEASE_S seconds that a thread renews every 0.75·LEASE_S; a dead holder's
  slots are freed by the server after at most LEASE_S + 15 s. The ephemeral API (no PREFECT_API_URL) keeps leases
  in the memory of the process that started it, so the GPU limit is not taken there (with a log line).

Invariants (tests/test_limits.py, tests/test_writer_lock.py):
- a run holds its lock and slots until the flow body returns or raises, then releases them;
- a run never waits on GPU slots the limit can never give, and never takes over a live holder's lock;
- a secret in --save (a URL's password, a signed query) reaches no lock record, limit name or message.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from contextlib import ExitStack, contextmanager
from typing import Iterator
from uuid import UUID

import httpx

from engine.checkpoint.writer import writer_lock
from engine.config import RunConfig
from engine.diagnosis import Diagnosis, DiagnosisError

GPU_LIMIT = "rollflow-gpus"
LEASE_S = 60.0  # the server's minimum lease
log = logging.getLogger("rollflow.limits")


# ---- pure -------------------------------------------------------------------------------------------------------
def gpus_occupied(cfg: RunConfig, cluster_gpus: float) -> int:
    """GPUs the run takes from its cluster: 0 without GPUs; colocated T; decoupled T + R (doctor's RF02 check).

    e.g. 2 nodes × 4 GPUs colocated → 8; decoupled with --rollout-num-gpus 4 → 8 + 4 = 12."""
    if cluster_gpus <= 0:
        return 0
    train = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    if cfg.colocate:
        return train
    if cfg.external_engines:  # servers on GPUs the cluster does not lend
        return train
    rollout = cfg.rollout_num_gpus if cfg.rollout_num_gpus is not None else \
        cfg.rollout_num_engines * cfg.rollout_num_gpus_per_engine
    return train + rollout


def _logger():
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return log


# ---- Prefect ----------------------------------------------------------------------------------------------------
def api_is_ephemeral() -> bool:
    """No API server of the user's: Prefect's ephemeral one, or the one `rollflow train` launched as such."""
    from prefect.settings import get_current_settings

    from plumbing.prestart import own_api_url

    url = get_current_settings().api.url
    return not url or url == own_api_url()


@contextmanager
def held(cfg: RunConfig, *, cluster_gpus: float | None = None) -> Iterator[None]:
    """Hold --save's writer lock and the run's GPU slots around the flow body (see the module docstring)."""
    from prefect.runtime import flow_run

    logger = _logger()
    with ExitStack() as stack:
        run = f"{cfg.experiment_name}/{cfg.run_name}" if cfg.run_name else cfg.experiment_name
        stack.enter_context(writer_lock(cfg.save, wait_s=cfg.wait_for_save_lock, run=run,
                                        flow_run_id=str(flow_run.id) if flow_run.id else None))
        if api_is_ephemeral():
            logger.info("%s not taken: the ephemeral Prefect API would never free a killed run's slots; set "
                        "PREFECT_API_URL to a `prefect server` for it", GPU_LIMIT)
            yield
            return
        if cluster_gpus is None:
            from engine.doctor.checks import Environment

            cluster_gpus = Environment.for_config(cfg).gpus
        need = gpus_occupied(cfg, cluster_gpus)
        if need:
            stack.enter_context(gpu_slots(need, cluster_gpus))
        else:
            logger.info("%s not taken: the run uses no GPUs", GPU_LIMIT)
        yield


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
