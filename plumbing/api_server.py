"""The ephemeral Prefect API server's process, run as a script by `prestart.EphemeralAPI` (`python api_server.py
PORT`): what Prefect's own `SubprocessASGIServer` runs (uvicorn on `prefect.server.api.server:create_app`, 127.0.0.1,
log level error, lifespan on; the environment comes from the launcher), with the server's start-up imports and app
build done without the cyclic garbage collector, then frozen out of its walks (engine/startgc.py says why: a
`gc.callbacks` probe in this process during a CPU demo start-up timed 9 full collections, 1.9 s of the ~4 s of CPU
its boot takes on the two cores the start-up shares).

Standard library, uvicorn and Prefect only: it runs as a script, so rollflow's packages need not be importable."""
from __future__ import annotations

import gc
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not argv[0].isdigit():
        raise SystemExit(f"usage: python {Path(__file__).name} PORT (got {argv!r})")
    gc.disable()
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
