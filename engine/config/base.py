"""Shared pydantic settings for every RunConfig section, and the CONFIG error they raise."""
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A group of flags. Attribute docstrings become `--help` text; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def config_error(what: str, fix: str, **facts: Any):
    """A CONFIG ConfigError naming what is wrong, the fix and the facts (the field, its value)."""
    from engine.diagnosis import ConfigError, Diagnosis

    return ConfigError(Diagnosis(code="CONFIG", severity="error", what=what, fix=fix, facts=facts))


def json_object(v: Any, example: str) -> Any:
    """A dict flag's value: the command line's JSON text parsed (empty text: {}), a YAML file's dict as it is;
    anything else a ValueError naming `example` (the field's validator turns it into a CONFIG error)."""
    import json

    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e.msg}); pass an object such as '{example}'") from None
    if not isinstance(v, dict):
        raise ValueError(f"a JSON object is needed, got {type(v).__name__}; e.g. '{example}'")
    return v
