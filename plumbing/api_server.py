"""The ephemeral Prefect API server's process, run as a script by `prestart.EphemeralAPI` (`python api_server.py
PORT`): what Prefect's own `SubprocessASGIServer` runs (uvicorn on `prefect.server.api.server:create_app`, 127.0.0.1,
log level error, lifespan on; the environment comes from the launcher), with the server's start-up imports and app
build done without the cyclic garbage collector, then frozen out of its walks (engine/startgc.py says why: a
`gc.callbacks` probe in this process during a CPU demo start-up timed 9 full collections, 1.9 s of the ~4 s of CPU
its boot takes on the two cores the start-up shares).

Its task-run recorder writes in batches (`batch_task_run_records`). Standard library, uvicorn and Prefect only: it
runs as a script, so rollflow's packages need not be importable."""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

#: the server's task-run recorder (it turns the flow's task-run events into the task runs the UI shows) writes a
#: batch at most this often, or once it holds this many events. Prefect's defaults, 1 event per write, cost this
#: server ~0.2 s of CPU per iteration of the CPU demo (12 events: four tasks × Pending, Running, Completed): 22 s of
#: CPU in a 100-rollout demo, 12 s with these (bench/results/trl_race.md). A task's state reaches the UI up to a
#: second later; a stopped server writes what it holds first (Prefect's own shutdown flush).
TASK_RUN_RECORDER = {"batch_size": 100, "flush_interval": 1.0}


def batch_task_run_records() -> dict[str, str]:
    """Set TASK_RUN_RECORDER's values for this process's Prefect settings where no Prefect settings source (the
    environment, a profile, prefect.toml, .env) sets them; returns the environment variables set. A Prefect whose
    settings have no such recorder keeps its own (said on stderr, which the run's console shows)."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    recorder = getattr(get_current_settings().server.services, "task_run_recorder", None)
    if recorder is None or not set(TASK_RUN_RECORDER) <= set(type(recorder).model_fields):
        print("rollflow: this Prefect's server has no task_run_recorder batch_size / flush_interval settings; its "
              "task-run recorder writes with Prefect's defaults", file=sys.stderr)
        return {}
    given = recorder.model_fields_set
    added = {f"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_{field.upper()}": str(value)
             for field, value in TASK_RUN_RECORDER.items() if field not in given}
    if added:
        os.environ.update(added)
        refresh_global_settings_context()
    return added


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not argv[0].isdigit():
        raise SystemExit(f"usage: python {Path(__file__).name} PORT (got {argv!r})")
    gc.disable()
    batch_task_run_records()
    import uvicorn
    from prefect.server.api.server import create_app

    gc.freeze()  # the imports: long-lived; create_app's own gc.collect() then walks only what it built

    def app():
        built = create_app()
        gc.freeze()  # the app: long-lived, walked by every full collection otherwise
        gc.enable()
        return built

    uvicorn.run(app, factory=True, host="127.0.0.1", port=int(argv[0]), log_level="error", lifespan="on")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent  # a script's own folder leads sys.path: plumbing's modules must not
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]  # shadow a library's (`policy`, `ui`)
    main(sys.argv[1:])
