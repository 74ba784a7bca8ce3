"""Routing replay for a mixture of experts (--use-routing-replay; GSPO's Routing Replay, arXiv 2507.18071; slime's
flag): the experts each token went to in the policy's no-grad forward before the steps are the experts of every
training forward of that rollout.

`Routes` keeps them per micro-batch (keyed by its samples and length: the same micro-batch in both calls, also across
the rollout's steps), one [T, k] index tensor per router, on the host. The torch backend records and replays through
forward hooks on transformers' routers (`TorchRouters`); the Megatron backend through megatron-core's own
RouterReplay (megatron_backend). Replayed, a router keeps its logits and gives the chosen experts the current
softmax probabilities — renormalised over the k where the model renormalises (Mixtral, `norm_topk_prob`) — so its
weights still get gradients; the routing itself is the recorded one.

--use-rollout-routing-replay (slime's flag; R3, arXiv 2510.11370) replays the experts the rollout engine routed each
token to instead: the engine returns them as SGLang does (`meta_info.routed_experts`, base64 of int32
[P + R - 1, num_hidden_layers, top_k]: every token but the last, which no forward saw; `encode_routes` /
`decode_routes`), the micro-batch carries them (`MicroBatch.routed_experts`, the MoE layers only) and every
forward of the policy before and in the steps replays them.
"""
from __future__ import annotations

import base64
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
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


def rollout_indices(mb: "MicroBatch", routers: int) -> list[torch.Tensor] | None:
    """--use-rollout-routing-replay: the engine's experts of a micro-batch, one [T, k] per router, -1 in the rows
    of tokens it did not route (None: the micro-batch carries none — a probe's or a scoring forward's, which route
    on their own)."""
    if mb.routed_experts is None:
        return None
    if mb.routed_experts.shape[1] != routers:
        raise RuntimeError(f"--use-rollout-routing-replay: the engine's routing has {mb.routed_experts.shape[1]} MoE "
                           f"layers, the trained model {routers} routers")
    return list(mb.routed_experts.unbind(1))


def routers(model: torch.nn.Module, flag: str = "--use-routing-replay") -> list[torch.nn.Module]:
    """The model's routers, in module order (one per MoE layer); refused when the model has none rollflow replays."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    name = REPLAYED.get(family)
    found = [m for m in model.modules() if name is not None and type(m).__name__ == name]
    if not found:
        raise ValueError(f"{flag}: {type(model).__name__} (model_type {family!r}) has no router rollflow "
                         f"records or replays (transformers' {', '.join(REPLAYED)}): drop the flag")
    return found


def router_layers(model: torch.nn.Module, found: list[torch.nn.Module]) -> list[int]:
    """The decoder layer index of each router in `found` (from its module name, `….layers.<i>.…`)."""
    where = {id(m): n for n, m in model.named_modules()}
    out = []
    for r in found:
        hit = re.search(r"(?:^|\.)layers\.(\d+)\.", where.get(id(r), ""))
        if hit is None:
            raise ValueError(f"routing replay: cannot tell the layer of router {where.get(id(r))!r}")
        out.append(int(hit.group(1)))
    return out


@dataclass(frozen=True)
class RouteLayout:
    """How SGLang lays out a token's routed experts: one row of `top_k` ids per decoder layer (`num_layers`), of
    which the layers `moe_layers` route (a dense layer's row holds -1 from rollflow's engine, whatever SGLang's)."""
    num_layers: int
    top_k: int
    moe_layers: tuple[int, ...]
    num_experts: int

    @staticmethod
    def of_shape(shape) -> "RouteLayout":
        """From an engine.model_shape.ModelShape of a mixture of experts."""
        dense = set(shape.moe_dense_layers)
        return RouteLayout(shape.num_layers, shape.moe_top_k,
                           tuple(i for i in range(shape.num_layers) if i not in dense), shape.num_experts)


def encode_routes(routes: np.ndarray | torch.Tensor, layers: list[int], layout: RouteLayout) -> str:
    """[T, len(layers), k] expert ids of the routers of decoder layers `layers` → SGLang's `routed_experts`: base64
    of little-endian int32 [T, num_layers, k], -1 in the other layers."""
    routes = np.asarray(routes.cpu() if isinstance(routes, torch.Tensor) else routes)
    full = np.full((routes.shape[0], layout.num_layers, layout.top_k), -1, dtype="<i4")
    full[:, layers, :] = routes
    return base64.b64encode(full.tobytes()).decode("ascii")


def decode_routes(b64: str, tokens: int, layout: RouteLayout, what: str = "routed_experts") -> np.ndarray:
    """SGLang's `routed_experts` of a sequence of `tokens` tokens → int16 [tokens - 1, #MoE layers, k] (the MoE
    layers' rows); a payload of another size is refused, naming what it holds."""
    raw = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    width = layout.num_layers * layout.top_k
    rows = tokens - 1
    if raw.size != rows * width:
        got = f"{raw.size / width:g} rows" if width else f"{raw.size} ids"
        raise ValueError(f"{what}: {got} of {layout.num_layers} layers × top {layout.top_k} experts for a sequence "
                         f"of {tokens} tokens ({rows} rows expected: every token but the last)")
    routes = raw.reshape(rows, layout.num_layers, layout.top_k)[:, list(layout.moe_layers), :]
    if routes.size and (routes.min() < 0 or routes.max() >= layout.num_experts):
        bad = routes[(routes < 0) | (routes >= layout.num_experts)][0]
        raise ValueError(f"{what}: expert id {int(bad)} in a MoE layer, outside [0, {layout.num_experts}): the "
                         "engine serves another model than the trainer's")
    return routes.astype(np.int16)


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

    def __init__(self, model: torch.nn.Module, flag: str = "--use-routing-replay"):
        self.routers = routers(model, flag)
        self._seen: dict[torch.nn.Module, torch.Tensor] = {}
        self._given: dict[torch.nn.Module, torch.Tensor] = {}
        self._mode: str | None = None
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        # (token, router) routings of the replayed forwards where the router alone picks another set of experts,
        # and all of them (device tensors; `take_differing` reads and resets)
        self.differing: torch.Tensor | int = 0
        self.compared: int = 0
        self._rollout = False

    def take_differing(self) -> tuple[float, float]:
        out = float(self.differing), float(self.compared)
        self.differing, self.compared = 0, 0
        return out

    def _hook(self, module, args, output):
        if self._mode == "record":
            self._seen[module] = output[2].detach()
        elif self._mode == "replay":
            logits, weights, own = output
            idx = self._given[module].to(device=logits.device, dtype=torch.long)
            with torch.no_grad():
                given = idx[:, 0] >= 0  # -1: a token the engine did not route (rollout routing) routes on its own
                idx = torch.where(given[:, None], idx, own)
                self.differing = self.differing + (own.sort(-1).values != idx.sort(-1).values).any(-1).sum()
                self.compared += int(given.sum()) if self._rollout else idx.shape[0]
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
    def replaying(self, indices: list[torch.Tensor], rollout: bool = False):
        """Each router returns the given experts ([T, k] per router; rollout: rows of -1 route on their own and are
        not compared)."""
        if not indices:  # nothing ran when it was recorded: nothing runs now either
            yield
            return
        self._rollout = rollout
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
