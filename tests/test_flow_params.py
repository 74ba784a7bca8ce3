"""The rl-train flow's parameters (flows/params.py) and the deployment files that feed them (prefect.yaml,
deployments/*.yaml): a YAML file with `cfg` overrides on top, errors that name the parameter and the fix."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from engine.config import RunConfig
from engine.doctor import ConfigError
from flows.params import CfgParam, run_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cfg_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("experiment_name: from-file\nrollout_batch_size: 8\nn_samples_per_prompt: 8\n"
                 "global_batch_size: 64\nlr: 3.0e-4\n")
    return str(f)


def test_overrides_win_over_the_file_and_the_file_over_defaults(cfg_file):
    cfg = run_config({"num_rollout": 2, "rollout-batch-size": 4, "global_batch_size": 32}, cfg_file)
    assert (cfg.num_rollout, cfg.rollout_batch_size, cfg.global_batch_size) == (2, 4, 32)  # overrides, dashed too
    assert (cfg.experiment_name, cfg.n_samples_per_prompt, cfg.lr) == ("from-file", 8, 3e-4)  # the file
    assert cfg.rollout_max_response_len == RunConfig.model_fields["rollout_max_response_len"].default


def test_a_runconfig_with_a_file_overrides_only_the_fields_it_was_given(cfg_file):
    cfg = run_config(RunConfig(num_rollout=3), cfg_file)
    assert (cfg.num_rollout, cfg.experiment_name, cfg.global_batch_size) == (3, "from-file", 64)


def test_without_a_file_cfg_is_the_whole_config():
    given = RunConfig(num_rollout=3)
    assert run_config(given, None) is given
    assert run_config({"num_rollout": 5}, None).num_rollout == 5


def test_a_partial_override_stays_a_dict_through_parameter_validation():
    """G = 16 alone is valid, but {B·n = 4·4 from another file, G = 48} only fails once merged: Prefect must not
    validate the overrides as a RunConfig on their own (left_to_right union)."""
    from pydantic import TypeAdapter

    ta = TypeAdapter(CfgParam)
    assert ta.validate_python({"global_batch_size": 48}) == {"global_batch_size": 48}
    given = RunConfig(num_rollout=3)
    assert ta.validate_python(given) is given


def test_an_override_that_disagrees_with_the_file_is_rf06(cfg_file):
    # B·n = 8·8 = 64 samples per rollout; G = 48 does not divide 64
    with pytest.raises(ConfigError) as e:
        run_config({"global_batch_size": 48}, cfg_file)
    assert e.value.codes == ["RF06"] and "48" in str(e.value)


def test_missing_file_names_the_parameter_the_path_the_directory_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        run_config(None, "deployments/nope.yaml")
    msg = str(e.value)
    assert "config deployments/nope.yaml: no such file" in msg and str(tmp_path) in msg
    assert "deployments/demo.yaml" in msg  # the fix shows a path that works


def test_unknown_key_in_the_file_names_the_parameter_and_suggests(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("n_sample_per_prompt: 4\n")
    with pytest.raises(ConfigError) as e:
        run_config(None, str(f))
    assert f"config {f}: unknown key 'n_sample_per_prompt'" in str(e.value)
    assert "did you mean key n_samples_per_prompt" in str(e.value)


def test_bad_override_value_names_the_field_and_value(cfg_file):
    with pytest.raises(ConfigError) as e:
        run_config({"num_rollout": -1}, cfg_file)
    assert "--num-rollout (field num_rollout) = -1" in str(e.value)


def test_neither_parameter_is_an_error_with_the_fix():
    with pytest.raises(ConfigError) as e:
        run_config(None, None)
    assert "config=" in e.value.diagnoses[0].fix and "cfg=" in e.value.diagnoses[0].fix


def test_every_deployment_in_prefect_yaml_points_at_a_flow_and_a_loadable_config(monkeypatch):
    """prefect.yaml's entrypoints import and name a flow; their `config` files load (relative to the repository
    root, where the pull step puts the worker); the cron example ships inactive."""
    monkeypatch.chdir(ROOT)
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert "rl-train" in deployments
    for d in deployments.values():
        module, fn = d["entrypoint"].split(":")
        flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), fn)
        assert hasattr(flow, "fn") and hasattr(flow, "name"), f"{d['entrypoint']} is not a Prefect flow"
        assert d["work_pool"]["name"] == "rollflow-process"
        if "config" in d.get("parameters", {}):
            cfg = run_config(d["parameters"].get("cfg"), d["parameters"]["config"])
            assert cfg.save and not cfg.progress  # a worker has no terminal; its runs get a save limit
    assert [s["active"] for s in deployments["rl-train"]["schedules"]] == [False]
    assert any("prefect.deployments.steps.set_working_directory" in step for step in spec["pull"])


def test_every_config_file_in_deployments_loads():
    files = sorted((ROOT / "deployments").glob("*.yaml"))
    assert files, "deployments/ holds the deployments' parameter files"
    for f in files:
        assert isinstance(run_config(None, str(f)), RunConfig)


def test_a_bad_config_file_fails_the_flow_run_with_the_message(prefect_harness, tmp_path):
    """The flow-run name cannot be computed either; the run must still end Failed with the message, not Pending."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.train import rl_train

    bad = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no such file"):
        rl_train(config=bad)

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=["rollflow/invalid-config"])))

    (fr,) = [r for r in asyncio.run(read()) if r.parameters.get("config") == bad]
    assert fr.state.is_failed() and f"config {bad}: no such file" in fr.state.message
