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
from dataclasses import dataclass
from pathlib import Path

import torch

TENSOR_LOAD_FORMAT = "safetensors"


def unique_tensors(state_dict: dict[str, torch.Tensor], device: str = "cpu") -> dict[str, torch.Tensor]:
    """Drop later names of a tensor already present (tied embeddings); detach and move to `device` (CPU by
    default), contiguous."""
    seen, out = set(), {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to(device).contiguous()
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


@dataclass
class HostWeights:
    """A state dict as numpy arrays for Ray's object store (zero-copy reads on the node), with each tensor's dtype.

    numpy has no bfloat16, so bf16/fp16 tensors travel as int16 bit patterns; `dtypes` says how to read them back.
    (Without it a bf16 trainer's int16 bits were copied into a float32 engine as integers — 0.066 became 15751.0 —
    and the engine served garbage after the first Megatron → engine sync.)
    """

    arrays: dict[str, "object"]  # name → numpy array (bf16/fp16: their int16 bit patterns)
    dtypes: dict[str, str]  # name → torch dtype name of the tensor, e.g. "bfloat16"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors, each in the dtype it was sent in (read-only arrays are only read, never written)."""
        import warnings

        out = {}
        with warnings.catch_warnings():  # object-store arrays are read-only; torch warns on from_numpy
            warnings.simplefilter("ignore", UserWarning)
            for name, a in self.arrays.items():
                t = torch.from_numpy(a)
                dtype = getattr(torch, self.dtypes[name])
                out[name] = t.view(dtype) if t.dtype != dtype else t
        return out


def numpy_state(state_dict: dict[str, torch.Tensor]) -> HostWeights:
    """Tensors → HostWeights (numpy arrays + dtypes) for Ray's object store."""
    arrays, dtypes = {}, {}
    for name, t in unique_tensors(state_dict).items():
        narrow = t.dtype in (torch.bfloat16, torch.float16)
        arrays[name] = (t.view(torch.int16) if narrow else t).numpy()
        dtypes[name] = str(t.dtype).removeprefix("torch.")
    return HostWeights(arrays, dtypes)


def check_names(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], *, full: bool) -> dict[str, torch.Tensor]:
    """Every sent name must be a served parameter or buffer with the same shape, by the model's own name or its
    checkpoint's (`engine.weights.layout`: transformers 5 fuses a mixture of experts in memory); with `full`, every
    served parameter must be sent, whole or as all its checkpoint tensors (a tied lm_head is the embedding:
    `named_parameters` lists the tensor once, as `unique_tensors` sends it). Anything else is RF14, listing the
    names: never a partial load. Returns {name: the tensor to copy into}."""
    from engine.diagnosis import Diagnosis, DiagnosisError
    from engine.weights.layout import served_targets

    targets, owner = served_targets(model)
    unknown = sorted(set(shapes) - set(targets))
    bad_shape = [f"{k}: sent {tuple(shapes[k])}, served {tuple(targets[k].shape)}" for k in sorted(shapes)
                 if k in targets and tuple(shapes[k]) != tuple(targets[k].shape)]
    missing = []
    if full:
        parts: dict[str, list[str]] = {}
        for part, whole in owner.items():
            parts.setdefault(whole, []).append(part)
        missing = sorted(k for k, _ in model.named_parameters()
                         if k not in shapes and not (k in parts and all(q in shapes for q in parts[k])))
    if not (unknown or bad_shape or missing):
        return targets
    parts_text = [f"{len(v)} {what}: {', '.join(v[:8])}{' …' if len(v) > 8 else ''}" for what, v in
                  (("names the engine does not serve", unknown), ("shapes that differ", bad_shape),
                   ("served parameters not sent", missing)) if v]
    raise DiagnosisError(Diagnosis(
        code="RF14", severity="error",
        what=f"the weights sent to the engine do not match its model ({len(shapes)} sent, {len(targets)} served): "
             + "; ".join(parts_text) + ". Nothing was loaded.",
        fix="the trainer's weight names must be the engine model's (Hugging Face names): check the weight mapping "
            "of --train-backend and that --hf-checkpoint is the same model for the trainer and the engine",
        facts={"unknown": unknown, "bad_shape": bad_shape, "missing": missing}))


def check_and_copy(model: torch.nn.Module, named: dict[str, torch.Tensor], *, full: bool) -> int:
    """Copy `named` into the model's parameters/buffers in place (cast to each one's device and dtype); returns
    bytes copied. `check_names` runs first, so a bad update changes nothing."""
    targets = check_names(model, {k: tuple(t.shape) for k, t in named.items()}, full=full)
    copied = 0
    with torch.no_grad():
        for k, t in named.items():
            targets[k].copy_(t.to(targets[k].device, targets[k].dtype))
            copied += t.numel() * t.element_size()
    return copied
