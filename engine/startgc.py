"""Start-up without the cyclic garbage collector (issue 18), in every process rollflow starts.

A process's start-up (the imports of torch, transformers, Ray, Prefect, MLflow; a model load) creates millions of
long-lived objects and hardly any garbage, yet each full collection walks them all, more of them each time. Timed
with a `gc.callbacks` probe in every process of a CPU demo run: the driver 8 full collections before its first
step (2.2 s), the Prefect API server 9 during its boot (1.9 s), the train worker 8 while it imported torch and
transformers and loaded the model (0.8 s); all on the two cores the start-up shares.

`defer()` turns the collector off; `ready()` freezes what start-up built (`gc.freeze`: the collector no longer
walks it) and turns the collector back on, once, and only where `defer` turned it off. Who calls them:
- the driver: `rollflow train` (flows/cli.py) defers, training's start (flows/train.py) is ready;
- a Ray worker that rollflow starts with `DEFER_ENV` set (the train workers, the engine actors): importing the
  `engine` package defers (before the actor's module imports torch) and removes the variable, so no child process
  inherits it; the actor's setup is ready when it returns or fails;
- the Prefect API server's process (plumbing/api_server.py) defers its own imports and is ready once its app is
  built.
A library caller that imports `engine` without the variable keeps its collector as it is.
"""
from __future__ import annotations

import gc
import os

#: set (to "1") in the environment of a Ray worker whose start-up should run without the collector
DEFER_ENV = "ROLLFLOW_DEFER_GC"

_deferred = False


def defer() -> None:
    """Turn the collector off until `ready()` (nothing changes when it is already off)."""
    global _deferred
    if gc.isenabled():
        gc.disable()
        _deferred = True


def defer_if_asked() -> None:
    """In a process started with DEFER_ENV=1: `defer()`, and drop the variable so child processes start normally."""
    if os.environ.pop(DEFER_ENV, None) == "1":
        defer()


def ready() -> None:
    """Freeze what exists now out of the collector's walks and turn it back on; only after `defer()`, and once.
    A full collection during training then walks only what training allocates (the CPU demo's driver: 0.05-0.07 s
    against 0.39-0.51 s without the freeze)."""
    global _deferred
    if _deferred:
        _deferred = False
        gc.freeze()
        gc.enable()
