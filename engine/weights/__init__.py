"""Weight sync trainer → rollout engines, two transports, one version counter.

- disk: the trainer writes a versioned safetensors directory (`<work_dir>/weights/v000007/`), every engine loads
  it through `/update_weights_from_disk`, and the directory is deleted once all engines have it.
- tensor: the trainer (rank 0, inside the cluster) cuts its state dict into buckets of at most
  `--update-weight-buffer-size` bytes and POSTs each to every engine's `/update_weights_from_tensor` as a
  base64 safetensors blob (`load_format="safetensors"`); the last bucket carries the new `weight_version`.

Both sides count versions: the run's `weight_version` (= rollout_id + 1 after rollout_id's train step) and the
engine's, reported by `/get_model_info` and in every response's `meta_info.weight_version`. A sync succeeds only
when every engine reports the new version.

Tied weights (embed_tokens ≡ lm_head) are one tensor and are sent once, under the first name.
"""
from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import torch

TENSOR_LOAD_FORMAT = "safetensors"


def unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names of a tensor already present (tied embeddings); detach and move to CPU, contiguous."""
    seen, out = set(), {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return out


def save_weights_dir(state_dict: dict[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Write `model.safetensors` atomically (tmp dir + rename). Shared tensors (tied embeddings) are written once."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(unique_tensors(state_dict), str(tmp / "model.safetensors"))
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


def buckets(state_dict: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split into consecutive buckets of at most max_bytes each (a tensor larger than that is alone in its bucket).

    e.g. sizes [4, 4, 4] MB with max 8 MB → [[a, b], [c]].
    """
    out: list[dict[str, torch.Tensor]] = []
    cur: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in unique_tensors(state_dict).items():
        n = t.numel() * t.element_size()
        if cur and size + n > max_bytes:
            out.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += n
    if cur:
        out.append(cur)
    return out


def encode_tensors(named: dict[str, torch.Tensor]) -> str:
    """One bucket → base64 text of a safetensors blob (the `serialized_named_tensors` entry)."""
    from safetensors.torch import save

    return base64.b64encode(save(named)).decode("ascii")


def decode_tensors(blob: str | bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(base64.b64decode(blob))


def check_and_copy(model: torch.nn.Module, named: dict[str, torch.Tensor], *, full: bool) -> int:
    """Copy `named` into the model's parameters/buffers in place; returns bytes copied.

    Every name and shape is checked before anything is copied, so a bad bucket changes nothing. With `full`, every
    model tensor must be present (a tied lm_head may be absent: it is the embedding).
    """
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    unknown = sorted(set(named) - set(targets))
    bad_shape = [f"{k}: {tuple(named[k].shape)} vs served {tuple(targets[k].shape)}" for k in named
                 if k in targets and tuple(named[k].shape) != tuple(targets[k].shape)]
    missing = [k for k in dict(model.named_parameters()) if k not in named and not k.endswith("lm_head.weight")] \
        if full else []
    if unknown or bad_shape or missing:
        raise ValueError(f"weights do not match the served model: unknown {unknown[:5]}, shape mismatch "
                         f"{bad_shape[:3]}, missing {missing[:5]}")
    copied = 0
    with torch.no_grad():
        for k, t in named.items():
            targets[k].copy_(t.to(targets[k].device, targets[k].dtype))
            copied += t.numel() * t.element_size()
    return copied
