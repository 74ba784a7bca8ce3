"""Shared pydantic settings for every RunConfig section, and the CONFIG error they raise."""
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A group of flags. Attribute docstrings become `--help` text; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    def changed(self, *names: str) -> dict[str, Any]:
        """{field: value} of those of `names` whose value is not the field's default (a setting given), in order:
        what a check of settings that would do nothing looks at."""
        fields = type(self).model_fields
        return {n: getattr(self, n) for n in names if getattr(self, n) != fields[n].default}


def flag(name: str) -> str:
    """A field's command-line flag: rollout_batch_size → --rollout-batch-size."""
    return "--" + name.replace("_", "-")


def given(values: dict[str, Any]) -> str:
    """`--flag value, …` of {field: value} (`Section.changed`), for a message."""
    return ", ".join(f"{flag(n)} {v}" for n, v in values.items())


def flags(names) -> str:
    """`--flag, …` of field names, for a fix."""
    return ", ".join(flag(n) for n in names)


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
