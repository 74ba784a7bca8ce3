"""What an RL engineer sees first, checked in a real browser: `prefect server` (UI on) and `mlflow server` on loopback,
3 rollouts against both, then Debian's Chromium (driven by Playwright, bench/ui_screenshots.py) opens the two pages
rollflow links to. Screenshots go to the test's tmp dir; `python bench/ui_screenshots.py` commits the demo's."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
pytestmark = pytest.mark.slow


def test_both_uis_show_whether_training_works_first(tmp_path):
    from bench.ui_screenshots import CHROMIUM, Servers, shoot, train

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing: `make test` installs Debian's chromium (make browser)"
    servers = Servers(tmp_path / "servers").start()
    try:
        summary = train(servers, "--num-rollout", "3", "--eval-interval", "1")
        seen = shoot(summary, tmp_path / "shots")
    finally:
        servers.stop()
    mlflow, prefect = seen["mlflow"], seen["prefect"]
    # MLflow: the link opens the run in the model-training layout, the overview section first, reward its first chart
    assert mlflow["layout"] == "model training", mlflow
    assert mlflow["sections"][0] == "0-overview" and mlflow["first_chart"] == "1-reward_mean", mlflow
    assert mlflow["shows_run_name"] and prefect["shows_run_name"], seen  # one name in both UIs
    # Prefect: the flow run lists every stage task by rollout id, and one summary card among the run's artifacts
    assert prefect["state"] == "Completed"
    want = {"preflight", "place", "convert"} | {f"eval-{k}" for k in range(4)} | {
        f"{stage}-{i}" for i in range(3) for stage in ("rollout", "pack", "train", "sync")} | {"save-2"}
    assert set(prefect["tasks"]) == want, prefect["tasks"]
    names = [a.rsplit("-", 2)[0] for a in prefect["artifacts"]]
    assert names.count("summary") == 1 and {"progress", "samples", "mlflow-run", "checkpoint"} <= set(names), names
    for shot in ("mlflow_run.png", "prefect_flow_run.png", "prefect_artifacts.png"):
        assert (tmp_path / "shots" / shot).stat().st_size > 20_000, shot
