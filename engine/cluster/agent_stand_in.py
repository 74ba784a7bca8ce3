"""Stands in for Ray's dashboard agent on a local cluster started with --ray-services lean (engine/cluster
`_services`): run by the raylet as a script (`python agent_stand_in.py PORT_NAMES <the agent's own arguments>`),
standard library only.

What Ray's agent does on a Ray without the dashboard's packages (the `ray` wheel rollflow installs: "Loaded 0
modules" in its log) is to write -1, "not in use", for its ports into the session folder, where the raylet waits
for them before it registers the node, and then to live as long as the raylet. It imports much of Ray to do so:
~0.7 s of CPU on the 2-core machine, while ray.init, and the train worker after it, wait (the raylet's log:
1.2 s from the agent's launch to the node's start during a demo start-up). This writes the same files (the
names come from the driver, which reads them from Ray: `PORT_NAMES`, comma-separated; the format is
`ray._raylet.persist_port`'s, which tests/test_cluster_lean.py compares) and waits for the raylet to exit.
"""
from __future__ import annotations

import os
import sys
import time


def _arg(argv: list[str], name: str) -> str:
    for a in argv:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    raise SystemExit(f"agent_stand_in: no --{name}= among the agent's arguments {argv!r}")


def persist(session_dir: str, node_id: str, port_name: str, port: int) -> None:
    """`ray._raylet.persist_port`: the port as text in `<session_dir>/<port_name>_<node_id>`, written whole
    (a temporary file renamed over it) so that the raylet never reads half of it."""
    path = os.path.join(session_dir, f"{port_name}_{node_id}")
    with open(path + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: agent_stand_in.py PORT_NAMES AGENT_SCRIPT --session-dir=… --node-id=… …")
    names, args = argv[0].split(","), argv[2:]  # argv[1]: the agent's script, which is not run
    session_dir, node_id = _arg(args, "session-dir"), _arg(args, "node-id")
    for name in names:
        persist(session_dir, node_id, name, -1)
    raylet = os.getppid()
    while os.getppid() == raylet:  # the raylet exited: this process is reparented
        time.sleep(1.0)


if __name__ == "__main__":
    main(sys.argv[1:])
