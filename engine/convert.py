"""HF ⇄ training checkpoint for the torch backend (the megatron backend adds its own weight mapping later).

The torch backend's `model/` holds the HF-named state dict in fp32 (what the trainer trains), so both ways are a
load and a save:
    HF → checkpoint   from_pretrained (any shard layout, transformers' key renames) → fp32 state dict →
                      iter_0000000/model/ + hf_config/; manifest next_rollout_id = 0 (starting weights, not a
                      resume) and resumable = false (no optimizer state)
    checkpoint → HF   hf_config/config.json → model; model/ weights (strict: only a tied lm_head may be absent);
                      cast to the config's dtype; save_pretrained + the tokenizer files from hf_config/
The round trip HF → checkpoint → HF gives identical tensors: fp32 → fp32 is exact, and so is bf16 → fp32 → bf16
(every bf16 value is an fp32 value).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.checkpoint import SaveReport, Store, iter_name, materialize, read_marker, rf01, save_iteration
from engine.diagnosis import ConfigError, Diagnosis

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")


def copy_hf_config(hf_dir: str | Path, dest: str | Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy the non-weight files at the top of an HF directory (config, generation config, tokenizer, template)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(Path(hf_dir).iterdir()):
        if (p.is_file() and not p.name.startswith(".") and p.name not in skip
                and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.endswith(".index.json")):
            shutil.copy2(p, dest / p.name)
            copied.append(p.name)
    return copied


def hf_to_checkpoint(hf_dir: str, save: str, *, staging: str | Path | None = None) -> SaveReport:
    """`rollflow convert --hf-checkpoint HF --save DIR`: HF weights → DIR/iter_0000000 + marker 0."""
    from engine.modeling import load_causal_lm
    from engine.weights import save_weights_dir

    if not (Path(hf_dir) / "config.json").is_file():
        raise ConfigError(Diagnosis(code="RF01", severity="error",
                                    what=f"--hf-checkpoint {hf_dir}: no config.json (not a Hugging Face directory)",
                                    fix="--hf-checkpoint a local directory written by save_pretrained"))
    from engine.checkpoint.writer import writer_lock

    store = Store(save)
    with writer_lock(save, run="rollflow convert"):  # a training run writing the same --save would collide
        if (marker := read_marker(store)) is not None:
            raise ConfigError(Diagnosis(code="RF05", severity="error",
                                        what=f"--save {store.url} already holds a checkpoint (marker {marker}); "
                                             "converting into it would replace iter_0000000 and move the marker",
                                        fix="--save an empty directory for the converted weights"))
        state = load_causal_lm(hf_dir).state_dict()  # fp32, the names the trainer uses

        def write_state(path: str) -> None:
            save_weights_dir(state, Path(path) / "model")
            copy_hf_config(hf_dir, Path(path) / "hf_config")

        manifest = {"train_backend": "torch", "next_rollout_id": 0, "resumable": False,
                    "converted_from": str(Path(hf_dir).resolve()), "hf_checkpoint": str(Path(hf_dir).resolve()),
                    "origin": None}
        with tempfile.TemporaryDirectory(prefix="rollflow-convert-") as tmp:
            return save_iteration(store, 0, write_state, manifest, staging=staging or tmp)


def checkpoint_to_hf(load: str, output_hf: str, *, ckpt_step: int | None = None, hf_checkpoint: str | None = None,
                     staging: str | Path | None = None) -> dict[str, Any]:
    """`rollflow convert --load DIR [--ckpt-step N] --output-hf OUT`: a verified iteration → an HF directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.modeling import _quiet_transformers
    from engine.weights import load_weights_dir

    _quiet_transformers()
    out = Path(output_hf)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=f"--output-hf {out} is not empty",
                                    fix="--output-hf a new directory (nothing is overwritten)"))
    store = Store(load)
    it = ckpt_step if ckpt_step is not None else read_marker(store)
    if it is None:
        raise ConfigError(rf01("--load", store))
    with tempfile.TemporaryDirectory(prefix="rollflow-convert-") as tmp:
        local, manifest, problem = materialize(store, it, staging or tmp)
        if problem:
            raise ConfigError(Diagnosis(code="RF01", severity="error", what=f"--load {store.url}: {problem}",
                                        fix="--ckpt-step an iteration that is complete, or restore the files"))
        config_dir = local / "hf_config" if (local / "hf_config" / "config.json").is_file() else hf_checkpoint
        if config_dir is None:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                        what=f"{store.uri(iter_name(it))} has no hf_config/ (saved before it existed)",
                                        fix="--hf-checkpoint DIR of the model it was trained from (for config.json "
                                            "and the tokenizer)"))
        config = AutoConfig.from_pretrained(config_dir)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
        missing, unexpected = model.load_state_dict(load_weights_dir(local / "model"), strict=False)
        bad = [k for k in missing if not k.endswith("lm_head.weight")]
        if bad or unexpected:
            raise ConfigError(Diagnosis(code="RF01", severity="error",
                                        what=f"{store.uri(iter_name(it))}/model does not match "
                                             f"{config_dir}/config.json: missing {bad[:5]}, unexpected "
                                             f"{unexpected[:5]}",
                                        fix="--hf-checkpoint the model this checkpoint was trained from"))
        dtype = getattr(config, "dtype", None) or torch.float32
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        tmp_out = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp_out, ignore_errors=True)
        model.save_pretrained(tmp_out)
        copy_hf_config(config_dir, tmp_out, skip=("config.json",))
        if out.exists():
            out.rmdir()
        tmp_out.rename(out)
    return {"iteration": it, "source": store.uri(iter_name(it)), "output_hf": str(out.resolve()),
            "dtype": str(dtype).removeprefix("torch."), "tensors": len(model.state_dict())}
