"""One port allocator for every server, router and NCCL port of a run (RF08): never guessed, checked free.

`PortRegistry` remembers every port it handed out, per node, in a key-value store with put-if-absent: on a Ray
cluster, the cluster's own store (Ray's GCS key-value store, `GcsKV`), shared by every run on the cluster and by
every process of a run, so two engines on one host can never be given the same port. No process of its own: it
was a detached actor, whose worker process took ~1.4 s of CPU from a CPU run's start-up for a few calls (issue
18). It hands ports out in order (on a cluster, from a random port of the range: two clusters on one host seldom
start on the same ports) and wraps around only after the whole range was handed out; the caller checks
each port free *on its own node* before use (`allocate_ports`), so a port some other process holds is skipped.

When a port is taken anyway (a race with another program, or a port the user chose), `port_in_use` names the
process that holds it, read from /proc (Linux; the owner is found for processes of the same user).
"""
from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path
from typing import Callable

from engine.diagnosis import Diagnosis

PORT_RANGE = (30000, 60000)


def free_loopback_port() -> int:
    """A port free on 127.0.0.1 now, picked by the OS: for the servers a test or a benchmark starts on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port() -> int:
    """A port free on every address of this node now, picked by the OS: for a process group this process hosts
    (its TCP store listens on all addresses)."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def is_port_free(port: int, host: str = "0.0.0.0", *, reuse: bool = False) -> bool:
    """True when `port` can be bound on `host` (0.0.0.0 — the strictest check — by default). reuse: bound as a
    server that sets SO_REUSEADDR binds it (uvicorn does), so connections of a stopped server that linger in
    TIME_WAIT do not count; only a socket listening there does. Without it (the allocator) such a port is avoided."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class LocalKV:
    """A key-value store with put-if-absent in this process (a registry that is not the cluster's: tests)."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self._lock = threading.Lock()

    def put_new(self, key: str, value: str = "") -> bool:
        """Store `value` under `key` unless the key exists; True when it was stored."""
        with self._lock:
            if key in self.data:
                return False
            self.data[key] = value
            return True

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def put(self, key: str, value: str) -> None:
        self.data[key] = value

    def delete_prefix(self, prefix: str) -> None:
        with self._lock:
            for key in [k for k in self.data if k.startswith(prefix)]:
                del self.data[key]

    def keys(self, prefix: str) -> list[str]:
        return [k for k in list(self.data) if k.startswith(prefix)]


class GcsKV:
    """The connected Ray cluster's key-value store (its GCS), in namespace `rollflow-ports`: atomic put-if-absent,
    reachable from the driver and every worker of every run on the cluster. Needs `ray.init` in this process."""

    namespace = "rollflow-ports"

    def put_new(self, key: str, value: str = "") -> bool:
        from ray.experimental.internal_kv import _internal_kv_put

        return not _internal_kv_put(key, value, overwrite=False, namespace=self.namespace)  # True: it existed

    def get(self, key: str) -> str | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(key, namespace=self.namespace)
        return None if value is None else value.decode()

    def put(self, key: str, value: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, value, overwrite=True, namespace=self.namespace)

    def delete_prefix(self, prefix: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(prefix, del_by_prefix=True, namespace=self.namespace)

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental.internal_kv import _internal_kv_list

        return [k.decode() for k in _internal_kv_list(prefix, namespace=self.namespace)]


class PortRegistry:
    """Hands out distinct ports per node from [start, end); a port is never handed out twice until the whole range
    was. `kv`: where the handed-out ports are kept — None: the connected Ray cluster's store (`GcsKV`, looked up at
    each call, so the registry is a plain value a Ray call can carry); a `LocalKV`: this process only.

    Each port is a key claimed with put-if-absent, so two processes reserving at once (two runs on one cluster,
    two engines starting) never get the same port; a per-node cursor (a hint, not a lock) makes reservations go
    in order instead of retrying the same keys."""

    def __init__(self, start: int = PORT_RANGE[0], end: int = PORT_RANGE[1], kv: LocalKV | None = None, *,
                 first: int | None = None):
        if not 0 < start < end <= 65536:
            raise ValueError(f"port range [{start}, {end}) is empty or outside 1–65535")
        if first is not None and not start <= first < end:
            raise ValueError(f"first port {first} is outside the range [{start}, {end})")
        self.start, self.end = start, end
        self.kv = kv
        self.first = start if first is None else first  # where a node's first reservation begins

    def _kv(self) -> LocalKV | GcsKV:
        return self.kv if self.kv is not None else GcsKV()

    def reserve(self, node: str, k: int) -> list[int]:
        """k ports never handed out before on `node` (once every port of the range was, the node's record is
        cleared and the range starts again: the caller's free check keeps a port in use from being given)."""
        kv, span = self._kv(), self.end - self.start
        if not 0 < k <= span:
            raise ValueError(f"{k} ports asked of a registry of {span} ([{self.start}, {self.end}))")
        cursor = kv.get(f"next/{node}")
        port = int(cursor) if cursor and self.start <= int(cursor) < self.end else self.first
        out: list[int] = []
        tried = 0
        while len(out) < k:
            if tried == span:  # every port of the range is handed out on this node: a new round
                kv.delete_prefix(f"port/{node}/")
                tried = 0
            if kv.put_new(f"port/{node}/{port}"):
                out.append(port)
            port = port + 1 if port + 1 < self.end else self.start
            tried += 1
        kv.put(f"next/{node}", str(port))
        return out

    def handed_out(self) -> dict[str, list[int]]:
        """{node: the ports handed out on it (this round), ascending}."""
        out: dict[str, list[int]] = {}
        for key in self._kv().keys("port/"):
            node, _, port = key[len("port/"):].rpartition("/")
            out.setdefault(node, []).append(int(port))
        return {n: sorted(p) for n, p in out.items()}


def _free_on_node(port: int, node: str, host: str) -> bool:
    """False only when the port is in use on the node's address (a name that is not an address of this machine,
    e.g. a test's fake node, leaves the decision to the wildcard check)."""
    if node == host:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((node, port))
        except OSError as e:
            return e.errno != errno.EADDRINUSE
    return True


def allocate_ports(reserve: Callable[[str, int], list[int]], node: str, k: int, *, host: str = "0.0.0.0",
                   max_tries: int = 1000) -> list[int]:
    """k ports from the registry that are free on this node right now (call it on the node that binds them).

    Free on `host` (the wildcard) and on the node's own address: a port held only by an outgoing connection from
    the node's address (an ephemeral source port) binds on the wildcard but not on that address."""
    out: list[int] = []
    for _ in range(max_tries):
        out += [p for p in reserve(node, k - len(out)) if is_port_free(p, host) and _free_on_node(p, node, host)]
        if len(out) == k:
            return out
    raise RuntimeError(f"[RF08] found only {len(out)} of {k} free ports on {node} after {max_tries} tries")


# ---- who holds a port (Linux /proc) ----------------------------------------------------------------------------
TCP_LISTEN = "0A"  # the state column of a listening socket in /proc/net/tcp


def socket_inodes(proc_net_tcp: str, port: int, *, listening: bool = False) -> set[str]:
    """Inodes of the sockets bound to local `port` in a /proc/net/tcp{,6} table (any local address); listening:
    only a socket that listens there (not a connection to or from the port)."""
    out = set()
    for line in proc_net_tcp.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10:
            continue
        local, state, inode = cols[1], cols[3], cols[9]
        if int(local.rsplit(":", 1)[1], 16) == port and inode != "0" and (not listening or state == TCP_LISTEN):
            out.add(inode)
    return out


def port_holder_pid(port: int, proc: Path = Path("/proc"), *, listening: bool = False) -> tuple[int, str] | None:
    """(pid, command line) of a process holding a socket on `port` (listening: the one listening there), or None
    when it cannot be found (none, or another user's process)."""
    inodes: set[str] = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            inodes |= socket_inodes((proc / table).read_text(), port, listening=listening)
        except OSError:
            continue
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                if os.readlink(fd) in targets:
                    cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    return int(pid_dir.name), cmd
        except OSError:  # other users' processes, or gone meanwhile
            continue
    return None


def port_holder(port: int) -> str | None:
    """'pid 123 (python …)' of the process holding `port`, when it can be seen (the doctor's RF08 check)."""
    holder = port_holder_pid(port)
    return f"pid {holder[0]} ({holder[1][:120]})" if holder else None


def port_in_use(port: int, host: str, what: str) -> Diagnosis:
    """RF08: `port` on `host` is taken; name the holder when /proc tells it."""
    holder = port_holder_pid(port)
    held = f"held by pid {holder[0]} ({holder[1][:160]})" if holder else "held by a process this user cannot see"
    return Diagnosis(code="RF08", severity="error", what=f"{what}: port {port} on {host} is already in use, {held}",
                     fix="let rollflow pick the ports (its allocator checks them free), stop the process holding "
                         f"port {port}, or run fewer engines per node (larger --rollout-num-gpus-per-engine)",
                     facts={"port": port, "host": host, "holder_pid": holder[0] if holder else None,
                            "holder_cmd": holder[1] if holder else None})
