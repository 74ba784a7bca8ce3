"""rl-export-hf: one committed checkpoint → a Hugging Face model directory that any evaluation harness or server
loads (`from_pretrained`). prefect.yaml runs it on every `rollflow.checkpoint.committed` event (the trigger
example: the event's payload `uri`, <save>/iter_%07d, becomes `checkpoint_uri`).

Output: <output_dir>/<save dir>-<hash of the --save URI>/iter_%07d/ (one directory per run and iteration, the
hash as in the run's save limit). An iteration already exported is not exported again (duplicate events).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from engine import checkpoint
from engine.diagnosis import ConfigError, Diagnosis
from tasks.export import export_hf

ITERATION_URI = re.compile(r"(?P<save>.+?)/+iter_(?P<n>\d{7})/*")


def export_source(uri: str, iteration: int | None) -> tuple[str, int | None]:
    """(--load, --ckpt-step) from an iteration's URI (<save>/iter_0000003) or a --save URI (+ `iteration`)."""
    m = ITERATION_URI.fullmatch(uri)
    if m is None:
        return uri.rstrip("/"), iteration
    n = int(m["n"])
    if iteration is not None and iteration != n:
        raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                    what=f"checkpoint {uri} is iteration {n} but iteration = {iteration}",
                                    fix="pass the --save directory with iteration=N, or the iteration's URI alone"))
    return m["save"], n


def save_slug(save: str) -> str:
    """`<last path part>-<sha256[:12] of the normalized --save>` (letters, digits, dashes): one name per directory
    however spelled, and the readable part comes from the redacted URI, so a signed URL's query never shows."""
    import hashlib

    from engine.tracking.secrets import redact_text

    uri = checkpoint.normalize(save)
    last = redact_text(uri).split("?", 1)[0].rsplit("/", 1)[-1]
    slug = re.sub(r"[^a-z0-9]+", "-", last.lower()).strip("-")[:32] or "root"
    return f"{slug}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"


def export_path(output_dir: str, save: str, iteration: int) -> Path:
    """Where rl-export-hf writes one iteration: <output_dir>/<save_slug>/iter_%07d."""
    return Path(output_dir) / save_slug(save) / checkpoint.iter_name(iteration)


@flow(name="rl-export-hf", log_prints=False, validate_parameters=True)
def rl_export_hf(checkpoint_uri: str, iteration: int | None = None, output_dir: str = "runs/hf-exports",
                 hf_checkpoint: str | None = None) -> dict[str, Any]:
    """Export one checkpoint iteration (default: the marker's) as a Hugging Face model directory."""
    load, step = export_source(checkpoint_uri, iteration)
    if step is None:
        step = checkpoint.read_marker(load)
        if step is None:
            store = checkpoint.Store(load)
            raise ConfigError(Diagnosis(code="RF01", severity="error",
                                        what=f"checkpoint_uri {load} has no {checkpoint.MARKER}; found "
                                             f"{checkpoint.describe_dir(store)}",
                                        fix="pass an iteration's URI (<save>/iter_%07d) or iteration=N; complete "
                                            f"iterations: {checkpoint.complete_iterations(store)}"))
    out = export_path(output_dir, load, step)
    if (out / "config.json").is_file():
        get_run_logger().info("%s is already exported to %s", checkpoint.iter_name(step), out)
        return {"source": f"{load}/{checkpoint.iter_name(step)}", "output_hf": str(out), "exported": False}
    result = export_hf(load, step, str(out), hf_checkpoint)
    create_markdown_artifact(key="hf-export", markdown=f"### {checkpoint.iter_name(step)} as a Hugging Face model\n\n"
                             f"| | |\n|---|---|\n| from | `{result['source']}` |\n| to | `{result['output_hf']}` |\n"
                             f"| tensors | {result['tensors']} ({result['dtype']}) |\n")
    return {**result, "exported": True}
