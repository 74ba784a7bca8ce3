"""Shared pydantic settings for every RunConfig section, and the CONFIG error they raise."""
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A group of flags. Attribute docstrings become `--help` text; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    def changed(self, *names: str) -> dict[str, Any]:
        """{field: value} of those of `names` that are given, in order: what a check of settings that would do
        nothing looks at. Given is a value other than the default, or a flag typed on the command line
        (`user_input`), also at the default's own value: `--tis-clip 2.0` without `--use-tis` does nothing
        either."""
        fields = type(self).model_fields
        named = _USER_GIVEN.get()
        return {n: getattr(self, n) for n in names
                if getattr(self, n) != fields[n].default or (n in named and getattr(self, n) is not None)}


#: The fields typed on the command line, while their config is made (`user_input`); empty for any other config (a
#: YAML file or a flow's `cfg` may be a whole dump of a run's config, where every field is present).
_USER_GIVEN: ContextVar[frozenset[str]] = ContextVar("rollflow_user_given", default=frozenset())


@contextmanager
def user_input(names):
    """Make a config from the command line inside: `Section.changed` then counts `names` as given."""
    token = _USER_GIVEN.set(frozenset(names))
    try:
        yield
    finally:
        _USER_GIVEN.reset(token)


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
