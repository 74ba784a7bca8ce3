"""Weight sync between processes on the same GPU: CUDA IPC handles to flattened buckets (no copy through the host).

The shape is SGLang's `/update_weights_from_tensor` with `load_format="flattened_bucket"` (what slime's colocated
path sends): per bucket one contiguous tensor in the engine's dtype and the metadata of the named tensors in it,
`{name, shape, dtype, start_idx, end_idx, numel}`. Only a handle to the bucket's GPU memory travels, not its bytes;
the engine opens the handle and copies out of it on the device.

Lifetime: the sender keeps every bucket alive (`IpcExport.buffers`) until the receiver has copied all of them and
synchronised; then the sender drops them (`release`). A handle names a device by the sender's index, and two
processes can number the same GPU differently (Ray narrows CUDA_VISIBLE_DEVICES per actor), so the handle carries
the GPU's UUID and the receiver opens it on its own index of that GPU.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch

#: position of the device index in torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments
_DEVICE_ARG = 6


@dataclass
class Bucket:
    """One flattened bucket as the receiver gets it: `payload` is the pickled IPC handle, `metadata` says what is in it."""

    payload: bytes
    metadata: list[dict]  # [{name, shape, dtype, start_idx, end_idx, numel}], offsets in elements of the flat tensor
    dtype: str
    nbytes: int


@dataclass
class IpcExport:
    """What a sender holds until the receiver is done."""

    buckets: list[Bucket] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def flatten_buckets(named: dict[str, torch.Tensor], dtype: torch.dtype, bucket_bytes: int
                    ) -> list[tuple[torch.Tensor, list[dict]]]:
    """Named tensors (one device) → [(flat [N] tensor in `dtype`, metadata)], each flat ≤ bucket_bytes unless a
    single tensor is larger. Pure torch: runs on CPU in tests."""
    out: list[tuple[torch.Tensor, list[dict]]] = []
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    esize = torch.empty((), dtype=dtype).element_size()

    def close() -> None:
        meta, start = [], 0
        for name, t in cur:
            meta.append({"name": name, "shape": list(t.shape), "dtype": str(dtype).removeprefix("torch."),
                         "start_idx": start, "end_idx": start + t.numel(), "numel": t.numel()})
            start += t.numel()
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for _, t in cur])  # [N] one new buffer
        out.append((flat, meta))

    for name, t in named.items():
        n = t.numel() * esize
        if cur and size + n > bucket_bytes:
            close()
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        close()
    return out


def unflatten(flat: torch.Tensor, metadata: list[dict]) -> dict[str, torch.Tensor]:
    """The named views of a flat bucket (no copy)."""
    return {m["name"]: flat[m["start_idx"]:m["end_idx"]].view(m["shape"]) for m in metadata}


def export(named: dict[str, torch.Tensor], dtype: torch.dtype, bucket_bytes: int) -> IpcExport:
    """CUDA tensors → buckets with IPC handles; keep the returned IpcExport alive until the receiver is done."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = IpcExport()
    for flat, meta in flatten_buckets(named, dtype, bucket_bytes):
        if not flat.is_cuda:
            raise ValueError("CUDA IPC needs CUDA tensors; this trainer's weights are on the CPU")
        _rebuild, args = reduce_tensor(flat)
        uuid = str(torch.cuda.get_device_properties(flat.device).uuid)
        out.buffers.append(flat)
        out.buckets.append(Bucket(payload=pickle.dumps((uuid, args)), metadata=meta,
                                  dtype=str(dtype).removeprefix("torch."), nbytes=flat.numel() * flat.element_size()))
    if out.buffers:  # the copies into the buckets are done before the receiver reads them
        torch.cuda.synchronize(out.buffers[0].device)
    return out


def local_index(uuid: str) -> int:
    """This process's CUDA index of the GPU with `uuid`."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"GPU {uuid} (the sender's) is not visible in this process: CUDA IPC needs both processes "
                       "on the same GPU (colocated); use --weight-sync-method disk otherwise")


def open_bucket(bucket: Bucket) -> torch.Tensor:
    """The sender's flat bucket, mapped into this process (valid until this tensor is freed)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid, args = pickle.loads(bucket.payload)
    args = list(args)
    args[_DEVICE_ARG] = local_index(uuid)
    return rebuild_cuda_tensor(*args)
