"""--eval-config (slime's): eval sets in one YAML file, each with its own keys, reward and sampling.

    eval:
      defaults:                    # optional: for every dataset that does not set the field
        n_samples_per_eval_prompt: 4
        temperature: 0.6
      datasets:                    # a list of {name, path, ...}, or a mapping name → {path, ...}
        - name: aime
          path: data/aime.jsonl
          rm_type: math
          label_key: answer
          max_response_len: 4096
        - name: gsm8k
          path: data/gsm8k.jsonl

A field set nowhere in the file comes from the run's flags (--n-samples-per-eval-prompt, --eval-temperature, …),
as slime resolves it: dataset, then `defaults`, then the command line. `EvalDataset.resolved(cfg)` gives every
field its value; `RunConfig.eval_datasets()` lists them, from this file or from --eval-prompt-data.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

class EvalDataset(BaseModel):
    """One eval set. None: not set here (`defaults`, then the run's flags decide)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    path: str
    rm_type: Optional[str] = None
    input_key: Optional[str] = Field(None, alias="prompt_key")  # slime's name; input_key (rollflow's flag) too
    label_key: Optional[str] = None
    metadata_key: Optional[str] = None
    tool_key: Optional[str] = None
    n_samples_per_eval_prompt: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = None
    max_response_len: Optional[int] = Field(None, ge=1)
    min_new_tokens: Optional[int] = Field(None, ge=0)
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    metadata_overrides: dict[str, Any] = Field(default_factory=dict)

    @field_validator("rm_type")
    @classmethod
    def _known_reward(cls, v):
        from engine.rewards import SAMPLE_RM_TYPES

        if v is not None and v not in (*SAMPLE_RM_TYPES, "remote_rm"):
            raise ValueError(f"rm_type {v!r} is none of {', '.join(SAMPLE_RM_TYPES)}, remote_rm")
        return v

    def resolved(self, cfg: Any) -> "EvalDataset":
        """Every field given: this dataset's value, else the run's flag."""
        flags = {"input_key": cfg.eval_input_key or cfg.input_key,
                 "label_key": cfg.eval_label_key or cfg.label_key, "metadata_key": cfg.metadata_key,
                 "tool_key": cfg.tool_key if cfg.eval_tool_key is None else cfg.eval_tool_key,
                 "n_samples_per_eval_prompt": cfg.n_samples_per_eval_prompt, "temperature": cfg.eval_temperature,
                 "top_p": cfg.eval_top_p or cfg.rollout_top_p,
                 "top_k": cfg.rollout_top_k if cfg.eval_top_k is None else cfg.eval_top_k,
                 "max_response_len": cfg.eval_max_response_len or cfg.rollout_max_response_len,
                 "min_new_tokens": cfg.eval_min_new_tokens or 0,
                 "stop": list(cfg.rollout_stop), "stop_token_ids": list(cfg.rollout_stop_token_ids)}
        return self.model_copy(update={k: v for k, v in flags.items() if getattr(self, k) is None})

    def row_metadata(self, metadata: Any) -> dict[str, Any]:
        """A row's metadata with this dataset's rm_type (the per-sample reward) and metadata_overrides."""
        out = dict(metadata) if isinstance(metadata, dict) else {}
        if self.rm_type is not None:
            out["rm_type"] = self.rm_type
        out.update(self.metadata_overrides)
        return out


def load(path: str) -> list[EvalDataset]:
    """The datasets of an --eval-config file, `defaults` applied; a bad file is a CONFIG error naming the field,
    the value and the fix. Read once per version of the file (a run's config, preflight and the driver all ask)."""
    import os

    try:
        st = os.stat(path)
    except OSError:
        return _read(path)  # says why it cannot be read
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = _read(path)
    return list(_LOADED[key])


_LOADED: dict[tuple, list[EvalDataset]] = {}


def _read(path: str) -> list[EvalDataset]:
    import yaml

    from engine.diagnosis import ConfigError, Diagnosis

    def error(what: str, fix: str) -> ConfigError:
        return ConfigError(Diagnosis(code="CONFIG", severity="error", what=f"--eval-config {path}: {what}", fix=fix,
                                     facts={"field": "eval_config", "value": path}))

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise error(f"cannot be read ({e.strerror or e})", "give the path of a YAML file") from None
    except yaml.YAMLError as e:
        raise error(f"is not YAML ({str(e).splitlines()[0]})", "fix the YAML") from None
    example = "eval: {datasets: [{name: aime, path: aime.jsonl}]}"
    if not isinstance(doc, dict) or not isinstance(doc.get("eval"), dict):
        raise error("has no `eval:` mapping at the top", f"write it as slime does: {example}")
    unknown = sorted(set(doc) - {"eval"}) + sorted(set(doc["eval"]) - {"defaults", "datasets"})
    if unknown:
        raise error(f"has keys rollflow does not read: {', '.join(unknown)}",
                    "keep `eval:` with `defaults:` and `datasets:` only")
    defaults = doc["eval"].get("defaults") or {}
    raw = doc["eval"].get("datasets")
    if isinstance(raw, dict):  # name → fields, as slime accepts
        raw = [{"name": name, **(fields or {})} for name, fields in raw.items()]
    if not isinstance(defaults, dict) or not isinstance(raw, list) or not raw:
        raise error("needs `datasets:`, a non-empty list (or mapping by name), and `defaults:` a mapping",
                    f"e.g. {example}")
    out: list[EvalDataset] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise error(f"dataset {i + 1} is {type(entry).__name__} {entry!r}, not a mapping",
                        "give each dataset as {name: ..., path: ...}")
        fields = {**{k: v for k, v in defaults.items() if k not in ("name", "path")},
                  **{k: v for k, v in entry.items() if v is not None}}
        where = f"dataset {entry.get('name', i + 1)!r}"
        try:
            out.append(EvalDataset.model_validate(fields))
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first["loc"]) or "?"
            value = first.get("input")
            raise error(f"{where}: {loc} = {value!r}: {first['msg']}",
                        f"fix {loc} (fields: {', '.join(sorted(_FIELDS))})") from None
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise error(f"names a dataset twice: {names}", "give each dataset its own name (it names eval/<name>_*)")
    return out


_FIELDS = {*(f.alias or name for name, f in EvalDataset.model_fields.items()), "input_key"}
