"""CUDA facts a process reports about itself (no-ops without CUDA, so CPU runs import this freely)."""
from __future__ import annotations


def gpu_memory(reset: bool = True) -> dict[str, float]:
    """This process's CUDA memory in GiB — `peak_gib` (the most its allocator held since the last reset) and
    `now_gib` — or {} when it has not used CUDA. Reserved, not allocated: reserved memory is what another process
    on the same GPU cannot use."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    out = {"peak_gib": torch.cuda.max_memory_reserved() / 2**30, "now_gib": torch.cuda.memory_reserved() / 2**30}
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return out
