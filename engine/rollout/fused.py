"""Fewer, larger kernels for the GPU decode step, without torch.compile (issue 17).

A decode step of a small model at a small batch is bound by how many kernels it launches, not by the bytes they
move: at 64 rows the 0.5B Qwen2's step is ~1,000 kernels of a few microseconds each (bench/results/
gpu_engine_profile.md). transformers' RMSNorm alone is eight of them (cast to fp32, square, mean, add ε, rsqrt,
multiply, cast back, times the weight), 49 times a step. `fuse_rms_norms` gives each RMSNorm module torch's fused
`F.rms_norm` instead (one kernel, or three with `exact`); the engine does so on CUDA (engine/rollout/generation.py),
for each module whose own forward gives the same on a probe (Gemma's x̂ · (1 + w) keeps transformers' forward):

- `exact=True`: `F.rms_norm(x.float()).to(dtype) * weight` — transformers' own order of roundings (normalise in
  fp32, round to the model's dtype, multiply by the weight in it);
- `exact=False` (the engine's): `F.rms_norm(x, weight)` — one kernel that multiplies by the weight before its
  single rounding.

Neither is bitwise transformers' result (F.rms_norm sums the squares in another order), so a token whose two best
candidates are within a rounding of each other can differ; the engine's log-probs against the trainer's are what
train/mismatch and the RF14 probe measure. On an H200 (bench/results/gpu_fused_norm.json), 64 rows × 128 + 128
tokens of the 0.5B shape: 3.53 ms a decode step with transformers' RMSNorm, 3.18 with `exact`, 2.82 without.

The RMSNorms of the engine's copy of the model are changed (per module instance); the trainer keeps transformers'
forward. The rotary function is the modeling module's, shared by the process, and gives transformers' result.

`fuse_rotary` runs the rotary embedding as one Triton kernel for q and one for k (ten elementwise kernels a layer →
two) with transformers' roundings: bitwise transformers' result (every row drew the same tokens with the same
log-probs). On an H200 (bench/results/gpu_fused_norm.json, 0.5B shape, 64 rows × 128 + 128 tokens, ms a decode
step): transformers' modules 3.53, rotary fused 3.06, RMSNorm fused 2.82, both (the engine's default on CUDA) 2.34.
"""
from __future__ import annotations

import logging
import types

log = logging.getLogger("rollflow.rollout")


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

    n, other = 0, set()
    for m in model.modules():
        if _is_rms_norm(m) and getattr(m.weight, "ndim", 0) == 1:
            m._rf_eps = float(getattr(m, "variance_epsilon", None) or getattr(m, "eps"))
            fn = fused_exact if exact else fused
            if not _computes_the_same(m, fn):
                other.add(type(m).__name__)
                continue
            m.forward = types.MethodType(fn, m)
            n += 1
    if other:
        log.info("RMSNorm modules left to transformers (their formula is not x̂ · w, e.g. Gemma's x̂ · (1 + w)): %s",
                 ", ".join(sorted(other)))
    return n


def _computes_the_same(m, fn) -> bool:
    """Whether `fn` gives what the module's class gives, on 8 random rows in the module's dtype and device (within a
    bf16 rounding): an RMSNorm of another formula (Gemma's x̂ · (1 + w), a bias) keeps transformers' forward."""
    import torch

    w = m.weight
    x = torch.randn(8, w.shape[0], generator=torch.Generator().manual_seed(0)).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        want, got = type(m).forward(m, x).float(), fn(m, x).float()
    return bool(torch.allclose(got, want, rtol=2 ** -6, atol=1e-3))


_ROPE_KERNEL = None


def _rope_kernel():
    """The Triton kernel of `rotary`, built on first use (Triton ships with CUDA builds of torch; never on a CPU)."""
    global _ROPE_KERNEL
    if _ROPE_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def rope(x_ptr, cos_ptr, sin_ptr, out_ptr, H, S, sxb, sxh, sxs, scb, scs, ssb, sss,
                 HALF: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr):
            pid = tl.program_id(0)
            s = pid % S
            h = (pid // S) % H
            b = pid // (S * H)
            i = tl.arange(0, BLOCK)
            m = i < HALF
            xp = x_ptr + b * sxb + h * sxh + s * sxs
            x1 = tl.load(xp + i, mask=m).to(tl.float32)
            x2 = tl.load(xp + HALF + i, mask=m).to(tl.float32)
            cp = cos_ptr + b * scb + s * scs
            sp = sin_ptr + b * ssb + s * sss
            c1 = tl.load(cp + i, mask=m).to(tl.float32)
            c2 = tl.load(cp + HALF + i, mask=m).to(tl.float32)
            s1 = tl.load(sp + i, mask=m).to(tl.float32)
            s2 = tl.load(sp + HALF + i, mask=m).to(tl.float32)
            # transformers: (x * cos) + (rotate_half(x) * sin), rotate_half(x) = cat(-x2, x1); each product and the
            # sum rounded to the tensors' dtype, as eager elementwise ops round
            o1 = ((x1 * c1).to(DT).to(tl.float32) + ((-x2) * s1).to(DT).to(tl.float32)).to(DT)
            o2 = ((x2 * c2).to(DT).to(tl.float32) + (x1 * s2).to(DT).to(tl.float32)).to(DT)
            op = out_ptr + pid * (2 * HALF)
            tl.store(op + i, o1, mask=m)
            tl.store(op + HALF + i, o2, mask=m)

        _ROPE_KERNEL = rope
    return _ROPE_KERNEL


def _rotate(x, cos, sin):
    """transformers' rotary embedding of x [B, H, S, D] with cos, sin [B or 1, S, D], as one kernel; out contiguous."""
    import torch
    import triton
    import triton.language as tl

    B, H, S, D = x.shape
    cos, sin = cos.expand(B, S, D), sin.expand(B, S, D)
    out = torch.empty((B, H, S, D), dtype=x.dtype, device=x.device)
    dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]
    _rope_kernel()[(B * H * S,)](x, cos, sin, out, H, S, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
                                 cos.stride(1), sin.stride(0), sin.stride(1), HALF=D // 2,
                                 BLOCK=triton.next_power_of_2(D // 2), DT=dt, enable_fp_fusion=False)
    return out


def fuse_rotary(model) -> bool:
    """Give the model's modeling module an `apply_rotary_pos_emb` that runs each of q and k as one Triton kernel (ten
    elementwise kernels a layer → two) with transformers' exact roundings (bitwise the same result; checked on a GPU
    by bench/gpu_fused_norm.py); any other call (CPU tensors, fp32, other layouts, autograd, a torch.compile trace:
    inductor fuses it itself) goes to transformers' own. The module function is shared by every model of that class
    in the process: the result is the same, only faster. On a GPU the kernel is first checked against
    transformers' function; if it cannot run there or differs, the module keeps transformers' function and a
    warning says why. Returns whether the module has the fused one now."""
    import sys

    import torch

    mod = sys.modules.get(type(model).__module__)
    orig = getattr(mod, "apply_rotary_pos_emb", None)
    if orig is None:
        return False
    if getattr(orig, "_rollflow_fused", False):
        return True
    device = next(model.parameters()).device
    if device.type == "cuda" and (why := _rotary_self_check(orig, device)):
        log.warning("the fused rotary embedding is not used, transformers' is: %s", why)
        return False

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if args or kwargs or unsqueeze_dim != 1 or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) \
                or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or q.shape[-1] % 2 or q.stride(-1) != 1 \
                or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.dtype != q.dtype \
                or sin.dtype != q.dtype or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return orig(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    apply_rotary_pos_emb._rollflow_fused = True
    apply_rotary_pos_emb.original = orig
    mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def _rotary_self_check(orig, device) -> str | None:
    """None when the kernel gives transformers' result bitwise on this GPU (decode and prefill shapes, bf16 and
    fp16, q as the strided view attention makes it), else why not (Triton missing or failing, a difference)."""
    import torch

    try:
        g = torch.Generator(device=device).manual_seed(0)
        for dtype in (torch.bfloat16, torch.float16):
            for b, s in ((3, 1), (2, 7)):
                hs = torch.randn(b, s, 5 * 64, device=device, generator=g).to(dtype)
                q = hs[..., :4 * 64].view(b, s, 4, 64).transpose(1, 2)
                k = hs[..., 4 * 64:].view(b, s, 1, 64).transpose(1, 2)
                ang = torch.rand(b, s, 32, device=device, generator=g) * 1000
                cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
                with torch.no_grad():
                    want = orig(q, k, cos, sin)
                    got = (_rotate(q, cos, sin), _rotate(k, cos, sin))
                if not (torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])):
                    return f"the kernel differs from transformers' apply_rotary_pos_emb ({dtype}, {b}x{s})"
    except Exception as e:  # no Triton, a compile error: transformers' function stays
        return f"{type(e).__name__}: {e}"
    return None


def unfuse_rotary(model) -> None:
    """Undo `fuse_rotary` (the benchmark's before/after)."""
    import sys

    mod = sys.modules.get(type(model).__module__)
    f = getattr(mod, "apply_rotary_pos_emb", None)
    if getattr(f, "_rollflow_fused", False):
        mod.apply_rotary_pos_emb = f.original
