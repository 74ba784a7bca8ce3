"""Ray: connect or start the cluster, start rollout engines and train workers, stop them.

Every worker gets `TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` in its runtime env by default (RF12: processes sharing
one inductor cache corrupt it and fail with JSONDecodeError).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

WORKER_ENV_DEFAULTS = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TOKENIZERS_PARALLELISM": "false"}


def worker_env() -> dict[str, str]:
    """Env for every Ray worker: the defaults, overridable by the caller's environment."""
    return {k: os.environ.get(k, v) for k, v in WORKER_ENV_DEFAULTS.items()}


def _threads_env(threads: int) -> dict[str, Any]:
    """OpenMP/MKL threads are fixed before torch is imported in the worker (set_num_threads later is not enough)."""
    t = str(max(1, threads))
    return {"env_vars": {**worker_env(), "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t}}


def connect(address: str | None, num_cpus: int | None = None) -> dict[str, Any]:
    """Join `address` or start a local cluster; returns the cluster's resources."""
    import ray

    if not ray.is_initialized():
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                                      runtime_env={"env_vars": worker_env()})
        if address:
            kwargs["address"] = address
        else:
            kwargs["num_cpus"] = num_cpus or os.cpu_count()
        ray.init(**kwargs)
    return dict(ray.cluster_resources())


def shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


@dataclass
class Engines:
    actors: list[Any]
    urls: list[str]
    pids: list[int] = field(default_factory=list)


def start_builtin_engines(model_path: str, n: int, *, threads: int, max_new_tokens: int,
                          timeout_s: float = 300.0) -> Engines:
    import ray

    from engine.rollout.actor import BuiltinEngineActor

    cls = ray.remote(num_cpus=0, max_restarts=0)(BuiltinEngineActor)
    actors = [cls.options(runtime_env=_threads_env(threads)).remote(model_path, threads=threads,
                                                                    max_new_tokens=max_new_tokens)
              for _ in range(n)]
    urls = ray.get([a.get_url.remote() for a in actors], timeout=timeout_s)
    pids = ray.get([a.pid.remote() for a in actors], timeout=timeout_s)
    return Engines(actors, urls, pids)


class TrainGroup:
    """The DP train workers; every call waits at most `timeout_s`."""

    def __init__(self, cfg, *, train_iters: int, timeout_s: float, threads: int):
        import ray

        from engine.rollout.ports import PortAllocator
        from engine.train.worker import TrainWorker

        self.timeout_s = timeout_s
        world = cfg.train_world_size
        # Megatron's rank order is tp-cp-ep-dp-pp: rank r belongs to DP replica (r // TP) mod DP.
        tp, dp = cfg.tensor_model_parallel_size, cfg.dp_size
        self.dp_rank_of = [(r // tp) % dp for r in range(world)]
        master = f"127.0.0.1:{PortAllocator(start=29500).allocate()}" if world > 1 else None
        gpus = 1 if cfg.train_backend == "megatron" else 0
        cls = ray.remote(num_cpus=0, num_gpus=gpus, max_restarts=0)(TrainWorker)
        cfg_dict = cfg.model_dump()
        self.workers = [cls.options(runtime_env=_threads_env(threads)).remote(
            cfg_dict, rank=r, world_size=world, master=master, train_iters=train_iters, threads=threads)
            for r in range(world)]
        ray.get([w.__ray_ready__.remote() for w in self.workers], timeout=timeout_s)

    def _all(self, method: str, *args, per_rank: list | None = None, **kwargs) -> list[Any]:
        import ray

        refs = [getattr(w, method).remote(*((per_rank[r],) if per_rank is not None else ()), *args, **kwargs)
                for r, w in enumerate(self.workers)]
        return ray.get(refs, timeout=self.timeout_s)

    def set_rollout(self, per_rank_steps: list[list[list[Any]]], rewards: list[float],
                    need_ref: bool) -> list[dict[str, float]]:
        """per_rank_steps: one entry per DP replica; every TP / PP rank of a replica gets the same micro-batches.
        Every rank also gets the rewards of the whole rollout (see engine.train.worker)."""
        return self._all("set_rollout", rewards, need_ref, per_rank=[per_rank_steps[d] for d in self.dp_rank_of])

    def train_step(self, k: int, global_batch_size: int) -> list[dict[str, Any]]:
        return self._all("train_step", k, global_batch_size)

    def save(self, path: str, save_optim: bool = True) -> list[str]:
        return [f for files in self._all("save", path, save_optim) for f in files]

    def load(self, path: str, load_optim: bool = True) -> None:
        self._all("load", path, load_optim)

    def load_weights(self, path: str, ref: bool = False) -> None:
        """Policy (ref=False) or reference weights from an HF dir or a checkpoint iteration, on every rank."""
        self._all("load_weights", path, ref)

    def save_weights(self, path: str) -> str:
        self._all("save_weights", path)
        return path

    def export_hf(self, path: str) -> None:
        self._all("export_hf", path)

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
