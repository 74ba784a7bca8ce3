"""The rl-train flow's parameters (masked before they reach Prefect: SecretSafeFlow) and its run name: a RunConfig,
or a YAML file of flags (`config`) with `cfg` overrides on top.

A deployment sets `config: deployments/demo.yaml` (relative to its working directory, the repository root) and a
run overrides single flags: `prefect deployment run rl-train/rl-train --params '{"cfg": {"num_rollout": 2}}'`.
The CLI and the tests pass a RunConfig as `cfg`. Precedence, as on the command line: field defaults < the file <
`cfg` (a RunConfig passed with a file overrides it with the fields it was given, `model_fields_set`).

`cfg` is a dict before a RunConfig (`union_mode="left_to_right"`) so that Prefect's parameter validation keeps
overrides as they were sent: a partial dict validated as a RunConfig alone could fail on values that only agree
with the file's (an RF06 batch size), or silently fill every other field with its default.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Union

from prefect import Flow
from pydantic import Field

from engine.config import RunConfig
from engine.config.cli import load_yaml, make_config
from engine.diagnosis import ConfigError, Diagnosis, DiagnosisError

CfgParam = Annotated[Union[dict[str, Any], RunConfig, None], Field(union_mode="left_to_right")]


def run_config(cfg: dict[str, Any] | RunConfig | None, config: str | None) -> RunConfig:
    """The run's RunConfig from the flow's two parameters; a ConfigError names the parameter, the value and the fix."""
    out = _run_config(cfg, config)
    _no_masked_secrets(out)
    return out


def _no_masked_secrets(cfg: RunConfig) -> None:
    """A value Prefect stored masked (a flow run retried from the UI gets `<redacted>`) cannot be used: say where the
    secret has to come from instead of failing later with a wrong password."""
    from engine.tracking.secrets import REDACTED

    found = [f"{k}={v!r}" for k, v in cfg.flat_params().items() if isinstance(v, str) and REDACTED in v]
    if found:
        raise ConfigError(Diagnosis(
            code="CONFIG", severity="error",
            what=f"{', '.join(found)}: a secret Prefect stored masked (secrets never reach Prefect's database)",
            fix="give the secret to the worker instead: the MLflow password as MLFLOW_TRACKING_PASSWORD (user "
                "MLFLOW_TRACKING_USERNAME) with a --mlflow-tracking-uri without it; drop --sglang-api-key (each run "
                "makes its own engine token)", facts={"fields": found}))


def _run_config(cfg: dict[str, Any] | RunConfig | None, config: str | None) -> RunConfig:
    if config is None:
        if isinstance(cfg, RunConfig):
            return cfg
        if cfg is None:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                        what="rl-train got neither `cfg` nor `config`",
                                        fix="pass config=<a RunConfig YAML file, e.g. deployments/demo.yaml> or "
                                            "cfg=<a RunConfig or a dict of flags>"))
        return make_config({k.replace("-", "_"): v for k, v in cfg.items()})
    if not Path(config).is_file():
        raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                    what=f"config {config}: no such file (relative paths are read from {os.getcwd()})",
                                    fix="pass the path of a RunConfig YAML file, absolute or relative to the "
                                        "deployment's working directory (the repository root: e.g. "
                                        "deployments/demo.yaml)", facts={"field": "config", "value": config}))
    values = load_yaml(config, source="config")
    if isinstance(cfg, RunConfig):
        overrides = cfg.model_dump(include=cfg.model_fields_set)
    else:
        overrides = {k.replace("-", "_"): v for k, v in (cfg or {}).items()}
    return make_config({**values, **overrides})


class SecretSafeFlow(Flow):
    """A flow whose parameters reach Prefect's database (and UI) with secrets masked: `--sglang-api-key`, the
    password of `--mlflow-tracking-uri` and any value engine/tracking/secrets.py counts as secret become
    `<redacted>`; the flow body still gets the real values (they never leave this process). A flow run started
    from the UI or a deployment gets only what Prefect stored, so there the secrets come from the worker's
    environment (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD; a run's engine token is made per run)."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        from engine.tracking.secrets import redact

        return redact(super().serialize_parameters(parameters))

    def with_options(self, **kwargs: Any) -> "SecretSafeFlow":
        new = super().with_options(**kwargs)
        new.__class__ = SecretSafeFlow
        return new


def flow_run_name() -> str:
    """The name the MLflow run gets too (engine.tracking.record.run_name_of): --run-name, else
    `<experiment>-<date>-<time>`; a resume renames the flow run after the MLflow run it continues."""
    from prefect.runtime import flow_run

    from engine.tracking.record import run_name_of

    try:
        cfg = run_config(flow_run.parameters.get("cfg"), flow_run.parameters.get("config"))
    except DiagnosisError:  # the flow body raises it again: the run fails with the message instead of staying Pending
        return "rollflow/invalid-config"
    return run_name_of(cfg)
