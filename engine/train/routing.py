"""Routing replay for a mixture of experts (--use-routing-replay; GSPO's Routing Replay, arXiv 2507.18071; slime's
flag): the experts each token went to in the policy's no-grad forward before the steps are the experts of every
training forward of that rollout.

`Routes` keeps them per micro-batch (keyed by its samples and length: the same micro-batch in both calls, also across
the rollout's steps), one [T, k] index tensor per router, on the host. The torch backend records and replays through
forward hooks on transformers' routers (`TorchRouters`); the Megatron backend through megatron-core's own
RouterReplay (megatron_backend). Replayed, a router keeps its logits and gives the chosen experts the current
softmax probabilities — renormalised over the k where the model renormalises (Mixtral, `norm_topk_prob`) — so its
weights still get gradients; the routing itself is the recorded one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from engine.packing.microbatch import MicroBatch

#: model_type → the routers' class name in transformers (softmax over all experts, top k, renormalised with
#: norm_topk_prob — Mixtral always — and returning (logits, weights, indices))
REPLAYED = {"qwen2_moe": "Qwen2MoeTopKRouter", "qwen3_moe": "Qwen3MoeTopKRouter", "mixtral": "MixtralTopKRouter"}


def key(mb: MicroBatch) -> tuple:
    return tuple(mb.sample_ids), mb.num_tokens


class Routes:
    """The recorded routing of a rollout's micro-batches: `record` in the no-grad forward, `of` in the steps."""

    def __init__(self) -> None:
        self.by_mb: dict[tuple, list[torch.Tensor]] = {}

    def clear(self) -> None:
        self.by_mb.clear()

    def record(self, mb: MicroBatch, indices: list[torch.Tensor]) -> None:
        """indices: [T, k] per router, in the routers' order; kept on the host in int16 (experts < 32768)."""
        self.by_mb[key(mb)] = [i.detach().to("cpu", torch.int16) for i in indices]

    @property
    def replaying(self) -> bool:
        return bool(self.by_mb)

    def of(self, mb: MicroBatch) -> list[torch.Tensor]:
        got = self.by_mb.get(key(mb))
        if got is None:
            raise RuntimeError(f"--use-routing-replay: no recorded routing for the micro-batch of samples "
                               f"{list(mb.sample_ids)[:8]} ({mb.num_tokens} tokens): the no-grad forward before the "
                               "steps saw other micro-batches")
        return got


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers, in module order (one per MoE layer); refused when the model has none rollflow replays."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    name = REPLAYED.get(family)
    found = [m for m in model.modules() if name is not None and type(m).__name__ == name]
    if not found:
        raise ValueError(f"--use-routing-replay: model_type {family!r} has no router rollflow replays "
                         f"(it replays {', '.join(REPLAYED)}): drop the flag")
    return found


def replayed_weights(logits: torch.Tensor, indices: torch.Tensor, *, renormalise: bool, dtype: torch.dtype
                     ) -> torch.Tensor:
    """The routing weights of the given experts [T, k]: softmax over all experts in float32, taken at `indices`,
    renormalised over them when the model does — transformers' routers' arithmetic with the top k given."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, indices)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)


class TorchRouters:
    """Forward hooks on a transformers model's routers: `recording()` collects each router's top-k indices,
    `replaying(indices)` makes each router return the given ones (per router module, so a layer recomputed in the
    backward replays the same)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers(model)
        self._seen: dict[torch.nn.Module, torch.Tensor] = {}
        self._given: dict[torch.nn.Module, torch.Tensor] = {}
        self._mode: str | None = None
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, module, args, output):
        if self._mode == "record":
            self._seen[module] = output[2].detach()
        elif self._mode == "replay":
            logits, weights, _ = output
            idx = self._given[module].to(device=logits.device, dtype=torch.long)
            renorm = getattr(module, "norm_topk_prob", True)  # Mixtral's router always renormalises
            return logits, replayed_weights(logits, idx, renormalise=renorm, dtype=weights.dtype), idx
        return None

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Yields a list that holds, after the block, each router's indices of the block's (one) forward."""
        out: list[torch.Tensor] = []
        self._mode, self._seen = "record", {}
        try:
            yield out
        finally:
            self._mode = None
        missing = [r for r in self.routers if r not in self._seen]
        if len(missing) == len(self.routers):  # no forward ran (a micro-batch without trained tokens)
            return
        if missing:
            raise RuntimeError(f"--use-routing-replay: {len(missing)} of {len(self.routers)} routers did not run")
        out.extend(self._seen[r] for r in self.routers)

    @contextmanager
    def replaying(self, indices: list[torch.Tensor]):
        if not indices:  # nothing ran when it was recorded: nothing runs now either
            yield
            return
        if len(indices) != len(self.routers):
            raise RuntimeError(f"--use-routing-replay: {len(indices)} recorded routers for {len(self.routers)}")
        self._mode, self._given = "replay", dict(zip(self.routers, indices))
        try:
            yield
        finally:
            self._mode, self._given = None, {}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
