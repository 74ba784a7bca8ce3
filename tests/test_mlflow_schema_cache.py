"""engine/tracking/schema_cache.py: a fresh local MLflow store starts from the cached schema of the first one (no
migrations), ends up as MLflow would have made it, never replaces a store, and falls back when the cache is bad."""
from __future__ import annotations

import os
import sqlite3

import pytest

from engine.tracking import _mlflow_client, schema_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return schema_cache.template_path()


def rows(db, sql):
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def test_the_first_store_leaves_a_template_and_the_next_starts_from_it(cache, tmp_path, monkeypatch):
    import mlflow.store.db.utils as db_utils

    a = tmp_path / "a" / "mlflow.db"
    monkeypatch.chdir(tmp_path)
    _mlflow_client(f"sqlite:///{a}")  # migrated by MLflow
    assert cache.is_file()
    assert rows(cache, "SELECT COUNT(*) FROM experiments") == [(0,)]  # no experiment 0: MLflow adds the store's own
    assert rows(cache, "SELECT version_num FROM alembic_version") == rows(a, "SELECT version_num FROM alembic_version")

    migrations = []
    monkeypatch.setattr(db_utils, "_initialize_tables", lambda engine: migrations.append(engine))
    b = tmp_path / "b" / "mlflow.db"
    client = _mlflow_client(f"sqlite:///{b}")
    assert migrations == [], "the copied store ran the migrations"
    # experiment 0 as MLflow makes it in a fresh store (its artifact location from the CWD, its own time)
    (exp_a,), (exp_b,) = rows(a, "SELECT * FROM experiments"), rows(b, "SELECT * FROM experiments")
    assert exp_b[:4] == exp_a[:4] and exp_b[6:] == exp_a[6:] and exp_b[4] >= exp_a[4]
    exp = client.create_experiment("x")
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "m", 1.5, step=3)
    assert client.get_metric_history(run.info.run_id, "m")[0].value == 1.5
    assert rows(cache, "SELECT COUNT(*) FROM runs") == [(0,)]  # the template is untouched


def test_never_replaces_an_existing_store(cache, tmp_path):
    _mlflow_client(f"sqlite:///{tmp_path / 'first.db'}")
    db = tmp_path / "mine.db"
    db.write_bytes(b"not a template")
    assert not schema_cache.seed(db)
    assert db.read_bytes() == b"not a template"


def test_a_refused_template_is_dropped_and_the_store_is_made_by_migrations(cache, tmp_path, caplog):
    _mlflow_client(f"sqlite:///{tmp_path / 'first.db'}")
    with sqlite3.connect(cache) as c:  # a template MLflow's schema check refuses (another release's head)
        c.execute("UPDATE alembic_version SET version_num = 'not-a-revision'")
    db = tmp_path / "second.db"
    client = _mlflow_client(f"sqlite:///{db}")
    assert "the cached MLflow schema was refused" in caplog.text
    assert client.get_experiment("0").name == "Default"
    assert rows(db, "SELECT version_num FROM alembic_version") != [("not-a-revision",)]
    assert cache.is_file() and rows(cache, "SELECT version_num FROM alembic_version") != [("not-a-revision",)]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
