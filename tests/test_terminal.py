"""What `rollflow train` prints on the terminal: a diagnosed failure as its diagnosis (tracebacks with --debug), and a
finished run launched again as "nothing to do"."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow


def train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", "examples/demo.yaml",
                           "--no-progress", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_diagnosed_failure_shows_the_diagnosis_not_tracebacks(tmp_path):
    # every prompt is too long for a 2040-token response: preflight's DATA error, inside the flow
    bad = ["--rollout-max-response-len", "2040", "--work-dir", str(tmp_path / "w"), "--save", str(tmp_path / "ck")]
    r = train(*bad)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out and "Task run failed" not in out, out
    assert out.count("[DATA error]") == 2 and "rollflow train stopped:" in out  # training and eval prompts
    assert len(out.strip().splitlines()) <= 8, out
    r = train(*bad, "--debug")
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" in out and "[DATA error]" in out, out


def test_an_async_run_trains_with_the_engine_started_beside_ray(tmp_path):
    """--async-mode one-step on the CPU demo: `rollflow train` starts the engine's own process right after Ray,
    beside the train worker, and place adopts both (plumbing/prestart.py)."""
    import json

    r = train("--num-rollout", "2", "--eval-prompt-data", "", "--async-mode", "one-step", "--work-dir",
              str(tmp_path / "w"), "--save", str(tmp_path / "ck"), "--summary-json", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    where = json.loads((tmp_path / "s.json").read_text())["placement"]
    assert where["train_prestarted"] and where["engine_prestarted"] and not where["engine_in_trainer"], where
    assert where["engines"][0]["pid"] != where["train"][0]["pid"], where


def test_a_finished_run_launched_again_has_nothing_to_do(tmp_path):
    args = ["--num-rollout", "1", "--eval-prompt-data", "", "--work-dir", str(tmp_path / "w"),
            "--save", str(tmp_path / "ck")]
    first = train(*args, "--summary-json", str(tmp_path / "summary.json"))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "rollflow: 1 rollout in" in first.stdout
    # the demo's shape on a local cluster: the train worker `rollflow train` started with Ray was the one place
    # used, and the engine served from its process
    import json

    where = json.loads((tmp_path / "summary.json").read_text())["placement"]
    assert where["train_prestarted"] and where["engine_in_trainer"] and where["engine_prestarted"], where
    assert where["engines"][0]["pid"] == where["train"][0]["pid"], where
    assert where["ray_services"] == "lean", where  # the local cluster without Ray's three unused services
    # the bundled Qwen2 on the CPU: rollflow's own model code in the trainer and the engine (--model-impl auto)
    assert where["train"][0]["model_impl"] == where["engines"][0]["model_impl"] == "native", where
    # the local cluster's workers run at the driver's priority, above the bookkeeping lowered to nice 10
    # (Ray's own default, worker_niceness 15, would put the trainer below the MLflow sender and the Prefect API)
    assert where["train"][0]["nice"] == os.getpriority(os.PRIO_PROCESS, 0), where
    again = train(*args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to do: iteration 0 is already saved and --num-rollout is 1" in again.stdout, again.stdout
