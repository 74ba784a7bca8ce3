"""The stages of one run, called by the Prefect tasks (one call per task) or directly without Prefect.

place → convert → [rollout → pack → train → save → sync] per rollout id → evaluate.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from engine import checkpoint, faults
from engine.config import RunConfig
from engine.doctor.checks import Environment, run_preflight
from engine.diagnosis import ConfigError, Diagnosis
from engine.packing.microbatch import MicroBatch
from engine.run import Run
from engine.samples import Sample
from engine.tracking import Tracker

log = logging.getLogger("rollflow")


def publish(run: Run, step: int, metrics: dict[str, float], *, track: bool = True) -> dict[str, float]:
    """A stage's metrics: into the run's history (carried by checkpoints) and MLflow at `step` (the rollout id),
    with MLflow copies of the headline ones (engine.tracking.metrics.overview); `track` False: the history only (a
    logging hook took over: --custom-rollout-log-function-path)."""
    from engine.tracking.metrics import overview

    run.record(metrics, step)
    if run.tracker is not None and track:
        run.tracker.log_metrics({**metrics, **overview(metrics, run.history, step)}, step=step)
    return metrics


# ---- preflight -------------------------------------------------------------------------------------------------
def preflight(cfg: RunConfig, env: Environment | None = None) -> list[Diagnosis]:
    """Every check; raises ConfigError when any is an error (nothing has started yet), logs the others."""
    diags = run_preflight(cfg, env or Environment.for_config(cfg))
    errors = [d for d in diags if d.severity == "error"]
    if errors:
        raise ConfigError(diags)
    for d in diags:
        log.warning(d.render())
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
    if start.kind == "checkpoint" and start.next_rollout_id > 0:  # preflight checked the peeked iteration; a
        from engine.doctor.checks import resume_guard  # fallback may have picked an older one
        from engine.diagnosis import DiagnosisError

        if (bad := resume_guard(cfg, f"{start.source}/{checkpoint.iter_name(start.iteration)}", start.manifest)):
            raise DiagnosisError(bad)
    for note in start.notes:  # the convert task reports them as warnings and an artifact
        log.info(note)
    log.info("rollflow: %s", start.describe())
    run.start = start
    return start


def _tracking_resume(cfg: RunConfig) -> dict[str, Any] | None:
    """The MLflow run to continue, for `track` (which runs before preflight and place): the manifest of the
    iteration the run will start from — a cheap look, place verifies it — else the run id a killed fresh attempt
    recorded in <save>/rollflow_run.json. Storage errors are left to preflight to report.

    A checkpoint written to another location than this run's --save (a copied or moved directory, or --load of
    another run's) starts a new MLflow run linked to the one that wrote it (`parent_run_id`): copies of one --save
    never log into the same run."""
    try:
        found = checkpoint.peek_start(load=cfg.load, save=cfg.save, ckpt_step=cfg.ckpt_step)
        ident = checkpoint.read_run_file(cfg.save) if cfg.save and found is None else None
    except Exception:  # noqa: BLE001 — unreachable S3, no credentials: RF01/RF05 say so with the fix
        return None
    here = checkpoint.normalize(cfg.save) if cfg.save else None
    if found:
        it, manifest, automatic = found
        if cfg.resume_changes(manifest.get("settings")):
            return None  # preflight refuses this resume (RF05): its failure is a run of its own, not the original's
        if manifest.get("save") not in (None, here):
            return {"iteration": it, "manifest": {}, "automatic": automatic,
                    "parent_run_id": manifest.get("mlflow_run_id"), "written_to": manifest["save"]}
        return {"iteration": it, "manifest": manifest, "automatic": automatic}
    if ident and ident.get("config_hash") == cfg.config_hash() and ident.get("save") in (None, here) \
            and ident.get("origin") == checkpoint.origin_of(cfg.load, cfg.ckpt_step):
        return {"iteration": None, "manifest": {"mlflow_run_id": ident.get("mlflow_run_id")}, "automatic": True}
    return None


# ---- track -----------------------------------------------------------------------------------------------------
def track(cfg: RunConfig, *, flow_run_id: str | None = None, flow_run_url: str | None = None,
          run_name: str | None = None) -> Tracker:
    """Open the MLflow run first (the checkpoint manifest's run when resuming), so a failed preflight is recorded.
    A new MLflow run is named `run_name` (the flow run's name), else --run-name or `<experiment>-<date>-<time>`."""
    from engine.tracking.record import open_tracking

    return open_tracking(cfg, work_dir=Path(cfg.work_dir).resolve(), resume=_tracking_resume(cfg),
                         flow_run_id=flow_run_id, flow_run_url=flow_run_url, run_name=run_name)


def place(cfg: RunConfig, *, tracker: Tracker | None = None, flow_run_id: str | None = None,
          flow_run_url: str | None = None) -> Run:
    """Start (or join) Ray, start the rollout engines and the train workers, and read the data while they start
    (tracking: `track`)."""
    from engine import cluster

    run = Run(cfg)
    run.flow_run_id, run.flow_run_url = flow_run_id, flow_run_url
    run.work_dir.mkdir(parents=True, exist_ok=True)
    resolve_start(run)
    # a Ray connection made by the caller is left open by run.close(); the one `rollflow train` started before
    # the flow (plumbing/prestart.py) is this run's
    run.owns_ray = cluster.take_prestarted() or not cluster.connected()
    run.cluster = cluster.connect(cfg.ray_address, cfg.num_cpus, cfg.ray_code, cfg.ray_services)
    fits_cluster(cfg)
    memory_recorder_fits(cfg, run.cluster.get("GPU", 0.0))
    try:
        # The engines and the train workers start first, side by side: each imports torch and transformers and
        # loads the model (~5 s of CPU each), so the driver reads the data and opens the tracker meanwhile.
        # Colocated, they share the GPUs: the engines take their memory fraction first, as before.
        # With the engine in train rank 0's process (--rollout-engine-process), the worker starts first and
        # serves the engine once it has loaded the model (its calls run in order).
        if cfg.no_engines:  # --load-debug-rollout-data, --debug-train-only: no engine starts
            plan_train_only(run)
        elif cfg.external_engines:  # --rollout-external-engine-addrs: servers that run already
            plan_external_engines(run)
        else:
            plan_rollout_engines(run)
        if not run.engine_in_trainer and not cfg.no_engines:
            launch_rollout_engines(run)
        if cfg.colocate:
            run.engines.wait_started()
        if cfg.trains:  # not with --debug-rollout-only
            run.train_group = cluster.TrainGroup(cfg, train_iters=run.plan.train_iters,
                                                 timeout_s=cfg.train_step_timeout, threads=run.train_threads,
                                                 placement=place_train_workers(run), registry=run.ports, wait=False)
        if run.engine_in_trainer:
            launch_rollout_engines(run, host=run.train_group.workers[0])
        load_driver_side(run, tracker)
        if run.engines is not None:
            run.engines.wait_started()
            watch_rollout_engines(run)
            if cfg.external_engines:  # RF14's default threshold follows what the servers compute in
                run.engine_dtype = external_dtype(run.engines)
        if run.train_group is not None:
            run.train_group.wait_ready()
            check_disk_sync(run)
            if cfg.use_pytorch_profiler or cfg.record_memory_history:
                run.train_group.profile_setup(*profile_dirs(run))
    except BaseException:
        run.close()  # a retried place() must not find this attempt's placement group still holding the GPUs
        raise
    return run


def memory_recorder_fits(cfg: RunConfig, cluster_gpus: float) -> None:
    """--record-memory-history with the torch recorder records the CUDA caching allocator: on a cluster without
    GPUs it would fail in every train rank's start; say so before anything starts."""
    if cfg.record_memory_history and cfg.memory_recorder == "torch" and not cluster_gpus:
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what="--record-memory-history records the CUDA caching allocator's history (--memory-recorder torch), "
                 "and this cluster has no GPUs",
            fix="--memory-recorder memray (host memory; pip install memray), or run on GPUs",
            facts={"field": "memory_recorder", "value": "torch", "cluster_gpus": cluster_gpus}))


def profile_dirs(run: Run) -> tuple[str, str]:
    """--use-pytorch-profiler's and --record-memory-history's directories, absolute as the driver sees them (a
    worker's working directory may be another): <work_dir>/profile, and --memory-snapshot-dir when set."""
    traces = run.work_dir / "profile"
    return str(traces), str(Path(run.cfg.memory_snapshot_dir).resolve()) if run.cfg.memory_snapshot_dir \
        else str(traces)


def dump_run_details(run: Run) -> None:
    """--dump-details DIR: the tokenizer (DIR/tokenizer) and the run's flags (DIR/config.yaml, secrets redacted)
    beside the rollout and train data the two debug patterns write there; rewritten at each start."""
    import yaml

    from engine.tracking.secrets import redact

    d = Path(run.cfg.dump_details)
    (d / "tokenizer").mkdir(parents=True, exist_ok=True)
    run.tokenizer.save_pretrained(str(d / "tokenizer"))
    text = yaml.safe_dump(redact(run.cfg.model_dump(mode="json")), sort_keys=False)
    tmp = d / ".config.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, d / "config.yaml")
    log.info("--dump-details: tokenizer and flags in %s; rollouts in %s, train data in %s", d,
             run.cfg.save_debug_rollout_data, run.cfg.save_debug_train_data)


def load_driver_side(run: Run, tracker: Tracker | None) -> None:
    """The driver's part of place: tokenizer, prompts, eval sets, reward model, hooks, the RF14 probe prompts, the
    tracker (and, for a fresh lineage, the run file naming its MLflow run)."""
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import eos_token_ids, load_tokenizer
    from engine.rewards import RewardModel

    cfg = run.cfg
    run.tokenizer = load_tokenizer(cfg.model_dir)
    run.eos_ids = eos_token_ids(cfg.model_dir, run.tokenizer)
    rows = load_prompts(cfg.prompt_data, input_key=cfg.input_key, label_key=cfg.label_key,
                        metadata_key=cfg.metadata_key, tool_key=cfg.tool_key)
    cap, cap_flag = cfg.prompt_cap()
    if cap:
        rows = short_prompts(run, rows, cap, cap_flag)
    run.dataset = PromptDataset(rows, shuffle=cfg.rollout_shuffle, seed=cfg.sampling_seed)
    run.eval_datasets = {} if cfg.no_engines else {d.name: d for d in cfg.eval_datasets()}  # no engine: no eval
    run.eval_sets = {name: eval_rows(d, cfg.eval_max_samples, run) for name, d in run.eval_datasets.items()}
    run.reward_model = RewardModel.of(cfg)
    load_hooks(run)
    run.probe = probe_prompts(run)
    if cfg.dump_details:
        dump_run_details(run)

    run.tracker = tracker or track(cfg, flow_run_id=run.flow_run_id, flow_run_url=run.flow_run_url)
    if run.store and run.start.next_rollout_id == 0 and run.tracker.run_id:  # a fresh lineage: remember its run
        if (checkpoint.read_run_file(run.store) or {}).get("mlflow_run_id") != run.tracker.run_id:
            checkpoint.write_run_file(run.store, {"mlflow_run_id": run.tracker.run_id, "origin": run.origin,
                                                  "config_hash": cfg.config_hash(), "created_at": time.time(),
                                                  "save": checkpoint.normalize(cfg.save)})


def eval_rows(d, limit: int, run: Run | None = None) -> list:
    """The first `limit` rows of eval set `d` (a resolved EvalDataset: its keys; its rm_type and
    metadata_overrides in each row's metadata, where the per-sample reward reads them); with `run`, rows over
    --eval-max-prompt-len tokens are dropped first."""
    import dataclasses

    from engine.data import load_prompts

    flag = "--eval-config" if run is not None and run.cfg.eval_config else "--eval-prompt-data"  # errors name it
    rows = load_prompts(d.path, input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key,
                        flag=flag, tool_key=d.tool_key)
    cap, cap_flag = run.cfg.prompt_cap(evaluation=True) if run is not None else (None, "")
    if cap:
        rows = short_prompts(run, rows, cap, cap_flag, f"eval set {d.name!r}")
    rows = rows[:limit]
    if d.rm_type is None and not d.metadata_overrides:
        return rows
    return [dataclasses.replace(r, metadata=d.row_metadata(r.metadata)) for r in rows]


def short_prompts(run: Run, rows: list, limit: int | None = None, flag: str = "--rollout-max-prompt-len",
                  data: str = "--prompt-data") -> list:
    """`flag` (--rollout-max-prompt-len, or --eval-max-prompt-len for an eval set): the rows whose rendered prompt
    has at most `limit` tokens (slime drops the others when it loads the data); the dropped ones are logged; none
    left is a DATA error."""
    from engine.diagnosis import DiagnosisError
    from engine.modeling import render_row

    cfg = run.cfg
    limit = cfg.rollout_max_prompt_len if limit is None else limit
    kept, dropped = [], []
    for r in rows:
        # a token is at least one byte: a prompt of fewer bytes than the limit is kept without tokenizing it
        # (the chat template's own tokens are counted by rendering, so only a raw prompt takes the shortcut)
        if not cfg.apply_chat_template and isinstance(r.prompt, str) and len(r.prompt.encode()) + 2 <= limit:
            kept.append(r)
            continue
        n = len(render_row(run.tokenizer, r, cfg))
        if n <= limit:
            kept.append(r)
        else:
            dropped.append((r.row, n))
    if dropped:
        lines = ", ".join(str(line) for line, _ in dropped[:10]) + (" …" if len(dropped) > 10 else "")
        log.warning("%s %d: dropped %d of %d %s rows (lines %s; longest %d tokens)",
                    flag, limit, len(dropped), len(rows), data, lines, max(n for _, n in dropped))
    if not kept:
        raise DiagnosisError(Diagnosis(
            code="DATA", severity="error",
            what=f"{flag} {limit} drops every one of the {len(rows)} {data} rows (the shortest has "
                 f"{min(n for _, n in dropped)} tokens)",
            fix=f"{flag} {min(n for _, n in dropped)} or more, or drop the flag",
            facts={"field": flag[2:].replace("-", "_"), "value": limit}))
    return kept


def hook_args(run: Run, rollout_id: int, *, evaluation: bool = False):
    """`args` of the user hooks (engine/rollout/hooks.py): the flags, the tokenizer, the sampling params."""
    from engine.rollout.hooks import HookArgs

    params = eval_sampling_params(run) if evaluation else sampling_params(run)
    return HookArgs(run.cfg, tokenizer=run.tokenizer, sampling_params=params.to_sglang(None),
                    rollout_id=rollout_id, evaluation=evaluation, eval_sets=run.eval_sets if evaluation else None,
                    tracker=getattr(run, "tracker", None))


def load_hooks(run: Run) -> None:
    """slime's hook flags (a bad path fails here, at start, naming the flag) and the data source."""
    from engine.modeling import render_prompt
    from engine.rollout.filters import load_filter
    from engine.rollout.hooks import Hooks, load_data_source

    cfg = run.cfg
    run.hooks = Hooks.load(cfg)
    from engine.rewards import load_function

    for flag in ("--custom-loss-function-path", "--custom-advantage-function-path", "--custom-tis-function-path",
                 "--custom-pg-loss-reducer-function-path", "--rollout-data-postprocess-path"):  # on the train workers:
        if path := getattr(cfg, flag[2:].replace("-", "_")):  # a bad path fails here, before any rollout
            load_function(path, flag)
    run.sample_filter = (load_filter(cfg.dynamic_sampling_filter_path, hook_args(run, -1))
                         if cfg.dynamic_sampling_filter_path else None)
    run.reward_model.args = hook_args(run, -1)  # for slime-style reward functions fn(args, sample)
    run.data_source = load_data_source(cfg, hook_args(run, -1),
                                       lambda prompt: render_prompt(run.tokenizer, prompt, cfg.apply_chat_template,
                                                                     cfg.apply_chat_template_kwargs))


def fits_cluster(cfg: RunConfig) -> None:
    """RF02 against the cluster just joined (preflight saw only this machine, or the cluster a moment ago): a
    topology that can never fit fails here, in seconds, with the formula and the numbers — not after a timeout."""
    from engine.cluster.placement import PlacementInfeasible
    from engine.doctor.checks import Environment, topology_fits_cluster

    env = Environment.from_ray(cfg.ray_address or "local")
    if errors := [d for d in topology_fits_cluster(cfg, env) if d.severity == "error"]:
        raise PlacementInfeasible(errors)


def engine_in_trainer(cfg: RunConfig, cluster_gpus: float) -> bool:
    """Whether the built-in engine serves from train rank 0's process (--rollout-engine-process): auto where the
    flags allow it (RunConfig.engine_in_trainer_blockers) and the cluster has no GPUs; trainer on a cluster with
    GPUs is a ConfigError (GPU engines and trainers are placed on GPU bundles of their own)."""
    if cfg.rollout_engine_process == "own":
        return False
    if cluster_gpus > 0:
        if cfg.rollout_engine_process == "trainer":
            raise ConfigError(Diagnosis(
                code="CONFIG", severity="error",
                what=f"--rollout-engine-process trainer on a cluster with {cluster_gpus:g} GPUs: the engine in the "
                     "trainer's process is for CPU runs (on GPUs the engines and the train ranks have bundles of "
                     "their own; --colocate shares the GPUs)",
                fix="--rollout-engine-process auto (own on GPUs) or own",
                facts={"field": "rollout_engine_process", "value": "trainer", "cluster_gpus": cluster_gpus}))
        return False
    return cfg.engine_in_trainer_on_cpu()


def plan_rollout_engines(run: Run) -> None:
    """The placement group of the engines, their spec, where they run and how weights reach them (`run.engine_spec`,
    `run.engine_in_trainer`, `run.sync_transport`); `launch_rollout_engines` starts them."""
    from engine import cluster
    from engine.cluster.placement import group_name, place as place_group, remove_leftovers, rollout_layout
    from engine.rollout.engines import engine_spec

    cfg = run.cfg
    run.ports = cluster.port_registry()
    layout = rollout_layout(cluster_gpus=run.cluster.get("GPU", 0.0),
                            train_gpus=cfg.train_world_size if cfg.trains else 0,  # --debug-rollout-only: none
                            colocate=cfg.colocate, rollout_num_gpus=cfg.rollout_num_gpus,
                            gpus_per_engine=cfg.rollout_num_gpus_per_engine, num_engines=cfg.rollout_num_engines)
    name = group_name(run.key)
    if gone := remove_leftovers(name):
        log.warning("removed %d placement group(s) named %s left by an earlier attempt of this run", gone, name)
    run.placement = place_group(layout, timeout_s=cfg.placement_timeout, name=name)
    run.on_gpu = layout.gpus_per_engine > 0
    run.engine_in_trainer = engine_in_trainer(cfg, run.cluster.get("GPU", 0.0))
    import secrets

    # in the trainer's process the engine leaves the thread count to the trainer (torch's is one per process)
    spec = engine_spec(cfg, threads=None if run.engine_in_trainer else run.threads_per_process,
                       log_dir=str(run.work_dir / "logs"), on_gpu=run.on_gpu,
                       api_key=secrets.token_urlsafe(24))  # this run's engines answer only to its own clients
    # `rollflow train` may have started this engine with Ray already (engine/cluster prestart_engine): adopted
    # when it was started for this very spec and threads (it then serves with its own token), else killed
    run.prestarted_engine = cluster.take_prestarted_engine(None if run.engine_in_trainer else spec,
                                                           run.threads_per_process)
    if run.prestarted_engine is not None:
        spec = run.prestarted_engine["spec"]
    elif run.engine_in_trainer and (hosted := cluster.prestarted_hosted_spec(spec)) is not None:
        spec = hosted  # the prestarted train worker serves it (adopted with the worker: launch_rollout_engines)
    run.engine_spec = spec
    run.engine_dtype = spec.dtype
    run.sync_transport = sync_transport(cfg, on_gpu=run.on_gpu, in_trainer=run.engine_in_trainer) if cfg.trains \
        else "none"
    if not cfg.trains:
        log.warning("rollflow: --debug-rollout-only: no train worker; the engines serve %s's weights for the whole "
                    "run", cfg.hf_checkpoint)
    log.info("rollflow: engines %s %s%s, weight sync by %s", "on GPU" if run.on_gpu else "on CPU", spec.dtype,
             " in train rank 0's process" if run.engine_in_trainer else "", run.sync_transport)
    if not (cfg.log_kl or cfg.use_kl_loss or cfg.kl_coef > 0):
        log.info("rollflow: no KL term (--kl-coef 0, no --use-kl-loss): the reference forward runs on the first "
                 "step only (RF01) and train/kl is not logged; --log-kl logs it every rollout")


def plan_train_only(run: Run) -> None:
    """--load-debug-rollout-data, --debug-train-only: no engines; on GPUs a bundle per train rank
    (`train_only_layout`); the weights go nowhere (`run.sync_transport` "none")."""
    cfg = run.cfg
    _place_train_ranks_only(run)
    run.sync_transport = "none"
    if cfg.replay:
        log.warning("rollflow: --load-debug-rollout-data: no rollout engine, no weight sync and no evaluation; "
                    "rollout i is read from %s", cfg.load_debug_rollout_data.replace("{rollout_id}", "<i>"))
    else:
        log.warning("rollflow: --debug-train-only: no rollout engine, no weight sync and no evaluation; the "
                    "rollouts are made by --rollout-function-path %s", cfg.rollout_function_path)


def _place_train_ranks_only(run: Run) -> None:
    """No engine on the cluster: on GPUs a bundle per train rank (`train_only_layout`), on CPUs nothing to place;
    an engine `rollflow train` may have prestarted is killed."""
    from engine import cluster
    from engine.cluster.placement import group_name, place as place_group, remove_leftovers, train_only_layout

    cfg = run.cfg
    run.ports = cluster.port_registry()
    layout = train_only_layout(cluster_gpus=run.cluster.get("GPU", 0.0),
                               train_gpus=cfg.train_world_size if cfg.trains else 0)
    if layout is not None and layout.bundles:
        name = group_name(run.key)
        if gone := remove_leftovers(name):
            log.warning("removed %d placement group(s) named %s left by an earlier attempt of this run", gone, name)
        run.placement = place_group(layout, timeout_s=cfg.placement_timeout, name=name)
        run.on_gpu = True
    cluster.take_prestarted_engine(None, run.threads_per_process)  # none is started for these runs; killed if it was


def plan_external_engines(run: Run) -> None:
    """--rollout-external-engine-addrs: the train ranks are placed as in a run without engines, the servers are
    attached by `launch_rollout_engines` (engine/rollout/external.py), and the weights reach them over HTTP:
    `disk` (/update_weights_from_disk of <work_dir>/weights/vN) or `http` (safetensors buckets to
    /update_weights_from_tensor, the built-in engine)."""
    cfg = run.cfg
    _place_train_ranks_only(run)
    run.engine_in_trainer = False
    run.sync_transport = {"disk": "disk", "tensor": "http", "distributed": "distributed"}[cfg.weight_sync_method] \
        if cfg.trains else "none"
    log.info("rollflow: %d external rollout engine(s) (%s: %s), weight sync by %s",
             len(cfg.rollout_external_engine_addrs), cfg.rollout_engine, ", ".join(cfg.rollout_external_engine_addrs),
             run.sync_transport)
    if not cfg.trains:
        log.warning("rollflow: --debug-rollout-only: the external engines serve the weights they were started with")


def external_dtype(engines) -> str:
    """The external servers' dtype for RF14's default threshold: float32 only when every one says float32."""
    dtypes = {s.info.get("dtype") for s in engines.slots}
    return "float32" if dtypes == {"float32"} else next((d for d in dtypes if d != "float32"), "unknown")


def launch_rollout_engines(run: Run, host=None) -> None:
    """The engines of `plan_rollout_engines` on their bundles, or served from `host` (a train worker actor),
    starting (`run.engines.wait_started()` waits)."""
    from engine import cluster
    from engine.rollout.engines import EngineGroup

    cfg = run.cfg
    if cfg.external_engines:
        from engine.rollout.external import ExternalEngines

        key = cfg.sglang_args.get("api-key")
        run.engines = ExternalEngines(cfg.rollout_external_engine_addrs, kind=cfg.rollout_engine,
                                      api_key=str(key) if key else None,
                                      start_timeout_s=cfg.rollout_engine_start_timeout,
                                      routed_experts=cfg.use_rollout_routing_replay)
        # a server that answers again after a failure gets the run's weights again (whatever it reports)
        run.engines.resync = (lambda slots: push_weights(run, slots, run.state.weight_version)) if cfg.trains \
            else None
        return
    if host is not None:  # served by the train worker: its start call made with the prestarted worker, if it was
        hosted = getattr(run.train_group, "hosted_engine", None)
        run.prestarted_engine = hosted if hosted is not None and hosted["spec"] == run.engine_spec else None
    run.engines = EngineGroup(run.engine_spec, run.placement, run.ports, fault_tolerant=cfg.use_fault_tolerance,
                              runtime_env=cluster._threads_env(run.threads_per_process), host=host,
                              prestarted=run.prestarted_engine).launch()
    # a restarted engine gets the weights of the last sync before it serves (initial weights: nothing to send)
    run.engines.resync = lambda slots: (push_weights(run, slots, run.state.weight_version)
                                        if run.state.weight_version else None)


def place_train_workers(run: Run):
    """Where the train ranks go: the GPU layout's bundles (run.placement), or on CPU over --actor-num-nodes > 1
    nodes a group of their own (`cpu_train_layout`, run.train_placement); None: anywhere on the cluster."""
    from engine.cluster.placement import cpu_train_layout, group_name, place as place_group, remove_leftovers

    cfg = run.cfg
    if run.placement is not None and run.placement.layout.train_bundles:
        return run.placement
    layout = cpu_train_layout(nodes=cfg.actor_num_nodes, per_node=cfg.actor_num_gpus_per_node)
    if layout is None:
        return None
    name = group_name(run.key) + "-train"
    remove_leftovers(name)
    run.train_placement = place_group(layout, timeout_s=cfg.placement_timeout, name=name)
    return run.train_placement


def check_disk_sync(run: Run) -> None:
    """--weight-sync-method disk only where it is proven to work: train rank 0 writes <work_dir>/weights/vN and
    every engine loads it, so rank 0 and every engine must see the driver's directory (a probe file, never
    assumed). Else a ConfigError naming the nodes that do not."""
    import ray

    from engine.cluster.nodes import Probe

    if run.sync_transport != "disk":
        return
    where = run.work_dir / "weights"
    with Probe(where) as p:
        rank0 = run.train_group.seeing(str(where / "v000000"))[0]
        # an external engine has no process here to ask: its first /update_weights_from_disk tells
        engines = [True] * len(run.engines.slots) if run.cfg.external_engines else \
            ray.get([s.actor.sees.remote(p.file, p.token) for s in run.engines.slots], timeout=60)
    blind = ([f"train rank 0 on {run.train_group.nodes[0]['node_ip']}"] if not rank0 else []) + \
        [f"rollout engine {s.index} on {s.info.get('node')}" for s, ok in zip(run.engines.slots, engines) if not ok]
    if blind:
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"--weight-sync-method disk: {', '.join(blind)} do(es) not see the driver's {where} (a probe file "
                 "written there is not visible on that node), so the engines could not load what rank 0 writes",
            fix="--weight-sync-method tensor (weights through Ray's object store, any node; the built-in engine), "
                "or a --work-dir on a filesystem every node mounts at the same path",
            facts={"field": "weight_sync_method", "value": "disk", "blind": blind, "path": str(where)}))


def sync_transport(cfg: RunConfig, *, on_gpu: bool, in_trainer: bool = False) -> str:
    """How weights reach the engines (one decision per run): `disk`; `in_process` when the engine serves from
    the train worker's process (a copy there); `cuda_ipc` when each built-in engine shares its GPU with a train
    rank that can gather the full weights (colocated; Megatron without pipeline stages); `distributed` (a
    broadcast in a process group of train rank 0 and the engines); else `object_store`."""
    if cfg.weight_sync_method in ("disk", "distributed"):
        return cfg.weight_sync_method
    if in_trainer:
        return "in_process"
    if cfg.colocate and on_gpu and cfg.rollout_engine == "builtin" and \
            (cfg.train_backend == "torch" or cfg.pipeline_model_parallel_size == 1):
        return "cuda_ipc"
    return "object_store"


def probe_prompts(run: Run, k: int = 4) -> list[list[int]]:
    """The first k eval (else train) prompts, rendered: after each weight sync every engine samples a short
    answer to each and the trainer scores those answers (RF14, `probe_engines`). Four answers of ≤ 16 tokens are
    ~60 log-probs: a wrong mapping or a half-loaded sync moves them by O(0.1–10), far above the thresholds;
    16 prompts cost 0.06 s more per sync on the CPU demo for no added detection (issue 18)."""
    from engine.modeling import render_row

    rows = (next(iter(run.eval_sets.values()), None) or run.dataset.rows)[:k]
    return [render_row(run.tokenizer, row, run.cfg) for row in rows]


def watch_rollout_engines(run: Run) -> None:
    """With --use-fault-tolerance: the health monitor of the started engines."""
    from engine.rollout.health import HealthMonitor

    cfg = run.cfg
    if cfg.use_fault_tolerance:
        HealthMonitor(run.engines, interval_s=cfg.rollout_health_check_interval,
                      timeout_s=cfg.rollout_health_check_timeout,
                      first_wait_s=cfg.rollout_health_check_first_wait).start()


# ---- convert ---------------------------------------------------------------------------------------------------
def convert(run: Run) -> int:
    """Load the starting weights (HF weights, or the resumed iteration) into trainers and engines.

    Returns the first rollout id to run (marker + 1 when resuming, 0 for starting weights).
    """
    s = run.start
    if s.kind == "checkpoint":
        run.train_group.load(s.local_dir, load_optim=run.cfg.load_optim)
        if s.manifest.get("data_state"):
            data_source(run).load_state(s.manifest["data_state"])
        if run.cfg.partial_rollout:
            read_partial(run, s.local_dir)
        run.state.history = {k: {int(i): v for i, v in d.items()} for k, d in s.manifest.get("history", {}).items()}
    elif s.kind == "hf":
        run.train_group.load_weights(s.local_dir)
    moved_ref = s.kind == "checkpoint" and run.cfg.ref_update_interval and (Path(s.local_dir) / "ref").is_dir()
    if run.ref_dir and not moved_ref:  # (a checkpoint's moved reference was loaded with it: --ref-update-interval)
        run.train_group.load_weights(run.ref_dir, ref=True)
    run.state.start_rollout_id = s.next_rollout_id
    if run.cfg.check_weight_update_equal:  # the engines hold the trainer's starting weights after it
        check_weight_update_equal(run)
        if run.cfg.offload_train:
            run.train_group.offload()
    elif run.cfg.external_engines and run.cfg.trains:
        # a server started with weights of its own gets the trainer's before rollout 0 too
        first_external_sync(run, s.next_rollout_id - 1)
    elif s.kind != "fresh":
        sync(run, s.next_rollout_id - 1)  # (offloads the trainer with --offload-train)
    elif run.cfg.offload_train:
        run.train_group.offload()
    shutil.rmtree(run.staging / "load", ignore_errors=True)  # loaded everywhere; S3 downloads are not needed
    return run.state.start_rollout_id


def check_weight_update_equal(run: Run) -> None:
    """--check-weight-update-equal (slime's flag): before the first rollout, prove that the weight sync writes every
    weight of every engine, bit for bit. Each engine keeps a snapshot of what it serves, overwrites all of it with
    random values (SGLang's /weights_checker reset_tensors: a weight the sync misses cannot pass for right), takes the
    trainer's weights through the run's own sync path, and must then equal its snapshot (compare). On a fresh start
    the snapshot is --hf-checkpoint's weights as the engines loaded them, so the trainer's own load is checked too;
    on a resume, a --load or with external engines the engines first get the trainer's weights once (a normal sync
    with its RF14 probe), and the snapshot is of those."""
    from engine.diagnosis import DiagnosisError

    cfg, s = run.cfg, run.start
    rid = s.next_rollout_id - 1
    if s.kind == "fresh" and not cfg.external_engines:
        source = f"--hf-checkpoint's weights as the engines loaded them ({cfg.hf_checkpoint})"
    else:
        (first_external_sync if cfg.external_engines else sync)(run, rid)
        source = "the trainer's starting weights, synced to them once first"
    t0 = time.perf_counter()

    def checker(action: str) -> None:
        answers = run.engines.check_weights(action)
        bad = {url: a.get("message") for url, a in answers.items() if a.get("success") is False}
        if bad:
            url, message = next(iter(bad.items()))
            lines = str(message).splitlines()
            if len(lines) > 21:  # a sync that missed everything lists every weight: the first ones say enough
                message = "\n".join(lines[:21] + [f"… and {len(lines) - 21} more"])
            raise DiagnosisError(Diagnosis(
                code="RF14", severity="error",
                what=f"--check-weight-update-equal: {action} failed on {len(bad)} of {len(answers)} engine(s)"
                     + (": after the trainer's weights were synced to version "
                        f"{rid + 1}, the engines do not serve what they held before ({source})"
                        if action == "compare" else "") + f". {url}: {message}",
                fix="the weight sync drops or changes the weights listed (a name mapping, a dtype read wrongly, a "
                    "missing shard): fix that path before training on it; on a fresh start the trainer's own "
                    "load of --hf-checkpoint may differ from the engines' instead"
                    if action == "compare" else
                    "the engines must serve SGLang's /weights_checker (the built-in engine does; SGLang since it "
                    "added the endpoint); or drop --check-weight-update-equal",
                facts={"field": "check_weight_update_equal", "action": action, "engines": sorted(bad)}))

    checker("snapshot")
    checker("reset_tensors")
    version = s.next_rollout_id
    with run.engines.lock:
        push_weights(run, run.engines.serving_slots(), version)
        run.state.weight_version = version
        run.served_versions.add(str(version))
        forget_handed(run)
    checker("compare")
    log.info("--check-weight-update-equal: after the sync to version %d every weight of %d engine(s) equals %s "
             "(%.1f s)", version, len(run.engines.serving()), source, time.perf_counter() - t0)


def first_external_sync(run: Run, rollout_id: int) -> None:
    """The trainer's weights to the external engines before their first rollout; a server that cannot take them
    is a CONFIG error saying what it needs (a refusal here is about how it was started, not a passing fault)."""
    from engine.rollout.client import EngineError

    try:
        sync(run, rollout_id)
    except EngineError as e:
        cfg = run.cfg
        where = (run.work_dir / "weights").resolve()
        fix = (f"the servers must see {where} at that path (a shared filesystem) and the built-in engine must be "
               f"started with --weight-dir {where}; or --weight-sync-method tensor (the built-in engine)"
               if run.sync_transport == "disk" else
               "start the servers with --api-key KEY (the weight endpoints need a key) and pass the same "
               "--sglang-api-key")
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"--rollout-external-engine-addrs: the trainer's weights did not reach the external engines "
                 f"(--weight-sync-method {cfg.weight_sync_method}): {e}",
            fix=fix, facts={"field": "rollout_external_engine_addrs", "value": cfg.rollout_external_engine_addrs,
                            "transport": run.sync_transport})) from None


# ---- rollout ---------------------------------------------------------------------------------------------------
class Handoff:
    """One stage's output on its way to the next stage (rollout → pack → train), passed as the task's return value
    and argument so the loop shows its data and Prefect draws the edge. A plain object: Prefect neither walks
    into it nor serializes it. The next stage `take()`s the payload (samples, tensors), which empties it: the flow
    run's record of task results keeps only the rollout id and the metrics alive."""

    _payload: tuple[str, ...] = ()

    def take(self) -> tuple:
        """The payload, once; a second take (a stage run twice on one output) is an error, not an empty batch."""
        if getattr(self, self._payload[0]) is None:
            raise RuntimeError(f"{self!r} was already taken by the next stage")
        out = tuple(getattr(self, k) for k in self._payload)
        for k in self._payload:
            setattr(self, k, None)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rollout {self.rollout_id})"


class RolloutBatch(Handoff):
    """B groups of n scored samples (`groups`, taken by pack) and the rollout's metrics."""
    _payload = ("groups",)

    def __init__(self, rollout_id: int, groups: list[list[Sample]], metrics: dict[str, float]):
        self.rollout_id, self.groups, self.metrics = rollout_id, groups, metrics


def sampling_params(run: Run, *, greedy: bool = False):
    """The engines stop on the model's EOS and on --rollout-stop-token-ids / --rollout-stop (RF10), sent
    explicitly so that SGLang and the built-in engine stop on exactly the same ids."""
    from engine.rollout.loop import SamplingParams

    cfg = run.cfg
    return SamplingParams(max_new_tokens=cfg.rollout_max_response_len,
                          temperature=0.0 if greedy else cfg.rollout_temperature, top_p=cfg.rollout_top_p,
                          top_k=cfg.rollout_top_k, stop=list(cfg.rollout_stop),
                          stop_token_ids=sorted(set(run.eos_ids) | set(cfg.rollout_stop_token_ids)),
                          skip_special_tokens=cfg.rollout_skip_special_tokens,
                          max_context_len=cfg.rollout_max_context_len)


def eval_sampling_params(run: Run, d=None):
    """The evaluation's sampling for eval set `d` (a resolved EvalDataset; None: the first): its temperature
    (--eval-temperature; default greedy for one sample per prompt, else --rollout-temperature), top-p, top-k,
    answer length, minimum answer length and stops (--eval-config's per set; else the flags)."""
    from engine.config.eval_config import EvalDataset
    from engine.rollout.loop import SamplingParams

    cfg = run.cfg
    if d is None:
        d = next(iter(run.eval_datasets.values()), None) or EvalDataset(name="test", path="").resolved(cfg)
    greedy = d.n_samples_per_eval_prompt == 1 and d.temperature is None
    temperature = 0.0 if greedy else cfg.rollout_temperature if d.temperature is None else d.temperature
    return SamplingParams(max_new_tokens=d.max_response_len, temperature=temperature, top_p=d.top_p, top_k=d.top_k,
                          stop=list(d.stop), stop_token_ids=sorted(set(run.eos_ids) | set(d.stop_token_ids)),
                          skip_special_tokens=cfg.rollout_skip_special_tokens, max_context_len=cfg.eval_context_len,
                          min_new_tokens=d.min_new_tokens or 0)


def _prompts(run: Run, rows: list):
    from engine.modeling import render_row
    from engine.rollout.loop import Prompt

    cfg = run.cfg
    return [Prompt(r, render_row(run.tokenizer, r, cfg)) for r in rows]


def data_source(run: Run):
    """--data-source-path's object, else the prompt file's rows (slime's data source interface: get_samples)."""
    from engine.modeling import render_row
    from engine.rollout.hooks import PromptDataSource

    if getattr(run, "data_source", None) is None:
        run.data_source = PromptDataSource(
            run.dataset, lambda r: render_row(run.tokenizer, r, run.cfg),
            run.cfg.n_samples_per_prompt)
    return run.data_source


def _draw(run: Run, k: int) -> list:
    """The next k prompts: rows of --prompt-data, or groups from --data-source-path (given to a generate hook)."""
    from engine.data import PromptRow
    from engine.rollout.hooks import HookError, PromptDataSource
    from engine.rollout.loop import Prompt

    src = data_source(run)
    if isinstance(src, PromptDataSource):
        return _prompts(run, run.dataset.next_batch(k))
    out = []
    for g in src.get_samples(k):
        if len(g) != run.cfg.n_samples_per_prompt:
            raise HookError.of("--data-source-path", run.cfg.data_source_path,
                               f"handed out a group of {len(g)} samples; --n-samples-per-prompt is "
                               f"{run.cfg.n_samples_per_prompt}")
        s = g[0]
        row = PromptRow(row=int(s.metadata.get("row", 0)), prompt=s.prompt, label=s.label, metadata=dict(s.metadata))
        ids = list(s.tokens)
        out.append(Prompt(row, ids, samples=g))
    return out


def custom_rollout(run: Run, rollout_id: int, args) -> Any:
    """--rollout-function-path: slime's contract, checked (B groups of n final samples; unscored ones are scored
    by the run's reward)."""
    from engine.rewards import select_key, split_category
    from engine.rollout.hooks import EngineClient, HookError, RolloutFnTrainOutput, call_hook, check_sample
    from engine.rollout.loop import RolloutResult
    from engine.samples import Status

    cfg, flag, path = run.cfg, "--rollout-function-path", run.cfg.rollout_function_path
    engine = EngineClient(None, run.engines, rid_prefix=f"rf{rollout_id}-{uuid.uuid4().hex[:6]}-",
                          timeout_s=cfg.rollout_timeout) if hasattr(run.engines, "serving") else None
    out = call_hook(flag, path, run.hooks.rollout, args.with_engine(engine), rollout_id, data_source(run),
                    evaluation=False)
    groups, extra = (out.samples, out.metrics or {}) if isinstance(out, RolloutFnTrainOutput) or hasattr(
        out, "samples") else (out, {})
    B, n = cfg.rollout_batch_size, cfg.n_samples_per_prompt
    if not isinstance(groups, list) or len(groups) != B or not all(isinstance(g, list) and len(g) == n
                                                                     for g in groups):
        shape = [len(g) if isinstance(g, list) else type(g).__name__ for g in groups][:8] \
            if isinstance(groups, list) else type(groups).__name__
        raise HookError.of(flag, path, f"returned groups {shape}; expected --rollout-batch-size {B} groups of "
                                       f"--n-samples-per-prompt {n} Samples")
    for gi, g in enumerate(groups):
        for j, smp in enumerate(g):
            check_sample(smp, flag, path)
            smp.index, smp.group_index, smp.rollout_id = gi * n + j, gi, rollout_id
        own = [smp for smp in g if smp.reward is not None]  # the rewards the function set itself
        if len(own) < len(g):
            run.reward_model.score_group([smp for smp in g if smp.reward is None])
        for smp in own:  # --reward-key selects from them too, --log-reward-category takes its key out
            if smp.status not in (Status.FAILED, Status.ABORTED):
                smp.reward_key = cfg.reward_key
                try:
                    smp.reward = split_category(smp.reward, cfg.log_reward_category, smp)
                    select_key(smp.reward, cfg.reward_key)
                except ValueError as e:
                    raise HookError.of(flag, path, f"sample {smp.index}: {e}") from None
    metrics = {k: float(v) for k, v in extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    result = RolloutResult(groups, {"drawn": float(B), "filtered": 0.0, "aborted": 0.0, "rounds": 1.0,
                                    "retried_requests": 0.0})
    result.extra_metrics = metrics
    return result


def revive_engines(run: Run) -> None:
    """Before a retried rollout: restart the engines that died or stopped answering (they get the current weights)."""
    if revived := run.engines.revive(run.cfg.rollout_health_check_timeout):
        log.warning("restarted rollout engine(s) %s before retrying the rollout", revived)


def rollout(run: Run, rollout_id: int) -> RolloutBatch:
    """B groups of n samples (over-sampled and filtered when asked); a high truncation share is RF10."""
    from engine.diagnosis import DiagnosisError
    from engine.rollout.diagnose import truncation_diagnosis
    from engine.rollout.loop import generate_rollout, rollout_metrics
    from engine.samples import Status

    from engine.rollout.hooks import (Hooks, PromptDataSource, apply_reward_post_process, apply_sample_filter,
                                      call_hook)

    cfg = run.cfg
    if cfg.replay:
        return replayed(run, rollout_id)
    t0 = time.perf_counter()
    src = data_source(run)
    position = src.state()
    params = sampling_params(run)
    keep = run.sample_filter
    hooks = getattr(run, "hooks", None) or Hooks()
    args = hook_args(run, rollout_id)
    version = run.state.weight_version  # what the engines serve as this rollout starts (async: older than the trainer)
    run.state.data_positions[rollout_id] = position
    partial = partial_buffer(run, rollout_id, position) if cfg.partial_rollout else None
    try:
        if hooks.rollout is not None:
            result = custom_rollout(run, rollout_id, args)
        else:
            result = generate_rollout(lambda k: _draw(run, k), rollout_id=rollout_id,
                                      batch_size=cfg.rollout_batch_size, n=cfg.n_samples_per_prompt, params=params,
                                      reward_model=run.reward_model, seed=cfg.sampling_seed, engines=run.engines,
                                      round_size=cfg.over_sampling_batch_size if keep else None, keep=keep,
                                      concurrency=cfg.rollout_concurrency, timeout_s=cfg.rollout_timeout,
                                      max_prompts=len(run.dataset.rows) if keep and isinstance(src, PromptDataSource)
                                      else None, generate=hooks.generate, hook_args=args,
                                      hook_path=cfg.custom_generate_function_path or "", partial=partial,
                                      sample_hooks=hooks.sample_hooks,
                                      routed_experts=cfg.use_rollout_routing_replay)
        samples = [s for g in result.groups for s in g]
        for smp in samples:
            if smp.metadata.get("weight_version") in (None, ""):
                smp.metadata["weight_version"] = str(version)
        if cfg.rollout_external_engine_addrs:
            shared_server(run, rollout_id, samples)
        removed = (apply_sample_filter(hooks.sample_filter, cfg.rollout_sample_filter_path, args, result.groups)
                   if hooks.sample_filter is not None else 0)
        if hooks.all_samples is not None:  # slime: every finished group, the dynamic filter's dropped ones too
            call_hook("--rollout-all-samples-process-path", cfg.rollout_all_samples_process_path, hooks.all_samples,
                      args, result.all_groups if result.all_groups is not None else result.groups, src)
        if hooks.post_process is not None:
            apply_reward_post_process(hooks.post_process, cfg.custom_reward_post_process_path, args, samples)
        diag = truncation_diagnosis(sum(s.status == Status.TRUNCATED for s in samples), len(samples),
                                    max_response_len=cfg.rollout_max_response_len,
                                    stop_token_ids=params.stop_token_ids, stop=params.stop,
                                    threshold=cfg.rollout_max_truncated_share)
        if diag is not None:
            raise DiagnosisError(diag)
        teacher = teacher_scores(run, samples) if cfg.use_opd and cfg.opd_type == "sglang" else {}
    except BaseException:
        src.load_state(position)  # a retried rollout takes the same prompts
        raise
    run.state.partial.pop(rollout_id, None)  # done: its samples travel on to pack and train
    faults.at("after_rollout", rollout_id)
    if cfg.colocate:
        run.engines.release_memory()  # the trainer needs the GPUs now; sync() resumes
    hook_metrics = {**getattr(result, "extra_metrics", {}),
                    **({"rollout/removed_samples": float(removed)} if hooks.sample_filter is not None else {}),
                    **({f"rollout/pass_at_{k}": v for k, v in pass_rates(
                        [[s.scalar_reward for s in g] for g in result.groups]).items()} if cfg.log_passrate else {}),
                    **(reward_categories(samples) if cfg.log_reward_category else {}),
                    **(multi_turn_metrics(samples, cfg.rollout_max_response_len) if cfg.log_multi_turn else {}),
                    **(correct_sample_metrics(samples, cfg.rollout_max_response_len)
                       if cfg.log_correct_samples else {}),
                    **(offpolicy_masked(samples) if cfg.mask_offpolicy_in_partial_rollout else {}),
                    **teacher}
    metrics = {**rollout_metrics(result, time.perf_counter() - t0), **gpu_memory_metrics(run, "rollout"),
               **hook_metrics}
    taken = hooks.rollout_log is not None and logged_by_hook(
        hooks.rollout_log, "--custom-rollout-log-function-path", cfg.custom_rollout_log_function_path,
        rollout_id, hook_args(run, rollout_id), samples, dict(metrics), time.perf_counter() - t0)
    metrics = publish(run, rollout_id, metrics, track=not taken)
    if run.tracker is not None and not taken:
        from engine.tracking.record import log_rollout

        log_rollout(run.tracker, cfg, rollout_id, result.groups, run.history_copy())  # samples + plots, when due
    if cfg.save_debug_rollout_data:
        save_rollout(run, rollout_id, result.groups, metrics, version)
    return RolloutBatch(rollout_id, result.groups, metrics)


def shared_server(run: Run, rollout_id: int, samples: list[Sample]) -> None:
    """External engines: every sample must come from weights this run pushed (the weight_version each response
    reports, every segment's with --partial-rollout). A version it never pushed means another process updated the
    server's weights — a second run sharing it, each overwriting the other's: a CONFIG error, not a retry. A
    second run that happens to push the same version numbers is not told apart by this check."""
    if not run.served_versions:
        return
    foreign = sorted({str(v) for s in samples for v in reported_versions(s)
                      if v is not None and str(v) not in run.served_versions})
    if foreign:
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"rollout {rollout_id}: the external engines answered with weight_version {', '.join(foreign[:3])}, "
                 f"which this run never pushed (it pushed {', '.join(sorted(run.served_versions, key=_num)[-3:])}): "
                 "another process updated their weights, e.g. a second run on the same servers",
            fix="give every run its own servers (--rollout-external-engine-addrs): two runs on one server each "
                "overwrite the other's weights",
            facts={"field": "rollout_external_engine_addrs", "value": run.cfg.rollout_external_engine_addrs,
                   "foreign_versions": foreign}))


def _num(v: str) -> tuple:
    return (0, int(v)) if v.isdigit() else (1, v)


def teacher_scores(run: Run, samples: list[Sample], batch: int = 64) -> dict[str, float]:
    """--use-opd --opd-type sglang: the teacher server's log-probs of every trained sample's response tokens
    (a prefill at the rollout temperature: /generate with max_new_tokens 0, as slime's on_policy_distillation
    asks), into sample.teacher_log_probs, `batch` sequences per request. A server that fails is an ENGINE error
    of the rollout (it is retried like one)."""
    from engine.rollout.client import EngineClient, EngineError
    from engine.samples import Status

    cfg = run.cfg
    t0 = time.perf_counter()
    client = EngineClient(cfg.opd_teacher_url, timeout_s=cfg.rollout_timeout, api_key=cfg.opd_teacher_api_key)
    todo = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED) and s.response_length]
    temperature = cfg.rollout_temperature or 1.0
    for i in range(0, len(todo), batch):
        part = todo[i:i + batch]
        try:
            scored = client.score([s.tokens for s in part], temperature)
        except Exception as e:  # noqa: BLE001 — named, then raised as the engine error it is
            raise EngineError(f"--opd-teacher-url {cfg.opd_teacher_url} did not score the rollout's samples: "
                              f"{e}") from e
        for s, lps in zip(part, scored):
            if len(lps) != len(s.tokens) - 1:
                raise EngineError(f"--opd-teacher-url {cfg.opd_teacher_url} returned {len(lps)} log-probs for a "
                                  f"sequence of {len(s.tokens)} tokens (expected {len(s.tokens) - 1})")
            s.teacher_log_probs = [float(x) for x in lps[len(lps) - s.response_length:]]
    return {"rollout/opd_teacher_seconds": time.perf_counter() - t0}


def logged_by_hook(fn: Callable, flag: str, path: str, *args: Any) -> bool:
    """A logging hook (slime's contract: True skips the default logging) called; its answer as a bool."""
    from engine.rollout.hooks import call_hook

    return bool(call_hook(flag, path, fn, *args))


def offpolicy_masked(samples: list[Sample]) -> dict[str, float]:
    """--mask-offpolicy-in-partial-rollout: rollout/offpolicy_masked_share, the share of the response tokens left
    out of the loss because an older weight version generated them (every segment of a continued sample but its
    last)."""
    total = sum(s.response_length for s in samples)
    masked = sum(sum((s.metadata.get("segment_lengths") or [0])[:-1]) for s in samples
                 if len(s.metadata.get("weight_versions") or []) > 1)
    return {"rollout/offpolicy_masked_share": masked / total if total else 0.0}


def multi_turn_metrics(samples: list[Sample], max_response_len: int) -> dict[str, float]:
    """--log-multi-turn (slime's log_multi_turn_data): the responses' model tokens (loss mask 1) and tool or
    environment tokens (mask 0), the shortest response, the share cut at the length limit, and the rounds of the
    conversation where the generate function recorded them (metadata["round_number"])."""
    if not samples:
        return {}
    lens = [s.response_length for s in samples]
    trained = [float(sum(s.loss_mask)) for s in samples]
    out = {"rollout/multi_turn_trained_len_mean": sum(trained) / len(trained),
           "rollout/multi_turn_trained_len_max": max(trained), "rollout/multi_turn_trained_len_min": min(trained),
           "rollout/multi_turn_observation_len_mean": sum(n - t for n, t in zip(lens, trained)) / len(lens),
           "rollout/multi_turn_response_len_min": float(min(lens)),
           "rollout/multi_turn_clip_ratio": sum(n >= max_response_len for n in lens) / len(lens)}
    rounds = [float(s.metadata["round_number"]) for s in samples
              if isinstance(s.metadata.get("round_number"), (int, float))]
    if rounds:
        out.update({"rollout/multi_turn_round_number_mean": sum(rounds) / len(rounds),
                    "rollout/multi_turn_round_number_max": max(rounds),
                    "rollout/multi_turn_round_number_min": min(rounds)})
    return out


def correct_sample_metrics(samples: list[Sample], max_response_len: int) -> dict[str, float]:
    """--log-correct-samples (slime's flag): the samples whose reward is 1 (correct, as slime counts): how many, the
    share of their responses in each quarter of --rollout-max-response-len (correct_length_p25 … p100, summing to
    1), and their mean per-token negative log-likelihood under the engine (slime's correct_entropy: each
    sample's mean −log p over its trained tokens, averaged over the samples). Nothing but the count when none is
    correct."""
    import math

    correct = [s for s in samples if s.scalar_reward == 1]
    out = {"rollout/correct_samples": float(len(correct))}
    if not correct:
        return out
    quarters = [0] * 4
    for s in correct:  # quarter q holds lengths in ((q)/4 · L, (q + 1)/4 · L]
        quarters[min(3, max(0, math.ceil(4 * s.response_length / max_response_len) - 1))] += 1
    out.update({f"rollout/correct_length_p{25 * (q + 1)}": k / len(correct) for q, k in enumerate(quarters)})
    nll = []
    for s in correct:
        lps = [-lp for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m]
        if lps:
            nll.append(sum(lps) / len(lps))
    if nll:
        out["rollout/correct_entropy"] = sum(nll) / len(nll)
    return out


def reward_categories(samples: list[Sample]) -> dict[str, float]:
    """--log-reward-category: rollout/reward_category/<category> = the share of the rollout's samples in it (the
    category text made a metric name: letters, digits, `_ - .` kept, the rest `_`)."""
    import re
    from collections import Counter

    counts = Counter(re.sub(r"[^A-Za-z0-9_.-]", "_", str(s.metadata.get("reward_category", "none")))[:80] or "_"
                     for s in samples)
    return {f"rollout/reward_category/{c}": k / len(samples) for c, k in sorted(counts.items())} if samples else {}


def save_rollout(run: Run, rollout_id: int, groups: list[list[Sample]], metrics: dict[str, float],
                 version: int) -> None:
    """--save-debug-rollout-data: the rollout's samples and metrics to its file (engine/rollout/replay.py)."""
    from engine.rollout import replay

    cfg = run.cfg
    path = replay.save(cfg.save_debug_rollout_data, rollout_id, groups, metrics,
                       {"hf_checkpoint": cfg.hf_checkpoint, "rollout_batch_size": cfg.rollout_batch_size,
                        "n_samples_per_prompt": cfg.n_samples_per_prompt, "weight_version": version})
    log.info("rollout %d saved to %s", rollout_id, path)


def replayed(run: Run, rollout_id: int) -> RolloutBatch:
    """--load-debug-rollout-data: rollout `rollout_id` as the recording run saved it (its samples, and its rollout
    metrics, published again with rollout/replayed = 1 and the seconds the read took)."""
    from engine.model_shape import read as model_shape
    from engine.rollout import replay

    cfg = run.cfg
    t0 = time.perf_counter()
    share = cfg.load_debug_rollout_data_subsample
    groups, saved, _ = replay.load(cfg.load_debug_rollout_data, rollout_id, batch_size=cfg.rollout_batch_size,
                                   n=cfg.n_samples_per_prompt, vocab_size=model_shape(cfg.model_dir).vocab_size,
                                   hf_checkpoint=cfg.hf_checkpoint, share=share)
    # a subsample's rollout metrics are not the recording's: only its reward mean and std, recomputed below
    kept = {} if share is not None else {
        k: v for k, v in saved.items() if k.startswith("rollout/") and k not in ("rollout/seconds",
                                                                                 "rollout/tokens_per_s")}
    changed = cfg.reward_key is not None and rekeyed(groups, cfg.reward_key, cfg.load_debug_rollout_data)
    if share is not None or changed:  # the recording's reward mean was of other samples, or of another key
        rewards = [s.scalar_reward for g in groups for s in g]
        mean = sum(rewards) / max(len(rewards), 1)
        kept.update({"rollout/reward_mean": mean,
                     "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1)) ** 0.5})
    metrics = publish(run, rollout_id, {**kept, "rollout/replayed": 1.0, "rollout/seconds": time.perf_counter() - t0})
    if run.tracker is not None:
        from engine.tracking.record import log_rollout

        log_rollout(run.tracker, cfg, rollout_id, groups, run.history_copy())
    return RolloutBatch(rollout_id, groups, metrics)


def rekeyed(groups: list[list[Sample]], key: str, source: str) -> bool:
    """--reward-key on replayed samples (the same recording, another key of its dict rewards): True when a
    sample's training reward changed; a dict without the key is a DATA error naming the keys it has."""
    from engine.diagnosis import DiagnosisError
    from engine.rewards import select_key

    changed = False
    for g in groups:
        for smp in g:
            if not isinstance(smp.reward, dict) or smp.reward_key == key:
                continue
            try:
                select_key(smp.reward, key)
            except ValueError as e:
                raise DiagnosisError(Diagnosis(
                    code="DATA", severity="error",
                    what=f"{source}, sample {smp.index} of rollout {smp.rollout_id}: {e}",
                    fix="--reward-key one of those keys, or drop it to train on the recorded reward",
                    facts={"field": "reward_key", "value": key})) from None
            smp.reward_key, changed = key, True
    return changed


PARTIAL_FILE = "rollout_buffer.json"


def partial_buffer(run: Run, rollout_id: int, position: Any):
    """--partial-rollout: the buffer of rollout `rollout_id`, registered for checkpoint snapshots — the one a
    checkpoint saved while this rollout was in flight, when the rollout starts from the same data position (so
    draw index d is the same prompt), else a new one (a retried rollout keeps its own)."""
    from engine.rollout.loop import PartialBuffer

    if (buf := run.state.partial.get(rollout_id)) is not None:
        return buf
    saved_at, buf = run.state.resume_partial.pop(rollout_id, (None, None))
    if buf is not None and saved_at != position:
        log.warning("rollout %d: the checkpoint's partial samples were drawn from another data position; "
                    "generating the rollout afresh", rollout_id)
        buf = None
    if buf is not None:
        log.info("rollout %d: continuing %d samples kept by the checkpoint (--partial-rollout)", rollout_id, len(buf))
    run.state.partial[rollout_id] = buf = buf or PartialBuffer(rollout_id)
    buf.mask_offpolicy = run.cfg.mask_offpolicy_in_partial_rollout
    if run.tokenizer is not None:  # the engines' decode (skip_special_tokens, SamplingParams.to_sglang)
        skip = run.cfg.rollout_skip_special_tokens
        buf.decode = lambda ids: run.tokenizer.decode(ids, skip_special_tokens=skip)
    return buf


def write_partial(run: Run, rollout_id: int, path: str) -> None:
    """Into the checkpoint of `rollout_id`: how far the rollouts after it, in flight now, got (--partial-rollout)."""
    ahead = {i: b for i, b in list(run.state.partial.items()) if i > rollout_id and len(b)}
    if not ahead:
        return
    snaps = [{**b.snapshot(), "data_position": run.state.data_positions.get(i)} for i, b in sorted(ahead.items())]
    (Path(path) / PARTIAL_FILE).write_text(json.dumps({"rollouts": snaps}))


def read_partial(run: Run, local_dir: str) -> None:
    from engine.rollout.loop import PartialBuffer

    f = Path(local_dir) / PARTIAL_FILE
    if f.exists():
        for snap in json.loads(f.read_text())["rollouts"]:
            run.state.resume_partial[int(snap["rollout_id"])] = (snap.get("data_position"),
                                                                 PartialBuffer.from_snapshot(snap))


# ---- pack ------------------------------------------------------------------------------------------------------
class PackedRollout(Handoff):
    """Packed micro-batches `per_rank_steps[rank][step][micro-batch]` and the scalar reward per sample (by
    Sample.index), taken by train; the pack metrics."""
    _payload = ("per_rank_steps", "rewards")

    def __init__(self, rollout_id: int, per_rank_steps: list[list[list[MicroBatch]]], metrics: dict[str, float],
                 rewards: list[float] | None = None, rewards_normalized: bool = False):
        self.rollout_id, self.per_rank_steps, self.metrics = rollout_id, per_rank_steps, metrics
        self.rewards = rewards if rewards is not None else []
        self.rewards_normalized = rewards_normalized  # --custom-reward-post-process-path's rewards: used as they are


def pack(run: Run, batch: RolloutBatch) -> PackedRollout:
    """The DP schedule, then packed (varlen) micro-batches per rank and step.

    Advantages are not computed here: the estimator needs the trainer's log-probs (and PPO the critic's values),
    so the train workers compute them from the rollout's rewards (engine.train.worker.set_rollout).
    Metrics: pack/efficiency (real tokens / (micro-batches × cap)), pack/dp_imbalance (max / mean FLOPs over
    ranks), pack/micro_batches_per_rank, … (engine.packing.schedule.schedule_stats).
    """
    from engine.model_shape import read as model_shape
    from engine.packing.flops import flops_per_sample
    from engine.packing.microbatch import make_micro_batch
    from engine.packing.schedule import build_dp_schedule, schedule_stats

    cfg, plan = run.cfg, run.plan
    t0 = time.perf_counter()
    (groups,) = batch.take()
    samples = [s for g in groups for s in g]
    stale = staleness_guard(run, batch.rollout_id, samples)
    if [s.index for s in samples] != list(range(len(samples))):
        raise ValueError("Sample.index must be the sample's position in the rollout (group_index·n + j)")
    lengths = [len(s.tokens) for s in samples]
    shape = model_shape(cfg.model_dir)
    flops = flops_per_sample(lengths, shape)
    if cfg.use_rollout_routing_replay:
        from engine.train.routing import RouteLayout

        routes = RouteLayout.of_shape(shape)
    else:
        routes = None
    max_tokens = cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None  # preflight: dynamic ⇒ set (RF03)
    steps = build_dp_schedule(lengths, dp_size=plan.dp_size, global_batch_size=plan.global_batch_size,
                              cp_size=cfg.context_parallel_size, max_tokens_per_gpu=max_tokens,
                              micro_batch_size=cfg.micro_batch_size, balance_data=cfg.balance_data,
                              balance_by_flops=cfg.balance_by_flops, flops=flops)
    per_rank = [[[make_micro_batch([samples[i] for i in mb], [0.0] * len(mb), routes=routes)
                  for mb in step.ranks[r]] for step in steps] for r in range(plan.dp_size)]
    cap = plan.token_cap
    metrics = {f"pack/{k}": v for k, v in schedule_stats(steps, lengths, flops, cap).items()}
    metrics["pack/seconds"] = time.perf_counter() - t0
    post = [getattr(s, "advantage_reward", None) for s in samples]
    normalized = bool(samples) and all(r is not None for r in post)
    packed = PackedRollout(batch.rollout_id, per_rank, publish(run, batch.rollout_id, {**metrics, **stale}),
                           rewards=post if normalized else [s.scalar_reward for s in samples],
                           rewards_normalized=normalized)
    packed.staleness_max = int(stale.get("async/staleness_max", 0))
    if cfg.keep_old_actor:  # the weights that generated the rollout (its trained samples: one version, no partials)
        versions = {sample_version(s) for s in samples if not s.remove_sample} or {batch.rollout_id}
        if len(versions) > 1:
            raise ValueError(f"--keep-old-actor: rollout {batch.rollout_id}'s samples come from weight versions "
                             f"{sorted(versions)}; a rollout is generated by one version without --partial-rollout")
        packed.generated_by = versions.pop()
    return packed


def reported_versions(s: Sample) -> list:
    """The weight versions the engines reported for a sample's tokens, as they reported them: every segment's with
    --partial-rollout, else the one."""
    return list(s.metadata.get("weight_versions") or []) or [s.metadata.get("weight_version")]


def sample_version(s: Sample) -> int:
    """The oldest weight version that generated a sample's tokens (SGLang's weight_version: "default" = the
    starting weights, 0; a partial rollout continued under newer weights lists each in `weight_versions`)."""
    out = []
    for v in reported_versions(s):
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            out.append(0)
    return min(out)


def staleness_guard(run: Run, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
    """Staleness of each sample = the trainer's version (rollout_id: the steps trained before this one) − the
    version that generated it. Above the bound (--async-mode: one-step 1, bounded --max-staleness) a sample is
    never trained on (remove_sample). Metrics only where samples can be stale: --async-mode, or
    --update-weights-interval > 1 (on-policy runs are 0 by construction)."""
    if run.cfg.staleness_bound == 0 or not samples:  # on-policy by construction: a sync precedes every rollout
        return {}
    bound = run.cfg.staleness_bound
    st = [max(0, rollout_id - sample_version(s)) for s in samples]
    dropped = 0
    for s, k in zip(samples, st):
        if k > bound:
            s.remove_sample = True
            dropped += 1
    return {"async/staleness_mean": sum(st) / len(st), "async/staleness_max": float(max(st)),
            "async/stale_dropped": float(dropped)}


# ---- train -----------------------------------------------------------------------------------------------------
def old_log_probs_source(run: Run, first: bool) -> str:
    """Where a rollout's old log-probs come from (worker.set_rollout's old_from). The run's first step always
    runs the no-grad forward ("forward"): RF01 compares it with the reference. Then --use-rollout-logprobs takes
    the engine's ("rollout"); a rollout trained by one optimizer step on the torch backend, whose old log-probs
    are used only inside that step (no --use-mis, no --kl-coef), takes them from the step's own forward
    ("train": the same weights, no update before it, so the same numbers without the extra forward).
    --loss-type sft_loss needs none of them ("none"), nor does --disable-compute-advantages-and-returns."""
    cfg = run.cfg
    if cfg.loss_type == "sft_loss" or cfg.disable_compute_advantages_and_returns:
        return "none"
    if first:
        return "forward"
    if cfg.use_rollout_logprobs:
        return "rollout"
    if (cfg.train_backend == "torch" and run.plan.num_steps_per_rollout == 1 and not cfg.use_mis
            and not cfg.tis_batch_normalize  # its mean weight is over the whole step, before it
            and not cfg.keep_old_actor  # a stale rollout's old log-probs: the kept weights' forward
            and cfg.kl_coef == 0 and not cfg.custom_advantage_function_path  # that function reads them first
            and not cfg.use_opd and not cfg.rollout_data_postprocess_path  # so do these
            and not cfg.use_rollout_entropy):
        return "train"
    return "forward"


def train(run: Run, packed: PackedRollout) -> dict[str, float]:
    """num_steps_per_rollout optimizer steps over the packed rollout, on every DP rank, with the runtime checks.

    RF01: on the run's first step the policy and the reference are the same weights (KL = 0, ratio = 1).
    RF14: before any update, the engine's log-probs of the rollout must match the trainer's (train/mismatch).
    RF09: a step whose grad norm spikes is reported (a warning in run.state.diagnoses) with its sample ids.
    """
    from engine.diagnosis import DiagnosisError
    from engine.train.backend import reduce_metrics
    from engine.train.checks import first_step_check, grad_norm_spike, mismatch_diagnosis, spike_diagnosis

    cfg = run.cfg
    t0 = time.perf_counter()
    rollout_id = packed.rollout_id
    normalized = getattr(packed, "rewards_normalized", False)
    per_rank_steps, rewards = packed.take()
    first = run.start.next_rollout_id == 0 and rollout_id == 0  # policy = reference on this step
    critic_only = rollout_id < cfg.num_critic_only_steps  # ppo: the critic is fitted first, the policy waits
    old_from = "forward" if critic_only else old_log_probs_source(run, first)
    # the reference forward only where KL is used (worker: --use-kl-loss, --kl-coef), asked for (--log-kl) or
    # checked (RF01, the run's first step)
    need_ref = (first or cfg.log_kl) and old_from != "none"
    first_parts = None  # step 0's metrics when the workers ran it in the set_rollout call
    if old_from == "forward":  # the mismatch (and on the first step RF01) is judged between the two calls
        facts = reduce_metrics(run.train_group.set_rollout(per_rank_steps, rewards, need_ref=need_ref,
                                                           normalized=normalized, old_from=old_from,
                                                           rollout_id=rollout_id,
                                                           old_version=getattr(packed, "generated_by", None)))
    else:  # judged after step 0 anyway (its forward gives the trainer's side): one call where the backend allows
        per_rank_facts, first_parts = run.train_group.set_rollout_and_step(
            per_rank_steps, rewards, need_ref, normalized, old_from, run.plan.global_batch_size, rollout_id)
        facts = reduce_metrics(per_rank_facts)
    trained = sum(float(mb.loss_mask.sum()) for rank in per_rank_steps for step in rank for mb in step)
    on_policy = getattr(packed, "staleness_max", 0) == 0

    def check_mismatch(f: dict[str, float]) -> dict[str, float]:
        """RF14 on the engine-vs-trainer numbers. It compares the engine with the same weights; a stale batch
        (async) differs by its policy's updates on purpose — there the probe after each sync is the RF14 check."""
        mm = {"train/mismatch": f["mismatch"], "train/mismatch_max": f["mismatch_max"]}
        if on_policy and not cfg.no_engines and (d := mismatch_diagnosis(
                where=f"rollout {rollout_id}", mean=f["mismatch"], worst=f["mismatch_max"], tokens=trained,
                threshold=cfg.mismatch_threshold(run.engine_dtype), engine_dtype=run.engine_dtype,
                train_dtype=run.train_dtype)):
            publish(run, rollout_id, mm)  # the numbers reach MLflow with the failure
            raise DiagnosisError(d)
        return mm

    # judged before any update when set_rollout ran the trainer's forward; otherwise right after the first step,
    # whose forward (on the same weights, before the update) gives the trainer's side
    mismatch = check_mismatch(facts) if "mismatch" in facts else {}
    if "mis_masked_share" in facts:
        mismatch["train/mis_masked_share"] = facts["mis_masked_share"]
    if "opd_reverse_kl" in facts:
        mismatch["train/opd_reverse_kl"] = facts["opd_reverse_kl"]
    if "postprocess_masked_share" in facts:
        mismatch["train/postprocess_masked_share"] = facts["postprocess_masked_share"]
    if first and (d := first_step_check(ref_logp_maxdiff=facts.get("ref_logp_maxdiff"), ratio_maxdev=None,
                                        ref_source=run.ref_dir or cfg.hf_checkpoint,
                                        policy_source=run.start.local_dir or cfg.hf_checkpoint)):
        raise DiagnosisError(d)
    per_step = []
    for k in range(run.plan.num_steps_per_rollout):
        parts = first_parts if k == 0 and first_parts is not None else \
            run.train_group.train_step(k, run.plan.global_batch_size, not critic_only)
        faults.at("during_train", rollout_id)
        m = reduce_metrics(parts)
        check_grad_norms(run, rollout_id, k, m)
        if critic_only:  # the critic's metrics only: no policy step ran
            per_step.append(m)
            continue
        if k == 0 and "train/mismatch" not in mismatch and "mismatch" in m:  # reported by the step's own forward
            mismatch.update(check_mismatch(m))
        m["loss"] = sum(p["loss_total"] for p in parts)
        if first and k == 0 and (d := first_step_check(ratio_maxdev=m["ratio_maxdev"])):
            raise DiagnosisError(d)
        if (median := grad_norm_spike(run.state.grad_norms, m["grad_norm"])) is not None:
            ids = sorted(i for rank in per_rank_steps for mb in rank[k] for i in mb.sample_ids)
            run.state.diagnoses.append(spike_diagnosis(step=len(run.state.grad_norms), rollout_id=rollout_id,
                                                 grad_norm=m["grad_norm"], median=median, sample_ids=ids))
            m["grad_norm_spikes"] = 1.0
        run.state.grad_norms.append(m["grad_norm"])
        per_step.append(m)
    secs = time.perf_counter() - t0
    if critic_only:
        out = {f"train/{k}": sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}
        out.update({"train/critic_only": 1.0, "train/seconds": secs,
                    "train/tokens_per_s": packed.metrics["pack/tokens"] / max(secs, 1e-9)})
        return publish(run, rollout_id, {**out, **mismatch, **after_train(run, rollout_id),
                                         **gpu_memory_metrics(run, "train")})
    skip = {"loss_total", "ratio_maxdev", "skipped", "skipped_steps_total", "grad_norm_spikes", "mismatch",
            "mismatch_max"}
    if not (first or cfg.log_kl or cfg.use_kl_loss or cfg.kl_coef > 0):
        skip.add("kl")  # no reference forward: the backend's kl sums are over no reference (0), not a KL
    out = {f"train/{k}": sum(s[k] for s in per_step) / len(per_step) for k in per_step[0] if k not in skip}
    out["train/grad_norm_max"] = max(s["grad_norm"] for s in per_step)
    out["train/skipped_steps"] = sum(s["skipped"] for s in per_step)
    out["train/skipped_steps_total"] = per_step[-1]["skipped_steps_total"]
    out["train/grad_norm_spikes"] = sum(s.get("grad_norm_spikes", 0.0) for s in per_step)
    out["train/seconds"] = secs
    out["train/tokens_per_s"] = packed.metrics["pack/tokens"] / max(secs, 1e-9)
    return publish(run, rollout_id, {**out, **mismatch, **after_train(run, rollout_id),
                                     **gpu_memory_metrics(run, "train")})


def check_grad_norms(run: Run, rollout_id: int, step_id: int, m: dict[str, float]) -> None:
    """--ci-save-grad-norm writes one optimizer step's global gradient norms (the policy's as role actor, PPO's
    critic's as critic); --ci-load-grad-norm checks them against such files with slime's tolerance (relative 1% or
    absolute 0.01): a REPRODUCE error names the step, both numbers and the file."""
    cfg = run.cfg
    pattern = cfg.ci_save_grad_norm or cfg.ci_load_grad_norm
    if not pattern:  # every step of every run passes here: nothing else before this
        return
    import math

    from engine.diagnosis import DiagnosisError

    flag = "--ci-save-grad-norm" if cfg.ci_save_grad_norm else "--ci-load-grad-norm"
    for role, key in (("actor", "grad_norm"), ("critic", "critic_grad_norm")):
        if key not in m:
            continue
        path = Path(pattern.format(role=role, rollout_id=rollout_id, step_id=step_id))
        if cfg.ci_save_grad_norm:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"grad_norm": m[key], "role": role, "rollout_id": rollout_id,
                                        "step_id": step_id}) + "\n")
            continue
        where = f"rollout {rollout_id}, step {step_id}, {role}"
        try:
            want = float(json.loads(path.read_text())["grad_norm"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DiagnosisError(Diagnosis(
                code="REPRODUCE", severity="error",
                what=f"{flag}: no reference gradient norm for {where} in {path} ({type(e).__name__}: {e})",
                fix=f"record the reference run with --ci-save-grad-norm {pattern} (the same rollouts and steps)",
                facts={"field": "ci_load_grad_norm", "path": str(path)})) from e
        if not math.isclose(m[key], want, rel_tol=0.01, abs_tol=0.01):
            raise DiagnosisError(Diagnosis(
                code="REPRODUCE", severity="error",
                what=f"{flag}: the gradient norm of {where} is {m[key]:.6g}, the reference run's was {want:.6g} "
                     f"({path}); beyond relative 1% and absolute 0.01",
                fix="compare the two runs' flags, seeds, data and versions (rollflow compare RUN…); a different "
                    "backend or precision can move it legitimately",
                facts={"field": "ci_load_grad_norm", "path": str(path), "got": m[key], "want": want,
                       "rollout_id": rollout_id, "step_id": step_id, "role": role}))


def after_train(run: Run, rollout_id: int) -> dict[str, float]:
    """After a rollout's steps: the profiler's files, --save-debug-train-data's files, then --ref-update-interval's
    move."""
    cfg = run.cfg
    # the recording's file is due (the workers write it at the first end at or after that rollout: a resume may
    # start past it)
    memory_due = cfg.record_memory_history and cfg.memory_snapshot_num_steps is not None and \
        not run.memory_dumped and rollout_id >= cfg.memory_snapshot_num_steps - 1
    if memory_due or (cfg.use_pytorch_profiler and cfg.profile_step_start <= rollout_id < cfg.profile_step_end):
        for rank, paths in enumerate(run.train_group.profile_end(rollout_id)):
            for path in paths:
                log.info("rollout %d: train rank %d wrote %s", rollout_id, rank, path)
        run.memory_dumped = run.memory_dumped or memory_due
    if cfg.save_debug_train_data:  # before the reference moves: what the steps were computed with
        for path in run.train_group.save_train_data(cfg.save_debug_train_data, rollout_id):
            log.info("rollout %d: train data saved to %s", rollout_id, path)
    return move_ref(run, rollout_id)


def move_ref(run: Run, rollout_id: int) -> dict[str, float]:
    """--ref-update-interval N: after training rollout i with (i + 1) % N == 0 the reference becomes the policy
    (slime's schedule); {"train/ref_updated": 1.0} then."""
    n = run.cfg.ref_update_interval
    if not n or (rollout_id + 1) % n:
        return {}
    run.train_group.update_ref()
    log.info("rollout %d: the reference is now the policy (--ref-update-interval %d)", rollout_id, n)
    return {"train/ref_updated": 1.0}


# ---- save ------------------------------------------------------------------------------------------------------
def should_save(cfg: RunConfig, rollout_id: int) -> bool:
    if not cfg.save:
        return False
    last = rollout_id == cfg.num_rollout - 1
    return last or (cfg.save_interval is not None and (rollout_id + 1) % cfg.save_interval == 0)


def save(run: Run, rollout_id: int) -> checkpoint.SaveReport:
    """iter_%07d (backend state + hf_config/ [+ hf/]) with its manifest, then the marker, then retention."""
    return commit_save(run, stage_save(run, rollout_id))


def stage_save(run: Run, rollout_id: int) -> checkpoint.Staged:
    """A save's first half: the trainer's state (+ hf_config/, partial rollouts, hf/) written into the iteration's
    temp location, with the manifest's facts as of now. `commit_save` finishes it (--async-save: in the background
    while the next rollouts train)."""
    from engine.convert import copy_hf_config

    cfg = run.cfg
    # async: a rollout already drawn ahead of this checkpoint is redone on resume, from where it started
    nxt = run.state.data_positions.get(rollout_id + 1)
    manifest = {"data_state": nxt if nxt is not None else data_source(run).state(),
                "mlflow_run_id": run.tracker.run_id if run.tracker else None,
                "prefect_flow_run_id": run.flow_run_id, "config_hash": cfg.config_hash(), "origin": run.origin,
                "history": {k: {str(i): v for i, v in d.items()} for k, d in run.history_copy().items()},
                "train_backend": cfg.train_backend, "resumable": cfg.save_optim, "seed": cfg.seed,
                "settings": cfg.fixed_settings(), "save": checkpoint.normalize(cfg.save),
                "rng": "per-rank python/numpy/torch RNG states in optim/state.pt; rollout sampling seeds are "
                       "sha256(seed:rollout_id:index)", "hf_checkpoint": cfg.hf_checkpoint}

    def write_state(path: str) -> None:
        run.train_group.save(path, save_optim=cfg.save_optim)
        copy_hf_config(cfg.model_dir, Path(path) / "hf_config")
        if cfg.partial_rollout:
            write_partial(run, rollout_id, path)  # listed in the manifest and checksummed like every file
        if cfg.save_hf:
            run.train_group.export_hf(str(Path(path) / "hf"))

    if run.tracker is not None:  # MLflow has every step up to this one before the marker names it (a kill after
        run.tracker.drain()  # the marker must not lose data of a step the resume does not redo)
    free_before = run.store.free_bytes()
    with _disk_full_as_diagnosis(run, rollout_id, free_before):
        staged = checkpoint.stage_iteration(run.store, rollout_id, write_state, manifest,
                                            staging=run.staging / "save")
    staged.free_before = free_before  # for the commit's disk-full diagnosis
    return staged


def commit_save(run: Run, staged: checkpoint.Staged) -> checkpoint.SaveReport:
    """A save's second half (engine/checkpoint/save.py: commit_iteration), then its metrics and MLflow record."""
    cfg, rollout_id = run.cfg, staged.iteration
    with _disk_full_as_diagnosis(run, rollout_id, staged.free_before):
        report = checkpoint.commit_iteration(run.store, staged, keep_last_n=cfg.keep_last_n)
    publish(run, rollout_id, report.metrics)
    if run.tracker is not None:
        from engine.tracking.record import log_checkpoint

        log_checkpoint(run.tracker, cfg, rollout_id, report.uri, run.flow_run_id)
    return report


@contextmanager
def _disk_full_as_diagnosis(run: Run, rollout_id: int, free_before: int | None) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        if (full := disk_full(run, rollout_id, e, free_before)) is not None:
            raise full from None  # the diagnosis, not 200 lines of a Ray worker's safetensors traceback
        raise


def disk_full(run: Run, rollout_id: int, e: BaseException, free_before: int | None) -> Exception | None:
    """A save that ran out of space as a short STORAGE diagnosis: where, about how much one iteration needs, how much
    was free, and the fixes. Recognised by ENOSPC (locally or in a Ray worker's traceback) or, as torch.save reports
    it only as an iostream error, by a local disk that had less free space than one iteration when the save began
    or has under 1 MiB left now. The iteration's temp directory is removed (the marker still names the previous,
    complete iteration)."""
    import errno
    import shutil

    from engine.doctor.checks import _gib, checkpoint_bytes
    from engine.diagnosis import DiagnosisError

    text = f"{e}"
    need, how = checkpoint_bytes(run.cfg, run.store)
    local = run.store if not run.store.remote else None
    free_now = local.free_bytes() if local else shutil.disk_usage(run.work_dir).free
    said = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in text \
        or "ENOSPC" in text
    if not (said or (local and (free_now < 2**20 or (need and free_before is not None and free_before < need)))):
        return None
    where = run.store.uri(checkpoint.iter_name(rollout_id)) if local else str(run.staging / "save")
    checkpoint.clean_leftovers(run.store, checkpoint.read_marker(run.store))
    free = free_before if free_before is not None else free_now
    marker = checkpoint.read_marker(run.store)
    return DiagnosisError(Diagnosis(
        code="STORAGE", severity="error",
        what=f"the save of rollout {rollout_id} ran out of disk space writing {where}: about "
             f"{_gib(need) if need else '?'} needed ({how or 'unknown'}), {_gib(free)} free when it began"
             + (f"; the marker still names iteration {marker}, which is complete" if marker is not None else ""),
        fix="free space on that disk, keep fewer iterations (--keep-last-n K), --no-save-optim, or another --save; "
            "then run the same command again: it resumes from the marker",
        facts={"path": where, "need_bytes": need, "free_bytes": free, "marker": marker}))


# ---- sync ------------------------------------------------------------------------------------------------------
def handed(run: Run, version: int, what: str, make: Callable[[], Any]) -> Any:
    """What the trainer hands over for weight version `version` (`what`: its weights, its probe log-probs), made by
    `make` once: a retried sync reuses it. Once handed over the trainer may train on (--async-mode), so asking it
    again would give the next step's weights under this version's name."""
    got = run.handed_over.setdefault(version, {})
    if what not in got:
        got[what] = make()
    return got[what]


def _weights_dir(run: Run, version: int) -> Path:
    return run.work_dir / "weights" / f"v{version:06d}"


def forget_handed(run: Run, keep: int | None = None) -> None:
    """Drop what the trainer handed over for every version but `keep` (an object-store copy, a weights directory,
    also one a failed run left): a sync that succeeded needs it no more, a failed one is superseded by the next."""
    import shutil

    for version in [v for v in list(run.handed_over) if v != keep]:
        run.handed_over.pop(version, None)
    if run.sync_transport == "disk":  # versioned and deleted after use
        for d in (run.work_dir / "weights").glob("v*"):
            if keep is None or d != _weights_dir(run, keep):
                shutil.rmtree(d, ignore_errors=True)


def push_weights(run: Run, slots: list, version: int, exported: Callable[[], None] | None = None,
                 probe_scores: dict | None = None) -> dict[str, float]:
    """The trainer's weights to these engines as `version` (run.sync_transport), checked on every engine.
    `exported` is called once the trainer has handed its weights over (a copy in Ray's object store, a directory,
    IPC buckets): from then on the trainer may train again while the engines load them (--async-mode).
    probe_scores (a dict, weight_sync in_process once the probe has its stored sequences): the RF14 probe's
    scores are computed in the same call, by the trainer and by each engine, into probe_scores[url]."""
    exported = exported or (lambda: None)
    from engine.rollout.client import EngineClient
    from engine.weights.sync import check_version, push_disk, push_in_process, push_ipc, push_object_store, push_tensors

    cfg = run.cfg
    key = getattr(run.engines, "api_key", None)
    t0 = time.perf_counter()
    if run.sync_transport == "cuda_ipc":
        # engine e sits on bundle b; train rank b shares that GPU (colocated layout) and exports to it
        source = {s.index: s.bundle for s in slots}
        per_rank = run.train_group.ipc_export(run.engine_dtype, cfg.update_weight_buffer_size, set(source.values()))
        exported()
        try:
            push_ipc(slots, {i: per_rank[r] for i, r in source.items()}, version, timeout_s=cfg.weight_sync_timeout)
        finally:
            run.train_group.ipc_release()
        nbytes = sum(b.nbytes for b in per_rank[next(iter(source.values()))]) if source else 0
    elif run.sync_transport == "in_process":
        probe = None
        if probe_scores is not None and run.probe and getattr(run, "probe_seqs", None):
            probe = (_probe_batch(run), sampling_params(run).temperature or 1.0,
                     [list(p) + list(r) for p, r in run.probe_seqs])
        nbytes = push_in_process(slots, version, timeout_s=cfg.weight_sync_timeout, exported=exported, probe=probe,
                                 scored=probe_scores)
    elif run.sync_transport == "object_store":
        ref, mb = handed(run, version, "weights", run.train_group.weights_ref)
        exported()
        push_object_store(slots, ref, version, timeout_s=cfg.weight_sync_timeout)
        nbytes = mb * 2**20
    elif run.sync_transport == "distributed":  # rank 0 broadcasts to the engines' ranks (SGLang's group API)
        answers, nbytes = run.train_group.group_push([(s.url, engine_ranks(run, s)) for s in slots], version,
                                                     api_key=key, backend=group_backend(run),
                                                     timeout_s=cfg.weight_sync_timeout)
        exported()
        for s, reply in zip(slots, answers):
            check_version(EngineClient(s.url, timeout_s=cfg.weight_sync_timeout, api_key=key), version,
                          cfg.weight_sync_timeout, reply)
    elif run.sync_transport == "http":  # external built-in engines: buckets to /update_weights_from_tensor
        import ray

        ref, mb = handed(run, version, "weights", run.train_group.weights_ref)
        exported()
        push_tensors([s.url for s in slots], ray.get(ref, timeout=cfg.weight_sync_timeout).tensors(), version,
                     bucket_bytes=cfg.update_weight_buffer_size, timeout_s=cfg.weight_sync_timeout, api_key=key)
        nbytes = mb * 2**20
    else:
        path = _weights_dir(run, version)
        handed(run, version, "weights", lambda: _save_weights(run, path, [s.url for s in slots]))
        exported()
        nbytes = sum(f.stat().st_size for f in path.glob("*"))
        push_disk([s.url for s in slots], str(path.resolve()), version, timeout_s=cfg.weight_sync_timeout,
                  api_key=key)
    secs = time.perf_counter() - t0
    return {"sync/mb": nbytes / 2**20, "sync/gb_per_s": nbytes / 1e9 / max(secs, 1e-9)}


def engine_ranks(run: Run, slot) -> int:
    """An engine's ranks in a weight-update group: an SGLang server's tensor × pipeline size (each rank receives
    the whole tensors), the built-in engine's one."""
    if slot.info.get("ranks"):  # an external server says (engine/rollout/external.py)
        return int(slot.info["ranks"])
    return run.engine_spec.tp_size if run.cfg.rollout_engine == "sglang" else 1


def group_backend(run: Run) -> str:
    """--weight-sync-method distributed: NCCL where the trainer and every engine are on GPUs, else gloo (CPU
    tensors). SGLang receives over NCCL only: with a trainer or an engine on CPUs that is a ConfigError."""
    trainer_on_gpu = run.on_gpu  # (engines on GPU bundles, or an external run's train ranks on them)
    engines_on_gpu = all((s.info.get("kind") == "sglang" or str(s.info.get("device")).startswith("cuda"))
                         if s.info.get("external") else run.on_gpu for s in run.engines.slots)
    if trainer_on_gpu and engines_on_gpu:
        return "nccl"
    if run.cfg.rollout_engine == "sglang":
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what="--weight-sync-method distributed with SGLang engines needs NCCL, i.e. the trainer and the engines "
                 f"on GPUs; here the trainer is on {'GPUs' if trainer_on_gpu else 'CPUs'}",
            fix="--weight-sync-method disk, or train on GPUs",
            facts={"field": "weight_sync_method", "value": "distributed"}))
    return "gloo"


def _save_weights(run: Run, path: Path, engines: list[str]) -> str:
    import shutil

    try:
        return run.train_group.save_weights(str(path), engines)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # half written: the retry writes it again
        raise


def _probe_batch(run: Run):
    """The stored probe sequences (prompt + the answer an engine sampled at the first probe) as one micro-batch
    whose loss mask covers the answers."""
    from engine.packing.microbatch import make_micro_batch
    from engine.samples import Status

    samples = [Sample(index=i, group_index=i, rollout_id=-1, prompt="", tokens=list(p) + list(r),
                      response_length=len(r), loss_mask=[1] * len(r), rollout_log_probs=[0.0] * len(r),
                      status=Status.COMPLETED)
               for i, (p, r) in enumerate(run.probe_seqs)]
    return make_micro_batch(samples, [0.0] * len(samples))


def probe_reference_start(run: Run) -> Callable[[], Any] | None:
    """Ask the trainer for its log-probs of the stored probe answers with the weights it holds now, without waiting:
    returns the function that waits for them (None until the first probe has sampled the answers). sync asks right
    after the weights went out and before the trainer may train again, and waits only once the engines have
    scored the same tokens: the trainer's forward runs while the engines load."""
    if not run.probe or not getattr(run, "probe_seqs", None):
        return None
    mb = _probe_batch(run)
    wait = run.train_group.score_start(mb)
    return lambda: wait()[mb.loss_mask > 0]


def probe_reference(run: Run):
    """probe_reference_start, waited for."""
    start = probe_reference_start(run)
    return start() if start is not None else None


def _answer_diffs(seqs: list, reference, lps: list[list[float]]):
    """|trainer − engine| log-prob over the stored probe answers' tokens ([K]); lps: the engine's log-probs of
    every token after the first of each (prompt + answer)."""
    import torch

    got = torch.tensor([x for (p, _), seq in zip(seqs, lps) for x in seq[len(p) - 1:]])
    return (reference.float() - got).abs()


def probe_engines(run: Run, version: int, reference=None, max_new_tokens: int = 16,
                  scored: dict | None = None) -> dict[str, float]:
    """RF14 right after a sync, before any rollout uses the weights. The first probe of a process: every serving
    engine samples a short answer to each probe prompt (fixed seeds, the run's sampling settings) and the trainer
    scores those tokens — the same quantity as train/mismatch; the first engine's answers are kept. Later probes
    are teacher-forced on those sequences: `reference` holds the trainer's log-probs (probe_reference, of the
    weights that went out; or the function probe_reference_start returned, waited for once the first engine has
    scored) and every engine scores the same tokens (a prefill). scored[url] = (the trainer's log-probs, the
    engine's per sequence): both sides already scored the stored sequences in the sync call (an engine in the
    train worker's process, push_weights' probe_scores). Returns the largest per-engine mean |Δ log-prob| as
    `sync/probe_mismatch`."""
    from engine.diagnosis import DiagnosisError
    from engine.packing.microbatch import make_micro_batch
    from engine.rollout.client import EngineClient
    from engine.samples import Status
    from engine.train.checks import mismatch_diagnosis

    cfg = run.cfg
    if not run.probe:  # a Run assembled without place (tests of single stages)
        return {}
    params = sampling_params(run)
    params.max_new_tokens = min(max_new_tokens, cfg.rollout_max_response_len)
    means = []
    for url in run.engines.serving():
        client = EngineClient(url, timeout_s=cfg.weight_sync_timeout, api_key=run.engines.api_key)
        if scored and url in scored:
            ref, lps = scored[url]
            diffs = _answer_diffs(run.probe_seqs, ref, lps)
        elif reference is not None:
            seqs = run.probe_seqs
            lps = client.score([list(p) + list(r) for p, r in seqs], params.temperature or 1.0)
            if callable(reference):
                reference = reference()
            diffs = _answer_diffs(seqs, reference, lps)
        else:
            outs = client.generate(
                {"input_ids": run.probe, "return_logprob": True,
                 "sampling_params": [params.to_sglang(seed=cfg.sampling_seed + i) for i in range(len(run.probe))]})
            samples = []
            for i, (prompt, o) in enumerate(zip(run.probe, outs)):
                lps = [float(t[0]) for t in o["meta_info"]["output_token_logprobs"]]
                samples.append(Sample(index=i, group_index=i, rollout_id=-1, prompt="",
                                      tokens=prompt + o["output_ids"], response_length=len(lps),
                                      loss_mask=[1] * len(lps), rollout_log_probs=lps, status=Status.COMPLETED))
            mb = make_micro_batch(samples, [0.0] * len(samples))
            m = mb.loss_mask > 0
            diffs = (run.train_group.score(mb)[m] - mb.rollout_log_probs[m]).abs()  # [K] over the sampled tokens
            if not getattr(run, "probe_seqs", None):
                run.probe_seqs = [(list(p), list(o["output_ids"])) for p, o in zip(run.probe, outs)
                                  if o["output_ids"]]
        mean, worst = (float(diffs.mean()), float(diffs.max())) if diffs.numel() else (0.0, 0.0)
        if d := mismatch_diagnosis(where=f"the weight sync to version {version} ({url})", mean=mean, worst=worst,
                                   tokens=diffs.numel(), threshold=cfg.mismatch_threshold(run.engine_dtype),
                                   engine_dtype=run.engine_dtype, train_dtype=run.train_dtype):
            raise DiagnosisError(d)
        means.append(mean)
    return {"sync/probe_mismatch": max(means, default=0.0)}


def sync(run: Run, rollout_id: int, pause: bool = False, exported: Any = None, loaded: Any = None
         ) -> dict[str, float]:
    """Trainer → every serving engine: weights of version rollout_id + 1 (a restarting engine waits for the lock
    and then gets them from its resync), then the RF14 probe; with --offload-train the trainer then leaves the GPU.
    pause (--partial-rollout with a rollout in flight): the engines abort what they generate and hold new requests
    (/pause_generation) until the new weights are in (/continue_generation); the rollout continues its samples.
    exported (a threading.Event, --async-mode): set once the trainer is done with its part (its probe scores, its
    weights handed over), so the next train step can start while the engines load and answer the probe.
    loaded (a threading.Event, --async-mode): set once every engine serves the new version, before the probe, so the
    next rollout can start while the probe runs (a failed probe fails the run before that rollout is trained)."""
    if run.engines is None:  # --load-debug-rollout-data: no engine to sync
        return {}
    t0 = time.perf_counter()
    version = rollout_id + 1
    paused = {}
    with run.engines.lock:  # a restarted engine's resync pushes under it too: nothing it reads is dropped meanwhile
        forget_handed(run, keep=version)
        if run.engines.released:
            run.engines.resume_memory()
        reference = []
        # an engine in the train worker's process: both sides score the probe in the sync call itself
        scored: dict | None = {} if run.sync_transport == "in_process" else None

        def handoff() -> None:
            # the trainer's probe log-probs are asked before anything else can reach it; then it is free, unless
            # this is the process's first probe: then it still has to score what the engines sample (below)
            if scored is None and (start := handed(run, version, "reference",
                                                   lambda: probe_reference_start(run))) is not None:
                reference.append(start)
            if exported is not None and reference:
                exported.set()

        if pause:
            paused = {"sync/paused_requests": float(run.engines.pause_generation())}
        try:
            out = push_weights(run, run.engines.serving_slots(), version, exported=handoff, probe_scores=scored)
            run.state.weight_version = version
            run.served_versions.add(str(version))
        finally:
            if pause:
                run.engines.continue_generation()
    if loaded is not None:
        loaded.set()
    out.update(paused)
    out.update(probe_engines(run, version, reference[0] if reference else None, scored=scored))
    with run.engines.lock:
        forget_handed(run)
    if exported is not None:
        exported.set()
    if run.cfg.offload_train:
        run.train_group.offload()
    metrics = {**out, "sync/seconds": time.perf_counter() - t0, "sync/weight_version": float(version),
               **gpu_memory_metrics(run, "sync")}
    if rollout_id < 0:  # the starting weights to external engines, before rollout 0: no rollout to log it under
        log.info("rollflow: the starting weights reached the external engines in %.2f s (probe mismatch %.3g)",
                 metrics["sync/seconds"], metrics.get("sync/probe_mismatch", 0.0))
        return metrics
    return publish(run, rollout_id, metrics)


def gpu_memory_metrics(run: Run, stage: str) -> dict[str, float]:
    """memory/<stage>_*: the most GPU memory the train workers and the engines held during the stage (each
    process's allocator peak since the previous stage; engine.gpu.gpu_memory). {} on CPU runs. Engines this run
    launched only: an external server's memory is its own process's (the engine part is then 0)."""
    import ray

    if not run.on_gpu:
        return {}
    train = [m.get("peak_gib", 0.0) for m in run.train_group.memory()] if run.train_group is not None else []
    slots = [s for s in run.engines.serving_slots() if s.actor is not None] if run.engines is not None else []
    engines = [m.get("peak_gib", 0.0) for m in ray.get([s.actor.memory.remote() for s in slots], timeout=60)]
    t, e = max(train, default=0.0), max(engines, default=0.0)
    return {f"memory/{stage}_peak_gib": t + e, f"memory/{stage}_train_gib": t, f"memory/{stage}_engine_gib": e}


# ---- evaluate --------------------------------------------------------------------------------------------------
def eval_accuracy_key(cfg: RunConfig) -> str:
    """The run's headline accuracy: that of its first eval set (eval/test_accuracy for a single path)."""
    return f"eval/{cfg.eval_sets[0][0]}_accuracy" if cfg.eval_sets else "eval/test_accuracy"


def should_sync(cfg: RunConfig, rollout_id: int) -> bool:
    """--update-weights-interval N: sync after rollout i when (i + 1) % N == 0, after the last rollout and before
    an evaluation (which must see the trained weights); every rollout with N = 1."""
    n = cfg.update_weights_interval
    return (n == 1 or (rollout_id + 1) % n == 0 or rollout_id == cfg.num_rollout - 1
            or should_eval(cfg, rollout_id))


def should_eval(cfg: RunConfig, rollout_id: int) -> bool:
    """--eval-interval: evaluate after this rollout (not after the last one: the final eval does)."""
    done = rollout_id + 1
    return cfg.eval_interval is not None and done % cfg.eval_interval == 0 and done < cfg.num_rollout


def evaluate(run: Run, step: int) -> float | None:
    """Accuracy on each eval set, on the engines, published at `step` (the rollouts trained before it: 0 before
    training, --num-rollout after, multiples of --eval-interval between): greedy with one sample per prompt, or the
    mean of --n-samples-per-eval-prompt k samples with pass@k (eval_metrics). Returns the headline (first set's)
    accuracy; None without eval prompts. A step already evaluated (a resumed run's history) is not evaluated again."""
    from engine.config.eval_config import EvalDataset
    from engine.rollout.loop import generate_rollout
    from engine.samples import Status

    if not run.eval_sets:
        return None
    if (done := evaluated(run, step)) is not None:
        return done
    if getattr(getattr(run, "hooks", None), "evaluate", None) is not None:
        return custom_evaluate(run, step)
    metrics: dict[str, float] = {}
    data: dict[str, dict[str, list]] = {}
    for name, eval_rows in run.eval_sets.items():
        d = run.eval_datasets.get(name) or EvalDataset(name=name, path="").resolved(run.cfg)  # rows set by hand
        rows = iter(eval_rows)
        # seeds of their own (rollout id -1 - step): never those of a training rollout, the same on a resume
        result = generate_rollout(lambda n: _prompts(run, [r for _, r in zip(range(n), rows)]),
                                  rollout_id=-1 - step, batch_size=len(eval_rows), n=d.n_samples_per_eval_prompt,
                                  params=eval_sampling_params(run, d),
                                  reward_model=run.reward_model.keyed(run.cfg.eval_reward_key or run.cfg.reward_key),
                                  seed=run.cfg.sampling_seed, engines=run.engines,
                                  concurrency=run.cfg.rollout_concurrency, timeout_s=run.cfg.rollout_timeout,
                                  generate=getattr(getattr(run, "hooks", None), "generate", None),
                                  hook_args=hook_args(run, -1 - step, evaluation=True),
                                  hook_path=run.cfg.custom_generate_function_path or "",
                                  sample_hooks=getattr(getattr(run, "hooks", None), "sample_hooks", None))
        metrics.update(eval_metrics(name, [[s.scalar_reward for s in g] for g in result.groups],
                                    passrate=run.cfg.log_passrate))
        flat = [s for g in result.groups for s in g]
        data[name] = {"rewards": [s.scalar_reward for s in flat],
                      "truncated": [s.status == Status.TRUNCATED for s in flat], "samples": flat}
    publish_eval(run, step, metrics, data)
    return evaluated(run, step)


def publish_eval(run: Run, step: int, metrics: dict[str, float], data: dict[str, dict[str, list]]) -> None:
    """An evaluation's metrics at `step`, through --custom-eval-rollout-log-function-path when set (True from it:
    the history only)."""
    hook = getattr(getattr(run, "hooks", None), "eval_log", None)
    taken = hook is not None and logged_by_hook(hook, "--custom-eval-rollout-log-function-path",
                                                run.cfg.custom_eval_rollout_log_function_path, step,
                                                hook_args(run, -1 - step, evaluation=True), data, dict(metrics))
    publish(run, step, metrics, track=not taken)


def custom_evaluate(run: Run, step: int) -> float | None:
    """--eval-function-path: slime's contract, fn(args, rollout_id, None, evaluation=True) with args.eval_sets and
    args.engine; its per-set rewards published at `step` (hooks.eval_output_metrics). The rollout id is -1 - step,
    as the built-in evaluation's (never a training rollout's seeds)."""
    from engine.rollout.hooks import EngineClient, call_hook, eval_output_metrics

    cfg, flag, path = run.cfg, "--eval-function-path", run.cfg.eval_function_path
    rid = -1 - step
    engine = EngineClient(None, run.engines, rid_prefix=f"ev{step}-{uuid.uuid4().hex[:6]}-",
                          timeout_s=cfg.rollout_timeout)
    args = hook_args(run, rid, evaluation=True).with_engine(engine)
    out = call_hook(flag, path, run.hooks.evaluate, args, rid, None, evaluation=True)
    metrics = eval_output_metrics(out, flag, path)
    publish_eval(run, step, metrics, out.data if hasattr(out, "data") else out)
    if eval_accuracy_key(cfg) not in metrics:
        log.warning("%s returned no eval set named %r (the first of --eval-prompt-data): the run's headline "
                    "accuracy is unknown at step %d", flag, eval_accuracy_key(cfg)[5:-9], step)
    return evaluated(run, step)


def eval_metrics(name: str, rewards: list[list[float]], passrate: bool = False) -> dict[str, float]:
    """rewards[prompt][sample] of eval set `name` → eval/<name>_accuracy (the mean reward); with k > 1 samples per
    prompt also eval/<name>_mean_at_k (the same mean) and eval/<name>_pass_at_k (the mean over prompts of the best
    reward of k); with `passrate` (--log-passrate) eval/<name>_pass_at_<j> for j = 1, 2, 4, … ≤ k."""
    k = len(rewards[0])
    mean = sum(sum(r) for r in rewards) / (k * len(rewards))
    out = {f"eval/{name}_accuracy": mean}
    if k > 1:
        out.update({f"eval/{name}_mean_at_k": mean,
                    f"eval/{name}_pass_at_k": sum(max(r) for r in rewards) / len(rewards)})
        if passrate:
            out.update({f"eval/{name}_pass_at_{j}": v for j, v in pass_rates(rewards).items()})
    return out


def pass_rates(rewards: list[list[float]]) -> dict[int, float]:
    """{k: pass@k} for k = 1, 2, 4, … ≤ n over groups of n rewards (a reward of 1 is correct, as slime counts):
    the mean over groups of the unbiased estimator 1 − C(n−c, k) / C(n, k) (Chen et al. 2021, slime's
    compute_pass_rate); {} for one sample per group."""
    from math import comb

    n = len(rewards[0]) if rewards else 0
    if n < 2 or any(len(r) != n for r in rewards):
        return {}
    correct = [sum(1 for x in r if x == 1) for r in rewards]
    out, k = {}, 1
    while k <= n:
        out[k] = sum(1.0 - comb(n - c, k) / comb(n, k) for c in correct) / len(correct)
        k *= 2
    return out


def evaluated(run: Run, step: int) -> float | None:
    """The accuracy published at `step`, by this run or the one it resumes (checkpoints carry the history;
    those of rollflow 0.1 keep the accuracy before training as eval/test_accuracy_before at step -1)."""
    if step == 0 and (old := run.history.get("eval/test_accuracy_before", {}).get(-1)) is not None:
        return old
    return run.history.get(eval_accuracy_key(run.cfg), {}).get(step)


# ---- summary ---------------------------------------------------------------------------------------------------
def placement_info(run: Run) -> dict[str, Any]:
    """Where the run's processes are: each train rank's node (ip, id, pid), the rendezvous address, the directories
    some ranks did not see (their files went through Ray's object store), each engine's node, process and URL,
    and whether the engine serves from train rank 0's process (--rollout-engine-process)."""
    from engine import cluster

    tg, eng = run.train_group, run.engines
    return {"master": getattr(tg, "master", None),
            "train": list(getattr(tg, "nodes", []) or []),
            "shipped_dirs": dict(getattr(tg, "blind", {}) or {}),  # dir → ranks that got its files via Ray
            "engine_in_trainer": run.engine_in_trainer,
            "train_prestarted": bool(getattr(tg, "prestarted", False)),  # started with Ray by `rollflow train`
            "engine_prestarted": run.prestarted_engine is not None,  # likewise, engine 0 (or the worker's)
            "ray_services": cluster.services_started(),  # lean / full for a local cluster the run started; None joined
            "engines": [{"index": s.index, "node_ip": s.info.get("node"), "node_id": s.info.get("node_id"),
                         "pid": s.info.get("pid"), "url": s.url, "model_impl": s.info.get("model_impl"),
                         "external": bool(s.info.get("external"))}
                        for s in getattr(eng, "slots", [])]}


def first_last(series: dict[int, float]) -> tuple[float | None, float | None]:
    """(mean of the first 3, mean of the last 3) values of a per-rollout series, by rollout id."""
    ids = sorted(series)
    first, last = [series[i] for i in ids[:3]], [series[i] for i in ids[-3:]]
    return (sum(first) / len(first) if first else None), (sum(last) / len(last) if last else None)


def summary(run: Run) -> dict[str, Any]:
    rewards = run.history.get("rollout/reward_mean", {})
    reward_first, reward_last = first_last(rewards)
    loss_first, loss_last = first_last(run.history.get("train/loss", {}))
    opd_first, opd_last = first_last(run.history.get("train/opd_reverse_kl", {}))
    return {
        "rollouts": len(rewards),
        "start_rollout": run.state.start_rollout_id,  # this process trained start_rollout .. num_rollout - 1
        "num_rollout": run.cfg.num_rollout,
        "reward_first": reward_first,
        "reward_last": reward_last,
        "loss_first": loss_first,  # train/loss, the same way (what --loss-type sft_loss runs are read by)
        "loss_last": loss_last,
        "opd_reverse_kl_first": opd_first,  # train/opd_reverse_kl, the same way (--use-opd)
        "opd_reverse_kl_last": opd_last,
        "test_accuracy_before": evaluated(run, 0),
        "test_accuracy_after": evaluated(run, run.cfg.num_rollout),
        "wall_s": time.time() - run.state.started_at,
        # the loop over rollout ids alone (no start-up, no first / last evaluation): async vs sync compares this
        "loop_wall_s": run.state.loop_seconds,
        "loop_started_unix": run.state.loop_started_unix,  # process start → this = start-up (bench/trl_race.py)
        "rollout_done_s": {str(i): round(v, 3) for i, v in sorted(run.state.done_at.items())},
        "async_mode": run.cfg.async_mode,
        "mlflow_run_id": run.tracker.run_id if run.tracker else None,
        "mlflow_tracking_uri": run.tracker.safe_uri if run.tracker else None,
        "mlflow_run_url": run.tracker.run_url() if run.tracker else None,
        "mlflow_lost": run.tracker.lost_report() if run.tracker else None,
        "flow_run_id": run.flow_run_id,
        "flow_run_url": run.flow_run_url,
        "save_dir": run.store.url if run.store else None,
        "last_checkpoint": checkpoint.read_marker(run.store) if run.store else None,
        "started_from": run.start.describe() if run.start else None,
        "weight_sync": run.sync_transport,
        "placement": placement_info(run),
        "engine_dtype": run.engine_dtype,
        # every metric by rollout id (what MLflow got), so a script can read the run from this one file
        "history": {k: {str(i): v for i, v in sorted(d.items())} for k, d in sorted(run.history_copy().items())},
    }
