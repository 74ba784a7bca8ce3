"""HF ⇄ training checkpoint (torch backend): the round trip gives identical tensors and loads in transformers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import checkpoint
from engine.convert import checkpoint_to_hf, hf_to_checkpoint
from engine.doctor import ConfigError
from flows.cli import main


def tensors(hf_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_round_trip_of_the_bundled_model_is_identical_and_loads(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    rep = hf_to_checkpoint(tiny_model, str(tmp_path / "ckpt"))
    assert checkpoint.read_marker(tmp_path / "ckpt") == 0 and rep.uri.endswith("iter_0000000")
    m = checkpoint.read_manifest(tmp_path / "ckpt", 0)
    assert (m["next_rollout_id"], m["resumable"]) == (0, False)  # starting weights, not a resume point
    assert {"model/model.safetensors", "hf_config/config.json", "hf_config/tokenizer.json"} <= set(m["files"])

    info = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert info["iteration"] == 0 and info["dtype"] == "float32"
    assert_identical(tensors(tiny_model), tensors(tmp_path / "hf"))
    # the same config, except the version stamp that transformers' save_pretrained writes (today's release, not
    # the one that built the bundled model: 5.24.0 → 5.25.0 broke an exact comparison on 2026-12-03)
    got, want = (json.loads(p.read_text()) for p in (tmp_path / "hf" / "config.json", Path(tiny_model) / "config.json"))
    assert got.pop("transformers_version", None) and want.pop("transformers_version", None)
    assert got == want
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (tmp_path / "hf" / name).read_bytes() == (Path(tiny_model) / name).read_bytes(), name
    ids = torch.tensor([[256, 10, 20, 30, 40]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits
    assert torch.equal(a, b)


def test_round_trip_keeps_bf16(tmp_path, tiny_model):
    # bf16 → fp32 (training weights) → bf16 is exact: every bf16 value is an fp32 value
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp_path / "src")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "src")
    hf_to_checkpoint(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    stored = load_file(str(tmp_path / "ckpt" / "iter_0000000" / "model" / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.float32}  # what the trainer trains
    assert checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))["dtype"] == "bfloat16"
    assert_identical(tensors(tmp_path / "src"), tensors(tmp_path / "out"))


def test_cli_converts_both_ways_through_s3(tmp_path, tiny_model, s3_bucket, capsys):
    url = s3_bucket + "/converted"
    assert main(["convert", "--hf-checkpoint", tiny_model, "--save", url]) == 0
    assert main(["convert", "--load", url, "--ckpt-step", "0", "--output-hf", str(tmp_path / "hf")]) == 0
    assert_identical(tensors(tiny_model), tensors(tmp_path / "hf"))
    out = capsys.readouterr().out
    assert f"--load {url}" in out and "51 tensors, float32" in out


def test_convert_refuses_to_overwrite(tmp_path, tiny_model, capsys):
    hf_to_checkpoint(tiny_model, str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError) as e:
        hf_to_checkpoint(tiny_model, str(tmp_path / "ckpt"))  # would move an existing marker
    assert e.value.codes == ["RF05"] and "marker 0" in str(e.value)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("keep me")
    with pytest.raises(ConfigError, match="--output-hf .* is not empty"):
        checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    with pytest.raises(ConfigError) as e:
        checkpoint_to_hf(str(tmp_path / "hf"), str(tmp_path / "hf2"))  # not a checkpoint
    assert e.value.codes == ["RF01"]
    assert main(["convert", "--load", str(tmp_path / "ckpt")]) == 2  # neither conversion: usage error
    assert "rollflow convert --hf-checkpoint HF_DIR --save CKPT_DIR" in capsys.readouterr().err
