"""--use-tensorboard: the TensorBoard mirror. What a run wrote is read back from its event files (TFRecord framing
of tensorboard Event protos), so the checks are on what `tensorboard --logdir` shows."""
from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from engine.config import RunConfig
from engine.diagnosis import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorboardX") is None,
                                reason="needs tensorboardX (pip install tensorboardX)")


def scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag → {step: value} over every events file under `directory` (TFRecords: u64 length, u32 crc, data, u32
    crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    files = sorted(directory.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {directory}"
    for f in files:
        data, pos = f.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[int(ev.step)] = v.simple_value
    return out


def test_tensorboard_flags_and_where_the_files_go(tmp_path, monkeypatch):
    from engine.tracking.tb_mirror import TensorboardMirror, log_dir

    with pytest.raises(ConfigError, match="--tb-project-name without --use-tensorboard"):
        RunConfig(tb_project_name="p")
    with pytest.raises(ConfigError, match="--tb-experiment-name names a directory under --tb-project-name"):
        RunConfig(use_tensorboard=True, tb_experiment_name="e")
    assert RunConfig(use_tensorboard=True).config_hash() == RunConfig().config_hash()
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert log_dir(RunConfig(use_tensorboard=True, work_dir="w"), "run-1") == Path("w/tensorboard/run-1")
    cfg = RunConfig(use_tensorboard=True, tb_project_name="proj", tb_experiment_name="exp")
    assert log_dir(cfg, "run-1") == Path("tensorboard_log/proj/exp")  # slime's layout
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "env"))
    assert log_dir(cfg, "run-1") == tmp_path / "env"
    mirror = TensorboardMirror.start(cfg, run_name="run-1")
    mirror.log({"rollout/reward_mean": 0.5, "eval/test_accuracy": 0.25}, 3)
    mirror.finish(ok=True)
    assert scalars(tmp_path / "env") == {"rollout/reward_mean": {3: 0.5}, "eval/test_accuracy": {3: 0.25}}


def test_a_tensorboard_failure_is_reported_once_and_training_goes_on(tmp_path):
    from engine.tracking import TrackingWarning
    from engine.tracking.tb_mirror import TensorboardMirror

    class Broken:
        calls = 0

        def add_scalar(self, *a):
            Broken.calls += 1
            raise OSError("disk full")

        def close(self):
            pass

    mirror = TensorboardMirror(Broken(), tmp_path)
    with pytest.warns(TrackingWarning, match="TensorBoard .* stopped: OSError: disk full"):
        mirror.log({"a/b": 1.0}, 0)
    mirror.log({"a/b": 2.0}, 1)  # stopped: no second call, no second warning
    assert Broken.calls == 1
    mirror.finish(ok=False)


@pytest.mark.slow
def test_a_run_and_its_resume_write_every_metric_to_tensorboard(prefect_harness, shared_ray, small_cfg, tmp_path,
                                                               monkeypatch):
    """Two rollouts, then a resume to three, into one --tb-project-name / --tb-experiment-name directory: every
    rollout's metrics at its rollout id and the evaluations at the rollouts trained, equal to the run's history."""
    from flows.train import rl_train

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    over = dict(use_tensorboard=True, tb_project_name="proj", tb_experiment_name="exp")
    first = rl_train(small_cfg(num_rollout=2, **over))
    second = rl_train(small_cfg(num_rollout=3, **over))
    got = scalars(tmp_path / "tensorboard_log" / "proj" / "exp")
    h = second["history"]
    assert got["rollout/reward_mean"] == {int(k): pytest.approx(v) for k, v in h["rollout/reward_mean"].items()}
    assert sorted(got["rollout/reward_mean"]) == [0, 1, 2] and sorted(got["train/loss"]) == [0, 1, 2]
    evals = {**first["history"]["eval/test_accuracy"], **h["eval/test_accuracy"]}
    assert got["eval/test_accuracy"] == {int(k): pytest.approx(v) for k, v in evals.items()}
    assert sorted(got["eval/test_accuracy"]) == [0, 2, 3]
