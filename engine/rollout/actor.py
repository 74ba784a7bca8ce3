"""One rollout engine inside a Ray actor on its placement-group bundle.

The actor asks the run's port registry for its ports (checked free on its own node), then either serves the
built-in engine from a thread of its own process, or launches `python -m sglang.launch_server` as a child process
(engine/rollout/sglang.py) on GPUs base_gpu_id.. of its node. Either way it answers with the engine's URL.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass
class EngineSpec:
    kind: Literal["builtin", "sglang"]
    model_path: str
    log_dir: str
    tp_size: int = 1
    threads: int | None = None
    max_new_tokens: int = 128
    deterministic: bool = False  # --sglang-enable-deterministic-inference (both engine kinds honour it)
    sglang_args: dict[str, Any] = field(default_factory=dict)
    python: str | None = None  # interpreter that runs `-m sglang.launch_server`
    colocate: bool = False
    start_timeout_s: float = 600.0
    dtype: str = "float32"  # the built-in engine's weights and compute (--rollout-dtype, resolved for its device)
    max_batch: int = 256  # the built-in engine's most rows per batch (--sglang-max-running-requests)
    api_key: str | None = None  # the run's engine token: every client of these engines sends it (SGLang's --api-key)
    weight_dirs: list[str] = field(default_factory=list)  # where /update_weights_from_disk may load from
    cuda_graphs: bool = True  # the built-in engine decodes through CUDA graphs on a GPU (--sglang-disable-cuda-graph)
    compile_decode: bool = False  # ... with its decode step compiled (--sglang-enable-torch-compile)
    max_total_tokens: int | None = None  # the KV-cache tokens of one batch (--sglang-max-total-tokens)
    model_impl: str = "auto"  # the built-in engine's model code (--model-impl)
    return_routed_experts: bool = False  # SGLang's --enable-return-routed-experts (--use-rollout-routing-replay)


class EngineActor:
    """Wrapped with `ray.remote` by engine/rollout/engines.py; `start` is called once, then `stop`."""

    def __init__(self, spec: EngineSpec, index: int, registry: Any):
        self.spec, self.index, self.registry = spec, index, registry
        self.server: Any = None  # ServerThread (builtin) or LaunchedEngine (sglang)
        self.state: Any = None  # the built-in engine's EngineState
        self.info: dict[str, Any] = {}

    def _ports(self, node: str, k: int) -> list[int]:
        from engine.rollout.ports import allocate_ports

        return allocate_ports(self.registry.reserve, node, k)

    def start(self) -> dict[str, Any]:
        """Start the engine (its server and model, or SGLang's process). The end of this actor's start-up: the
        collector, off since the process started (engine/startgc.py), comes back on, also on a failure."""
        from engine import startgc

        try:
            return self._start()
        finally:
            startgc.ready()

    def _start(self) -> dict[str, Any]:
        import ray

        from dataclasses import replace

        from engine.cluster.nodes import local_model, require_model

        node = ray.util.get_node_ip_address()
        self.spec = replace(self.spec, model_path=local_model(self.spec.model_path))  # s3://: this node's copy
        require_model(self.spec.model_path, who=f"rollout engine {self.index}")
        gpu_ids = [int(float(g)) for g in ray.get_gpu_ids()]
        base_gpu = gpu_ids[0] if gpu_ids else 0
        log = str(Path(self.spec.log_dir) / f"engine-{self.index}.log")
        if self.spec.kind == "builtin":  # the one place the engine kind is looked at
            url, ports, child = self._start_builtin(node, gpu_ids)
            log = None  # in this actor's Ray log
        else:
            url, ports, child = self._start_sglang(node, base_gpu, log)
        self.info = {"url": url, "node": node, "node_id": ray.get_runtime_context().get_node_id(),
                     "pid": os.getpid(), "child_pid": child, "gpu_ids": gpu_ids,
                     "model_impl": self.state.model_impl if self.state is not None else None,
                     "base_gpu_id": base_gpu, "ports": ports, "log": log}
        return self.info

    def _start_builtin(self, node: str, gpu_ids: list[int]) -> tuple[str, list[int], None]:
        import torch

        from engine.diagnosis import DiagnosisError
        from engine.rollout.server import EngineState, ServerThread

        device = f"cuda:{gpu_ids[0]}" if gpu_ids and torch.cuda.is_available() else "cpu"
        if device != "cpu":
            torch.cuda.set_device(device)
        state = EngineState(self.spec.model_path, device=device, dtype=self.spec.dtype, threads=self.spec.threads,
                            max_new_tokens=self.spec.max_new_tokens, deterministic=self.spec.deterministic,
                            max_batch=self.spec.max_batch, api_key=self.spec.api_key,
                            weight_dirs=self.spec.weight_dirs, cuda_graphs=self.spec.cuda_graphs,
                            compile_decode=self.spec.compile_decode, max_total_tokens=self.spec.max_total_tokens,
                            model_impl=self.spec.model_impl,
                            return_routed_experts=self.spec.return_routed_experts)
        self.state = state
        for attempt in range(3):  # a port checked free can be taken before the bind (another cluster on the node)
            (port,) = self._ports(node, 1)
            self.server = ServerThread(state, node, port)
            try:
                return self.server.start(timeout_s=self.spec.start_timeout_s), [port], None
            except DiagnosisError as e:
                if attempt == 2 or e.codes != ["RF08"]:
                    raise

    def _start_sglang(self, node: str, base_gpu: int, log: str) -> tuple[str, list[int], int]:
        import sys

        from engine.diagnosis import DiagnosisError
        from engine.rollout.sglang import LaunchedEngine, mem_fraction_of, sglang_command

        for attempt in range(3):  # as for the built-in engine: a port checked free can be taken before SGLang binds
            port, nccl_port, dist_port = self._ports(node, 3)
            cmd = sglang_command(python=self.spec.python or sys.executable, model_path=self.spec.model_path,
                                 host=node, port=port, tp_size=self.spec.tp_size, base_gpu_id=base_gpu,
                                 nccl_port=nccl_port, dist_init_addr=f"{node}:{dist_port}",
                                 sglang_args=self.spec.sglang_args, colocate=self.spec.colocate,
                                 api_key=self.spec.api_key)
            self.server = LaunchedEngine(cmd, url=f"http://{node}:{port}", log_path=log,
                                         ports=[port, nccl_port, dist_port],
                                         mem_fraction_static=mem_fraction_of(self.spec.sglang_args))
            try:
                url = self.server.start(self.spec.start_timeout_s)
                return url, [port, nccl_port, dist_port], self.server.proc.pid
            except DiagnosisError:
                if attempt == 2 or not self.server.lost_port_race():
                    raise
                self.server.stop()

    def update_weights(self, named: dict, version: str) -> str:
        """In-cluster weight sync: `named` arrives from Ray's object store (the caller passes a reference).
        Returns the weight_version the engine serves now (what its /get_model_info answers: no HTTP round trip)."""
        if self.state is None:
            raise RuntimeError("weights by object store reach only the built-in engine; SGLang loads them from disk")
        self.state.update_from_named(named, version)
        return str(self.state.weight_version)

    def update_weights_ipc(self, buckets: list, version: str) -> str:
        """Colocated weight sync: CUDA IPC buckets from the train rank on this engine's GPU; returns the served
        weight_version."""
        if self.state is None:
            raise RuntimeError("CUDA IPC weights reach only the built-in engine; SGLang loads them from disk")
        self.state.update_from_ipc(buckets, version)
        return str(self.state.weight_version)

    @staticmethod
    def sees(file: str, token: str) -> bool:
        """Whether this engine's node sees the driver's probe file (engine/cluster/nodes.py)."""
        from engine.cluster.nodes import sees

        return sees(file, token)

    def memory(self) -> dict[str, float]:
        """This engine's CUDA memory since the last call ({} on CPU): engine.gpu.gpu_memory."""
        return self.state.memory() if self.state is not None else {}

    # self.server is a ServerThread (built-in) or a LaunchedEngine (SGLang): the same five methods, chosen in start()
    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def diagnose(self) -> list[dict]:
        return [d.model_dump() for d in self.server.diagnose()] if self.server is not None else []

    def log_tail(self, lines: int = 30) -> str:
        return self.server.log_tail(lines) if self.server is not None else ""

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def kill_process_group(pgid: int) -> bool:
    """Kill a launched server's process group (it runs in its own session, so it outlives a SIGKILLed actor)."""
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
