"""--use-wandb: the W&B mirror, run offline (no server): what the flow wrote is read back from W&B's own run file
(its record log of protobuf records), so every check is on what `wandb sync` would upload."""
from __future__ import annotations

import importlib.util
import json
import struct
import warnings
from pathlib import Path

import pytest

from engine.config import RunConfig
from engine.diagnosis import ConfigError

# wandb is a dev dependency: imported by the tests that use it, not at collection (the other tests never load it)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb (pip install wandb)")

SECRET = "wandbkey-0123456789abcdef0123456789abcdef"


def wandb_records(run_dir: Path) -> list:
    """The protobuf Records of an offline run's `run-<id>.wandb` file: W&B's record log (a ':W&B' header, then
    32 KiB blocks of records with a 7-byte header: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, chunks, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 0:
            break
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            chunks.append(part + chunk)
    out = []
    for c in chunks:
        r = pb.Record()
        r.ParseFromString(c)
        out.append(r)
    return out


def history(records) -> list[dict]:
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def run_record(records):
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return run


def test_wandb_flags_need_use_wandb_and_reach_wandb_init(tmp_path, monkeypatch):
    import wandb

    from engine.tracking.wandb_mirror import WandbMirror

    with pytest.raises(ConfigError, match="--wandb-project, --wandb-mode offline without --use-wandb"):
        RunConfig(wandb_project="p", wandb_mode="offline")
    assert RunConfig(use_wandb=True, wandb_key=SECRET).config_hash() == RunConfig().config_hash()

    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or object())
    cfg = RunConfig(use_wandb=True, work_dir=str(tmp_path), wandb_project="rl", wandb_team="lab",
                    wandb_group="sweep", wandb_mode="offline", wandb_host="https://wandb.example.org",
                    wandb_key=SECRET, experiment_name="exp")
    WandbMirror.start(cfg, run_name="r1", run_id="0123abcd", config={"lr": 1.0, "wandb_key": SECRET})
    assert (seen["project"], seen["entity"], seen["group"], seen["mode"], seen["name"]) == \
        ("rl", "lab", "sweep", "offline", "r1")
    assert seen["id"] == "0123abcd" and seen["resume"] == "allow" and seen["dir"] == str(tmp_path / "wandb")
    assert seen["settings"].api_key == SECRET and seen["settings"].base_url == "https://wandb.example.org"
    assert seen["config"] == {"lr": 1.0, "wandb_key": "<redacted>"}
    WandbMirror.start(RunConfig(use_wandb=True, wandb_run_id="given", work_dir=str(tmp_path)), run_name="r",
                      run_id="0123abcd", config={})
    assert seen["id"] == "given" and seen["project"] == "rollflow"  # --wandb-run-id; the experiment's name
    # slime's names: the run named --wandb-group exactly (rollflow's names carry no random suffix to drop)
    WandbMirror.start(RunConfig(use_wandb=True, wandb_group="sweep", disable_wandb_random_suffix=True,
                                work_dir=str(tmp_path)), run_name="r", run_id="0123abcd", config={})
    assert seen["name"] == seen["group"] == "sweep"
    with pytest.raises(ConfigError, match="names the W&B run --wandb-group, which is not set"):
        RunConfig(use_wandb=True, disable_wandb_random_suffix=True)
    with pytest.raises(ConfigError, match="--disable-wandb-random-suffix without --use-wandb"):
        RunConfig(disable_wandb_random_suffix=True)


def test_wandb_always_use_train_step_puts_every_section_on_the_optimizer_steps(monkeypatch, tmp_path):
    """slime's --wandb-always-use-train-step: rollout/, train/, eval/ … share the `train/step` axis, the optimizer
    steps taken (the step × --num-steps-per-rollout, here 4); system/* keeps its seconds; unset, each section has
    its own axis at the step as logged."""
    from engine.tracking.wandb_mirror import WandbMirror

    class Run:
        def __init__(self):
            self.axes, self.logged = {}, []

        def define_metric(self, name, step_metric=None):
            self.axes[name] = step_metric

        def log(self, row):
            self.logged.append(row)

    def mirrored(**over):
        run = Run()
        monkeypatch.setattr("wandb.init", lambda **kw: run)
        cfg = RunConfig(use_wandb=True, work_dir=str(tmp_path), rollout_batch_size=8, n_samples_per_prompt=8,
                        global_batch_size=16, **over)
        mirror = WandbMirror.start(cfg, run_name="r", run_id="0123abcd", config={})
        mirror.log({"rollout/reward_mean": 0.5, "train/loss": 0.1}, step=3)
        mirror.log({"eval/test_accuracy": 0.7}, step=4)
        mirror.log({"system/cpu_percent": 50.0}, step=120)
        return run

    run = mirrored(wandb_always_use_train_step=True)
    assert run.logged == [{"rollout/reward_mean": 0.5, "train/step": 12}, {"train/loss": 0.1, "train/step": 12},
                          {"eval/test_accuracy": 0.7, "train/step": 16},
                          {"system/cpu_percent": 50.0, "system/step": 120}]
    assert run.axes["rollout/*"] == run.axes["eval/*"] == "train/step" and run.axes["system/*"] == "system/step"
    run = mirrored()
    assert [r.get("rollout/step", r.get("train/step", r.get("eval/step"))) for r in run.logged[:3]] == [3, 3, 4]
    assert run.axes["rollout/*"] == "rollout/step" and run.axes["eval/*"] == "eval/step"
    with pytest.raises(ConfigError, match="--wandb-always-use-train-step without --use-wandb"):
        RunConfig(wandb_always_use_train_step=True)


@pytest.mark.slow
def test_a_run_and_its_resume_mirror_every_metric_into_one_wandb_run(prefect_harness, shared_ray, small_cfg,
                                                                     tmp_path):
    """Two rollouts, then a resume to three: one W&B run (the MLflow run's id) holds every rollout's metrics
    against rollout/step and the evaluations against eval/step, with the same values as the run's history; the
    run's flags are its config, the key redacted; the key is in no file W&B wrote."""
    from flows.train import rl_train

    wdir = tmp_path / "wandb"
    over = dict(use_wandb=True, wandb_mode="offline", wandb_dir=str(wdir), wandb_group="sweep-1", wandb_key=SECRET)
    first = rl_train(small_cfg(num_rollout=2, **over))
    second = rl_train(small_cfg(num_rollout=3, **over))
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    import psutil

    assert not [c for c in psutil.Process().children(recursive=True) if "wandb" in " ".join(c.cmdline())]
    runs = sorted((wdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    records = [wandb_records(r) for r in runs]
    ids = {run_record(rs).run_id for rs in records}
    assert ids == {first["mlflow_run_id"]}, ids  # the resume continued the same W&B run
    run = run_record(records[0])
    assert (run.project, run.run_group) == ("tests", "sweep-1")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["lr"] == 1e-4 and config["wandb_key"] == "<redacted>" and config["wandb_group"] == "sweep-1"

    rows = history(records[0]) + history(records[1])
    rollout = {r["rollout/step"]: r for r in rows if "rollout/step" in r and "rollout/reward_mean" in r}
    assert sorted(rollout) == [0, 1, 2]
    for i in range(3):
        assert rollout[i]["rollout/reward_mean"] == second["history"]["rollout/reward_mean"][str(i)]
    evals = {r["eval/step"]: r["eval/test_accuracy"] for r in rows if "eval/test_accuracy" in r}
    done = {**first["history"]["eval/test_accuracy"], **second["history"]["eval/test_accuracy"]}
    assert evals == {int(k): v for k, v in done.items()} and sorted(evals) == [0, 2, 3], evals  # 2: the first end
    assert any("train/loss" in r and "train/step" in r for r in rows)
    for f in wdir.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_a_wandb_failure_is_reported_once_and_training_goes_on(tmp_path, monkeypatch):
    import wandb

    from engine.tracking import TrackingWarning
    from engine.tracking.wandb_mirror import WandbMirror

    class Broken:
        calls = 0

        def define_metric(self, *a, **k):
            pass

        def log(self, *a, **k):
            Broken.calls += 1
            raise ConnectionError(f"upload refused, key {SECRET}")

    m = WandbMirror(Broken(), SECRET)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m.log({"rollout/a": 1.0}, 0)
        m.log({"rollout/a": 2.0}, 1)
    assert Broken.calls == 1 and len(seen) == 1 and issubclass(seen[0].category, TrackingWarning)
    assert "upload refused" in str(seen[0].message) and SECRET not in str(seen[0].message)

    def refuse(**kw):
        raise RuntimeError(f"API key {kw['settings'].api_key} refused")

    monkeypatch.setattr(wandb, "init", refuse)
    cfg = RunConfig(use_wandb=True, work_dir=str(tmp_path), wandb_key=SECRET)
    with pytest.warns(TrackingWarning, match="did not start: RuntimeError: API key <redacted> refused"):
        assert WandbMirror.start(cfg, run_name="r", run_id="abc", config={}) is None
