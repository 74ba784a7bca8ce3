"""Prefect tasks, one module per stage: thin wrappers that call engine.stages and add what only Prefect has
(retries, run names, artifacts). The stages themselves record their metrics and MLflow records."""
from types import SimpleNamespace

from engine.config import RunConfig
from tasks.convert import convert
from tasks.evaluate import evaluate
from tasks.pack import pack
from tasks.place import configured as place_for, place
from tasks.preflight import preflight
from tasks.rollout import rollout
from tasks.save import commit, save
from tasks.sync import sync
from tasks.train import train


def for_run(cfg: RunConfig) -> SimpleNamespace:
    """Every task with this run's options: place with --placement-retries and its backoff, rollout with
    --rollout-retries; the others as defined."""
    return SimpleNamespace(preflight=preflight, place=place_for(cfg), convert=convert, evaluate=evaluate,
                           rollout=rollout.with_options(retries=cfg.rollout_retries), pack=pack, train=train,
                           save=save, commit=commit, sync=sync)


__all__ = ["commit", "convert", "evaluate", "for_run", "pack", "place", "place_for", "preflight", "rollout", "save", "sync",
           "train"]
