"""The `rollflow` command line: train, doctor, serve."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from engine.diagnosis import DiagnosisError

USAGE = """rollflow <command> [flags]

commands:
  train    run RL training as a Prefect flow (rollflow train --help lists every flag)
  doctor   check a config for the failures in the catalog (RF01–RF14) without starting anything
  serve    run the built-in rollout engine (SGLang's HTTP API) in the foreground
  compare  compare MLflow runs: params that differ, final / best metrics, a plot (rollflow compare --help)
  convert  HF ⇄ training checkpoint: --hf-checkpoint DIR --save DIR, or --load DIR [--ckpt-step N] --output-hf DIR
"""


def _quiet_console() -> None:
    """Before Prefect is imported: its console shows warnings and errors only (task-run state lines would drown
    the progress bar) while the Prefect API / UI still receives every INFO log. Both are overridable."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rollflow")  # engine logs (rollflow.*) reach the UI
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # MLflow resets its logger's level on import
    # Prefect waits 20 s for its ephemeral API server; on a loaded 2-core machine that start took longer and a
    # restarted run died before its first task (seen in bench/resume.py). Overridable like the others.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    logging.getLogger("mlflow").setLevel(logging.WARNING)


def _print_summary(s: dict, cfg) -> None:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    delta = (s["reward_last"] - s["reward_first"]) if s["reward_first"] is not None else None
    start, total = s.get("start_rollout", 0), s.get("num_rollout", s["rollouts"])
    if start >= total:
        head = (f"rollflow: nothing to do: iteration {s.get('last_checkpoint')} is already saved and --num-rollout is "
                f"{total} (raise --num-rollout to train on)")
    else:
        n = total - start
        head = (f"rollflow: {n} rollout{'' if n == 1 else 's'} in {s['wall_s']:.0f}s"
                + (f" (resumed at rollout {start} of {total})" if start else ""))
    from engine.rollout.sft import placeholder_rewards

    progress = []
    if not placeholder_rewards(cfg):  # engine.rollout.sft's samples carry reward 0
        progress.append(f"  reward (mean of first 3 / last 3 rollouts): {s['reward_first']:.3f} → "
                        f"{s['reward_last']:.3f} ({delta:+.3f})" if delta is not None else "  reward: no rollouts ran")
    if cfg.use_opd and s.get("opd_reverse_kl_first") is not None:
        progress.append(f"  reverse KL to the teacher (mean of first 3 / last 3 rollouts): "
                        f"{s['opd_reverse_kl_first']:.3g} → {s['opd_reverse_kl_last']:.3g}")
    if cfg.loss_type == "sft_loss" and s.get("loss_first") is not None:
        progress.append(f"  SFT loss (mean of first 3 / last 3 rollouts): {s['loss_first']:.3g} → "
                        f"{s['loss_last']:.3g} ({s['loss_last'] - s['loss_first']:+.3g})")
    if cfg.no_engines:
        accuracy = "  test accuracy: not measured (no rollout engine" + (
            "; evaluate the saved weights with an engine: examples/sft.yaml shows how)" if cfg.debug_train_only
            else ")")
    elif not cfg.has_eval():
        accuracy = "  test accuracy: not measured (no eval set)"
    elif cfg.trains:
        accuracy = f"  test accuracy (greedy): {pct(s['test_accuracy_before'])} → {pct(s['test_accuracy_after'])}"
    else:
        accuracy = (f"  test accuracy (greedy, the starting weights): {pct(s['test_accuracy_before'])}; "
                    "--debug-rollout-only trained nothing")
    lines = ["", head, *progress, accuracy]
    if s.get("save_dir"):
        lines.append(f"  checkpoints: {s['save_dir']} (latest_checkpointed_iteration.txt = {s['last_checkpoint']})")
    url = s.get("flow_run_url") or f"http://127.0.0.1:4200/runs/flow-run/{s['flow_run_id']}"
    lines.append(f"  Prefect flow run {s['flow_run_id']}: `prefect server start`, then open {url}")
    if s.get("mlflow_run_id"):
        uri = s["mlflow_tracking_uri"]
        how = f"`mlflow ui --backend-store-uri {uri}`, then open " if uri.startswith("sqlite:") else "open "
        lines.append(f"  MLflow run {s['mlflow_run_id']}: {how}{s.get('mlflow_run_url')}")
    if s.get("mlflow_lost"):
        lines.append(f"  MLflow incomplete: {s['mlflow_lost']}")
    print("\n".join(lines), flush=True)


def _fail_fast_if_save_in_use(cfg) -> None:
    """A --save that another live run writes fails before the ~20 s of start-up (Prefect's API, Ray, the actors),
    with the diagnosis the flow's writer lock gives (plumbing/limits.py still takes the lock: this only reads it).
    Not with --wait-for-save-lock or --flow-retries, which wait for the holder inside the flow."""
    if not cfg.save or cfg.wait_for_save_lock or cfg.flow_retries:
        return
    from engine.checkpoint.writer import SaveInUse, busy, live_holder

    if (holder := live_holder(cfg.save)) is not None:
        raise SaveInUse(busy(cfg.save, holder, 0.0))


def cmd_train(argv: list[str]) -> int:
    from engine.cluster import WORKER_ENV_DEFAULTS
    from engine.config.cli import parse_args

    cfg = parse_args(argv, prog="rollflow train")
    _fail_fast_if_save_in_use(cfg)
    _quiet_console()
    # before torch is imported anywhere (its OpenMP reads it once): the idle side's OpenMP threads sleep instead of
    # spinning on the cores the other side computes on (the engine and the trainer alternate on the same CPUs);
    # the Ray workers inherit it (engine/cluster WORKER_ENV_DEFAULTS for joined clusters)
    os.environ.setdefault("OMP_WAIT_POLICY", WORKER_ENV_DEFAULTS["OMP_WAIT_POLICY"])
    from engine import startgc
    from plumbing import prestart

    startgc.defer()  # until training starts (flows/train.py), or start-up or the flow fails
    if cfg.progress:  # the bar appears after place: say what the first seconds are spent on
        print(f"rollflow train {cfg.experiment_name}: starting the Prefect API and Ray, then preflight, the engines "
              "and the train workers …", file=sys.stderr, flush=True)
    # start-up side by side (plumbing/prestart.py): the Prefect API server boots in its own process at nice 10,
    # launched before this process imports anything of Prefect; Ray starts at once while a thread imports Prefect
    # and the stages, then the train worker loads and a thread creates MLflow's store. Ray and the worker are one
    # chain (the worker can only start once Ray is up), the server's boot and the flow's start the other; the
    # server's boot fills the idle core around them. A SIGTERM meanwhile exits through atexit, which stops them all.
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        prestart.launch_ephemeral_api_early()  # its ~3 s of CPU start while this thread starts Ray
        # What starting Ray and the train worker imports, imported in this thread before the import thread starts:
        # two threads importing one module at the same time can leave the second with a half-initialised module
        # (seen with prefect.settings, "Failed to initialize plugins", and requests before its DependencyWarning
        # filter). From here on the two threads import disjoint modules (tests/test_prestart.py checks it).
        prestart.import_for_ray()
        # Prefect, torch, the stages, and transformers' tokenizer classes (preflight's first tokenizer): while
        # ray.init waits for Ray's processes
        imports = prestart.import_in_background(*prestart.BACKGROUND_IMPORTS)
        if prestart.start_ray(cfg):  # a one-rank CPU run's train worker (and its own engine) start loading at once
            prestart.start_train_worker(cfg)
            prestart.start_engine(cfg)
        mlflow_store = prestart.warm_mlflow_store(cfg, after=imports.imported["prefect.settings"])
        imports.join()
        from prefect.exceptions import CancelledRun

        from flows.train import rl_train

        api = prestart.launch_ephemeral_api()  # the early one, unless Prefect's settings name a server
        if api is not None:
            prestart.wait_ephemeral_api(api)
        if mlflow_store is not None:
            mlflow_store.join()
    except BaseException:
        startgc.ready()  # the collector back on for a caller that goes on (a test calling main)
        raise
    finally:
        signal.signal(signal.SIGTERM, before)
    try:
        result = rl_train(cfg)  # SIGTERM: the flow run ends Cancelled (flows/train.py)
    except CancelledRun as e:
        print(f"rollflow: the flow run was cancelled: {e}", file=sys.stderr, flush=True)
        return 143
    finally:
        startgc.ready()
    if cfg.summary_json:
        Path(cfg.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.summary_json).write_text(json.dumps(result, indent=2))
    _print_summary(result, cfg)
    return 0


DOCTOR_HELP = """rollflow doctor [--config FILE] [train flags…] [--log FILE…] [--json]

Runs every preflight check that needs no GPU on the config (the same checks `rollflow train` runs first) and
prints the report, errors first; exits 1 when any check finds an error. --log FILE (repeatable) also classifies a
failed run's log or traceback (engine logs, Ray task errors): out-of-memory (RF03), port collisions (RF08),
illegal memory access (RF11), inductor JSONDecodeError (RF12), NaN/Inf (RF13). --json prints the diagnoses as a
list of objects. `rollflow train --help` lists the train flags.
"""


def _take_option(argv: list[str], name: str) -> tuple[list[str], list[str]]:
    """Remove every `name VALUE` / `name=VALUE` from argv; return (rest, values)."""
    rest, values, i = [], [], 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith(name + "="):
            values.append(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    return rest, values


def cmd_doctor(argv: list[str]) -> int:
    """Every preflight check that needs no GPU (and the classifiers on --log files); exit 1 on any error."""
    from engine.config.cli import parse_args
    from engine.doctor.checks import Environment, run_preflight
    from engine.doctor.classify import classify_text
    from engine.diagnosis import ConfigError, render_report

    if argv[:1] in (["-h"], ["--help"]):
        print(DOCTOR_HELP)
        return 0
    as_json = "--json" in argv
    argv, logs = _take_option([a for a in argv if a != "--json"], "--log")
    cfg = None
    try:
        cfg = parse_args(argv, prog="rollflow doctor")
        diags = run_preflight(cfg, Environment.for_config(cfg))
    except ConfigError as e:
        diags = e.diagnoses
    for path in logs:
        if not Path(path).is_file():
            print(f"rollflow doctor: --log {path}: no such file", file=sys.stderr)
            return 2
        diags += classify_text(Path(path).read_text(errors="replace"), cfg)
    if as_json:
        print(json.dumps([d.model_dump() for d in diags], indent=2))
    else:
        errors = sum(d.severity == "error" for d in diags)
        print(render_report(diags) if diags else "rollflow doctor: no problems found")
        if diags:
            print(f"\nrollflow doctor: {errors} error(s), {len(diags) - errors} other finding(s)")
    return 1 if any(d.severity == "error" for d in diags) else 0


def cmd_serve(argv: list[str]) -> int:
    from engine.rollout.server import main as serve_main

    return serve_main(argv)


def cmd_convert(argv: list[str]) -> int:
    from engine.convert import checkpoint_to_hf, hf_to_checkpoint
    from engine.diagnosis import ConfigError, Diagnosis

    p = argparse.ArgumentParser(prog="rollflow convert", description="Convert between a Hugging Face model and a "
                                "training checkpoint (torch backend). Paths may be local or s3://bucket/prefix.")
    p.add_argument("--hf-checkpoint", help="HF model directory: converted into --save, or (with --load) the model "
                   "whose config.json/tokenizer to use when the checkpoint has no hf_config/")
    p.add_argument("--save", help="checkpoint directory to write (iter_0000000 + marker 0: starting weights)")
    p.add_argument("--load", help="checkpoint directory to read (its marker's iteration, or --ckpt-step)")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration of --load to convert (default: the marker's)")
    p.add_argument("--output-hf", help="new directory for the Hugging Face model (loads with from_pretrained)")
    a = p.parse_args(argv)
    if a.save and a.hf_checkpoint and not (a.load or a.output_hf):
        r = hf_to_checkpoint(a.hf_checkpoint, a.save)
        print(f"rollflow convert: {a.hf_checkpoint} → {r.uri} ({r.bytes / 2**20:.1f} MiB in {r.seconds:.1f}s); "
              f"train from it with --load {a.save} (it starts at rollout 0)")
        return 0
    if a.load and a.output_hf and not a.save:
        r = checkpoint_to_hf(a.load, a.output_hf, ckpt_step=a.ckpt_step, hf_checkpoint=a.hf_checkpoint)
        print(f"rollflow convert: {r['source']} → {r['output_hf']} ({r['tensors']} tensors, {r['dtype']})")
        return 0
    raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                what=f"rollflow convert {' '.join(argv)}: not one of the two conversions",
                                fix="rollflow convert --hf-checkpoint HF_DIR --save CKPT_DIR, or rollflow convert "
                                    "--load CKPT_DIR [--ckpt-step N] --output-hf NEW_HF_DIR"))


def cmd_compare(argv: list[str]) -> int:
    from engine.diagnosis import ConfigError, Diagnosis
    from engine.tracking import default_tracking_uri, sqlite_path
    from engine.tracking import compare as cmp

    p = argparse.ArgumentParser(prog="rollflow compare", description="Compare MLflow runs: the params that differ, "
                                "and the final and best value of each metric per run (a resumed run's redone steps "
                                "count once: the latest value per step).")
    p.add_argument("refs", nargs="+", metavar="RUN_OR_EXPERIMENT",
                   help="run id, run name, experiment name or experiment id (all of its runs)")
    p.add_argument("--metrics", help=f"comma-separated metric names (default: those of {','.join(cmp.DEFAULT_METRICS)} "
                   "that were logged)")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG overlaying each metric's curves, one line per run")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table", help="output format (default: table)")
    p.add_argument("--work-dir", default="runs/default",
                   help="the runs' --work-dir, whose mlflow.db is read (default: runs/default)")
    p.add_argument("--mlflow-tracking-uri", help="tracking URI (default: $MLFLOW_TRACKING_URI, else "
                   "sqlite:///<work-dir>/mlflow.db)")
    p.add_argument("--all-params", action="store_true", help="also list differing paths and names (work dir, --save, "
                   "run name, …)")
    a = p.parse_args(argv)
    uri = default_tracking_uri(a.work_dir, a.mlflow_tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.is_file():  # MLflow would create an empty store there
        raise ConfigError(Diagnosis(code="COMPARE", severity="error", what=f"no MLflow store at {db}",
                                    fix="pass the --work-dir the runs used (e.g. --work-dir runs/demo) or "
                                        "--mlflow-tracking-uri"))
    _quiet_console()
    from mlflow.tracking import MlflowClient

    metrics = [m.strip() for m in a.metrics.split(",") if m.strip()] if a.metrics else None
    c = cmp.compare(MlflowClient(tracking_uri=uri), a.refs, metrics, uri=uri, all_params=a.all_params)
    out = {"table": cmp.render_table, "csv": cmp.render_csv, "json": cmp.render_json}[a.format](c)
    sys.stdout.write(out)
    if a.plot:
        if not c["metrics"]:
            raise ConfigError(Diagnosis(code="COMPARE", severity="error", what="--plot: no metric to plot",
                                        fix="pass --metrics m1,m2"))
        cmp.plot(c, a.plot)
        print(f"plot: {a.plot}", file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "doctor": cmd_doctor, "serve": cmd_serve, "compare": cmd_compare,
            "convert": cmd_convert}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        import difflib

        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"rollflow: unknown command {argv[0]!r}" + (f"; did you mean {close[0]!r}?" if close else ""),
              file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    try:
        return cmd(argv[1:])
    except DiagnosisError as e:
        print(f"\nrollflow {argv[0]} stopped:\n{e}", file=sys.stderr)
        return 2 if type(e).__name__ == "ConfigError" else 1


if __name__ == "__main__":
    sys.exit(main())
