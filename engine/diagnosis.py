"""Diagnoses are data: a stable code, a severity, what was found (with the numbers) and the exact fix."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Diagnosis(BaseModel):
    model_config = ConfigDict(frozen=True)

    code: str
    """Catalog code, e.g. "RF02"."""
    severity: Literal["error", "warning", "info"]
    what: str
    """What was found, with the numbers and paths: "asked 16 GPUs (8 train + 8 rollout), cluster has 8"."""
    fix: str
    """The exact fix, with flags and values: "--colocate, or --rollout-num-gpus 0"."""
    facts: dict[str, Any] = {}
    """The raw numbers behind `what`, for JSON output and MLflow."""

    def render(self) -> str:
        return f"[{self.code} {self.severity}] {self.what}\n    fix: {self.fix}"


def render_report(diagnoses: list[Diagnosis]) -> str:
    """Errors first, then warnings, then info; one block per diagnosis."""
    order = {"error": 0, "warning": 1, "info": 2}
    ranked = sorted(diagnoses, key=lambda d: (order[d.severity], d.code))
    return "\n".join(d.render() for d in ranked)


class DiagnosisError(Exception):
    """Raised when a check or a runtime classifier finds an error; carries the diagnoses. Not retried unless a
    subclass says `retryable` (e.g. RF02 busy GPUs: a later attempt may find them free)."""

    retryable = False

    def __init__(self, diagnoses: list[Diagnosis] | Diagnosis):
        self.diagnoses = [diagnoses] if isinstance(diagnoses, Diagnosis) else list(diagnoses)
        super().__init__(render_report(self.diagnoses))

    def __reduce__(self):  # picklable across Ray / processes: rebuild from the diagnoses, not the message
        return (type(self), (self.diagnoses,))

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnoses]


class ConfigError(DiagnosisError):
    """The configuration can never work: never retried. Not a ValueError, so pydantic does not wrap it."""
