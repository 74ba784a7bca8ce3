"""rollflow's library: plain Python + PyTorch + Ray. Never imports prefect, flows or tasks.

Importing a submodule stays light: math and config modules do not start Ray or load transformers.
"""
from pathlib import Path

from . import startgc as _startgc

#: The repository root (where `examples/` lives when running from a clone or an editable install).
PROJECT_ROOT = Path(__file__).resolve().parent.parent

# A Ray worker that rollflow started for an actor (the train workers, the engines): its start-up (the actor's
# imports of torch and transformers, the model load) runs without the cyclic collector; the actor's setup turns it
# back on (engine/startgc.py). Without ROLLFLOW_DEFER_GC=1 in the environment this does nothing.
_startgc.defer_if_asked()
