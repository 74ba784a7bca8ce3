"""Bookkeeping threads yield the CPU to training and rollout.

On a machine whose cores are all busy (an async run on CPU: the engine and the trainer each hold a core) the
driver's bookkeeping — MLflow writes and plots, Prefect UI artifacts — competes with the work that sets the pace.
Those threads lower their own scheduling priority (Linux: `setpriority` on a thread id changes that thread only),
so they run in the gaps; their work is not dropped, only delayed. Measured on the 2-core demo: bench/results/
async*.md. Lowering a priority needs no privilege; raising it back would, so only threads that do nothing else
call this.
"""
from __future__ import annotations

import os
import threading

#: nice value of bookkeeping threads (0 = normal, 19 = lowest)
BACKGROUND_NICE = 10


def lower_this_thread(nice: int = BACKGROUND_NICE) -> bool:
    """Run the calling thread at `nice` (Linux); True when it took effect. Elsewhere a no-op (False)."""
    if not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"):
        return False
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) >= nice:
            return True
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError:
        return False


def lower_process(pid: int, nice: int = BACKGROUND_NICE) -> int:
    """Every thread of process `pid` (and the threads it starts later, which inherit it) at `nice`; Linux only.
    Returns how many threads were lowered (0 where that is not possible)."""
    lowered = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            lowered += 1
        except OSError:
            continue
    return lowered
