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
