"""Shared fixtures: the bundled tiny model, a session-scoped Prefect test harness, small run configs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from engine.config.data import BUNDLED_MODEL, BUNDLED_TEST, BUNDLED_TRAIN  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model() -> str:
    assert (Path(BUNDLED_MODEL) / "config.json").is_file(), "the bundled model is missing: see examples/README.md"
    return BUNDLED_MODEL


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture
def small_cfg(tmp_path, tiny_model):
    """A run small enough for CI: B=4 prompts × n=4 samples, 2 rollouts, short responses."""
    from engine.config import RunConfig

    def make(**over):
        base = dict(hf_checkpoint=tiny_model, prompt_data=BUNDLED_TRAIN, eval_prompt_data=BUNDLED_TEST,
                    eval_max_samples=16, apply_chat_template=True, rollout_batch_size=4, n_samples_per_prompt=4,
                    num_rollout=2, rollout_max_response_len=8, lr=1e-4, micro_batch_size=4,
                    work_dir=str(tmp_path / "work"), save=str(tmp_path / "ckpt"), progress=False,
                    experiment_name="tests")
        base.update(over)
        return RunConfig(**base)

    return make
