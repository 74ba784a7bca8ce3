"""rl-export-hf (flows/export.py): a committed checkpoint → a Hugging Face directory, the trigger example's flow."""
from __future__ import annotations

import pytest

from engine.doctor import ConfigError
from flows.export import export_path, export_source


def test_an_iteration_uri_names_the_save_dir_and_the_step():
    assert export_source("s3://b/run/iter_0000012", None) == ("s3://b/run", 12)
    assert export_source("/ckpt/run/iter_0000003/", 3) == ("/ckpt/run", 3)
    assert export_source("/ckpt/run/", 7) == ("/ckpt/run", 7)  # a --save dir + iteration
    assert export_source("/ckpt/run", None) == ("/ckpt/run", None)  # the marker's iteration
    with pytest.raises(ConfigError, match="iteration 3 but iteration = 4"):
        export_source("/ckpt/run/iter_0000003", 4)


def test_exports_of_two_runs_never_share_a_directory(tmp_path):
    a, b = export_path("out", str(tmp_path / "x" / "ckpt"), 5), export_path("out", str(tmp_path / "y" / "ckpt"), 5)
    assert a != b and a.name == b.name == "iter_0000005" and a.parent.name.startswith("ckpt-")


@pytest.mark.slow
def test_export_flow_writes_a_loadable_model_once(prefect_harness, tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file

    from engine.convert import hf_to_checkpoint
    from flows.export import rl_export_hf

    save = str(tmp_path / "ckpt")
    hf_to_checkpoint(tiny_model, save)  # iter_0000000 + marker 0
    first = rl_export_hf(save, output_dir=str(tmp_path / "hf"))
    out = export_path(str(tmp_path / "hf"), save, 0)
    assert first["exported"] and first["output_hf"] == str(out.resolve())
    got, want = load_file(out / "model.safetensors"), load_file(f"{tiny_model}/model.safetensors")
    assert got.keys() <= want.keys() and all(torch.equal(got[k], want[k]) for k in got)  # the same weights
    again = rl_export_hf(f"{save}/iter_0000000", 0, output_dir=str(tmp_path / "hf"))  # a duplicate event
    assert not again["exported"] and again["output_hf"] == str(out)
    with pytest.raises(ConfigError, match="has no latest_checkpointed_iteration.txt"):
        rl_export_hf(str(tmp_path / "empty"), output_dir=str(tmp_path / "hf"))


def test_the_export_folder_names_one_save_however_spelled_and_no_secret(tmp_path, monkeypatch):
    import re

    from flows.export import save_slug

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    names = {save_slug(p) for p in ("runs/ckpt", "./runs/ckpt/", str(tmp_path / "runs" / "ckpt"), "runs/../runs/ckpt")}
    assert len(names) == 1 and next(iter(names)).startswith("ckpt-")
    assert save_slug("s3://b/run/") == save_slug("s3://b/run") != save_slug("s3://other/run")
    weird = save_slug(str(tmp_path / "Weird Name!%/x"))
    assert re.fullmatch(r"[a-z0-9-]+", weird) and save_slug("/").startswith("root-")
    for save in ("s3://bucket/run?sig=SeCrEtSiG0123456789&x=1", "https://user:Pa55w0rdXYZ@host/ckpt"):
        assert "SeCrEtSiG" not in save_slug(save) and "Pa55w0rd" not in save_slug(save)
