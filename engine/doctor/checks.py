"""Preflight checks: pure functions `(RunConfig, Environment) -> list[Diagnosis]`, registered by code.

The Environment is a view of the cluster and the files, so every check is testable with a fake view.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.checkpoint import MARKER
from engine.diagnosis import ConfigError, Diagnosis
from engine.packing.arithmetic import micro_batch_cap

Check = Callable[["object", "Environment"], list[Diagnosis]]
CHECKS: dict[str, list[Check]] = {}


def check(code: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS.setdefault(code, []).append(fn)
        return fn
    return register


@dataclass
class Environment:
    """What the checks may look at besides the config: the cluster's resources and the worker env."""

    gpus: float = 0.0  # GPUs in the Ray cluster (or on this machine, for the local cluster a run starts)
    cpus: float = 0.0
    gpus_per_node: list[float] = field(default_factory=list)
    cpus_per_node: list[float] = field(default_factory=list)
    source: str = "this machine"
    worker_env: dict[str, str] = field(default_factory=dict)  # env every Ray worker gets

    @staticmethod
    def local() -> "Environment":
        """The resources of the local cluster a run would start here."""
        import os

        from engine.cluster import worker_env

        gpus = 0
        try:
            import torch

            gpus = torch.cuda.device_count()
        except Exception:
            pass
        return Environment(gpus=float(gpus), cpus=float(os.cpu_count() or 1), gpus_per_node=[float(gpus)],
                           cpus_per_node=[float(os.cpu_count() or 1)], source="this machine", worker_env=worker_env())

    @staticmethod
    def for_config(cfg) -> "Environment":
        return Environment.from_ray(cfg.ray_address) if cfg.ray_address else Environment.local()

    @staticmethod
    def from_ray(address: str) -> "Environment":
        """Read a running Ray cluster's resources (joins it briefly as a driver)."""
        import ray

        from engine.cluster import worker_env

        ctx = ray.is_initialized()
        if not ctx:
            from engine.cluster import _keeping_sigterm, check_reachable

            check_reachable(address)  # seconds, not the minutes ray.init waits for an address that never answers
            _keeping_sigterm(lambda: ray.init(address=address, include_dashboard=False, log_to_driver=False))
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            per_node = [float(n["Resources"].get("GPU", 0.0)) for n in nodes]
            cpus_per_node = [float(n["Resources"].get("CPU", 0.0)) for n in nodes]
        finally:
            if not ctx:
                ray.shutdown()
        return Environment(gpus=sum(per_node), cpus=sum(cpus_per_node), gpus_per_node=per_node,
                           cpus_per_node=cpus_per_node,
                           source=f"Ray cluster {address}", worker_env=worker_env())


def run_preflight(cfg, env: Environment) -> list[Diagnosis]:
    """Every check; a diagnosis found by several checks (e.g. a broken config.json they all read) is kept once."""
    out: list[Diagnosis] = []
    for code in sorted(CHECKS):
        for fn in CHECKS[code]:
            try:
                found = fn(cfg, env)
            except ConfigError as e:
                found = e.diagnoses
            out += [d for d in found if d not in out]
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
    cap = micro_batch_cap(cfg.max_tokens_per_gpu or 0, cp)
    if cfg.use_dynamic_batch_size and resp > cap:
        return [Diagnosis(code="RF03", severity="warning", facts=facts,
                          what=f"one response can reach rollout_max_response_len = {resp} tokens, more than the "
                               f"micro-batch cap max_tokens_per_gpu·CP = {cfg.max_tokens_per_gpu}·{cp} = {cap}: "
                               "such a sample is trained alone in its micro-batch, over the cap (OOM risk)",
                          fix=f"--max-tokens-per-gpu {safe} if memory allows, or a shorter "
                              f"--rollout-max-response-len (slime would split it with --context-parallel-size "
                              f"{-(-resp // cfg.max_tokens_per_gpu)}; no rollflow backend runs context parallelism "
                              "yet)")]
    return []


@check("CONFIG")
def parallel_layout(cfg, env: Environment) -> list[Diagnosis]:
    """TP / PP split the model and EP the experts (megatron backend only); TP·PP must divide the train GPUs and EP
    the data-parallel ranks; no backend runs CP."""
    tp, pp, cp, world = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                         cfg.context_parallel_size, cfg.train_world_size)
    out = []
    ep = cfg.expert_model_parallel_size
    if ep > 1 and cfg.train_backend != "megatron":
        out.append(Diagnosis(code="CONFIG", severity="error",
                             what=f"--expert-model-parallel-size {ep} with --train-backend {cfg.train_backend}: only "
                                  "the megatron backend places experts on different GPUs",
                             fix="--train-backend megatron, or --expert-model-parallel-size 1",
                             facts={"field": "expert_model_parallel_size", "value": ep}))
    elif ep > 1 and not world % (tp * pp * cp) and (cfg.dp_size * tp) % ep:
        ranks = cfg.dp_size * tp  # (experts are never TP-split: EP groups take data- and tensor-parallel ranks)
        out.append(Diagnosis(code="CONFIG", severity="error",
                             what=f"--expert-model-parallel-size {ep} does not divide the {ranks} GPUs of a pipeline "
                                  f"stage ({cfg.dp_size} data-parallel × {tp} tensor-parallel ranks): Megatron forms "
                                  "each EP group from them (the experts are never split by TP)",
                             fix=f"an EP size that divides {ranks}, or more train GPUs "
                                 "(--actor-num-gpus-per-node / --actor-num-nodes)",
                             facts={"field": "expert_model_parallel_size", "value": ep, "dp": cfg.dp_size}))
    if cp > 1:
        out.append(Diagnosis(code="CONFIG", severity="error", facts={"context_parallel_size": cp},
                             what=f"--context-parallel-size {cp}: no rollflow backend splits a sequence across GPUs "
                                  f"yet (the {cfg.train_backend} backend would put max_tokens_per_gpu·{cp} tokens on "
                                  "one GPU)",
                             fix="--context-parallel-size 1, with --max-tokens-per-gpu at least the longest sample"))
    if tp * pp == 1:
        return out
    if cfg.train_backend != "megatron":
        out.append(Diagnosis(code="CONFIG", severity="error",
                             what=f"--tensor-model-parallel-size {tp} / --pipeline-model-parallel-size {pp} with "
                                  f"--train-backend {cfg.train_backend}: only the megatron backend splits the model",
                             fix="--train-backend megatron, or --tensor-model-parallel-size 1 "
                                 "--pipeline-model-parallel-size 1"))
    elif world % (tp * pp * cp):
        out.append(Diagnosis(code="CONFIG", severity="error",
                             what=f"{world} train GPUs (actor_num_nodes × actor_num_gpus_per_node) are not a "
                                  f"multiple of TP·PP·CP = {tp}·{pp}·{cp} = {tp * pp * cp}",
                             fix=f"--actor-num-gpus-per-node a multiple of {tp * pp * cp}, or a smaller TP / PP",
                             facts={"world": world, "tp": tp, "pp": pp, "cp": cp}))
    return out


@check("CONFIG")
def backend_supports_estimator(cfg, env: Environment) -> list[Diagnosis]:
    if cfg.advantage_estimator == "ppo" and cfg.train_backend != "torch":
        return [Diagnosis(code="CONFIG", severity="error",
                          what=f"--advantage-estimator ppo needs a critic, which only the torch backend trains "
                               f"(--train-backend {cfg.train_backend})",
                          fix="--train-backend torch, or a critic-free estimator (grpo, gspo, cispo, "
                              "reinforce_plus_plus, reinforce_plus_plus_baseline)")]
    return []


@check("CONFIG")
def gpu_memory_flags(cfg, env: Environment) -> list[Diagnosis]:
    """--offload-train frees a GPU for colocated engines: it needs GPUs, and the torch backend with one replica
    (Megatron's CUDA graphs hold fixed addresses; FSDP2 keeps its own references to the shards)."""
    if not cfg.offload_train:
        return []
    why = []
    if env.gpus <= 0:
        why.append(f"{env.source} has no GPUs, so there is no GPU memory to free")
    if cfg.train_backend != "torch":
        why.append(f"the {cfg.train_backend} backend cannot offload")
    elif cfg.dp_size > 1:
        why.append(f"DP = {cfg.dp_size}: the torch backend offloads one unsharded replica only")
    if not why:
        return []
    return [Diagnosis(code="CONFIG", severity="error", what="--offload-train: " + "; ".join(why),
                      fix="drop --offload-train (or use it on a GPU with --train-backend torch and one train GPU)",
                      facts={"gpus": env.gpus, "train_backend": cfg.train_backend, "dp_size": cfg.dp_size})]


@check("RF05")
def resume_hint(cfg, env: Environment) -> list[Diagnosis]:
    """Automatic resume is reported; a weights-only (--no-save-optim) iteration needs --no-load-optim."""
    try:
        return _resume_hint(cfg)
    except Exception as e:  # noqa: BLE001 — storage errors, as in RF01
        return [_unreadable("RF05", "--save", cfg.save, e)]


def _resume_hint(cfg) -> list[Diagnosis]:
    from engine import checkpoint

    found = checkpoint.peek_start(load=cfg.load, save=cfg.save, ckpt_step=cfg.ckpt_step)
    if found is None:
        return _marker_without_iterations(cfg)
    it, m, automatic = found
    url = cfg.save if automatic else cfg.load
    store, out = checkpoint.Store(url), []
    marker = checkpoint.read_marker(store)
    if automatic and marker is not None and marker != it:  # (for --load, RF01's check says it)
        out.append(Diagnosis(code="RF05", severity="warning",
                             what=f"{store.url}/{checkpoint.MARKER} names iteration {marker}, which is missing or "
                                  f"has no manifest: the run starts from iteration {it}, the newest older one "
                                  "(verified at start)",
                             fix="nothing to do; the missing iteration's rollouts run again",
                             facts={"marker": marker, "iteration": it}))
    if m.get("resumable") is False and cfg.load_optim:
        out.append(Diagnosis(code="RF05", severity="error",
                             what=f"{store.url}/iter_{it:07d} was saved with --no-save-optim (weights only): the "
                                  "run cannot resume exactly from it",
                             fix="--no-load-optim to continue from its weights with a fresh optimizer, or a new "
                                 "--save", facts={"iteration": it}))
    if (bad := resume_guard(cfg, f"{store.url}/iter_{it:07d}", m)) is not None:
        out.append(bad)
    if automatic and not cfg.load and not any(d.severity == "error" for d in out):
        out.append(Diagnosis(code="RF05", severity="info",
                             what=f"--save {store.url} holds a checkpoint (iteration {it}) and --load is unset: the "
                                  f"run resumes automatically at rollout {m.get('next_rollout_id', it + 1)}",
                             fix="nothing to do to resume; to start over use a new --save directory",
                             facts={"iteration": it}))
    return out


def _marker_without_iterations(cfg) -> list[Diagnosis]:
    """A --save (or --load) whose marker names an iteration none of whose predecessors has a manifest: the start
    fails (RF01); say so now instead of announcing a resume point that does not exist."""
    from engine import checkpoint

    for flag, url in (("--save", cfg.save), ("--load", cfg.load)):
        if not url or cfg.ckpt_step is not None:
            continue
        store = checkpoint.Store(url)
        if checkpoint.marker_text(store) is None:
            continue
        marker = checkpoint.read_marker(store)
        its = [i for i in checkpoint.list_iterations(store) if marker is None or i <= marker]
        if any(checkpoint.read_manifest(store, i) is not None for i in its):
            return []
        return [Diagnosis(code="RF01", severity="error",
                          what=f"{flag} {store.url}: {checkpoint.MARKER} holds {checkpoint.marker_text(store)!r} but "
                               f"no iteration at or below it has a manifest ({len(its)} iteration dir(s)): there is "
                               "nothing to resume from",
                          fix=f"restore the checkpoint files, or start over with a new {flag} (or delete "
                              f"{store.uri(checkpoint.MARKER)})", facts={"path": store.url, "marker": marker})]
    return []


def resume_guard(cfg, where: str, manifest: dict) -> Diagnosis | None:
    """RF05 error when a resume changes a setting the checkpoint recorded (engine/config RESUME_FIXED)."""
    changes = cfg.resume_changes(manifest.get("settings"))
    if not changes:
        return None
    from engine.config import MEGATRON_OPTIM_LAYOUT

    listed = "; ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, old, new in changes)
    kept = [k for k, _, _ in changes if k not in MEGATRON_OPTIM_LAYOUT]
    layout = [k for k, _, _ in changes if k in MEGATRON_OPTIM_LAYOUT]
    fixes = []
    if kept:
        fixes.append("a new --save to train with the new settings (--load the checkpoint there to start from its "
                     "weights), or --allow-config-change " + " ".join(kept) + " to resume with them anyway")
    if layout:
        fixes.append("for " + ", ".join(layout) + ": the Megatron optimizer state is sharded by them (only the data-"
                     "parallel size may change); resume with the sizes it was saved with, or add --no-load-optim "
                     "(the weights reshard to the new layout, Adam's moments start over). A run that saves with "
                     "--dist-ckpt-optim-fully-reshardable can change them with its optimizer state")
    return Diagnosis(code="RF05", severity="error",
                     what=f"resuming {where} with settings that differ from the ones it was trained with: {listed}",
                     fix="; ".join(fixes), facts={"changes": [list(c) for c in changes]})


@check("MODEL")
def model_dir_usable(cfg, env: Environment) -> list[Diagnosis]:
    """--hf-checkpoint has a readable config.json and a tokenizer, a chat template when one is applied, and its
    prompts start with the BOS the tokenizer would add to text (a warning)."""
    from engine.modeling import load_tokenizer, read_model_json, render_row

    path = Path(cfg.model_dir)
    if read_model_json(path, "config.json") is None:  # (raises for invalid JSON, naming the file)
        return [Diagnosis(code="MODEL", severity="error",
                          what=f"--hf-checkpoint {path}: no config.json (not a Hugging Face model directory)",
                          fix="--hf-checkpoint a directory written by save_pretrained")]
    try:
        tok = load_tokenizer(str(path))
        # without tokenizer files transformers builds an empty one (1 token), which encodes every prompt to nothing
        problem = None if tok("2+2=")["input_ids"] else f"its tokenizer has {len(tok)} token(s) and encodes text to nothing"
    except Exception as e:  # noqa: BLE001 — transformers raises many types for a missing / broken tokenizer
        problem = f"{type(e).__name__}: {str(e)[:200]}"
    if problem:
        return [Diagnosis(code="MODEL", severity="error", what=f"--hf-checkpoint {path}: no usable tokenizer ({problem})",
                          fix="copy the tokenizer files of the base model (tokenizer.json, tokenizer_config.json, "
                              "special_tokens_map.json, or tokenizer.model) into the directory")]
    out = []
    if cfg.apply_chat_template and not tok.chat_template:
        return [Diagnosis(code="MODEL", severity="error",
                          what=f"--apply-chat-template, but the tokenizer in {path} has no chat template",
                          fix="--no-apply-chat-template (plain-text prompts), or add the base model's chat template "
                              "(chat_template.jinja, or chat_template in tokenizer_config.json)")]
    if cfg.apply_chat_template_kwargs and (unread := unread_template_kwargs(tok, cfg.apply_chat_template_kwargs)):
        return [Diagnosis(code="CONFIG", severity="error",
                          what=f"--apply-chat-template-kwargs: the chat template of {path} never reads "
                               f"{', '.join(unread)} (it reads {', '.join(template_variables(tok)) or 'no variable'}"
                               "), so the key would do nothing",
                          fix="drop the key, or spell it as the template does",
                          facts={"field": "apply_chat_template_kwargs", "unread": unread})]
    bos = tok.bos_token_id
    adds_bos = bos is not None and tok("x")["input_ids"][:1] == [bos]
    if adds_bos and cfg.apply_chat_template:
        from engine.data import load_prompts

        row = load_prompts(cfg.prompt_data, input_key=cfg.input_key, label_key=cfg.label_key,
                           tool_key=cfg.tool_key)[0]
        ids = render_row(tok, row, cfg)
        if ids[:1] != [bos]:
            out.append(Diagnosis(code="MODEL", severity="warning",
                                 what=f"the tokenizer in {path} starts text with BOS {tok.bos_token!r} (id {bos}), but "
                                      "its chat template does not: the engine gets the prompts without it "
                                      f"(line {row.row}: {tok.decode(ids[:12])!r}…)",
                                 fix="a chat template that writes the BOS token (most do: '{{ bos_token }}'), or "
                                     "--no-apply-chat-template to encode plain prompts with the tokenizer's BOS",
                                 facts={"bos_token_id": bos, "line": row.row}))
    return out


@check("MODEL")
def opd_teacher_usable(cfg, env: Environment) -> list[Diagnosis]:
    """--use-opd --opd-type megatron: --opd-teacher-load is a Hugging Face directory with the student's vocabulary,
    or a --save directory with its marker (or --opd-teacher-ckpt-step's iteration): found before anything starts,
    not when the train worker first loads it. Not for an s3:// teacher (read on the train nodes)."""
    from engine import checkpoint
    from engine.modeling import read_model_json

    if not (cfg.use_opd and cfg.opd_type == "megatron" and cfg.opd_teacher_load) \
            or str(cfg.opd_teacher_load).startswith("s3://"):
        return []
    src, step = Path(cfg.opd_teacher_load), cfg.opd_teacher_ckpt_step
    facts = {"field": "opd_teacher_load", "value": str(src)}
    if step is None and (teacher := read_model_json(src, "config.json", "--opd-teacher-load")) is not None:
        student = read_model_json(Path(cfg.model_dir), "config.json") or {}
        t_vocab, s_vocab = teacher.get("vocab_size"), student.get("vocab_size")
        if t_vocab is not None and s_vocab is not None and int(t_vocab) != int(s_vocab):
            return [Diagnosis(code="CONFIG", severity="error",
                              what=f"--opd-teacher-load {src} has a vocabulary of {t_vocab} tokens and the student "
                                   f"(--hf-checkpoint) {s_vocab}: the teacher would score other tokens than the "
                                   "samples'", fix="a teacher with the student's tokenizer (the same model family)",
                              facts=facts)]
        if cfg.train_backend == "megatron" and student and _megatron_shape(teacher) != _megatron_shape(student):
            return [Diagnosis(code="CONFIG", severity="error",
                              what=f"--opd-teacher-load {src} is not the student's architecture "
                                   f"({_megatron_shape(teacher)} against {_megatron_shape(student)}): the megatron "
                                   "backend loads the teacher into the student's model, as slime's does",
                              fix="--opd-type sglang --opd-teacher-url HOST:PORT (a server of the teacher), or "
                                  "--train-backend torch (it loads the teacher as a model of its own)",
                              facts=facts)]
        return []
    it = step if step is not None else checkpoint.read_marker(src)
    if it is None or not checkpoint.iter_dir(src, it).is_dir():
        return [Diagnosis(code="CONFIG", severity="error",
                          what=f"--opd-teacher-load {src}: " + (
                              f"--opd-teacher-ckpt-step {step}: it has no iteration {step}" if step is not None else
                              "neither a Hugging Face directory (config.json) nor a checkpoint directory with "
                              f"{checkpoint.MARKER}"),
                          fix="--opd-teacher-load a Hugging Face model directory or a directory written by --save"
                              + (", and an iteration it holds" if step is not None else ""), facts=facts)]
    return []


#: what the Megatron mapping raises for a config it cannot build
UNMAPPABLE = (NotImplementedError, KeyError, TypeError, ValueError)


def _megatron_shape(hf_config: dict) -> str:
    """The Megatron mapping's ModelShape of an HF config, or why it cannot map it (compared as text)."""
    import dataclasses

    from engine.train.megatron_mapping import shape_from_hf_config

    try:  # the position limit changes no weight
        return str(dataclasses.replace(shape_from_hf_config(hf_config), max_position_embeddings=0))
    except UNMAPPABLE as e:
        return f"not mappable: {e}"


@check("CONFIG")
def servers_answer(cfg, env: Environment) -> list[Diagnosis]:
    """--rollout-external-engine-addrs and --opd-teacher-url: servers the run does not start. One that does not
    answer /health now is a warning (the run waits --rollout-engine-start-timeout for an external engine; a
    teacher that does not answer fails the first rollout)."""
    from engine.rollout.client import EngineClient

    servers = [("--rollout-external-engine-addrs", u) for u in cfg.rollout_external_engine_addrs]
    if cfg.use_opd and cfg.opd_type == "sglang" and cfg.opd_teacher_url:
        servers.append(("--opd-teacher-url", cfg.opd_teacher_url))
    return [Diagnosis(code="CONFIG", severity="warning",
                      what=f"{flag}: {url} does not answer /health now",
                      fix="start that server (rollflow does not start it), or correct the address",
                      facts={"field": flag[2:].replace("-", "_"), "value": url})
            for flag, url in servers if not EngineClient(url).health(timeout_s=2.0)]


@check("MODEL")
def native_model_code_runs(cfg, env: Environment) -> list[Diagnosis]:
    """--model-impl native: rollflow's model code can run the model where the run puts it (the CPU; a cluster with
    GPUs trains and generates on CUDA). Found here, before any process starts, not at the worker's model load.
    auto needs no check: it loads transformers' classes wherever the native code cannot run."""
    from engine.native_model import unsupported

    path = Path(cfg.model_dir)
    if cfg.model_impl != "native" or not (path / "config.json").is_file():
        return []  # model_dir_usable reports a missing config.json
    device = "cuda" if env.gpus > 0 else "cpu"
    if (why := unsupported(path, device)) is None:
        return []
    return [Diagnosis(code="MODEL", severity="error",
                      what=f"--model-impl native: rollflow's model code cannot run {path} on {env.source} ({why})",
                      fix="--model-impl auto (transformers' classes where the native code cannot run) or transformers",
                      facts={"field": "model_impl", "value": "native", "reason": why})]


@check("MODEL")
def megatron_maps_the_model(cfg, env: Environment) -> list[Diagnosis]:
    """--train-backend megatron: its mapping (engine/train/megatron_mapping.py) builds the model of --hf-checkpoint:
    Qwen2, Qwen3, Llama, Mistral and (experts whole: at TP = 1 or under TP with --sequence-parallel, split over
    ranks by --expert-model-parallel-size) Qwen2-MoE, Qwen3-MoE, Mixtral, not Qwen2's sliding windows.
    Found here, not at the
    train workers' model build, after Ray and the engines have started."""
    from engine.modeling import read_model_json

    if cfg.train_backend != "megatron":
        return []
    hf = read_model_json(cfg.model_dir, "config.json")
    if hf is None:
        return []  # model_dir_usable reports a missing config.json
    from engine.train.megatron_mapping import shape_from_hf_config

    try:
        shape = shape_from_hf_config(hf)
    except UNMAPPABLE as e:
        why = str(e)
    else:
        tp, ep = cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size
        if ep > 1 and not shape.num_experts:
            return [Diagnosis(code="MODEL", severity="error",
                              what=f"--expert-model-parallel-size {ep}: {cfg.model_dir} is a dense model, it has no "
                                   "experts to place", fix="--expert-model-parallel-size 1",
                              facts={"field": "expert_model_parallel_size", "value": ep})]
        if ep > 1 and shape.num_experts % ep:
            return [Diagnosis(code="MODEL", severity="error",
                              what=f"--expert-model-parallel-size {ep} does not divide the {shape.num_experts} "
                                   f"experts of {cfg.model_dir}: each EP rank holds the same number of them",
                              fix=f"an EP size that divides {shape.num_experts}",
                              facts={"field": "expert_model_parallel_size", "value": ep,
                                     "num_experts": shape.num_experts})]
        if tp == 1 or not shape.num_experts or cfg.sequence_parallel:
            return []  # (a TP that does not divide the heads is the topology check's)
        return [Diagnosis(code="MODEL", severity="error",
                          what=f"--train-backend megatron with --tensor-model-parallel-size {tp}: {cfg.model_dir} is a "
                               "mixture of experts, which megatron-core trains under TP only with sequence "
                               "parallelism",
                          fix=f"add --sequence-parallel (the experts run whole on every TP rank), or "
                              f"--tensor-model-parallel-size 1 and --expert-model-parallel-size {tp} (the GPUs become "
                              "data-parallel ranks, the experts split over them), or --train-backend torch",
                          facts={"field": "tensor_model_parallel_size", "value": tp})]
    return [Diagnosis(code="MODEL", severity="error",
                      what=f"--train-backend megatron cannot build {cfg.model_dir}: {why}",
                      fix="--train-backend torch (transformers' classes: any causal LM), or a model the Megatron "
                          "mapping covers (Qwen2, Qwen3, Llama, Mistral, Qwen2-MoE, Qwen3-MoE, Mixtral)",
                      facts={"field": "train_backend", "value": "megatron", "reason": why})]


@check("MODEL")
def routing_replay_has_routers(cfg, env: Environment) -> list[Diagnosis]:
    """--use-routing-replay / --use-rollout-routing-replay: the model is a mixture of experts whose routers rollflow
    replays (Qwen2-MoE, Qwen3-MoE, Mixtral: softmax, top k, renormalised or not); a dense model has nothing to replay
    (an idle flag)."""
    from engine.model_shape import ModelShape
    from engine.modeling import read_model_json
    from engine.train.routing import REPLAYED

    field = "use_rollout_routing_replay" if cfg.use_rollout_routing_replay else \
        "use_routing_replay" if cfg.use_routing_replay else None
    if field is None:
        return []
    flag = "--" + field.replace("_", "-")
    hf = read_model_json(cfg.model_dir, "config.json")
    if hf is None:
        return []  # model_dir_usable reports a missing config.json
    family = (hf.get("text_config") or hf).get("model_type")
    if family in REPLAYED:
        return []
    try:
        moe = ModelShape.from_hf_config(hf).num_experts > 0
    except (ConfigError, *UNMAPPABLE):
        moe = False
    what = (f"{flag}: {cfg.model_dir} ({family}) is a mixture of experts whose router rollflow does not "
            f"replay (it replays {', '.join(REPLAYED)})") if moe else \
        f"{flag}: {cfg.model_dir} ({family}) has no experts, so there is no routing to replay"
    return [Diagnosis(code="MODEL", severity="error", what=what, fix=f"drop {flag}",
                      facts={"field": field, "value": True, "model_type": family})]


@check("RF10")
def model_has_stop(cfg, env: Environment) -> list[Diagnosis]:
    from engine.modeling import read_model_json

    path = Path(cfg.model_dir)
    if not (path / "config.json").is_file():
        return []  # model_dir_usable reports it
    ids = []
    for name in ("generation_config.json", "config.json"):
        eos = (read_model_json(path, name) or {}).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if (read_model_json(path, "tokenizer_config.json") or {}).get("eos_token"):
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

    files = [("--prompt-data", cfg.prompt_data, load_prompts(cfg.prompt_data, input_key=cfg.input_key,
                                                             label_key=cfg.label_key, metadata_key=cfg.metadata_key,
                                                             tool_key=cfg.tool_key))]
    for d in [] if cfg.no_engines else cfg.eval_datasets():  # no engine: nothing is evaluated
        flag = "--eval-config" if cfg.eval_config else "--eval-prompt-data"
        files.append((flag, d.path, [dataclasses.replace(r, metadata=d.row_metadata(r.metadata)) for r in load_prompts(
            d.path, input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key, flag=flag,
            tool_key=d.tool_key)]))
    return [d for flag, path, rows in files if (d := _sample_rm_types(cfg, flag, path, rows))]


def _sample_rm_types(cfg, flag: str, path: str, rows) -> Diagnosis | None:
    """Rows whose metadata names a reward ("rm_type", slime's per-sample override) that does not exist; with
    --custom-rm-path the custom reward scores every sample and the names are not read."""
    from engine.rewards import SAMPLE_RM_TYPES

    if cfg.custom_rm_path:
        return None
    ok = set(SAMPLE_RM_TYPES) | ({"remote_rm"} if cfg.rm_url else set())
    bad = [(r.row, str(t)) for r in rows if isinstance(r.metadata, dict) and (t := r.metadata.get("rm_type"))
           and str(t).strip() not in ok]
    if not bad:
        return None
    shown = ", ".join(f"line {line}: {t!r}" for line, t in bad[:5])
    shown += f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
    return Diagnosis(code="DATA", severity="error",
                     what=f"{flag} {path}: {len(bad)} row(s) name a reward in their metadata's rm_type that rollflow "
                          f"does not have ({shown})",
                     fix=f"use one of {', '.join(sorted(ok))} (remote_rm: with --rm-type remote_rm --rm-url), or "
                         "score them with --custom-rm-path",
                     facts={"flag": flag, "path": path, "rows": [line for line, _ in bad[:20]]})


@check("DATA")
def sft_rows_trainable(cfg, env: Environment) -> list[Diagnosis]:
    """engine.rollout.sft's rows, before anything starts: one sample per row (--n-samples-per-prompt 1), each row
    an answer (--label-key) or a conversation with an assistant turn after a first non-assistant one (a
    conversation needs --apply-chat-template), and the template renders the first conversation's turns as prefixes
    (what the rollout function would refuse mid-run)."""
    from engine.data import load_prompts
    from engine.rollout import sft

    if not sft.placeholder_rewards(cfg):
        return []
    if cfg.n_samples_per_prompt != 1:
        return [Diagnosis(code="CONFIG", severity="error",
                          what=f"{cfg.rollout_function_path} trains each row once per rollout, and "
                               f"--n-samples-per-prompt is {cfg.n_samples_per_prompt}",
                          fix="--n-samples-per-prompt 1", facts={"field": "n_samples_per_prompt"})]
    rows = load_prompts(cfg.prompt_data, input_key=cfg.input_key, label_key=cfg.label_key,
                        metadata_key=cfg.metadata_key)
    bad: list[tuple[int, str]] = []
    first_conversation = None
    for r in rows:
        if isinstance(r.prompt, list):
            roles = [m.get("role") for m in r.prompt]
            if not cfg.apply_chat_template:
                bad.append((r.row, "a conversation, and --apply-chat-template is off"))
            elif "assistant" not in roles:
                bad.append((r.row, "no assistant message to train on"))
            elif roles[0] == "assistant":
                bad.append((r.row, "starts with an assistant message"))
            elif first_conversation is None:
                first_conversation = r
        elif r.label is None or not str(r.label):
            bad.append((r.row, f"no answer under --label-key {cfg.label_key!r}"))
    if bad:
        shown = "; ".join(f"line {line}: {why}" for line, why in bad[:5]) + (" …" if len(bad) > 5 else "")
        return [Diagnosis(code="DATA", severity="error",
                          what=f"{len(bad)} of {len(rows)} --prompt-data rows cannot be trained on by "
                               f"{cfg.rollout_function_path} ({shown})",
                          fix="give each row an answer (--label-key) or a conversation with an assistant turn "
                              "(--input-key messages --label-key '' --apply-chat-template), or drop those rows",
                          facts={"lines": [line for line, _ in bad[:50]]})]
    if first_conversation is not None:
        from engine.modeling import load_tokenizer

        try:
            sft.conversation_tokens(load_tokenizer(cfg.model_dir), first_conversation.prompt,
                                    cfg.apply_chat_template_kwargs, row=first_conversation.row)
        except ValueError as e:
            return [Diagnosis(code="DATA", severity="error", what=f"--prompt-data {e}",
                              fix="split conversations into one row per assistant turn, or use a chat template that "
                                  "does not rewrite earlier turns", facts={"line": first_conversation.row})]
    return []


@check("DATA")
def saved_rollouts_present(cfg, env: Environment) -> list[Diagnosis]:
    """--load-debug-rollout-data: a file for every rollout id of the run, before anything starts."""
    from engine.rollout.replay import missing, missing_diagnosis

    if not cfg.replay:
        return []
    if not (gone := missing(cfg.load_debug_rollout_data, cfg.num_rollout)):
        return []
    return [missing_diagnosis(cfg.load_debug_rollout_data, gone, f"of --num-rollout {cfg.num_rollout}")]


@check("STORAGE")
def save_location_writable(cfg, env: Environment) -> list[Diagnosis]:
    """--save can be written (the S3 bucket exists and takes a probe object; a local directory is writable) and, on
    a local disk, has room for the next checkpoint."""
    from engine import checkpoint

    if not cfg.save:
        return []
    store = checkpoint.Store(cfg.save)
    if (problem := store.write_problem()) is not None:
        return [Diagnosis(code="STORAGE", severity="error", what=f"--save {store.url} cannot be written: {problem}",
                          fix=store.write_fix(), facts={"path": store.url})]
    free = store.free_bytes()
    need, how = checkpoint_bytes(cfg, store)
    if free is None or need is None or free >= need:
        return []
    return [Diagnosis(code="STORAGE", severity="error",
                      what=f"--save {store.url}: {_gib(free)} free on its disk, the next checkpoint needs about "
                           f"{_gib(need)} ({how})",
                      fix="free space there, keep fewer iterations (--keep-last-n K deletes older ones after each "
                          "save), --no-save-optim (weights only), or another --save",
                      facts={"path": store.url, "free_bytes": free, "need_bytes": need})]


@check("CONFIG")
def reward_service_reachable(cfg, env: Environment) -> list[Diagnosis]:
    """--rm-type remote_rm: the service's host and port take a connection (3 s); a warning, since a service may
    come up after the run starts (until it answers, its samples fail and the rollouts are retried)."""
    import socket
    from urllib.parse import urlsplit

    from engine.tracking.secrets import redact_text

    if cfg.rm_type != "remote_rm" or not cfg.rm_url:
        return []
    url = urlsplit(cfg.rm_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=3).close()
        return []
    except OSError as e:
        return [Diagnosis(code="CONFIG", severity="warning",
                          what=f"--rm-url {redact_text(cfg.rm_url)}: {url.hostname}:{port} does not take a connection "
                               f"from here ({type(e).__name__}: {e}); every sample's reward will fail until it does",
                          fix="start the reward service (or fix --rm-url) before the first rollout ends",
                          facts={"field": "rm_url", "host": url.hostname, "port": port})]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def checkpoint_bytes(cfg, store) -> tuple[int | None, str]:
    """Bytes of the next iteration: the newest saved one's size when there is one, else an estimate from the
    model's parameter count (fp32 weights, + 2 fp32 Adam moments with --save-optim, + the HF export with
    --save-hf)."""
    from engine import checkpoint
    from engine.modeling import weight_numel

    for it in reversed(checkpoint.list_iterations(store)):
        m = checkpoint.read_manifest(store, it)
        if m and m.get("files"):
            return sum(int(f.get("size", 0)) for f in m["files"].values()), f"the size of iter_{it:07d}"
    numel = weight_numel(cfg.model_dir)
    if numel is None:
        return None, ""
    per = 4 * (3 if cfg.save_optim else 1) + (2 if cfg.save_hf and cfg.bf16 else 4 if cfg.save_hf else 0)
    return numel * per, f"estimated: {numel:,} parameters × {per} bytes"


@check("DATA")
def prompts_fit_context(cfg, env: Environment) -> list[Diagnosis]:
    """Every prompt (training and eval) leaves --rollout-max-response-len tokens of the model's context. Cheap on
    every row: a prompt whose rendered text has fewer bytes than the room left cannot have more tokens (a token is
    at least one byte, + 2 for special tokens a tokenizer adds); only the others are tokenized."""
    from engine.data import load_prompts
    from engine.modeling import load_tokenizer, read_model_json, render_row

    ctx = (read_model_json(cfg.model_dir, "config.json") or {}).get("max_position_embeddings")
    if not isinstance(ctx, int):
        return []
    eval_len_flag = "--eval-max-response-len" if cfg.eval_max_response_len else "--rollout-max-response-len"
    # (flag, path, input_key, flag naming the answer length, answer length) of the training data and every eval set
    files = [("--prompt-data", cfg.prompt_data, (cfg.input_key, cfg.tool_key), "--rollout-max-response-len",
              0 if cfg.debug_train_only else cfg.rollout_max_response_len)]  # no engine: the rows are all there is
    for d in [] if cfg.no_engines else cfg.eval_datasets():  # no engine: nothing is evaluated
        if cfg.eval_config:
            files.append(("--eval-config", d.path, (d.input_key, d.tool_key),
                          f"--eval-config {d.name}'s max_response_len", d.max_response_len))
        else:
            files.append(("--eval-prompt-data", d.path, (d.input_key, d.tool_key), eval_len_flag,
                          d.max_response_len))
    # a context cap (--rollout-max-context-len, --eval-max-context-len) bounds prompt + answer by construction:
    # it must fit the model, and then the file's prompts need no count (the longer ones are dropped at load)
    capped = []
    for f in files:
        cap = cfg.rollout_max_context_len if f[0] == "--prompt-data" else cfg.eval_context_len
        if cap is None:
            continue
        capped.append(f)
        cap_flag = "--rollout-max-context-len" if f[0] == "--prompt-data" or not cfg.eval_max_context_len \
            else "--eval-max-context-len"
        if cap > ctx:
            return [Diagnosis(code="DATA", severity="error",
                              what=f"{cap_flag} {cap} is above the model's context of {ctx} tokens "
                                   "(max_position_embeddings)", fix=f"{cap_flag} {ctx} or less",
                              facts={"context": ctx, "field": cap_flag[2:].replace("-", "_"), "value": cap})]
    files = [f for f in files if f not in capped]
    for flag, _, _, len_flag, new in files:
        if ctx - new <= 0:
            return [Diagnosis(code="DATA", severity="error",
                              what=f"{len_flag} {new} leaves no room for a prompt in the model's context of {ctx} "
                                   "tokens (max_position_embeddings)",
                              fix=f"{len_flag} below {ctx}, leaving room for the longest prompt",
                              facts={"context": ctx})]
    try:
        tok = load_tokenizer(cfg.model_dir)
    except Exception:  # noqa: BLE001 — model_dir_usable reports it
        return []
    overhead = 0
    if cfg.apply_chat_template and tok.chat_template:
        overhead = len(tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                               add_generation_prompt=True,
                                               **cfg.apply_chat_template_kwargs).encode())
    out = []
    for flag, path, (input_key, tool_key), len_flag, new in files:
        if not path:
            continue
        room = ctx - new
        rows = load_prompts(path, input_key=input_key, label_key=None, flag=flag, tool_key=tool_key)
        long: list[tuple[int, int]] = []  # (line, tokens)
        for r in rows:
            if isinstance(r.prompt, str) and r.tools is None and len(r.prompt.encode()) + overhead + 2 <= room:
                continue
            try:
                n = len(render_row(tok, r, cfg))
            except Exception:  # noqa: BLE001 — a prompt the template refuses: the rollout reports it
                continue
            cap = cfg.rollout_max_prompt_len if flag == "--prompt-data" else cfg.eval_max_prompt_len
            if cap and n > cap:
                continue  # dropped when the data is loaded (stages.short_prompts)
            if n > room:
                long.append((r.row, n))
        if long:
            worst = max(long, key=lambda x: x[1])
            lines = ", ".join(str(line) for line, _ in long[:10]) + (" …" if len(long) > 10 else "")
            out.append(Diagnosis(
                code="DATA", severity="error",
                what=f"{len(long)} of {len(rows)} {flag} prompts leave less than {len_flag} {new} tokens of the "
                     f"model's context of {ctx} (longest: {worst[1]} tokens, line {worst[0]}; lines {lines}): the "
                     "engine refuses them",
                fix=f"drop or shorten those rows, {len_flag} ≤ {ctx - worst[1]}, or a model with a longer context",
                facts={"flag": flag, "lines": [line for line, _ in long], "context": ctx}))
    return out


@check("RF02")
def topology_fits_cluster(cfg, env: Environment) -> list[Diagnosis]:
    """Colocated: GPUs ≥ nodes × gpus_per_node; decoupled: ≥ that + rollout GPUs; each train node fits on a node."""
    out = []
    n, g = cfg.actor_num_nodes, cfg.actor_num_gpus_per_node
    if env.gpus <= 0:  # CPU mode: one node's workers share its cores; several nodes need a CPU per rank on each
        fit = sum(1 for c in env.cpus_per_node if c >= g)
        if n > 1 and env.cpus_per_node and fit < n and cfg.trains:
            out.append(Diagnosis(code="RF02", severity="error",
                                 what=f"--actor-num-nodes {n} puts {g} train worker(s) (--actor-num-gpus-per-node) "
                                      f"on each of {n} different nodes, each worker holding one CPU, but only {fit} "
                                      f"of {env.source}'s nodes have {g} CPU(s) (CPUs per node: "
                                      f"{[int(c) for c in env.cpus_per_node]}): Ray would wait forever",
                                 fix=f"--actor-num-nodes {max(1, fit)} or add nodes",
                                 facts={"need_nodes": n, "fitting_nodes": fit,
                                        "cpus_per_node": env.cpus_per_node}))
        return out
    train = n * g if cfg.trains else 0  # --debug-rollout-only: no train rank
    rollout = cfg.rollout_num_gpus if cfg.rollout_num_gpus is not None else \
        cfg.rollout_num_engines * cfg.rollout_num_gpus_per_engine
    if cfg.no_engines or cfg.external_engines:  # no engine, or servers on GPUs of their own
        rollout = 0
    if cfg.colocate:
        need, formula = train, f"colocated: GPUs ≥ actor_num_nodes × actor_num_gpus_per_node = {n} × {g} = {train}"
    else:
        need = train + rollout
        formula = (f"decoupled: GPUs ≥ actor_num_nodes × actor_num_gpus_per_node + rollout_num_gpus = "
                   f"{n} × {g} + {rollout} = {need}")
    facts = {"need": need, "have": env.gpus, "train_gpus": train, "rollout_gpus": 0 if cfg.colocate else rollout,
             "gpus_per_node": env.gpus_per_node}
    if need > env.gpus:
        fixes = []
        if not cfg.colocate and train <= env.gpus:
            fixes.append("--colocate (training and rollout share the GPUs)")
            if env.gpus - train >= cfg.rollout_num_gpus_per_engine:
                fixes.append(f"--rollout-num-gpus {int(env.gpus - train)}")
        if train > env.gpus:
            fixes.append(f"--actor-num-nodes × --actor-num-gpus-per-node ≤ {int(env.gpus)}")
        out.append(Diagnosis(code="RF02", severity="error",
                             what=f"the run asks for {need} GPUs ({formula}) but {env.source} has "
                                  f"{env.gpus:g}: Ray would wait forever",
                             fix=", or ".join(fixes) or "a larger cluster", facts=facts))
    elif cfg.trains and sum(1 for x in env.gpus_per_node if x >= g) < n:
        out.append(Diagnosis(code="RF02", severity="error",
                             what=f"each of the {n} training node(s) needs {g} GPUs on one node, but the nodes have "
                                  f"{env.gpus_per_node} GPUs",
                             fix=f"--actor-num-gpus-per-node {int(max(env.gpus_per_node, default=0))} "
                                 f"--actor-num-nodes {max(1, -(-train // max(1, int(max(env.gpus_per_node)))))}",
                             facts=facts))
    return out


@check("RF04")
def model_name_consistent(cfg, env: Environment) -> list[Diagnosis]:
    from engine.modeling import read_model_json

    path = Path(cfg.model_dir) / "config.json"
    config = read_model_json(cfg.model_dir, "config.json")
    if config is None:
        return []  # model_dir_usable reports it
    model_type = config.get("model_type")
    if cfg.model_name and model_type and cfg.model_name.lower() != model_type.lower():
        return [Diagnosis(code="RF04", severity="error",
                          what=f"--model-name {cfg.model_name} but {path} says model_type {model_type!r}",
                          fix=f"--model-name {model_type}")]
    if cfg.actor_num_nodes > 1 and not cfg.model_name:
        return [Diagnosis(code="RF04", severity="warning",
                          what=f"{cfg.actor_num_nodes} training nodes will read {cfg.hf_checkpoint} and none is "
                               "told the architecture",
                          fix=f"--model-name {model_type} (files are also read behind a per-node lock)")]
    return []


_SGLANG_PORT_KEYS = ("port", "router-port", "nccl-port", "dist-init-addr")


@check("RF07")
def moe_dispatcher_switched(cfg, env: Environment) -> list[Diagnosis]:
    if cfg.moe_dispatcher == cfg.moe_token_dispatcher_type:
        return []
    return [Diagnosis(code="RF07", severity="info",
                      what="--moe-token-dispatcher-type allgather cannot handle packed (variable-length) sequences, "
                           f"and packing is always on: the run uses {cfg.moe_dispatcher}",
                      fix="nothing to do (pass --moe-token-dispatcher-type alltoall to silence this)")]


@check("CONFIG")
def sglang_flags_exist(cfg, env: Environment) -> list[Diagnosis]:
    """`--sglang-*` flags go to `python -m sglang.launch_server` verbatim: one SGLang does not have is a typo."""
    from engine.config.sglang_args import known_flags, unknown_flags

    out = []
    version, _ = known_flags()
    for name, near in unknown_flags(list(cfg.sglang_args)):
        out.append(Diagnosis(
            code="CONFIG", severity="error",
            what=f"--sglang-{name} is not a flag of SGLang's launch_server (sglang {version}'s server arguments, "
                 "engine/config/sglang_server_args.txt)",
            fix=(f"did you mean {' or '.join('--sglang-' + n for n in near)}?" if near else
                 "check the name in `python -m sglang.launch_server --help`") +
                " (for a newer SGLang, regenerate the list: python -m engine.config.sglang_args --from-wheel …)",
            facts={"flag": name, "suggestions": near, "sglang_version": version}))
    return out


@check("RF08")
def fixed_ports_free(cfg, env: Environment) -> list[Diagnosis]:
    from engine.rollout.ports import is_port_free, port_holder

    out = []
    for key in _SGLANG_PORT_KEYS:
        val = cfg.sglang_args.get(key)
        if val is None or isinstance(val, bool):
            continue
        port = int(str(val).rsplit(":", 1)[-1]) if str(val).rsplit(":", 1)[-1].isdigit() else None
        if port is None:
            continue
        holder = None if is_port_free(port) else (port_holder(port) or "another process")
        if holder:
            out.append(Diagnosis(code="RF08", severity="error",
                                 what=f"--sglang-{key} {val}: port {port} is already in use by {holder}",
                                 fix=f"drop --sglang-{key} so rollflow's port allocator picks free ports, or stop "
                                     f"{holder}", facts={"port": port, "holder": holder}))
        elif cfg.rollout_num_engines > 1 and key == "port":
            out.append(Diagnosis(code="RF08", severity="error",
                                 what=f"--sglang-port {port} is fixed but {cfg.rollout_num_engines} engines are "
                                      "started: they would collide on one machine",
                                 fix="drop --sglang-port: every engine gets its own port from the allocator"))
    return out


# Chat-template markers of the common families; a pre-templated prompt carries some of them.
TEMPLATE_MARKERS = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|eot_id|>", "[INST]", "[/INST]",
                    "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<｜User｜>",
                    "<｜Assistant｜>", "<|begin_of_text|>", "<s>")


RF09_SAMPLE = 32  # rows RF09 reads, evenly spaced over --prompt-data


@check("RF09")
def pretemplated_data_matches_model(cfg, env: Environment) -> list[Diagnosis]:
    """Render a probe with the tokenizer's template; compare pre-templated rows' markers and generation suffix."""
    from engine.data import load_prompts

    every = load_prompts(cfg.prompt_data, input_key=cfg.input_key, label_key=cfg.label_key)
    step = max(1, len(every) // RF09_SAMPLE)  # spread over the whole file: a file of mixed rows is caught too
    rows = [r for r in every[::step][:RF09_SAMPLE] + every[-1:] if isinstance(r.prompt, str)]
    templated = [r for r in rows if any(m in r.prompt for m in TEMPLATE_MARKERS)]
    if not templated:
        return []
    if cfg.apply_chat_template:
        r = templated[0]
        return [Diagnosis(code="RF09", severity="error",
                          what=f"--prompt-data rows are already chat-templated (line {r.row}: {r.prompt[:80]!r}) and "
                               "--apply-chat-template would template them a second time",
                          fix="--no-apply-chat-template, or store plain prompts / chat messages in the data")]
    from engine.modeling import load_tokenizer

    tok = load_tokenizer(cfg.model_dir)
    if not tok.chat_template:
        return []
    probe = tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                    add_generation_prompt=True)
    model_markers = {m for m in TEMPLATE_MARKERS if m in probe}
    gen_suffix = probe.split("\x00", 1)[1].strip()
    for r in templated:
        data_markers = {m for m in TEMPLATE_MARKERS if m in r.prompt}
        foreign = sorted(data_markers - model_markers)
        if foreign or (gen_suffix and not r.prompt.rstrip().endswith(gen_suffix)):
            rendered = tok.apply_chat_template([{"role": "user", "content": "…"}], tokenize=False,
                                               add_generation_prompt=True)
            return [Diagnosis(code="RF09", severity="error",
                              what=(f"--prompt-data line {r.row} is pre-templated with a template that differs from "
                                    f"the model's: data {r.prompt[:80]!r} vs model {rendered!r}"
                                    + (f" (markers {foreign} are not the model's)" if foreign else "")),
                              fix="store plain prompts and pass --apply-chat-template, or re-template the data with "
                                  "this model's tokenizer", facts={"line": r.row, "foreign_markers": foreign})]
    return []


def template_variables(tok) -> list[str]:
    """The names the tokenizer's chat template(s) read (jinja2's undeclared variables)."""
    import jinja2
    from jinja2 import meta

    templates = tok.chat_template if isinstance(tok.chat_template, dict) else {"default": tok.chat_template or ""}
    names: set[str] = set()
    for text in templates.values():
        names |= meta.find_undeclared_variables(jinja2.Environment().parse(text))
    return sorted(names)


def unread_template_kwargs(tok, kwargs: dict) -> list[str]:
    """--apply-chat-template-kwargs keys the template never reads (Jinja ignores them without a word)."""
    read = set(template_variables(tok))
    return sorted(k for k in kwargs if k not in read)


@check("RF12")
def inductor_cache_disabled(cfg, env: Environment) -> list[Diagnosis]:
    if env.worker_env.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1") != "1":
        return [Diagnosis(code="RF12", severity="warning",
                          what="TORCHINDUCTOR_FORCE_DISABLE_CACHES is set to "
                               f"{env.worker_env['TORCHINDUCTOR_FORCE_DISABLE_CACHES']!r} in the environment, so Ray "
                               "workers share inductor's cache (JSONDecodeError under torch.compile)",
                          fix="unset TORCHINDUCTOR_FORCE_DISABLE_CACHES (rollflow sets it to 1 in every worker)")]
    return []
