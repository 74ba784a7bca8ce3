"""The `rollflow` command line: train, doctor, serve."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from engine.doctor.diagnosis import DiagnosisError

USAGE = """rollflow <command> [flags]

commands:
  train    run RL training as a Prefect flow (rollflow train --help lists every flag)
  doctor   check a config for the failures in the catalog (RF01–RF13) without starting anything
  serve    run the built-in rollout engine (SGLang's HTTP API) in the foreground
  convert  HF ⇄ training checkpoint: --hf-checkpoint DIR --save DIR, or --load DIR [--ckpt-step N] --output-hf DIR
"""


def _quiet_console() -> None:
    """Before Prefect is imported: its console shows warnings and errors only (task-run state lines would drown
    the progress bar) while the Prefect API / UI still receives every INFO log. Both are overridable."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect waits 20 s for its ephemeral API server; on a loaded 2-core machine that start took longer and a
    # restarted run died before its first task (seen in bench/resume.py). Overridable like the others.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    logging.getLogger("mlflow").setLevel(logging.WARNING)


def _print_summary(s: dict, cfg) -> None:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    delta = (s["reward_last"] - s["reward_first"]) if s["reward_first"] is not None else None
    lines = [
        "",
        f"rollflow: {s['rollouts']} rollouts in {s['wall_s']:.0f}s",
        f"  reward (mean of first 3 / last 3 rollouts): {s['reward_first']:.3f} → {s['reward_last']:.3f} "
        f"({delta:+.3f})" if delta is not None else "  reward: no rollouts ran",
        f"  test accuracy (greedy): {pct(s['test_accuracy_before'])} → {pct(s['test_accuracy_after'])}",
    ]
    if s.get("save_dir"):
        lines.append(f"  checkpoints: {s['save_dir']} (latest_checkpointed_iteration.txt = {s['last_checkpoint']})")
    url = s.get("flow_run_url") or f"http://127.0.0.1:4200/runs/flow-run/{s['flow_run_id']}"
    lines.append(f"  Prefect flow run {s['flow_run_id']}: `prefect server start`, then open {url}")
    if s.get("mlflow_run_id"):
        uri = s["mlflow_tracking_uri"]
        how = f"mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite:") else uri
        lines.append(f"  MLflow run {s['mlflow_run_id']}: {how}, then open http://127.0.0.1:5000")
    print("\n".join(lines), flush=True)


def cmd_train(argv: list[str]) -> int:
    from engine.config.cli import parse_args

    cfg = parse_args(argv, prog="rollflow train")
    _quiet_console()
    from flows.train import rl_train

    result = rl_train(cfg)
    if cfg.summary_json:
        Path(cfg.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.summary_json).write_text(json.dumps(result, indent=2))
    _print_summary(result, cfg)
    return 0


def cmd_doctor(argv: list[str]) -> int:
    """Every preflight check that needs no GPU; exit 1 when any finds an error."""
    from engine.config.cli import parse_args
    from engine.doctor.checks import Environment, run_preflight
    from engine.doctor.diagnosis import ConfigError, render_report

    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    try:
        cfg = parse_args(argv, prog="rollflow doctor")
        diags = run_preflight(cfg, Environment.for_config(cfg))
    except ConfigError as e:
        diags = e.diagnoses
    if as_json:
        print(json.dumps([d.model_dump() for d in diags], indent=2))
    else:
        errors = sum(d.severity == "error" for d in diags)
        print(render_report(diags) if diags else "rollflow doctor: no problems found")
        if diags:
            print(f"\nrollflow doctor: {errors} error(s), {len(diags) - errors} other finding(s)")
    return 1 if any(d.severity == "error" for d in diags) else 0


def cmd_serve(argv: list[str]) -> int:
    from engine.config.data import BUNDLED_MODEL
    from engine.rollout.server import serve

    p = argparse.ArgumentParser(prog="rollflow serve", description="The built-in engine: SGLang's HTTP API over "
                                "a transformers model (CPU or GPU).")
    p.add_argument("--hf-checkpoint", default=BUNDLED_MODEL, help="model directory (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default: 30000)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default max_new_tokens (default: 128)")
    a = p.parse_args(argv)
    serve(a.hf_checkpoint, a.host, a.port, threads=a.threads, max_new_tokens=a.max_new_tokens)
    return 0


def cmd_convert(argv: list[str]) -> int:
    from engine.convert import checkpoint_to_hf, hf_to_checkpoint
    from engine.doctor.diagnosis import ConfigError, Diagnosis

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


COMMANDS = {"train": cmd_train, "doctor": cmd_doctor, "serve": cmd_serve, "convert": cmd_convert}


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
