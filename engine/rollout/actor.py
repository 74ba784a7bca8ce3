"""The built-in engine inside a Ray actor: an HTTP server thread on a port checked free on its node."""
from __future__ import annotations

import os


class BuiltinEngineActor:
    """Wrapped with `ray.remote` by the cluster module; one per rollout engine."""

    def __init__(self, model_path: str, *, host: str = "127.0.0.1", port: int | None = None,
                 threads: int | None = None, max_new_tokens: int = 128, device: str = "cpu"):
        from engine.rollout.ports import PortAllocator, is_port_free
        from engine.rollout.server import EngineState, ServerThread

        if port is None:
            port = PortAllocator(host, start=30000 + (os.getpid() % 1000) * 20).allocate()
        elif not is_port_free(port, host):
            raise OSError(f"[RF08] port {port} on {host} is already in use")
        self.state = EngineState(model_path, device=device, threads=threads, max_new_tokens=max_new_tokens)
        self.server = ServerThread(self.state, host, port)
        self.url = self.server.start()

    def get_url(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()

    def weight_version(self) -> int:
        return self.state.weight_version

    def stop(self) -> None:
        self.server.stop()
