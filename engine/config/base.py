"""Shared pydantic settings for every RunConfig section."""
from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A group of flags. Attribute docstrings become `--help` text; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
