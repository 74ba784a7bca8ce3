"""rollflow's library: plain Python + PyTorch + Ray. Never imports prefect, flows or tasks.

Importing a submodule stays light: math and config modules do not start Ray or load transformers.
"""
from pathlib import Path

#: The repository root (where `examples/` lives when running from a clone or an editable install).
PROJECT_ROOT = Path(__file__).resolve().parent.parent
