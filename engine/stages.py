"""The stages of one run, called by the Prefect tasks (one call per task) or directly without Prefect.

place → convert → [rollout → pack → train → save → sync] per rollout id → evaluate.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from engine import checkpoint, faults
from engine.config import RunConfig
from engine.doctor.checks import Environment, run_preflight
from engine.doctor.diagnosis import ConfigError, Diagnosis
from engine.packing.microbatch import MicroBatch
from engine.run import Run
from engine.samples import Sample

log = logging.getLogger("rollflow")


# ---- preflight -------------------------------------------------------------------------------------------------
def preflight(cfg: RunConfig, env: Environment | None = None) -> list[Diagnosis]:
    """Every check; raises ConfigError when any is an error (nothing has started yet)."""
    diags = run_preflight(cfg, env or Environment.for_config(cfg))
    errors = [d for d in diags if d.severity == "error"]
    if errors:
        raise ConfigError(diags)
    return diags


# ---- place -----------------------------------------------------------------------------------------------------
def resolve_start(run: Run) -> checkpoint.StartPoint:
    """Where the run starts (engine/checkpoint/resolve.py has the rules), verified; then clean --save's leftovers.

    Fills run.start, run.ref_dir and run.store; the notes (fallbacks, clean-ups) go to the log and an artifact.
    """
    cfg = run.cfg
    shutil.rmtree(run.staging, ignore_errors=True)  # downloads of an earlier (killed) attempt
    start = checkpoint.resolve_start(load=cfg.load, save=cfg.save, ckpt_step=cfg.ckpt_step,
                                     load_optim=cfg.load_optim, staging=run.staging / "load")
    run.ref_dir = checkpoint.resolve_ref(ref_load=cfg.ref_load, ref_ckpt_step=cfg.ref_ckpt_step, load=cfg.load,
                                         start=start, staging=run.staging / "load")
    if cfg.save:
        run.store = checkpoint.Store(cfg.save)
        for gone in checkpoint.clean_leftovers(run.store, checkpoint.read_marker(run.store)):
            start.notes.append(f"deleted {gone}, left by a save that was killed before its marker")
    for note in start.notes:  # the convert task reports them as warnings and an artifact
        log.info(note)
    log.info("rollflow: %s", start.describe())
    run.start = start
    return start


def _mlflow_run_id(run: Run) -> str | None:
    """The MLflow run to continue: the checkpoint's, else the one a killed fresh attempt recorded in --save."""
    if run.start.kind == "checkpoint":
        return run.start.manifest.get("mlflow_run_id")
    ident = checkpoint.read_run_file(run.store) if run.store else None
    if ident and ident.get("config_hash") == run.cfg.config_hash() and ident.get("origin") == run.origin:
        return ident.get("mlflow_run_id")
    return None


def place(cfg: RunConfig, *, flow_run_id: str | None = None, flow_run_url: str | None = None) -> Run:
    """Start (or join) Ray, read the data, start the rollout engines and the train workers, open tracking."""
    from engine import cluster
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import eos_token_ids, load_tokenizer
    from engine.rewards import RewardModel
    from engine.tracking import Tracker, default_tracking_uri

    run = Run(cfg)
    run.flow_run_id, run.flow_run_url = flow_run_id, flow_run_url
    run.work_dir.mkdir(parents=True, exist_ok=True)
    resolve_start(run)
    run.tokenizer = load_tokenizer(cfg.hf_checkpoint)
    run.eos_ids = eos_token_ids(cfg.hf_checkpoint, run.tokenizer)
    rows = load_prompts(cfg.prompt_data, input_key=cfg.input_key, label_key=cfg.label_key,
                        metadata_key=cfg.metadata_key)
    run.dataset = PromptDataset(rows, shuffle=cfg.rollout_shuffle, seed=cfg.seed)
    if cfg.eval_prompt_data:
        run.eval_rows = load_prompts(cfg.eval_prompt_data, input_key=cfg.input_key, label_key=cfg.label_key,
                                     metadata_key=cfg.metadata_key,
                                     flag="--eval-prompt-data")[: cfg.eval_max_samples]
    run.reward_model = RewardModel(cfg.rm_type, cfg.custom_rm_path, cfg.group_rm)

    run.tracker = Tracker(default_tracking_uri(str(run.work_dir), cfg.mlflow_tracking_uri), cfg.experiment_name)
    tags = {"rollflow.config_hash": cfg.config_hash(), "rollflow.model": cfg.hf_checkpoint,
            "rollflow.dataset": cfg.prompt_data, "rollflow.save": run.store.url if run.store else ""}
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
    if flow_run_url:
        tags["prefect.flow_run_url"] = flow_run_url
    previous = _mlflow_run_id(run)
    if previous:  # one tag per restart (a unique key), e.g. rollflow.resume.20260101-120000-123456
        tags[f"rollflow.resume.{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}"] = (
            run.start.describe() + "".join(f"; {n}" for n in run.start.notes))[:5000]
    run_name = cfg.run_name or f"{cfg.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run.tracker.start(run_name, previous, tags)
    run.tracker.log_params(cfg.flat_params())
    if run.store and run.start.kind != "checkpoint" and run.tracker.run_id and run.tracker.run_id != previous:
        checkpoint.write_run_file(run.store, {"mlflow_run_id": run.tracker.run_id, "config_hash": cfg.config_hash(),
                                              "origin": run.origin, "created_at": time.time()})

    run.cluster = cluster.connect(cfg.ray_address, cfg.num_cpus)
    run.engines = cluster.start_builtin_engines(cfg.hf_checkpoint, cfg.rollout_num_engines,
                                                threads=run.threads_per_process,
                                                max_new_tokens=cfg.rollout_max_response_len)
    run.train_group = cluster.TrainGroup(cfg, train_iters=run.plan.train_iters, timeout_s=cfg.train_step_timeout,
                                         threads=run.train_threads)
    return run


# ---- convert ---------------------------------------------------------------------------------------------------
def convert(run: Run) -> int:
    """Load the starting weights (HF weights, or the resumed iteration) into trainers and engines.

    Returns the first rollout id to run (marker + 1 when resuming, 0 for starting weights).
    """
    s = run.start
    if s.kind == "checkpoint":
        run.train_group.load(s.local_dir, load_optim=run.cfg.load_optim)
        if s.manifest.get("data_state"):
            run.dataset.load_state(s.manifest["data_state"])
        run.history = {k: {int(i): v for i, v in d.items()} for k, d in s.manifest.get("history", {}).items()}
    elif s.kind == "hf":
        run.train_group.load_weights(s.local_dir)
    if run.ref_dir:
        run.train_group.load_weights(run.ref_dir, ref=True)
    run.start_rollout_id = s.next_rollout_id
    if s.kind != "fresh":
        sync(run, s.next_rollout_id - 1)
    shutil.rmtree(run.staging / "load", ignore_errors=True)  # loaded everywhere; S3 downloads are not needed
    return run.start_rollout_id


# ---- rollout ---------------------------------------------------------------------------------------------------
@dataclass
class RolloutBatch:
    rollout_id: int
    groups: list[list[Sample]]
    metrics: dict[str, float]


def sampling_params(run: Run, *, greedy: bool = False):
    from engine.rollout.loop import SamplingParams

    cfg = run.cfg
    return SamplingParams(max_new_tokens=cfg.rollout_max_response_len,
                          temperature=0.0 if greedy else cfg.rollout_temperature, top_p=cfg.rollout_top_p,
                          top_k=cfg.rollout_top_k, stop=list(cfg.rollout_stop),
                          stop_token_ids=list(cfg.rollout_stop_token_ids))


def rollout(run: Run, rollout_id: int) -> RolloutBatch:
    from engine.modeling import render_prompt
    from engine.rollout.loop import generate_rollout, rollout_metrics

    cfg = run.cfg
    t0 = time.perf_counter()
    position = run.dataset.state()
    rows = run.dataset.next_batch(cfg.rollout_batch_size)
    prompt_ids = [render_prompt(run.tokenizer, r.prompt, cfg.apply_chat_template) for r in rows]
    try:
        groups = generate_rollout(rows, rollout_id=rollout_id, prompt_ids=prompt_ids, urls=run.engines.urls,
                                  n=cfg.n_samples_per_prompt, params=sampling_params(run),
                                  reward_model=run.reward_model, seed=cfg.seed,
                                  concurrency=cfg.rollout_concurrency, timeout_s=cfg.rollout_timeout,
                                  deterministic=cfg.deterministic_rollout)
    except BaseException:
        run.dataset.load_state(position)  # a retried rollout takes the same prompts
        raise
    faults.at("after_rollout", rollout_id)
    return RolloutBatch(rollout_id, groups, rollout_metrics(groups, time.perf_counter() - t0,
                                                            cfg.rollout_max_response_len))


# ---- pack ------------------------------------------------------------------------------------------------------
@dataclass
class PackedRollout:
    rollout_id: int
    per_rank_steps: list[list[list[MicroBatch]]]  # [rank][step][micro-batch]
    metrics: dict[str, float]


def pack(run: Run, batch: RolloutBatch) -> PackedRollout:
    """Advantages per sample, then the DP schedule, then packed micro-batches per rank and step."""
    import torch

    from engine.algorithms import grpo_advantages
    from engine.packing.microbatch import make_micro_batch
    from engine.packing.schedule import build_dp_schedule

    cfg, plan = run.cfg, run.plan
    samples = [s for g in batch.groups for s in g]
    adv = grpo_advantages(torch.tensor([s.scalar_reward for s in samples]), cfg.n_samples_per_prompt).tolist()
    steps = build_dp_schedule([len(s.tokens) for s in samples], dp_size=plan.dp_size,
                              global_batch_size=plan.global_batch_size,
                              max_tokens_per_gpu=cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None,
                              micro_batch_size=cfg.micro_batch_size)
    per_rank = [[[make_micro_batch([samples[i] for i in mb], [adv[i] for i in mb]) for mb in step.ranks[r]]
                 for step in steps] for r in range(plan.dp_size)]
    real = sum(len(s.tokens) for s in samples)
    n_mb = sum(len(step.ranks[r]) for step in steps for r in range(plan.dp_size))
    return PackedRollout(batch.rollout_id, per_rank, {"pack/micro_batches": float(n_mb),
                                                      "pack/tokens": float(real),
                                                      "pack/micro_batches_per_rank": n_mb / plan.dp_size})


# ---- train -----------------------------------------------------------------------------------------------------
def train(run: Run, packed: PackedRollout) -> dict[str, float]:
    """num_steps_per_rollout optimizer steps over the packed rollout, on every DP rank."""
    from engine.train.backend import reduce_metrics

    cfg = run.cfg
    t0 = time.perf_counter()
    # KL to the reference is always reported (one extra no-grad forward); it is a loss term with --use-kl-loss.
    run.train_group.set_rollout(packed.per_rank_steps, need_ref=True)
    per_step = []
    for k in range(run.plan.num_steps_per_rollout):
        parts = run.train_group.train_step(k, run.plan.global_batch_size)
        faults.at("during_train", packed.rollout_id)
        m = reduce_metrics(parts)
        m["loss"] = sum(p["loss_total"] for p in parts)
        per_step.append(m)
    secs = time.perf_counter() - t0
    out = {f"train/{k}": sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]
           if k not in ("loss_total", "tokens")}
    out["train/grad_norm_max"] = max(s["grad_norm"] for s in per_step)
    out["train/seconds"] = secs
    out["train/tokens_per_s"] = packed.metrics["pack/tokens"] / max(secs, 1e-9)
    out["train/skipped_steps"] = per_step[-1]["skipped_steps"]
    return out


# ---- save ------------------------------------------------------------------------------------------------------
def should_save(cfg: RunConfig, rollout_id: int) -> bool:
    if not cfg.save:
        return False
    last = rollout_id == cfg.num_rollout - 1
    return last or (cfg.save_interval is not None and (rollout_id + 1) % cfg.save_interval == 0)


def save(run: Run, rollout_id: int) -> checkpoint.SaveReport:
    """iter_%07d (backend state + hf_config/ [+ hf/]) with its manifest, then the marker, then retention."""
    from engine.convert import copy_hf_config

    cfg = run.cfg
    manifest = {"data_state": run.dataset.state(), "mlflow_run_id": run.tracker.run_id if run.tracker else None,
                "prefect_flow_run_id": run.flow_run_id, "config_hash": cfg.config_hash(), "origin": run.origin,
                "history": {k: {str(i): v for i, v in d.items()} for k, d in run.history.items()},
                "train_backend": cfg.train_backend, "resumable": cfg.save_optim, "seed": cfg.seed,
                "rng": "per-rank python/numpy/torch RNG states in optim/state.pt; rollout sampling seeds are "
                       "sha256(seed:rollout_id:index)", "hf_checkpoint": cfg.hf_checkpoint}

    def write_state(path: str) -> None:
        run.train_group.save(path, save_optim=cfg.save_optim)
        copy_hf_config(cfg.hf_checkpoint, Path(path) / "hf_config")
        if cfg.save_hf:
            run.train_group.export_hf(str(Path(path) / "hf"))

    return checkpoint.save_iteration(run.store, rollout_id, write_state, manifest, staging=run.staging / "save",
                                     keep_last_n=cfg.keep_last_n)


# ---- sync ------------------------------------------------------------------------------------------------------
def sync(run: Run, rollout_id: int) -> dict[str, float]:
    """Trainer → engines from disk: write weights v<id+1>, every engine loads them, delete the directory."""
    import shutil

    from engine.rollout.client import EngineClient

    t0 = time.perf_counter()
    version = rollout_id + 1
    path = run.work_dir / "weights" / f"v{version:06d}"
    run.train_group.save_weights(str(path))
    size = sum(f.stat().st_size for f in path.glob("*"))
    for url in run.engines.urls:
        EngineClient(url, timeout_s=run.cfg.train_step_timeout).update_weights_from_disk(str(path), version)
    shutil.rmtree(path, ignore_errors=True)
    run.weight_version = version
    secs = time.perf_counter() - t0
    return {"sync/seconds": secs, "sync/mb": size / 2**20, "sync/weight_version": float(version)}


# ---- evaluate --------------------------------------------------------------------------------------------------
def evaluate(run: Run) -> float | None:
    """Greedy accuracy (mean reward, one sample per prompt) on the eval prompts, on the engines."""
    from engine.data import PromptRow
    from engine.modeling import render_prompt
    from engine.rollout.loop import generate_rollout

    if not run.eval_rows:
        return None
    rows: list[PromptRow] = run.eval_rows
    prompt_ids = [render_prompt(run.tokenizer, r.prompt, run.cfg.apply_chat_template) for r in rows]
    groups = generate_rollout(rows, rollout_id=-1, prompt_ids=prompt_ids, urls=run.engines.urls, n=1,
                              params=sampling_params(run, greedy=True), reward_model=run.reward_model,
                              seed=run.cfg.seed, concurrency=run.cfg.rollout_concurrency,
                              timeout_s=run.cfg.rollout_timeout)
    return sum(g[0].scalar_reward for g in groups) / len(groups)


# ---- summary ---------------------------------------------------------------------------------------------------
def summary(run: Run, *, acc_before: float | None, acc_after: float | None) -> dict[str, Any]:
    rewards = run.history.get("rollout/reward_mean", {})
    ids = sorted(rewards)
    first = [rewards[i] for i in ids[:3]]
    last = [rewards[i] for i in ids[-3:]]
    return {
        "rollouts": len(ids),
        "reward_first": sum(first) / len(first) if first else None,
        "reward_last": sum(last) / len(last) if last else None,
        "test_accuracy_before": acc_before,
        "test_accuracy_after": acc_after,
        "wall_s": time.time() - run.started_at,
        "mlflow_run_id": run.tracker.run_id if run.tracker else None,
        "mlflow_tracking_uri": run.tracker.uri if run.tracker else None,
        "flow_run_id": run.flow_run_id,
        "flow_run_url": run.flow_run_url,
        "save_dir": run.store.url if run.store else None,
        "last_checkpoint": checkpoint.read_marker(run.store) if run.store else None,
        "started_from": run.start.describe() if run.start else None,
    }
