"""Ray: connect or start the cluster, the port registry, the train workers (engines: engine/rollout/engines.py).

Every worker gets `TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` in its runtime env by default (RF12: processes sharing
one inductor cache corrupt it and fail with JSONDecodeError).
"""
from __future__ import annotations

import os
from typing import Any, Callable

WORKER_ENV_DEFAULTS = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TOKENIZERS_PARALLELISM": "false"}


#: Fault injection (engine/faults.py) set in the driver's environment reaches the engines and workers too, also on a
#: Ray cluster started before the variables were set.
FORWARDED = ("ROLLFLOW_FAULT", "ROLLFLOW_ENGINE_FAULT", "ROLLFLOW_FAULT_STATE")


def worker_env() -> dict[str, str]:
    """Env for every Ray worker: the defaults, overridable by the caller's environment, plus FORWARDED when set."""
    return {**{k: os.environ.get(k, v) for k, v in WORKER_ENV_DEFAULTS.items()},
            **{k: os.environ[k] for k in FORWARDED if k in os.environ}}


def _threads_env(threads: int) -> dict[str, Any]:
    """OpenMP/MKL threads are fixed before torch is imported in the worker (set_num_threads later is not enough)."""
    t = str(max(1, threads))
    return {"env_vars": {**worker_env(), "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t}}


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds (RF02, ConfigError) when `--ray-address host:port` (or ray://host:port) does not accept a TCP
    connection: ray.init would otherwise wait for minutes. `auto` / `local` are left to Ray."""
    import socket

    from engine.diagnosis import ConfigError, Diagnosis

    if address in ("auto", "local") or ":" not in address:
        return
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {e}" if not isinstance(e, TimeoutError) else f"no answer within {timeout_s:g} s"
    raise ConfigError(Diagnosis(code="RF02", severity="error",
                                what=f"--ray-address {address} cannot be reached ({why})",
                                fix="start the cluster (`ray start --head` on that node), check the address and port "
                                    "(the head's GCS port, 6379 by default) and the firewall, or leave "
                                    "--ray-address unset for a local cluster",
                                facts={"field": "ray_address", "value": address}))


def connect(address: str | None, num_cpus: int | None = None) -> dict[str, Any]:
    """Join `address` or start a local cluster; returns the cluster's resources."""
    import ray

    if address and not ray.is_initialized():
        check_reachable(address)
    if not ray.is_initialized():
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                                      runtime_env={"env_vars": worker_env()})
        if address:
            kwargs["address"] = address
        else:
            kwargs["num_cpus"] = num_cpus or os.cpu_count()
        _keeping_sigterm(lambda: ray.init(**kwargs))
    return dict(ray.cluster_resources())


def _keeping_sigterm(fn):
    """Run fn (ray.init) and put back the SIGTERM handler it replaces: a Ray driver's handler exits the process
    at once (sys.exit), which would skip the flow's clean-up; the handler before it (Prefect's, inside a flow run)
    unwinds the run instead."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return fn()
    before = signal.getsignal(signal.SIGTERM)
    try:
        return fn()
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def connected() -> bool:
    import ray

    return ray.is_initialized()


def shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def port_registry():
    """The cluster's one port registry (RF08): a detached named actor shared by every run on this Ray cluster."""
    import ray

    from engine.rollout.ports import PortRegistry

    return ray.remote(num_cpus=0)(PortRegistry).options(name="rollflow-ports", namespace="rollflow",
                                                         lifetime="detached", get_if_exists=True).remote()


def reserve_fn(registry):
    """`reserve(node, k)` of the registry actor, for engine.rollout.ports.allocate_ports."""
    import ray

    return lambda node, k: ray.get(registry.reserve.remote(node, k))


class TrainGroup:
    """The DP train workers; every call waits at most `timeout_s`."""

    def __init__(self, cfg, *, train_iters: int, timeout_s: float, threads: int, placement=None, registry=None,
                 wait: bool = True):
        """Start the workers; with wait=False return at once and call `wait_ready` later (the caller starts
        other actors meanwhile)."""
        import ray

        from engine.rollout.ports import allocate_ports
        from engine.train.worker import TrainWorker

        self.timeout_s = timeout_s
        world = cfg.train_world_size
        # Megatron's rank order is tp-cp-ep-dp-pp: rank r belongs to DP replica (r // TP) mod DP.
        tp, dp = cfg.tensor_model_parallel_size, cfg.dp_size
        self.dp_rank_of = [(r // tp) % dp for r in range(world)]
        # Megatron shards the model over ranks, the torch backend over DP ranks (FSDP2): gathering the weights is
        # then a collective every rank joins
        self.collective = cfg.train_backend == "megatron" or world > 1
        master = None
        if world > 1:  # gloo's rendezvous port comes from the cluster's one allocator too (RF08)
            node = ray.util.get_node_ip_address()
            master = f"127.0.0.1:{allocate_ports(reserve_fn(registry or port_registry()), node, 1)[0]}"
        gpus = 1 if cfg.train_backend == "megatron" else 0
        cls = ray.remote(num_cpus=0, num_gpus=gpus, max_restarts=0)(TrainWorker)
        cfg_dict = cfg.model_dump()
        lay = placement.layout if placement is not None else None

        def where(r: int) -> dict:  # a GPU layout puts rank r on bundle r (colocated: 0.8 of it, see placement.py)
            if lay is None or not lay.train_bundles:
                return {}
            return {"num_gpus": lay.train_gpu_fraction, "scheduling_strategy": placement.strategy(lay.train_bundles[r])}

        self.workers = [cls.options(runtime_env=_threads_env(threads), **where(r)).remote(
            cfg_dict, rank=r, world_size=world, master=master, train_iters=train_iters, threads=threads)
            for r in range(world)]
        self._ready = [w.__ray_ready__.remote() for w in self.workers]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "TrainGroup":
        """Wait (at most timeout_s) until every worker has built its backend and loaded the model."""
        import ray

        ray.get(self._ready, timeout=self.timeout_s)
        return self

    def _all(self, method: Callable[[Any], Any], *args, per_rank: list | None = None, **kwargs) -> list[Any]:
        """method(worker), e.g. `lambda w: w.train_step`, called on every worker (rank r first gets per_rank[r])."""
        import ray

        refs = [method(w).remote(*((per_rank[r],) if per_rank is not None else ()), *args, **kwargs)
                for r, w in enumerate(self.workers)]
        return ray.get(refs, timeout=self.timeout_s)

    def set_rollout(self, per_rank_steps: list[list[list[Any]]], rewards: list[float],
                    need_ref: bool) -> list[dict[str, float]]:
        """per_rank_steps: one entry per DP replica; every TP / PP rank of a replica gets the same micro-batches.
        Every rank also gets the rewards of the whole rollout (see engine.train.worker)."""
        return self._all(lambda w: w.set_rollout, rewards, need_ref,
                         per_rank=[per_rank_steps[d] for d in self.dp_rank_of])

    def train_step(self, k: int, global_batch_size: int) -> list[dict[str, Any]]:
        return self._all(lambda w: w.train_step, k, global_batch_size)

    def save(self, path: str, save_optim: bool = True) -> list[str]:
        return [f for files in self._all(lambda w: w.save, path, save_optim) for f in files]

    def load(self, path: str, load_optim: bool = True) -> None:
        self._all(lambda w: w.load, path, load_optim)

    def load_weights(self, path: str, ref: bool = False) -> None:
        """Policy (ref=False) or reference weights from an HF dir or a checkpoint iteration, on every rank."""
        self._all(lambda w: w.load_weights, path, ref)

    def save_weights(self, path: str) -> str:
        self._all(lambda w: w.save_weights, path)
        return path

    def weights_ref(self) -> tuple[Any, float]:
        """(a reference to rank 0's weights in Ray's object store, their MB); the driver never holds the weights."""
        import ray

        joined = self.workers if self.collective else self.workers[:1]
        calls = [w.numpy_state.options(num_returns=2).remote() for w in joined]
        mbs = ray.get([mb for _, mb in calls], timeout=self.timeout_s)
        return calls[0][0], mbs[0]

    def ipc_export(self, dtype: str, bucket_bytes: int, exporters: set[int]) -> list[list]:
        """Per rank, the CUDA IPC buckets of its weights in `dtype` (empty for ranks not in `exporters`); the
        workers keep the memory until `ipc_release`."""
        return self._all(lambda w: w.ipc_export, dtype, bucket_bytes,
                         per_rank=[r in exporters for r in range(len(self.workers))])

    def ipc_release(self) -> None:
        self._all(lambda w: w.ipc_release)

    def score(self, mb) -> Any:
        """Log-probs [T] of one micro-batch under the policy (from a rank whose answer counts)."""
        return next(lp for lp, counts in self._all(lambda w: w.score, mb) if counts)

    def offload(self) -> None:
        self._all(lambda w: w.offload)

    def memory(self) -> list[dict[str, float]]:
        """Each worker's CUDA memory since the last call ({} on CPU): see engine.train.worker.gpu_memory."""
        return self._all(lambda w: w.memory)

    def export_hf(self, path: str) -> None:
        self._all(lambda w: w.export_hf, path)

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
