"""The doctor: the failure catalog (RF01–RF14), preflight checks and runtime classifiers."""
from engine.diagnosis import ConfigError, Diagnosis, DiagnosisError, render_report

__all__ = ["ConfigError", "Diagnosis", "DiagnosisError", "render_report"]
