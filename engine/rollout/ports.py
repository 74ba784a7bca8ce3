"""One port allocator for every server, router and NCCL port on a host (RF08): never guessed, checked free."""
from __future__ import annotations

import socket
import threading


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out distinct free ports from [start, end) on one host; a port is never handed out twice."""

    def __init__(self, host: str = "127.0.0.1", start: int = 30000, end: int = 60000):
        self.host, self.next, self.end = host, start, end
        self.taken: set[int] = set()
        self._lock = threading.Lock()

    def allocate(self) -> int:
        with self._lock:
            while self.next < self.end:
                port, self.next = self.next, self.next + 1
                if port not in self.taken and is_port_free(port, self.host):
                    self.taken.add(port)
                    return port
        raise RuntimeError(f"no free port in [{self.next}, {self.end}) on {self.host}")


def port_holder(port: int) -> str | None:
    """'pid 123 (python …)' of the process listening on `port`, when the OS lets us see it."""
    try:
        import psutil

        for c in psutil.net_connections(kind="inet"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                p = psutil.Process(c.pid)
                return f"pid {c.pid} ({' '.join(p.cmdline()[:4])[:120]})"
    except Exception:  # no permission or no psutil: the port number alone is still reported
        return None
    return None
