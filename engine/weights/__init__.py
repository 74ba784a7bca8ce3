"""Weight sync trainer → rollout engines, two transports, one version counter.

- disk: the trainer writes a versioned safetensors directory (`<work_dir>/weights/v000007/`), every engine loads
  it through `/update_weights_from_disk`, and the directory is deleted once all engines have it.
- tensor (in-cluster): train rank 0 returns its state dict as numpy arrays into Ray's object store, and every
  engine actor receives the reference and copies the arrays into its model (zero-copy reads on the same node;
  Ray moves the bytes between nodes). Nothing goes through the driver or through HTTP: a 193 MB state dict
  through uvicorn's request body took 16-35 s on the loaded 2-core test machine (~10 MB/s), hence this path.
- HTTP tensors (`engine/weights/sync.py:push_tensors`, for engines outside the run's actors): buckets of at most
  `bucket_bytes` POSTed to `/update_weights_from_tensor` as raw safetensors bodies, or in
  SGLang's JSON shape with base64 entries (`load_format="safetensors"`).

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


def pack_tensors(named: dict[str, torch.Tensor]) -> bytes:
    """One bucket → a safetensors blob."""
    from safetensors.torch import save

    return save(named)


def unpack_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(blob)


def encode_tensors(named: dict[str, torch.Tensor]) -> str:
    """One bucket → base64 text of a safetensors blob (a `serialized_named_tensors` entry of SGLang's JSON body)."""
    return base64.b64encode(pack_tensors(named)).decode("ascii")


def decode_tensors(blob: str | bytes) -> dict[str, torch.Tensor]:
    """A JSON entry (base64 text) or a raw safetensors blob (bytes) → named tensors."""
    return unpack_tensors(blob if isinstance(blob, bytes) else base64.b64decode(blob))


def numpy_state(state_dict: dict[str, torch.Tensor]) -> dict[str, "object"]:
    """Tensors → numpy arrays for Ray's object store (zero-copy reads); bf16/fp16 travel as int16 bit patterns
    (numpy has no bfloat16) and `check_and_copy` reinterprets them with the served tensor's dtype."""
    out = {}
    for name, t in unique_tensors(state_dict).items():
        out[name] = (t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    return out


def _as_tensor(x, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    import warnings

    with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(x)
    return t.view(like.dtype) if t.dtype == torch.int16 and like.dtype in (torch.bfloat16, torch.float16) else t


def check_and_copy(model: torch.nn.Module, named: dict[str, "torch.Tensor | object"], *, full: bool) -> int:
    """Copy `named` into the model's parameters/buffers in place; returns bytes copied.

    Every name and shape is checked before anything is copied, so a bad bucket changes nothing. With `full`, every
    model tensor must be present (a tied lm_head may be absent: it is the embedding).
    """
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    named = {k: _as_tensor(v, targets[k]) if k in targets else v for k, v in named.items()}
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
