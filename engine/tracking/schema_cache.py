"""A new SQLite MLflow store without MLflow's schema migrations (issue 18, start-up).

MLflow creates a local store by running its ~60 alembic migrations one by one: 1.5–2.5 s of one core at every
fresh `--work-dir`, on the start-up path (the GIL it holds slows the imports beside it). The result depends only on
MLflow's release, so the first store a release creates is kept, emptied, as a template
(`$XDG_CACHE_HOME/rollflow/mlflow-<version>-schema.db`, default `~/.cache/…`), and a later fresh store starts as a
copy of it (~0.04 s). The template has MLflow's tables, its `alembic_version` and its default workspace row, but no
experiment: MLflow itself then creates experiment 0 in the new store, with that store's artifact location and
creation time, exactly as in a migrated one.

Never over data: the copy is linked into place only where no file is (a store created meanwhile wins), and a store
that was copied but does not open (MLflow's schema check) is removed, with the template, before MLflow creates
it the usual way. The cache is an optimisation only; any failure falls back to the migrations.
"""
from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
from importlib import metadata
from pathlib import Path

log = logging.getLogger("rollflow.tracking")


def template_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollflow"
    return root / f"mlflow-{metadata.version('mlflow')}-schema.db"


def _tmp(next_to: Path) -> Path:
    return next_to.with_name(f".{next_to.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def seed(db: Path) -> bool:
    """Start the store `db` as a copy of the template when `db` does not exist yet. True when it did."""
    try:
        template = template_path()
        if db.exists() or not template.is_file():
            return False
        db.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp(db)
        try:
            shutil.copyfile(template, tmp)
            os.link(tmp, db)  # fails if db exists by now: never replaces a store
            return True
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, metadata.PackageNotFoundError) as e:  # FileExistsError included: a store made meanwhile
        log.debug("rollflow: MLflow schema template not used for %s (%s)", db, e)
        return False


def forget(db: Path) -> None:
    """A copied store that MLflow refused: remove it (nothing was written to it) and the template it came from."""
    for path in (db, template_path()):
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("rollflow: could not remove %s (%s)", path, e)


def remember(db: Path) -> bool:
    """After MLflow created and migrated `db` (no run in it yet): keep its schema as the template, unless one
    exists. True when written."""
    try:
        template = template_path()
        if template.exists():
            return False
        template.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp(template)
        try:
            src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            dst = sqlite3.connect(tmp)
            try:
                src.backup(dst)  # a consistent copy even with MLflow's engine open on db
                if dst.execute("SELECT COUNT(*) FROM runs").fetchone()[0]:
                    return False  # not a fresh store after all
                dst.execute("DELETE FROM experiments WHERE experiment_id = 0 AND name = 'Default'")
                if dst.execute("SELECT COUNT(*) FROM experiments").fetchone()[0]:
                    return False
                dst.commit()
            finally:
                src.close()
                dst.close()
            os.replace(tmp, template)
            return True
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, sqlite3.Error, metadata.PackageNotFoundError) as e:
        log.debug("rollflow: MLflow schema template not written from %s (%s)", db, e)
        return False
