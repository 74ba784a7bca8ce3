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


SAMPLE_COLUMNS = ["rollout_id", "group", "index", "prompt", "response", "label", "reward",
                  "advantage (group-normalised reward)", "response_tokens", "prompt_tokens", "finish_reason", "status",
                  "weight_version"]


def group_advantages(group: list[Sample]) -> list[float]:
    """GRPO's advantage of each sample: its reward normalised within its group, (r − mean) / (std + 1e-6)."""
    rewards = [s.scalar_reward for s in group]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


def samples_table(groups: list[list[Sample]]) -> str:
    """Every sample of the rollout as a table for MLflow's table view (pandas' "split" JSON, as log_table writes):
    prompt, response, label, reward, GRPO's advantage (the reward normalised within its group), lengths, finish
    reason, status, the weight version that generated it."""
    data = []
    for g in groups:
        for s, advantage in zip(g, group_advantages(g)):
            fr = s.metadata.get("finish_reason")
            data.append([s.rollout_id, s.group_index, s.index, str(s.prompt), s.response, str(s.label),
                         s.scalar_reward, advantage, s.response_length,
                         s.prompt_length, fr.get("type") if isinstance(fr, dict) else fr, s.status.value,
                         s.metadata.get("weight_version")])
    return json.dumps({"columns": SAMPLE_COLUMNS, "data": data}, default=str, ensure_ascii=False)


def _series(history: dict[str, dict[int, float]], key: str) -> tuple[list[int], list[float]]:
    pts = sorted(history.get(key, {}).items())
    return [s for s, _ in pts], [v for _, v in pts]


def _png(draw, *, title: str, ylabel: str) -> bytes:
    """A 700×400 PNG: draw(ax) on fresh axes, then the title, labels, grid and legend every run plot has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        draw(ax)
        ax.set(title=title, xlabel="rollout id", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()
    finally:
        plt.close(fig)


def plot_curves(history: dict[str, dict[int, float]], keys: list[str], *, title: str, ylabel: str,
                band: tuple[str, str] | None = None, between: tuple[str, str] | None = None) -> bytes:
    """PNG of `keys` over rollout ids; `band = (mean_key, std_key)` shades mean ± std, `between = (low_key,
    high_key)` shades the area between two curves."""
    def draw(ax):
        for key in keys:
            xs, ys = _series(history, key)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        if band:
            xs, mean = _series(history, band[0])
            _, std = _series(history, band[1])
            if len(std) == len(mean):
                ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                alpha=0.2, label=f"{band[0]} ± std")
        if between:
            xs, low = _series(history, between[0])
            _, high = _series(history, between[1])
            if len(low) == len(high):
                ax.fill_between(xs, low, high, alpha=0.2, label=f"{between[0]} … {between[1]}")

    return _png(draw, title=title, ylabel=ylabel)


def run_plots(history: dict[str, dict[int, float]]) -> dict[str, bytes]:
    """The run's plots: artifact file → PNG bytes (only for curves that have points)."""
    out = {}
    if history.get("rollout/reward_mean"):
        out["plots/reward.png"] = plot_curves(history, ["rollout/reward_mean"], title="reward over rollouts",
                                              ylabel="reward", band=("rollout/reward_mean", "rollout/reward_std"))
    if history.get("rollout/response_len_mean"):
        out["plots/response_length.png"] = plot_curves(
            history, ["rollout/response_len_mean", "rollout/response_len_p50", "rollout/response_len_max"],
            title="response length over rollouts (shaded: 10th to 90th percentile)", ylabel="tokens",
            between=("rollout/response_len_p10", "rollout/response_len_p90"))
    if history.get("rollout/seconds"):
        out["plots/stage_seconds.png"] = plot_stacked(
            history, [f"{s}/seconds" for s in ("rollout", "pack", "train", "save", "sync")],
            title="where each rollout's time goes", ylabel="seconds")
    return out


def plot_stacked(history: dict[str, dict[int, float]], keys: list[str], *, title: str, ylabel: str) -> bytes:
    """PNG of one stacked bar per rollout id, a segment per key (a key missing at a rollout counts 0)."""
    xs = sorted({i for k in keys for i in history.get(k, {})})

    def draw(ax):
        bottom = [0.0] * len(xs)
        for key in keys:
            ys = [history.get(key, {}).get(i, 0.0) for i in xs]
            if any(ys):
                ax.bar(xs, ys, bottom=bottom, width=0.8, label=key)
                bottom = [b + y for b, y in zip(bottom, ys)]

    return _png(draw, title=title, ylabel=ylabel)


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
