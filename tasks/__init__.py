"""Prefect tasks, one module per stage: thin wrappers that call engine.stages, set retries, run names,
timeouts and artifacts."""
from tasks.convert import convert
from tasks.evaluate import evaluate
from tasks.pack import pack
from tasks.place import configured as place_for, place
from tasks.preflight import preflight
from tasks.rollout import configured as rollout_for, rollout
from tasks.save import save
from tasks.sync import sync
from tasks.train import train

__all__ = ["convert", "evaluate", "pack", "place", "place_for", "preflight", "rollout", "rollout_for", "save", "sync",
           "train"]
