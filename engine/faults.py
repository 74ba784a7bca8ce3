"""Fault injection for the resume proof: the training process SIGKILLs itself at a named boundary.

    ROLLFLOW_FAULT=during_save@2                      die once the save of rollout 2 is half done
    ROLLFLOW_FAULT=after_rollout@1,after_marker@3     several faults, comma-separated
    ROLLFLOW_FAULT_STATE=/tmp/fired                   each fault fires once: it is appended to this file before
                                                      the kill, so the SAME command and environment restarted
                                                      in a loop runs to the end (without it a fault fires on
                                                      every run that reaches it)

Boundaries, in the order one rollout meets them:
    after_rollout   the rollout is generated and scored, nothing trained yet
    during_train    the first optimizer step of the rollout is done on the workers, the rollout's train is not
    during_save     iter_%07d is half written (local: state in iter_%07d.tmp/; S3: half the files uploaded)
    before_marker   iter_%07d is complete, latest_checkpointed_iteration.txt still names the previous one
    after_marker    the marker names the new iteration; retention and weight sync have not run

The built-in rollout engine has faults of its own, counted in /generate requests of one engine process:
    ROLLFLOW_ENGINE_FAULT=hang@20                     request 20 (0-based) never answers: the engine is stuck
    ROLLFLOW_ENGINE_FAULT=exit@20                     the engine process dies (os._exit) on request 20
(`engine_fault(index)`, once per ROLLFLOW_FAULT_STATE like the others: the engine that replaces it runs clean.)

A node can be made blind to the driver's files (engine/cluster/nodes.py), set in THAT node's environment:
    ROLLFLOW_HIDDEN_PATHS=/data/run:/models         rollflow's visibility checks on this node treat paths under
                                                    these prefixes as absent (a node that does not mount them)

Unset (the default) this module does nothing: `at` is one dict lookup. SIGKILL, not an exception: no `finally`,
no atexit, no flush — the process vanishes as it does on an OOM kill or a preempted node.
"""
from __future__ import annotations

import os
import signal

ENV = "ROLLFLOW_FAULT"
STATE_ENV = "ROLLFLOW_FAULT_STATE"
BOUNDARIES = ("after_rollout", "during_train", "during_save", "before_marker", "after_marker")
ENGINE_ENV = "ROLLFLOW_ENGINE_FAULT"
ENGINE_FAULTS = ("hang", "exit")


def parse(spec: str, *, env: str = ENV, names: tuple[str, ...] = BOUNDARIES) -> list[tuple[str, int]]:
    """'during_save@2,after_marker@3' → [('during_save', 2), ('after_marker', 3)]; a bad spec is a ValueError."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        boundary, at, rid = part.partition("@")
        if boundary not in names or not at or not rid.lstrip("-").isdigit():
            raise ValueError(f"{env}={spec!r}: {part!r} is not <name>@<number> with a name in "
                             f"{', '.join(names)} (e.g. {env}={names[0]}@2)")
        out.append((boundary, int(rid)))
    return out


def _fire_once(name: str) -> bool:
    """True the first time `name` fires under ROLLFLOW_FAULT_STATE (recorded durably first); always True without it."""
    state = os.environ.get(STATE_ENV)
    if name in _fired(state):
        return False
    if state:
        with open(state, "a") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
    return True


def _fired(state: str | None) -> set[str]:
    if not state or not os.path.exists(state):
        return set()
    with open(state) as f:
        return {line.strip() for line in f if line.strip()}


def at(boundary: str, rollout_id: int) -> None:
    """SIGKILL this process if ROLLFLOW_FAULT names (boundary, rollout_id) and it has not fired yet."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    assert boundary in BOUNDARIES, boundary
    if (boundary, rollout_id) not in parse(spec):
        return
    if _fire_once(f"{boundary}@{rollout_id}"):
        os.kill(os.getpid(), signal.SIGKILL)


def engine_fault(request_index: int) -> str | None:
    """'hang' or 'exit' when ROLLFLOW_ENGINE_FAULT names this /generate request (0-based) and it has not fired."""
    spec = os.environ.get(ENGINE_ENV)
    if not spec:
        return None
    for kind, index in parse(spec, env=ENGINE_ENV, names=ENGINE_FAULTS):
        if index == request_index and _fire_once(f"engine-{kind}@{index}"):
            return kind
    return None
