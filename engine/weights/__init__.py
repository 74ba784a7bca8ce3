"""Weight sync trainer → rollout engines.

From disk: the trainer writes a versioned safetensors directory (`<work_dir>/weights/v000007/`), every engine
loads it through `/update_weights_from_disk`, and the directory is deleted once all engines have it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch


def save_weights_dir(state_dict: dict[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Write `model.safetensors` atomically (tmp dir + rename). Shared tensors (tied embeddings) are written once."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    seen, tensors = set(), {}
    for name, t in state_dict.items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(tmp / "model.safetensors"))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def load_weights_dir(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
