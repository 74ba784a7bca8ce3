"""Weight names on the wire: a Hugging Face checkpoint's names, not a transformers model's in-memory ones.

transformers 5 keeps some weights in another layout in memory than in the checkpoint files: a mixture of experts
(Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek, GLM-4-MoE, …) holds one fused `mlp.experts.gate_up_proj` [E, 2f, h] and
`mlp.experts.down_proj` [E, h, f] where the files (and SGLang's weight loaders) have
`mlp.experts.<e>.gate_proj.weight` … per expert. The trainer therefore sends checkpoint names
(`checkpoint_state`: transformers' own `revert_weight_conversion`, which `save_pretrained` applies), as the Megatron
backend's mapping does, so that a real SGLang server loads what any rollflow trainer sends; and the built-in engine
(`served_targets`) takes checkpoint names as views into its in-memory parameters, found once per model by sending
each element's index through the same conversion. The model's own names are taken too. For a model without such
conversions (the dense families) both are the same names and nothing is converted.
"""
from __future__ import annotations

import torch


def _revert():
    """transformers' `revert_weight_conversion` (transformers ≥ 5), or None where in-memory names are the
    checkpoint's (transformers 4)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return revert_weight_conversion


def checkpoint_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's in-memory names) under the names of its checkpoint files; the same dict when the model
    keeps them (most models)."""
    if not _converts(model):
        return state
    with torch.no_grad():
        return _revert()(model, dict(state))


def _converts(model: torch.nn.Module) -> bool:
    """Whether transformers converts any of this model's weights between file and memory (cached on the model)."""
    cached = getattr(model, "_rollflow_converts", None)
    if cached is None:
        from engine.modeling import impl_of

        # rollflow's own model code (dense families only) keeps the checkpoint's names: transformers' conversion
        # code is not even imported (~0.3 s of CPU with the accelerate it imports, at a worker's first sync)
        revert = _revert() if impl_of(model) != "native" else None
        cached = False
        if revert is not None and hasattr(model, "config"):
            meta = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in model.named_parameters()}
            try:
                cached = set(revert(model, dict(meta))) != set(meta)
            except Exception:  # noqa: BLE001 — a model transformers has no conversion for
                cached = False
        _keep(model, "_rollflow_converts", cached)
    return cached


def _keep(model: torch.nn.Module, attr: str, value) -> None:
    """Cache `value` on the model (a module that refuses attributes is asked again next time)."""
    try:
        setattr(model, attr, value)
    except Exception:  # noqa: BLE001
        pass


def served_targets(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """({name: tensor an update copies into}, {checkpoint name: the parameter it is part of}) of a served model:
    its parameters and buffers by their own names, and, where transformers converts a parameter, each of its
    checkpoint tensors as a strided view into it. The views' geometry is found once per model; the views are made
    at each call, on the parameters' storage of the moment (offloading may have moved it)."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    owner: dict[str, str] = {}
    for part, (name, size, stride, offset) in _geometry(model).items():
        p = targets[name]
        targets[part] = p.as_strided(size, stride, p.storage_offset() + offset)
        owner[part] = name
    return targets, owner


def _geometry(model: torch.nn.Module) -> dict[str, tuple[str, tuple, tuple, int]]:
    """{checkpoint name: (its parameter, size, stride, offset in the parameter)} of the converted parameters;
    cached on the model."""
    cached = getattr(model, "_rollflow_geometry", None)
    if cached is not None:
        return cached
    out: dict[str, tuple[str, tuple, tuple, int]] = {}
    if _converts(model):
        revert = _revert()
        # every layer's experts have the same geometry: the index probe runs once per (leaf name, shape), and a
        # later layer's parts reuse it where their names are that layer's prefix + the same suffixes
        seen: dict[tuple, dict[str, tuple[tuple, tuple, int]]] = {}
        for name, p in model.named_parameters():
            with torch.no_grad():
                parts = revert(model, {name: torch.empty(p.shape, device="meta")})
            if list(parts) == [name]:
                continue
            prefix, leaf = name.rpartition(".")[0] + ".", name.rpartition(".")[2]
            known = seen.get((leaf, tuple(p.shape)))
            if known is not None and {prefix + k for k in known} == set(parts):
                out.update({prefix + k: (name, *g) for k, g in known.items()})
                continue
            blocks = _blocks(revert, model, name, p)
            out.update(blocks)
            if all(k.startswith(prefix) for k in blocks):
                seen[(leaf, tuple(p.shape))] = {k[len(prefix):]: g[1:] for k, g in blocks.items()}
    _keep(model, "_rollflow_geometry", out)
    return out


def _blocks(revert, model: torch.nn.Module, name: str, p: torch.Tensor) -> dict[str, tuple[str, tuple, tuple, int]]:
    """Each checkpoint tensor of parameter `name` as a strided block of it: the conversion is run on the elements'
    indices (a rearrangement keeps them), and each part must be such a block, else this raises naming it."""
    if not p.is_contiguous():
        raise NotImplementedError(f"{name} is not contiguous: its checkpoint tensors cannot be mapped into it")
    n = p.numel()
    index = torch.arange(n, dtype=torch.int64 if n >= 2**31 else torch.int32, device=p.device).view(p.shape)
    with torch.no_grad():
        parts = revert(model, {name: index})
    out = {}
    for part, idx in parts.items():
        idx = idx.to(p.device)
        size, stride, offset = tuple(idx.shape), tuple(_step(idx, d) for d in range(idx.dim())), int(idx.reshape(-1)[0])
        if not torch.equal(index.as_strided(size, stride, offset), idx):
            raise NotImplementedError(f"{part}: transformers stores it inside {name} in a way that is not a "
                                      "strided block, so an update cannot be copied into it in place")
        out[part] = (name, size, stride, offset)
    return out


def _step(idx: torch.Tensor, dim: int) -> int:
    """The index step along `dim` of a strided block (0 where the dimension has one element)."""
    if idx.shape[dim] < 2:
        return 0
    first = idx.narrow(dim, 0, 1).reshape(-1)[0]
    second = idx.narrow(dim, 1, 1).reshape(-1)[0]
    return int(second - first)
