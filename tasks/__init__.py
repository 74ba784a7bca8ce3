"""Prefect tasks, one module per stage: thin wrappers that call engine.stages, set retries, run names,
timeouts and artifacts."""
from tasks.convert import convert
from tasks.evaluate import evaluate
from tasks.pack import pack
from tasks.place import place
from tasks.preflight import preflight
from tasks.rollout import rollout
from tasks.save import save
from tasks.sync import sync
from tasks.train import train

__all__ = ["convert", "evaluate", "pack", "place", "preflight", "rollout", "save", "sync", "train"]
