"""Wait until a Ray cluster has N alive nodes (the Slurm recipe runs it before the flow, so the run's topology
check sees the whole allocation):

    python -m engine.cluster.wait --address 10.0.0.1:6379 --nodes 4 --timeout 300

Exit 0 once the cluster has at least --nodes alive nodes, printing them; exit 1 after --timeout seconds with
how many joined; exit 2 at once when the address cannot be reached or its cluster refuses this process (RF02: a
token-authenticated cluster, say). Progress goes to stderr every 10 s.
"""
from __future__ import annotations

import argparse
import sys
import time


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def wait_for_nodes(address: str, nodes: int, timeout_s: float, poll_s: float = 2.0) -> list[dict]:
    """Join `address`, poll until `nodes` are alive (at most timeout_s), disconnect; returns the alive nodes."""
    import ray

    from engine.cluster import check_reachable

    check_reachable(address)
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        deadline, said = time.monotonic() + timeout_s, 0.0
        while len(up := alive_nodes()) < nodes and time.monotonic() < deadline:
            if time.monotonic() - said > 10:
                print(f"waiting for Ray nodes at {address}: {len(up)} of {nodes} alive", file=sys.stderr)
                said = time.monotonic()
            time.sleep(poll_s)
        return alive_nodes()
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.cluster.wait", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="the head's GCS address host:port")
    p.add_argument("--nodes", type=int, required=True, help="alive nodes to wait for (head included)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up (default 300)")
    a = p.parse_args(argv)
    from engine.diagnosis import ConfigError

    try:
        up = wait_for_nodes(a.address, a.nodes, a.timeout)
    except ConfigError as e:  # the address cannot be reached, or its cluster refuses this process (RF02)
        print(e, file=sys.stderr)
        return 2
    names = ", ".join(f"{n['NodeManagerAddress']} (GPU {n['Resources'].get('GPU', 0):g}, "
                      f"CPU {n['Resources'].get('CPU', 0):g})" for n in up)
    if len(up) < a.nodes:
        print(f"only {len(up)} of {a.nodes} Ray nodes joined {a.address} within {a.timeout:g} s: {names}; check "
              "the workers' `ray start --address` output (firewall, the head's port, the Ray version on each node)",
              file=sys.stderr)
        return 1
    print(f"{len(up)} Ray nodes alive: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
