"""Preflight checks: pure functions `(RunConfig, Environment) -> list[Diagnosis]`, registered by code.

The Environment is a view of the cluster and the files, so every check is testable with a fake view.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.checkpoint import MARKER, list_iterations, read_marker
from engine.doctor.diagnosis import ConfigError, Diagnosis

Check = Callable[["object", "Environment"], list[Diagnosis]]
CHECKS: dict[str, list[Check]] = {}


def check(code: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS.setdefault(code, []).append(fn)
        return fn
    return register


@dataclass
class Environment:
    """What the checks may look at besides the config."""

    gpus: float = 0.0  # GPUs in the Ray cluster (or that the run will start)
    cpus: float = 0.0
    gpus_per_node: list[float] = field(default_factory=list)

    @staticmethod
    def local() -> "Environment":
        import os

        return Environment(gpus=0.0, cpus=float(os.cpu_count() or 1), gpus_per_node=[0.0])


def run_preflight(cfg, env: Environment) -> list[Diagnosis]:
    out: list[Diagnosis] = []
    for code in sorted(CHECKS):
        for fn in CHECKS[code]:
            try:
                out += fn(cfg, env)
            except ConfigError as e:
                out += e.diagnoses
    return out


def _listing(path: Path) -> str:
    iters = list_iterations(path)
    hf = sorted(p.name for p in path.glob("*.safetensors")) + (["config.json"] if (path / "config.json").is_file()
                                                               else [])
    if iters:
        return f"iteration dirs without marker: {', '.join(f'iter_{i:07d}' for i in iters[-5:])}"
    if hf:
        return f"a Hugging Face model ({', '.join(hf[:4])}), not a training checkpoint"
    return "nothing loadable" if path.is_dir() else "the directory does not exist"


@check("RF01")
def load_dir_has_marker(cfg, env: Environment) -> list[Diagnosis]:
    if not cfg.load:
        return []
    path = Path(cfg.load)
    if read_marker(path) is not None:
        return []
    return [Diagnosis(code="RF01", severity="error",
                      what=f"--load {path} has no {MARKER}; found {_listing(path)}",
                      fix=(f"--load a directory written by --save (it holds {MARKER}); for a Hugging Face model "
                           f"use --hf-checkpoint {path}; to start fresh drop --load"),
                      facts={"path": str(path), "iterations": list_iterations(path)})]


@check("RF03")
def dynamic_batch_needs_cap(cfg, env: Environment) -> list[Diagnosis]:
    """--max-tokens-per-gpu: required by dynamic batching, ignored without it, and sized for one sample."""
    cp, resp = cfg.context_parallel_size, cfg.rollout_max_response_len
    safe = -(-resp // cp)  # slime's advice: start at rollout_max_response_len / cp_size, raise while memory allows
    facts = dict(max_tokens_per_gpu=cfg.max_tokens_per_gpu, context_parallel_size=cp,
                 rollout_max_response_len=resp, use_dynamic_batch_size=cfg.use_dynamic_batch_size)
    if cfg.use_dynamic_batch_size and cfg.max_tokens_per_gpu is None:
        return [Diagnosis(code="RF03", severity="error", facts=facts,
                          what="--use-dynamic-batch-size is set but --max-tokens-per-gpu is not",
                          fix=f"--max-tokens-per-gpu {safe} (rollout_max_response_len / context_parallel_size = "
                              f"{resp} / {cp}, a safe start), then raise it while memory allows")]
    if cfg.max_tokens_per_gpu is not None and not cfg.use_dynamic_batch_size:
        return [Diagnosis(code="RF03", severity="warning", facts=facts,
                          what=f"--max-tokens-per-gpu {cfg.max_tokens_per_gpu} has no effect without "
                               f"--use-dynamic-batch-size: micro-batches hold --micro-batch-size "
                               f"{cfg.micro_batch_size} samples whatever their length",
                          fix="--use-dynamic-batch-size to pack by tokens under the cap, or drop --max-tokens-per-gpu")]
    cap = (cfg.max_tokens_per_gpu or 0) * cp
    if cfg.use_dynamic_batch_size and resp > cap:
        return [Diagnosis(code="RF03", severity="warning", facts=facts,
                          what=f"one response can reach rollout_max_response_len = {resp} tokens, more than the "
                               f"micro-batch cap max_tokens_per_gpu·CP = {cfg.max_tokens_per_gpu}·{cp} = {cap}: "
                               "such a sample is trained alone in its micro-batch, over the cap (OOM risk)",
                          fix=f"--context-parallel-size {-(-resp // cfg.max_tokens_per_gpu)} (with the megatron "
                              f"backend), or --max-tokens-per-gpu {safe} if memory allows")]
    return []


@check("LAYOUT")
def context_parallel_layout(cfg, env: Environment) -> list[Diagnosis]:
    """CP splits sequences across GPUs: only megatron does it, and CP must divide the train GPUs."""
    cp, world = cfg.context_parallel_size, cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    if cp == 1:
        return []
    if cfg.train_backend != "megatron":
        return [Diagnosis(code="LAYOUT", severity="error", facts={"context_parallel_size": cp},
                          what=f"--context-parallel-size {cp} with --train-backend {cfg.train_backend}: only the "
                               "megatron backend splits a sequence across GPUs (the torch backend would put "
                               f"max_tokens_per_gpu·{cp} tokens on one worker)",
                          fix="--train-backend megatron, or --context-parallel-size 1")]
    if world % cp:
        return [Diagnosis(code="LAYOUT", severity="error", facts={"context_parallel_size": cp, "world": world},
                          what=f"{world} train GPUs (actor_num_nodes × actor_num_gpus_per_node) are not a multiple "
                               f"of --context-parallel-size {cp}",
                          fix=f"--actor-num-gpus-per-node a multiple of {cp}, or a --context-parallel-size "
                              f"dividing {world}")]
    return []


@check("RF05")
def resume_hint(cfg, env: Environment) -> list[Diagnosis]:
    if cfg.save and not cfg.load and (it := read_marker(cfg.save)) is not None:
        return [Diagnosis(code="RF05", severity="info",
                          what=f"--save {cfg.save} holds a checkpoint (iteration {it}) and --load is unset: the run "
                               f"resumes automatically at rollout {it + 1}",
                          fix=f"nothing to do to resume; to start over use a new --save directory",
                          facts={"iteration": it})]
    return []


@check("RF10")
def model_has_stop(cfg, env: Environment) -> list[Diagnosis]:
    path = Path(cfg.hf_checkpoint)
    if not (path / "config.json").is_file():
        return [Diagnosis(code="MODEL", severity="error",
                          what=f"--hf-checkpoint {path}: no config.json (not a Hugging Face model directory)",
                          fix="--hf-checkpoint a directory written by save_pretrained")]
    ids = []
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.is_file() and json.loads(tok_cfg.read_text()).get("eos_token"):
        ids.append("tokenizer eos")
    if ids or cfg.rollout_stop or cfg.rollout_stop_token_ids:
        return []
    return [Diagnosis(code="RF10", severity="error",
                      what=f"the model in {path} has no EOS token (generation_config.json, config.json and the "
                           "tokenizer name none) and no --rollout-stop / --rollout-stop-token-ids is set: generation "
                           f"would run to rollout_max_response_len={cfg.rollout_max_response_len} every time",
                      fix="--rollout-stop-token-ids <id of the end-of-turn token> (or --rollout-stop '<stop text>')")]


@check("DATA")
def data_readable(cfg, env: Environment) -> list[Diagnosis]:
    from engine.data import load_prompts

    load_prompts(cfg.prompt_data, input_key=cfg.input_key, label_key=cfg.label_key,
                 metadata_key=cfg.metadata_key)
    if cfg.eval_prompt_data:
        load_prompts(cfg.eval_prompt_data, input_key=cfg.input_key, label_key=cfg.label_key,
                     metadata_key=cfg.metadata_key, flag="--eval-prompt-data")
    return []
