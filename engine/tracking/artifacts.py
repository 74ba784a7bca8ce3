"""The files a run leaves in MLflow, as pure functions of data: sample rollouts (JSONL), curves (PNG), the failure
report (markdown), the checkpoint record (JSON), and the project's git commit.

Plots use matplotlib's Agg backend (no display; safe in Ray / Prefect worker threads).
"""
from __future__ import annotations

import io
import json
import subprocess
import traceback
from pathlib import Path
from typing import Any

from engine.diagnosis import DiagnosisError, render_report
from engine.samples import Sample

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def samples_jsonl(groups: list[list[Sample]]) -> str:
    """One JSON line per sample: prompt, response, label, reward, status, lengths, ids (no token ids or
    log-probs: those are B·n·L numbers per rollout and stay in the run)."""
    lines = []
    for g in groups:
        for s in g:
            lines.append(json.dumps({
                "rollout_id": s.rollout_id, "group_index": s.group_index, "index": s.index, "prompt": s.prompt,
                "response": s.response, "label": s.label, "reward": s.reward, "status": s.status.value,
                "prompt_length": s.prompt_length, "response_length": s.response_length,
                "finish_reason": s.metadata.get("finish_reason"), "weight_version": s.metadata.get("weight_version"),
            }, default=str, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def _series(history: dict[str, dict[int, float]], key: str) -> tuple[list[int], list[float]]:
    pts = sorted(history.get(key, {}).items())
    return [s for s, _ in pts], [v for _, v in pts]


def plot_curves(history: dict[str, dict[int, float]], keys: list[str], *, title: str, ylabel: str,
                band: tuple[str, str] | None = None) -> bytes:
    """PNG of `keys` over rollout ids; `band = (mean_key, std_key)` shades mean ± std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for key in keys:
            xs, ys = _series(history, key)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        if band:
            xs, mean = _series(history, band[0])
            _, std = _series(history, band[1])
            if len(std) == len(mean):
                ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                alpha=0.2, label=f"{band[0]} ± std")
        ax.set(title=title, xlabel="rollout id", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()
    finally:
        plt.close(fig)


def run_plots(history: dict[str, dict[int, float]]) -> dict[str, bytes]:
    """The run's plots: artifact file → PNG bytes (only for curves that have points)."""
    out = {}
    if history.get("rollout/reward_mean"):
        out["plots/reward.png"] = plot_curves(history, ["rollout/reward_mean"], title="reward over rollouts",
                                              ylabel="reward", band=("rollout/reward_mean", "rollout/reward_std"))
    if history.get("rollout/response_len_mean"):
        out["plots/response_length.png"] = plot_curves(
            history, ["rollout/response_len_mean", "rollout/response_len_max"], title="response length over rollouts",
            ylabel="tokens")
    return out


def failure_report(exc: BaseException) -> tuple[str, str]:
    """(short tag value, markdown report): the doctor's diagnoses when the failure was diagnosed, else the
    exception and the tail of its traceback, marked unclassified."""
    if isinstance(exc, DiagnosisError):
        codes = ",".join(dict.fromkeys(exc.codes))
        return codes, f"# Doctor report\n\nThe run failed with {codes}.\n\n```\n{render_report(exc.diagnoses)}\n```\n"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-12:])
    name = type(exc).__name__
    return name, (f"# Doctor report\n\nThe run failed with an unclassified error (no RF code matched): "
                  f"`{name}: {str(exc)[:500]}`\n\n```\n{tb}\n```\n")


def checkpoint_record(rollout_id: int, path: str, save: str, flow_run_id: str | None) -> str:
    """JSON for `checkpoints/iter_%07d.json`: where the iteration lives and the marker that names it."""
    marker = f"{save.rstrip('/')}/latest_checkpointed_iteration.txt"
    return json.dumps({"iteration": rollout_id, "uri": path, "marker": marker, "flow_run_id": flow_run_id},
                      indent=1) + "\n"


def git_info(root: Path = PROJECT_ROOT) -> dict[str, str]:
    """`mlflow.source.git.commit` and whether the checkout had local changes; empty outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"mlflow.source.git.commit": commit, "rollflow.git_dirty": str(dirty).lower()}


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollflow")
    except PackageNotFoundError:
        return "unknown"


def as_yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
