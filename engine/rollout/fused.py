"""Fewer, larger kernels for the GPU decode step, without torch.compile (issue 17).

A decode step of a small model at a small batch is bound by how many kernels it launches, not by the bytes they
move: at 64 rows the 0.5B Qwen2's step is ~1,000 kernels of a few microseconds each (bench/results/
gpu_engine_profile.md). transformers' RMSNorm alone is eight of them (cast to fp32, square, mean, add ε, rsqrt,
multiply, cast back, times the weight), 49 times a step. `fuse_rms_norms` gives each RMSNorm module torch's fused
`F.rms_norm` instead (one kernel, or three with `exact`); the engine does so on CUDA (engine/rollout/generation.py):

- `exact=True`: `F.rms_norm(x.float()).to(dtype) * weight` — transformers' own order of roundings (normalise in
  fp32, round to the model's dtype, multiply by the weight in it);
- `exact=False` (the engine's): `F.rms_norm(x, weight)` — one kernel that multiplies by the weight before its
  single rounding.

Neither is bitwise transformers' result (F.rms_norm sums the squares in another order), so a token whose two best
candidates are within a rounding of each other can differ; the engine's log-probs against the trainer's are what
train/mismatch and the RF14 probe measure. On an H200 (bench/results/gpu_fused_norm.json), 64 rows × 128 + 128
tokens of the 0.5B shape: 3.58 ms a decode step with transformers' RMSNorm, 3.20 with `exact`, 2.83 without.

Only the engine's copy of the model is changed (per module instance); the trainer keeps transformers' forward.
"""
from __future__ import annotations

import types


def _is_rms_norm(m) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight") and \
        (hasattr(m, "variance_epsilon") or hasattr(m, "eps"))


def fuse_rms_norms(model, exact: bool = False) -> int:
    """Swap the forward of every RMSNorm module of `model` for the fused one; returns how many were swapped."""
    import torch.nn.functional as F

    def fused_exact(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self._rf_eps).to(x.dtype) * self.weight

    def fused(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self._rf_eps)

    n = 0
    for m in model.modules():
        if _is_rms_norm(m) and getattr(m.weight, "ndim", 0) == 1:
            m._rf_eps = float(getattr(m, "variance_epsilon", None) or getattr(m, "eps"))
            m.forward = types.MethodType(fused_exact if exact else fused, m)
            n += 1
    return n
