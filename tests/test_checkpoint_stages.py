"""The save and convert stages with a real torch backend in this process (no Ray): what lands in an iteration
for --no-save-optim / --save-hf, and what a resumed, HF-started or --ref-load run loads."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import checkpoint, stages
from engine.data import PromptDataset, load_prompts
from engine.doctor import ConfigError
from engine.run import Run
from engine.train.torch_backend import TorchBackend


class NoEngines:
    """The engine pool's sync interface with no engines: sync() then only writes the weights (disk method)."""

    lock = threading.RLock()
    released = False

    def serving_slots(self) -> list:
        return []


class InProcessGroup:
    """TrainGroup's interface over one TorchBackend (rank 0 only)."""

    def __init__(self, cfg):
        self.backend = TorchBackend(cfg)

    def save(self, path, save_optim=True):
        return self.backend.save(path, save_optim=save_optim)

    def load(self, path, load_optim=True):
        self.backend.load(path, load_optim=load_optim)

    def load_weights(self, path, ref=False):
        self.backend.load_weights(path, ref=ref)

    def export_hf(self, path):
        self.backend.export_hf(path)

    def save_weights(self, path, engines=None):
        from engine.weights import save_weights_dir

        save_weights_dir(self.backend.model_state(), path)


def make_run(small_cfg, **over) -> Run:
    cfg = small_cfg(eval_prompt_data="", weight_sync_method="disk", **over)
    run = Run(cfg)
    stages.resolve_start(run)
    run.dataset = PromptDataset(load_prompts(cfg.prompt_data, input_key=cfg.input_key, label_key=cfg.label_key),
                                shuffle=False, seed=cfg.seed)
    run.engines = NoEngines()
    run.train_group = InProcessGroup(cfg)
    return run


def perturb(run: Run, by: float) -> None:
    with torch.no_grad():
        for p in run.train_group.backend.model.parameters():
            p.add_(by)


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_save_then_resume_restores_weights_data_and_history(small_cfg):
    run = make_run(small_cfg)
    perturb(run, 0.01)
    run.dataset.next_batch(5)
    run.record({"rollout/reward_mean": 0.5}, 0)
    rep = stages.save(run, 0)
    saved = params(run.train_group.backend.model)
    m = checkpoint.read_manifest(run.cfg.save, 0)
    assert m["resumable"] is True and "optim/state.pt" in m["files"] and "hf_config/config.json" in m["files"]
    assert m["data_state"] == {"epoch": 0, "offset": 5} and rep.metrics["save/mb"] > 0

    again = make_run(small_cfg)  # the same command, restarted
    assert (again.start.kind, again.start.automatic) == ("checkpoint", True)
    assert stages.convert(again) == 1
    got = params(again.train_group.backend.model)
    assert all(torch.equal(saved[k], got[k]) for k in saved)
    assert again.dataset.state() == {"epoch": 0, "offset": 5} and again.history["rollout/reward_mean"] == {0: 0.5}


def test_no_save_optim_and_save_hf(small_cfg):
    from transformers import AutoModelForCausalLM

    run = make_run(small_cfg, save_optim=False, save_hf=True)
    perturb(run, 0.02)
    stages.save(run, 0)
    d = Path(run.cfg.save) / "iter_0000000"
    m = checkpoint.read_manifest(run.cfg.save, 0)
    assert m["resumable"] is False and not (d / "optim").exists()
    assert "hf/model.safetensors" in m["files"] and "hf/config.json" in m["files"]  # hashed like the rest
    hf = AutoModelForCausalLM.from_pretrained(d / "hf")
    want = load_file(str(d / "model" / "model.safetensors"))
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in want.items())
    with pytest.raises(ConfigError) as e:  # resuming needs the optimizer state
        make_run(small_cfg, save_optim=False)
    assert "--no-load-optim" in str(e.value)
    run2 = make_run(small_cfg, load_optim=False)
    assert stages.convert(run2) == 1


def test_hf_load_sets_policy_and_reference_and_ref_load_overrides(small_cfg, tmp_path, tiny_model):
    src = make_run(small_cfg, save=str(tmp_path / "src"))
    perturb(src, 0.03)
    stages.save(src, 0)
    src.train_group.backend.model.save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / "hf" / name).write_bytes((Path(tiny_model) / name).read_bytes())
    want = params(src.train_group.backend.model)

    run = make_run(small_cfg, save=str(tmp_path / "a"), load=str(tmp_path / "hf"))
    assert (run.start.kind, run.ref_dir) == ("hf", str(tmp_path / "hf"))
    assert stages.convert(run) == 0
    b = run.train_group.backend
    assert all(torch.equal(want[k], b.model.state_dict()[k]) for k in want)
    assert all(torch.equal(want[k], b._ref_model().state_dict()[k]) for k in want)  # KL = 0 at the first step

    run = make_run(small_cfg, save=str(tmp_path / "b"), ref_load=str(tmp_path / "src"))
    stages.convert(run)
    b = run.train_group.backend
    assert all(torch.equal(want[k], b._ref_model().state_dict()[k]) for k in want)
    assert not torch.equal(want["model.norm.weight"], b.model.state_dict()["model.norm.weight"])  # policy: HF init


def test_async_save_commits_the_state_of_the_save_not_of_the_commit(small_cfg):
    """--async-save: the trainer trains on while the commit runs, so what lands must be the state when the save
    stage wrote it; the resume point moves only at the commit."""
    run = make_run(small_cfg, async_save=True)
    perturb(run, 0.01)
    staged = stages.stage_save(run, 0)
    saved = params(run.train_group.backend.model)
    assert checkpoint.read_marker(run.cfg.save) is None  # nothing to resume from until the commit
    perturb(run, 0.5)  # the next step trains while the commit runs
    rep = stages.commit_save(run, staged)
    assert checkpoint.read_marker(run.cfg.save) == 0 and rep.metrics["save/commit_seconds"] > 0
    again = make_run(small_cfg)
    assert stages.convert(again) == 1
    got = params(again.train_group.backend.model)
    assert all(torch.equal(saved[k], got[k]) for k in saved)


class _Future:
    def __init__(self, log, rollout_id, error=None):
        self.log, self.rollout_id, self.error, self.done = log, rollout_id, error, False
        self.state = type("S", (), {"is_final": lambda s: self.done})()

    def result(self, timeout=None):
        self.log.append(f"waited commit-{self.rollout_id}")
        if self.error:
            raise self.error
        return "uri"


def test_async_saves_commit_one_at_a_time_in_order_and_a_failed_commit_stops_the_loop():
    from types import SimpleNamespace

    from flows.train import _Saves

    log, futures = [], {}

    def submit(r, rollout_id, staged):
        log.append(f"commit-{rollout_id} of {staged.unquote()}")  # quoted: Prefect does not walk it
        futures[rollout_id] = _Future(log, rollout_id, OSError("upload failed") if rollout_id == 2 else None)
        return futures[rollout_id]

    t = SimpleNamespace(save=lambda r, i: log.append(f"save-{i}") or f"staged-{i}",
                        commit=SimpleNamespace(submit=submit))
    run = SimpleNamespace(cfg=SimpleNamespace(async_save=True), tracker=None,
                          record=lambda m, step: log.append(f"{sorted(m)} at {step}"))
    saves = _Saves(t, None, run)
    saves.save(0)
    saves.check()  # commit 0 still running: the loop goes on without waiting
    saves.save(1)  # ... but the next save waits for it first
    assert log == ["['save/wait_seconds'] at 0", "save-0", "commit-0 of staged-0", "waited commit-0",
                   "['save/wait_seconds'] at 1", "save-1", "commit-1 of staged-1"]
    futures[1].done = True
    saves.check()  # a landed commit is collected at the next step
    assert log[-1] == "waited commit-1" and saves.pending is None
    saves.save(2)
    futures[2].done = True
    with pytest.raises(OSError, match="upload failed"):  # a failed commit fails the run at the next step
        saves.check()
    saves.save(3)
    futures[3].error = RuntimeError("killed")
    said, handler = [], logging.Handler()
    handler.emit = lambda rec: said.append(rec.getMessage())
    logging.getLogger("rollflow.checkpoint").addHandler(handler)
    try:
        saves.settle()  # a later stage failed: the commit is waited for, its own failure logged, not raised
    finally:
        logging.getLogger("rollflow.checkpoint").removeHandler(handler)
    assert "rollflow: the checkpoint of rollout 3 did not commit: killed" in said and saves.pending is None
    assert saves.drain() == 0.0
