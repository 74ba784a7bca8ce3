"""`rollflow compare`: the params that differ between runs, and the final and best value of each metric per run.

Invariants
- Redone steps count once: a resumed run logs the steps after its last checkpoint again, and the latest point per
  step (by timestamp) is the value of that step. `points` counts steps, `redone` the extra points.
- "best" follows the metric's direction (engine.tracking.metrics: reward max, loss min, …); metrics without one
  (counts, settings) have no best.
- Params that only name places or the run (work dir, --save, run name, …: engine.config.NON_SEMANTIC) are not
  listed as differences unless asked (`all_params`).
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from engine.diagnosis import ConfigError, Diagnosis
from engine.tracking.metrics import better

DEFAULT_METRICS = ["rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/kl", "eval/test_accuracy"]


# ---- pure functions of metric points ---------------------------------------------------------------------------
def latest_per_step(points: Iterable[Any]) -> dict[int, float]:
    """MLflow metric points (step, value, timestamp) → {step: value} keeping the latest point of each step
    (ties: the later point in the list)."""
    best_ts: dict[int, int] = {}
    out: dict[int, float] = {}
    for p in points:
        if p.step not in best_ts or p.timestamp >= best_ts[p.step]:
            best_ts[p.step], out[p.step] = p.timestamp, p.value
    return dict(sorted(out.items()))


def summarize(series: dict[int, float], direction: str | None) -> dict[str, Any]:
    """final = value at the last step; best = max or min over steps (first step reaching it), None if no direction."""
    if not series:
        return {"final": None, "final_step": None, "best": None, "best_step": None}
    last = max(series)
    out = {"final": series[last], "final_step": last, "best": None, "best_step": None}
    if direction in ("max", "min"):
        pick = max if direction == "max" else min
        value = pick(series.values())
        out.update(best=value, best_step=min(s for s, v in series.items() if v == value))
    return out


def differing(params: list[dict[str, str]], hide: set[str] = frozenset()) -> list[str]:
    """Keys whose value is not the same in every run (a key missing from some run differs)."""
    keys = sorted({k for p in params for k in p} - set(hide))
    return [k for k in keys if len({p.get(k) for p in params}) > 1]


# ---- reading MLflow --------------------------------------------------------------------------------------------
@dataclass
class RunData:
    run_id: str
    name: str
    experiment: str
    status: str
    params: dict[str, str]
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    logged: dict[str, int] = field(default_factory=dict)  # raw points per metric (redone steps included)
    available: set[str] = field(default_factory=set)


def _not_found(ref: str, client, uri: str) -> ConfigError:
    names = [e.name for e in client.search_experiments()]
    return ConfigError(Diagnosis(code="COMPARE", severity="error",
                                 what=f"{ref!r} is not a run id, run name, experiment name or experiment id at {uri}",
                                 fix=f"pass one of the experiments {names} or a run id / name from them",
                                 facts={"ref": ref, "experiments": names}))


def resolve(client, refs: list[str], uri: str) -> list[Any]:
    """Each ref is a run id, an experiment name or id (all its runs), or a run name; runs in order, once each."""
    from mlflow.exceptions import MlflowException

    out: dict[str, Any] = {}
    for ref in refs:
        runs: list[Any] = []
        try:
            runs = [client.get_run(ref)]
        except MlflowException:
            exp = client.get_experiment_by_name(ref)
            if exp is None and ref.isdigit():
                try:
                    exp = client.get_experiment(ref)
                except MlflowException:
                    exp = None
            if exp is not None:
                runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
            else:
                ids = [e.experiment_id for e in client.search_experiments()]
                quoted = ref.replace("'", "\\'")
                runs = client.search_runs(ids, filter_string=f"attributes.run_name = '{quoted}'",
                                          order_by=["attributes.start_time ASC"]) if ids else []
        if not runs:
            raise _not_found(ref, client, uri)
        out.update({r.info.run_id: r for r in runs if r.info.run_id not in out})
    return list(out.values())


def load(client, runs: list[Any], metrics: list[str]) -> list[RunData]:
    exp_names: dict[str, str] = {}
    data = []
    for r in runs:
        eid = r.info.experiment_id
        if eid not in exp_names:
            exp_names[eid] = client.get_experiment(eid).name
        d = RunData(r.info.run_id, r.info.run_name or r.info.run_id[:8], exp_names[eid], r.info.status,
                    dict(r.data.params), available=set(r.data.metrics))
        for m in metrics:
            if m in d.available:
                hist = client.get_metric_history(r.info.run_id, m)
                d.series[m], d.logged[m] = latest_per_step(hist), len(hist)
        data.append(d)
    names = [d.name for d in data]
    for d in data:  # same name twice (two runs of one --run-name): add the id
        if names.count(d.name) > 1:
            d.name = f"{d.name} ({d.run_id[:8]})"
    return data


def compare(client, refs: list[str], metrics: list[str] | None = None, *, uri: str = "",
            all_params: bool = False) -> dict[str, Any]:
    """The comparison as plain data (what --format json prints)."""
    from engine.config import NON_SEMANTIC

    runs = resolve(client, refs, uri)
    available = sorted({k for r in runs for k in r.data.metrics})
    if metrics is None:
        chosen = [m for m in DEFAULT_METRICS if m in available]
    else:
        missing = [m for m in metrics if m not in available]
        if missing:
            import difflib

            near = {m: difflib.get_close_matches(m, available, n=1) for m in missing}
            hint = "; ".join(f"{m} → did you mean {n[0]}?" for m, n in near.items() if n)
            raise ConfigError(Diagnosis(code="COMPARE", severity="error",
                                        what=f"--metrics {','.join(missing)}: not logged by any of the runs",
                                        fix=(hint + "; " if hint else "") + f"logged metrics: {', '.join(available)}",
                                        facts={"missing": missing}))
        chosen = metrics
    data = load(client, runs, chosen)
    diff = differing([d.params for d in data], set() if all_params else NON_SEMANTIC)
    return {
        "tracking_uri": uri,
        "metrics": chosen,
        "differing_params": diff,
        "runs": [{
            "run_id": d.run_id, "run_name": d.name, "experiment": d.experiment, "status": d.status,
            "params": {k: d.params.get(k) for k in diff},
            "metrics": {m: {**summarize(d.series.get(m, {}), better(m)), "better": better(m),
                            "points": len(d.series.get(m, {})),
                            "redone": d.logged.get(m, 0) - len(d.series.get(m, {})),
                            "series": [[s, v] for s, v in d.series.get(m, {}).items()]} for m in chosen},
        } for d in data],
    }


# ---- rendering -------------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def render_table(c: dict[str, Any]) -> str:
    runs = c["runs"]
    out = [_table([["run", "id", "experiment", "status"]] +
                  [[r["run_name"], r["run_id"], r["experiment"], r["status"]] for r in runs])]
    if c["differing_params"]:
        out.append("params that differ\n" + _table(
            [["param"] + [r["run_name"] for r in runs]] +
            [[k] + [_fmt(r["params"][k]) for r in runs] for k in c["differing_params"]]))
    else:
        out.append("params that differ: none" + (" (single run)" if len(runs) == 1 else ""))
    rows = [["metric", "run", "final", "@step", "best", "@step", "steps", "redone"]]
    for m in c["metrics"]:
        for i, r in enumerate(runs):
            s = r["metrics"][m]
            best = _fmt(s["best"]) + (f" ({s['better']})" if s["best"] is not None else "")
            rows.append([m if i == 0 else "", r["run_name"], _fmt(s["final"]), _fmt(s["final_step"]), best,
                         _fmt(s["best_step"]), str(s["points"]), str(s["redone"])])
    out.append(_table(rows) if c["metrics"] else "metrics: none of the default metrics were logged; pass --metrics")
    return "\n\n".join(out) + "\n"


def render_csv(c: dict[str, Any]) -> str:
    """One row per run: ids, the differing params, then final / best (with steps) of each metric."""
    head = ["run_id", "run_name", "experiment", "status"] + [f"param:{k}" for k in c["differing_params"]]
    for m in c["metrics"]:
        head += [f"{m}:final", f"{m}:final_step", f"{m}:best", f"{m}:best_step", f"{m}:steps"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for r in c["runs"]:
        row = [r["run_id"], r["run_name"], r["experiment"], r["status"]] + [r["params"][k] for k in c["differing_params"]]
        for m in c["metrics"]:
            s = r["metrics"][m]
            row += [s["final"], s["final_step"], s["best"], s["best_step"], s["points"]]
        w.writerow(["" if v is None else v for v in row])
    return buf.getvalue()


def render_json(c: dict[str, Any]) -> str:
    return json.dumps(c, indent=2) + "\n"


def plot(c: dict[str, Any], path: str) -> None:
    """One panel per metric, one line per run (redone steps counted once), written as PNG (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = c["metrics"]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(8, 3 * len(metrics)), dpi=100, squeeze=False)
    try:
        for ax, m in zip(axes[:, 0], metrics):
            for r in c["runs"]:
                pts = r["metrics"][m]["series"]
                if pts:
                    ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o" if len(pts) < 30 else None,
                            markersize=3, label=r["run_name"])
            ax.set(title=m, xlabel="step (rollout id)")
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
