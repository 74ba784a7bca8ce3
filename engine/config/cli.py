"""RunConfig from YAML and the command line.

Precedence: field defaults < `--config FILE` (YAML) < flags. Every field is a flag named like slime's
(`--rollout-batch-size`); booleans also get `--no-…`; `--sglang-*` flags are kept verbatim in `sglang_args`.
Unknown flags and keys are errors that suggest the nearest valid flag. A flag typed on the command line counts as
given even at its default's value (`--tis-clip 2.0` without `--use-tis` is refused: it would do nothing); a YAML key
or a flow's `cfg` key only at another value, since either may be a whole dump of a run's config (--dump-details' and
MLflow's config.yaml, the parameters Prefect stored for a retry).
"""
from __future__ import annotations

import argparse
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import ValidationError

from engine.config import SECTIONS, RunConfig
from engine.config.base import flag, user_input
from engine.diagnosis import ConfigError, Diagnosis

SGLANG_PREFIX = "--sglang-"


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _add_field(group: argparse._ArgumentGroup, name: str, field) -> None:
    tp = _unwrap_optional(field.annotation)
    origin = typing.get_origin(tp)
    default = field.default
    help_text = (field.description or "").replace("%", "%%") + f" (default: {default!r})"
    kwargs: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS, help=help_text)
    if tp is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        kwargs["choices"] = list(typing.get_args(tp))
        kwargs["metavar"] = "{" + ",".join(map(str, kwargs["choices"])) + "}"
    elif origin is list:
        (item,) = typing.get_args(tp)
        # repeating the flag adds to the list (slime's append flags, e.g. --rollout-sample-hook-path A
        # --rollout-sample-hook-path B) instead of keeping the last occurrence only
        if typing.get_origin(item) is Literal:  # e.g. --profile-target train_actor train_log_probs
            choices = list(typing.get_args(item))
            kwargs.update(nargs="*", choices=choices, metavar="{" + ",".join(map(str, choices)) + "}",
                          action="extend")
        else:
            kwargs.update(nargs="*", type=item, metavar=item.__name__.upper(), action="extend")
    elif tp in (int, float, str):
        kwargs.update(type=tp, metavar=tp.__name__.upper())
    elif origin is dict and name != "sglang_args":
        kwargs.update(type=str, metavar="JSON")  # the field's validator parses it (a CONFIG error names the flag)
    else:
        return  # dicts (sglang_args) are filled by the pass-through
    group.add_argument(flag(name), **kwargs)


def build_parser(prog: str = "rollflow train", description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, allow_abbrev=False,
        epilog="Any --sglang-<flag> [value] is passed unchanged to `python -m sglang.launch_server --<flag>`.")
    parser.add_argument("--config", metavar="FILE", help="YAML file of flags (snake_case or dashed keys); "
                        "flags on the command line override it")
    for section in SECTIONS:
        title = section.__name__.removesuffix("Args").lower()
        doc = (sys.modules[section.__module__].__doc__ or "").strip().splitlines()
        group = parser.add_argument_group(title, doc[0] if doc else None)
        for name, field in section.model_fields.items():
            _add_field(group, name, field)
    return parser


def _all_flags() -> list[str]:
    out = []
    for name, field in RunConfig.model_fields.items():
        out.append(flag(name))
        if _unwrap_optional(field.annotation) is bool:
            out.append("--no-" + name.replace("_", "-"))
    return out + ["--config"]


def suggest(bad: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(bad, choices, n=1, cutoff=0.5)
    return f"did you mean {close[0]}?" if close else "see `rollflow train --help` for every flag"


def split_sglang(argv: list[str]) -> tuple[list[str], dict[str, str | bool | list[str]]]:
    """Take `--sglang-x [value …]` tokens out of argv: no value is a switch, one value a string, several a list
    (`--sglang-cuda-graph-bs 1 2 4 8`)."""
    rest, sglang = [], {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith(SGLANG_PREFIX):
            key, eq, val = tok[len(SGLANG_PREFIX):].partition("=")
            vals = [val] if eq else []
            while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                vals.append(argv[i + 1])
                i += 1
            sglang[key] = True if not vals else vals[0] if len(vals) == 1 else vals
        else:
            rest.append(tok)
        i += 1
    return rest, sglang


def load_yaml(path: str, source: str = "--config") -> dict[str, Any]:
    """A YAML file of flags → {field: value}; `source` names it in errors (the flow's parameter: "config")."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=f"{source} {path}: no such file",
                                    fix="pass the path of an existing YAML file"))
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=f"{source} {path}: invalid YAML: {e}",
                                    fix="fix the YAML syntax")) from None
    if not isinstance(raw, dict):
        raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                    what=f"{source} {path}: top level is {type(raw).__name__}, not a mapping",
                                    fix="write one `flag: value` per line"))
    out: dict[str, Any] = {}
    sglang: dict[str, Any] = dict(raw.pop("sglang_args", None) or raw.pop("sglang-args", None) or {})
    names = list(RunConfig.model_fields)
    bad: list[Diagnosis] = []  # every unknown key at once
    for key, val in raw.items():
        name = str(key).replace("-", "_")
        if name.startswith("sglang_"):
            sglang[str(key)[len("sglang_"):].replace("_", "-")] = val
        elif name not in RunConfig.model_fields:
            if d := slime_flag_diagnosis(name):
                bad.append(Diagnosis(code=d.code, severity=d.severity, what=f"{source} {path}: {d.what}",
                                     fix=d.fix, facts=d.facts))
            else:
                bad.append(Diagnosis(code="CONFIG", severity="error", what=f"{source} {path}: unknown key {key!r}",
                                     fix=suggest(name, names).replace("did you mean ", "did you mean key ")))
        else:
            out[name] = val
    if bad:
        raise ConfigError(bad)
    if sglang:
        out["sglang_args"] = sglang
    return out


def unknown_flag_diagnosis(bad: str) -> Diagnosis:
    """The CONFIG error for a command-line token that is no rollflow flag: one of slime's (with its reason), else
    the nearest flag."""
    name = bad.split("=")[0]
    return (name.startswith("--") and slime_flag_diagnosis(name)) or Diagnosis(
        code="CONFIG", severity="error", what=f"unknown flag {bad}", fix=suggest(name, _all_flags()))


def slime_flag_diagnosis(name: str) -> Diagnosis | None:
    """The CONFIG error for one of slime's flags that rollflow does not take (engine/config/slime_flags.py), by
    flag or config key; None for any other name."""
    from engine.config.slime_flags import not_taken

    if (known := not_taken(name)) is None:
        return None
    why, instead = known
    shown = "--" + name.lstrip("-").replace("_", "-")
    return Diagnosis(code="CONFIG", severity="error", what=f"{shown} is slime's flag, which rollflow does not take: "
                     f"{why}", fix=instead, facts={"field": shown.removeprefix("--").replace("-", "_")})


def format_validation_error(err: ValidationError, source: dict[str, Any]) -> ConfigError:
    diags = []
    for e in err.errors():
        name = str(e["loc"][0]) if e["loc"] else "config"
        if e["type"] == "extra_forbidden" and (d := slime_flag_diagnosis(name)):
            diags.append(d)
            continue
        got = e.get("input")
        field = RunConfig.model_fields.get(name)
        hint = f"pass a valid value to {flag(name)}"
        if field is not None and field.description:
            hint += f" ({field.description.rstrip('.')})"
        diags.append(Diagnosis(code="CONFIG", severity="error",
                               what=f"{flag(name)} (field {name}) = {got!r}: {e['msg']}",
                               fix=hint, facts={"field": name, "value": repr(got)}))
    return ConfigError(diags)


def make_config(values: dict[str, Any], flags_given: Any = ()) -> RunConfig:
    """{field: value} → RunConfig; `flags_given` (the fields set on the command line) count as given
    (`Section.changed`) also at their default's value."""
    try:
        with user_input(flags_given):
            return RunConfig(**values)
    except ValidationError as e:
        raise format_validation_error(e, values) from None


def parse_args(argv: list[str], prog: str = "rollflow train") -> RunConfig:
    """argv (without the subcommand) → RunConfig, or ConfigError / SystemExit(0) for --help."""
    argv, sglang = split_sglang(list(argv))
    parser = build_parser(prog)
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # every unknown flag at once (a ported slime script may hold several)
        raise ConfigError([unknown_flag_diagnosis(bad)
                           for bad in [u for u in unknown if u.startswith("-")] or unknown[:1]])
    values = load_yaml(ns.config) if ns.config else {}
    cli = {k: v for k, v in vars(ns).items() if k != "config"}
    values.update(cli)
    if sglang:
        values["sglang_args"] = {**values.get("sglang_args", {}), **sglang}
    return make_config(values, flags_given=cli)
