"""Preflight checks: pure functions `(RunConfig, Environment) -> list[Diagnosis]`, registered by code.

The Environment is a view of the cluster and the files, so every check is testable with a fake view.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.checkpoint import MARKER
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


def _load_dir(flag: str, url: str, step: int | None, step_flag: str) -> list[Diagnosis]:
    """A --load / --ref-load directory must hold a marker (or a complete iteration --ckpt-step names) or an HF
    model; anything else is RF01 with a listing of what is there. Cheap: manifests and sizes, no checksums."""
    from engine import checkpoint

    store = checkpoint.Store(url)
    if step is not None:
        problem = checkpoint.problem_with(store, step)
        if problem is None:
            return []
        complete = checkpoint.complete_iterations(store)
        return [Diagnosis(code="RF01", severity="error", what=f"{flag} {store.url} {step_flag} {step}: {problem}",
                          fix=f"{step_flag} one of {complete}" if complete else
                          f"{flag} a directory with a complete iteration; found {checkpoint.describe_dir(store)}",
                          facts={"path": store.url, "complete": complete})]
    marker = checkpoint.read_marker(store)
    if marker is None and checkpoint.marker_text(store) is not None:
        complete = checkpoint.complete_iterations(store)
        return [Diagnosis(code="RF01", severity="warning" if complete else "error",
                          what=f"{flag} {store.url}: {MARKER} holds {checkpoint.marker_text(store)!r}, not an "
                               "iteration number", facts={"path": store.url, "complete": complete},
                          fix=f"nothing: the run falls back to iter_{complete[-1]:07d}, the newest complete one"
                          if complete else "restore the checkpoint, or start over with a new --save")]
    if marker is None:
        return [] if checkpoint.is_hf_dir(store) else [checkpoint.rf01(flag, store, step_flag=step_flag)]
    problem = checkpoint.problem_with(store, marker)
    if problem is None:
        return []
    older = [i for i in checkpoint.complete_iterations(store) if i < marker]
    return [Diagnosis(code="RF01", severity="warning" if older else "error",
                      what=f"{flag} {store.url}: {MARKER} names iteration {marker} but {problem}",
                      fix=(f"nothing: the run falls back to iter_{older[-1]:07d}, the newest complete one (or pick "
                           f"one with {step_flag})" if older else
                           "restore the files, or start over with a new --save"),
                      facts={"path": store.url, "marker": marker, "complete": older})]


@check("RF01")
def load_dir_has_marker(cfg, env: Environment) -> list[Diagnosis]:
    out = []
    if cfg.ckpt_step is not None and not cfg.load:
        out.append(Diagnosis(code="RF01", severity="error", what=f"--ckpt-step {cfg.ckpt_step} is set but --load "
                             "is not", fix=f"--load DIR --ckpt-step {cfg.ckpt_step}, or drop --ckpt-step"))
    if cfg.ref_ckpt_step is not None and not cfg.ref_load:
        out.append(Diagnosis(code="RF01", severity="error", what=f"--ref-ckpt-step {cfg.ref_ckpt_step} is set but "
                             "--ref-load is not", fix=f"--ref-load DIR --ref-ckpt-step {cfg.ref_ckpt_step}"))
    for flag, url, step, step_flag in (("--load", cfg.load, cfg.ckpt_step, "--ckpt-step"),
                                       ("--ref-load", cfg.ref_load, cfg.ref_ckpt_step, "--ref-ckpt-step")):
        if not url:
            continue
        try:
            out += _load_dir(flag, url, step, step_flag)
        except Exception as e:  # noqa: BLE001 — no credentials, unreachable endpoint, denied access (botocore
            out.append(_unreadable("RF01", flag, url, e))  # errors are not OSErrors)
    return out


def _unreadable(code: str, flag: str, url: str, e: Exception) -> Diagnosis:
    """A storage error as a diagnosis: the URL and botocore's message (which never holds the secret key)."""
    return Diagnosis(code=code, severity="error", what=f"{flag} {url} cannot be read: {type(e).__name__}: {e}",
                     fix="check the path; for s3:// the bucket, AWS_ENDPOINT_URL_S3 and the AWS credentials "
                         "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws)")


@check("RF03")
def dynamic_batch_needs_cap(cfg, env: Environment) -> list[Diagnosis]:
    if cfg.use_dynamic_batch_size and cfg.max_tokens_per_gpu is None:
        return [Diagnosis(code="RF03", severity="error",
                          what="--use-dynamic-batch-size is set but --max-tokens-per-gpu is not",
                          fix=f"--max-tokens-per-gpu {cfg.rollout_max_response_len} (rollout_max_response_len as a "
                              "safe start), then raise it while memory allows")]
    return []


@check("RF05")
def resume_hint(cfg, env: Environment) -> list[Diagnosis]:
    """Automatic resume is reported; a weights-only (--no-save-optim) iteration needs --no-load-optim."""
    try:
        return _resume_hint(cfg)
    except Exception as e:  # noqa: BLE001 — storage errors, as in RF01
        return [_unreadable("RF05", "--save", cfg.save, e)]


def _resume_hint(cfg) -> list[Diagnosis]:
    from engine import checkpoint

    if cfg.load and cfg.ckpt_step is not None:
        store, it = checkpoint.Store(cfg.load), cfg.ckpt_step
    else:  # --save's own progress comes first (resolve.py, rule 1), then --load's marker
        found = [(checkpoint.Store(u), checkpoint.read_marker(u)) for u in (cfg.save, cfg.load) if u]
        store, it = next(((st, i) for st, i in found if i is not None), (None, None))
        if store is None:
            return []
    m = checkpoint.read_manifest(store, it) or {}
    if m.get("resumable") is False and m.get("next_rollout_id", it + 1) > 0 and cfg.load_optim:
        return [Diagnosis(code="RF05", severity="error",
                          what=f"{store.url}/iter_{it:07d} was saved with --no-save-optim (weights only): the run "
                               "cannot resume exactly from it",
                          fix="--no-load-optim to continue from its weights with a fresh optimizer, or a new --save",
                          facts={"iteration": it})]
    if cfg.load:
        return []
    return [Diagnosis(code="RF05", severity="info",
                      what=f"--save {store.url} holds a checkpoint (iteration {it}) and --load is unset: the run "
                           f"resumes automatically at rollout {m.get('next_rollout_id', it + 1)}",
                      fix="nothing to do to resume; to start over use a new --save directory",
                      facts={"iteration": it})]


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
