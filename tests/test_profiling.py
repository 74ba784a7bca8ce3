"""--use-pytorch-profiler and --record-memory-history (engine/train/profiling.py): what is profiled, when, and where
the files go; the flags' checks. The CUDA allocator's history is checked on a GPU (tests/test_gpu_flow.py)."""
from __future__ import annotations

import gzip
import json
import logging

import pytest
from test_train_backend import make_cfg, make_worker, packed_rollout, stage_run

from engine.config import RunConfig
from engine.diagnosis import ConfigError


def trace_ops(path) -> set[str]:
    """The operator and annotation names in a gzipped Chrome trace (e.g. aten::mm, Optimizer.step#AdamW.step)."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return {e.get("name") for e in events if e.get("cat") in ("cpu_op", "user_annotation")}


def run_rollouts(cfg, tmp_path, ids):
    from engine.stages import train

    w = make_worker(cfg)
    w.profile_setup(str(tmp_path / "profile"), str(tmp_path / "profile"))
    run = stage_run(cfg, w)
    for i in ids:
        train(run, packed_rollout(i))
    return run


def test_the_profiler_records_the_window_and_the_targets_asked_for(tiny_model, tmp_path, caplog):
    """Rollout 1 of 0..2 profiled; train_actor: one trace per optimizer step (forward, backward and AdamW's update
    inside), train_log_probs: the no-grad forwards (here the old log-probs and the reference: --use-kl-loss), with
    no backward in them."""
    cfg = make_cfg(tiny_model, num_rollout=3, use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2,
                   profile_target=["train_actor", "train_log_probs"], use_kl_loss=True, kl_loss_coef=0.1,
                   logprob_mismatch_threshold=1e3)
    caplog.set_level(logging.INFO, logger="rollflow")
    run = run_rollouts(cfg, tmp_path, range(3))
    d = tmp_path / "profile"
    assert sorted(p.name for p in d.iterdir()) == ["train_actor_rollout1_step0_rank0.pt.trace.json.gz",
                                                  "train_log_probs_rollout1_rank0.pt.trace.json.gz"]
    step = trace_ops(d / "train_actor_rollout1_step0_rank0.pt.trace.json.gz")
    forwards = trace_ops(d / "train_log_probs_rollout1_rank0.pt.trace.json.gz")
    assert "aten::mm" in step and any("backward" in op.lower() for op in step)
    assert "Optimizer.step#AdamW.step" in step and "Optimizer.step#AdamW.step" not in forwards
    assert "aten::mm" in forwards and not any("backward" in op.lower() for op in forwards)
    # the driver logs every file; profile_end is asked for only inside the window
    logged = [r.getMessage() for r in caplog.records if "train rank 0 wrote" in r.getMessage()]
    assert len(logged) == 2 and all(m.startswith("rollout 1: ") and str(d) in m for m in logged)
    assert run.train_group.calls.count("profile_end") == 1


def test_no_log_prob_trace_where_no_forward_runs(tiny_model, tmp_path):
    """One step per rollout and no KL: the step's own forward gives the old log-probs, so nothing runs before it."""
    cfg = make_cfg(tiny_model, num_rollout=2, use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2,
                   profile_target=["train_log_probs"], logprob_mismatch_threshold=1e3)
    run_rollouts(cfg, tmp_path, range(2))
    assert not (tmp_path / "profile").exists()


def test_train_overall_is_one_trace_per_rollout_from_its_forwards_to_its_last_step(tiny_model, tmp_path):
    cfg = make_cfg(tiny_model, num_rollout=2, use_pytorch_profiler=True, profile_step_start=0, profile_step_end=1,
                   logprob_mismatch_threshold=1e3)
    run_rollouts(cfg, tmp_path, range(2))
    d = tmp_path / "profile"
    assert [p.name for p in d.iterdir()] == ["train_overall_rollout0_rank0.pt.trace.json.gz"]
    ops = trace_ops(d / "train_overall_rollout0_rank0.pt.trace.json.gz")
    assert "aten::mm" in ops and any("backward" in op.lower() for op in ops)


def test_a_rank_outside_profile_ranks_writes_nothing(tiny_model, tmp_path):
    from engine.train.profiling import TrainProfiler

    cfg = make_cfg(tiny_model, num_rollout=2, actor_num_gpus_per_node=2, use_pytorch_profiler=True,
                   profile_step_start=0, profile_step_end=2, profile_ranks=[1])
    for rank in (0, 1):
        p = TrainProfiler(cfg, rank=rank, device="cpu", directory=str(tmp_path / str(rank)), memory_dir="")
        p.begin(0)
        with p.region("train_actor", 0, "x"):
            pass
        assert bool(p.end(0)) == (rank == 1)
    assert not (tmp_path / "0").exists()


def test_a_profile_left_open_by_a_failed_rollout_is_written_as_unfinished(tiny_model, tmp_path):
    from engine.train.profiling import TrainProfiler

    cfg = make_cfg(tiny_model, num_rollout=3, use_pytorch_profiler=True, profile_step_start=0, profile_step_end=3)
    p = TrainProfiler(cfg, rank=0, device="cpu", directory=str(tmp_path), memory_dir="")
    p.begin(0)  # its steps failed: the driver never ended it; the retried rollout begins again
    p.begin(0)
    assert [f.rsplit("/", 1)[1] for f in p.end(0)] == ["train_overall_rollout0_unfinished_rank0.pt.trace.json.gz",
                                                       "train_overall_rollout0_rank0.pt.trace.json.gz"]


def test_the_files_go_under_the_work_dir_and_memory_snapshot_dir_as_the_driver_resolves_them(tmp_path, monkeypatch):
    from engine.run import Run
    from engine.stages import profile_dirs

    monkeypatch.chdir(tmp_path)
    run = Run(RunConfig(work_dir="w", record_memory_history=True))
    assert profile_dirs(run) == (str(tmp_path / "w" / "profile"),) * 2
    run = Run(RunConfig(work_dir="w", record_memory_history=True, memory_snapshot_dir="snaps"))
    assert profile_dirs(run) == (str(tmp_path / "w" / "profile"), str(tmp_path / "snaps"))


def test_memory_history_on_a_cpu_rank_fails_at_its_start_naming_the_flag(tiny_model, tmp_path):
    """Placement refuses it on a cluster without GPUs, before any worker starts; a CPU rank refuses it too."""
    from engine.stages import memory_recorder_fits
    from engine.train.profiling import TrainProfiler

    cfg = make_cfg(tiny_model, record_memory_history=True)
    with pytest.raises(ConfigError, match="records the CUDA caching allocator's history.*has no GPUs") as e:
        memory_recorder_fits(cfg, 0.0)
    assert "--memory-recorder memray" in e.value.diagnoses[0].fix
    memory_recorder_fits(cfg, 1.0)
    memory_recorder_fits(make_cfg(tiny_model, record_memory_history=True, memory_recorder="memray",
                                  memory_snapshot_num_steps=1), 0.0)
    with pytest.raises(RuntimeError, match="--record-memory-history records the CUDA caching allocator.*runs on cpu"):
        TrainProfiler(cfg, rank=0, device="cpu", directory=str(tmp_path), memory_dir=str(tmp_path))


@pytest.mark.parametrize("over, match", [
    (dict(profile_step_start=0), "--profile-step-start without --use-pytorch-profiler"),
    (dict(profile_target=["train_actor"]), "--profile-target without --use-pytorch-profiler"),
    (dict(memory_snapshot_num_steps=2), "--memory-snapshot-num-steps without --record-memory-history"),
    (dict(memory_snapshot_dir="/tmp/x"), "--memory-snapshot-dir without --record-memory-history"),
    (dict(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=2), "no rollout would be profiled"),
    (dict(use_pytorch_profiler=True, profile_step_start=10), r"rollout ids are 0\.\.3 \(--num-rollout 4\)"),
    (dict(use_pytorch_profiler=True, profile_step_start=0, profile_ranks=[0, 2]), r"rank\(s\) 2 do not exist"),
    (dict(use_pytorch_profiler=True, profile_step_start=0, profile_ranks=[-1]), "numbered from 0"),
    (dict(use_pytorch_profiler=True, profile_step_start=0, profile_target=["train_overall", "train_actor"]),
     "train_overall contains the other targets"),
    (dict(use_pytorch_profiler=True, profile_step_start=0, debug_rollout_only=True, save=None),
     "--use-pytorch-profiler profiles the train ranks, and --debug-rollout-only starts none"),
    (dict(record_memory_history=True, memory_snapshot_num_steps=5), "the run trains 4 rollouts"),
    (dict(record_memory_history=True, memory_snapshot_path="a/b.pickle"), "is a file name"),
])
def test_profiling_flags_that_would_do_nothing_are_refused(over, match):
    with pytest.raises(ConfigError, match=match) as e:
        RunConfig(num_rollout=4, **over)
    (d,) = e.value.diagnoses
    assert d.fix and d.facts["field"]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_trace_has_the_kernels_and_the_memory_snapshot_its_allocations(tiny_model, tmp_path):
    import pickle

    import torch

    from engine.train.profiling import TrainProfiler

    cfg = make_cfg(tiny_model, num_rollout=3, use_pytorch_profiler=True, profile_step_start=0, profile_step_end=1,
                   record_memory_history=True, memory_snapshot_num_steps=2, memory_snapshot_path="mem.pickle")
    p = TrainProfiler(cfg, rank=0, device="cuda", directory=str(tmp_path / "t"), memory_dir=str(tmp_path / "m"))
    kept = []
    for rollout in range(3):
        p.begin(rollout)
        x = torch.randn(512, 512, device="cuda")
        kept.append(x @ x)
        torch.cuda.synchronize()
        files = p.end(rollout)
        assert [f.rsplit("/", 1)[1] for f in files] == {
            0: ["train_overall_rollout0_rank0.pt.trace.json.gz"], 1: ["rank0_mem.pickle"], 2: []}[rollout]
    trace = tmp_path / "t" / "train_overall_rollout0_rank0.pt.trace.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA activity, not only the CPU side
    snap = pickle.loads((tmp_path / "m" / "rank0_mem.pickle").read_bytes())
    traces = [e for dev in snap["device_traces"] for e in dev]
    assert sum(e["action"] == "alloc" and e["size"] >= 512 * 512 * 4 for e in traces) >= 4  # rollouts 0 and 1
    assert not any(torch.cuda.memory._snapshot()["device_traces"])  # recording stopped after the snapshot
    # an out-of-memory error writes the allocator's state first
    q = TrainProfiler(make_cfg(tiny_model, record_memory_history=True), rank=0, device="cuda",
                      directory=str(tmp_path / "t"), memory_dir=str(tmp_path / "oom"))
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert (tmp_path / "oom" / "rank0_snapshot.pickle.oom").stat().st_size > 0
    torch.cuda.memory._record_memory_history(enabled=None)
    del q


def test_the_command_line_takes_several_targets_and_names_the_choices(capsys):
    from engine.config.cli import parse_args

    cfg = parse_args(["--num-rollout", "6", "--use-pytorch-profiler", "--profile-step-start", "3",
                      "--profile-target", "train_actor", "train_log_probs", "--profile-ranks", "0"])
    assert cfg.profile_target == ["train_actor", "train_log_probs"] and cfg.profile_ranks == [0]
    with pytest.raises(SystemExit):
        parse_args(["--use-pytorch-profiler", "--profile-target", "train_all"])
    assert "invalid choice: 'train_all' (choose from 'train_overall', 'train_actor', 'train_log_probs')" in \
        capsys.readouterr().err


def test_memray_records_the_ranks_host_allocations_until_the_rollout_asked_for(tiny_model, tmp_path):
    """--memory-recorder memray on the CPU: the file is closed once rollout --memory-snapshot-num-steps − 1 is
    trained (the driver asks then, and not again), and its allocations carry the trainer's Python stacks."""
    from memray import FileReader

    cfg = make_cfg(tiny_model, num_rollout=3, record_memory_history=True, memory_recorder="memray",
                   memory_snapshot_num_steps=2, logprob_mismatch_threshold=1e3)
    run = run_rollouts(cfg, tmp_path, range(3))
    assert run.train_group.calls.count("profile_end") == 1  # after rollout 1 only
    (f,) = (tmp_path / "profile").iterdir()
    assert f.name == "rank0_memray.bin"
    reader = FileReader(str(f))
    assert reader.metadata.total_allocations > 1000
    # what was alive at the peak was allocated by the trainer: its forward, loss and step
    functions = {frame[0] for rec in reader.get_high_watermark_allocation_records(merge_threads=True)
                 for frame in rec.stack_trace()}
    assert {"train_step", "packed_forward", "policy_loss"} <= functions, sorted(functions)[:60]
    with pytest.raises(ConfigError, match="--memory-snapshot-num-steps is not set"):
        make_cfg(tiny_model, record_memory_history=True, memory_recorder="memray")
    with pytest.raises(ConfigError, match="--memory-recorder without --record-memory-history"):
        make_cfg(tiny_model, memory_recorder="memray")
