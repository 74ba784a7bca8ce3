"""Micro-batch materialisation: several samples packed into one flat row (varlen).

Per-token tensors are aligned with the flat token ids: entry t describes predicting tokens[t] from the tokens
before it *in the same sample*. The first token of each sample has no prediction (mask 0). Packing is always on:
a micro-batch is one flat row of T = Σ L_i tokens, never S padded rows (the trainer's attention must not cross
the cu_seqlens boundaries). E.g. samples of 3 and 2 tokens: tokens [a0 a1 a2 b0 b1], cu_seqlens [0, 3, 5],
position_ids [0 1 2 0 1].
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.samples import Sample, Status

if TYPE_CHECKING:
    from engine.train.routing import RouteLayout


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [T] long, samples concatenated (prompt + response each)
    cu_seqlens: torch.Tensor  # [S+1] int32, sample boundaries in the flat row
    position_ids: torch.Tensor  # [T] long, restarting at 0 for every sample
    loss_mask: torch.Tensor  # [T] float, 1 on trained response tokens
    advantages: torch.Tensor  # [T] float, the sample's advantage broadcast to its response tokens
    rollout_log_probs: torch.Tensor  # [T] float, log π_engine(tokens[t]) from the rollout (0 off-response)
    sample_ids: list[int]  # [S] Sample.index, for reports (RF09 / RF13)
    response_lengths: list[int] | None = None  # [S] R_i: sample i's response is its last R_i tokens
    teacher_log_probs: torch.Tensor | None = None  # [T] --opd-type sglang: log π_teacher (0 off-response)
    # [T, #MoE layers, k] int16 --use-rollout-routing-replay: the experts the engine routed each token to; -1 where
    # it routed none (a sample's last token, which no engine forward saw; padding): those route on their own
    routed_experts: torch.Tensor | None = None
    tis_scale: float | None = None  # --tis-batch-normalize: its step's mean TIS weight (the weights ÷ it)

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_seqlen(self) -> int:
        """Tokens of the longest sample (flash attention's max_seqlen), from the host copy: no device sync."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max()) if self.num_samples else 0


def sample_routes(s: Sample, layout: "RouteLayout", trained: bool) -> np.ndarray:
    """A sample's engine routing as [L, #MoE layers, k] int16 (--use-rollout-routing-replay), its last token -1 (no
    engine forward saw it). A trained sample must carry it (Sample.rollout_routed_experts: SGLang's base64 or an
    array [L - 1, num_layers, k]); one that is not trained and has none is all -1 (its tokens are in no loss)."""
    from engine.train.routing import decode_routes

    L, raw = len(s.tokens), s.rollout_routed_experts
    moe = len(layout.moe_layers)
    if raw is None:
        if trained:
            raise ValueError(
                f"sample {s.index}: --use-rollout-routing-replay, and the engine returned no routed experts for it: "
                "rollflow's engines and SGLang return them to a request with `return_routed_experts` when started "
                "with --enable-return-routed-experts (rollflow starts its own so); a --custom-generate-function-path "
                "sets sample.rollout_routed_experts = meta_info['routed_experts'] of the sample's last /generate")
        return np.full((L, moe, layout.top_k), -1, dtype=np.int16)
    what = f"sample {s.index}'s routed experts"
    if isinstance(raw, str):
        routes = decode_routes(raw, L, layout, what)
    else:
        arr = np.asarray(raw)
        if arr.shape != (L - 1, layout.num_layers, layout.top_k):
            raise ValueError(f"{what}: shape {tuple(arr.shape)}, not [{L - 1}, {layout.num_layers}, {layout.top_k}] "
                             f"(every token of its {L} but the last × layers × top k)")
        routes = decode_routes(base64_int32(arr), L, layout, what)
    return np.concatenate([routes, np.full((1, moe, layout.top_k), -1, dtype=np.int16)])


def base64_int32(arr) -> str:
    import base64

    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode("ascii")


def make_micro_batch(samples: list[Sample], advantages: list[float], pad_to_multiple: int = 1,
                     routes: "RouteLayout | None" = None) -> MicroBatch:
    """Pack `samples` (with one advantage each) into a MicroBatch; optional padding to a multiple (TP / CP);
    `routes` (--use-rollout-routing-replay): the model's layout of the engine's routed experts, which the micro-batch
    then carries."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    toks, pos, mask, adv, rlp, cu, resp = [], [], [], [], [], [0], []
    routed: list[np.ndarray] = []
    teacher = any(s.teacher_log_probs is not None for s in samples)
    tlp: list[float] = []
    for s, a in zip(samples, advantages):
        L, R = len(s.tokens), s.response_length
        P = L - R
        # failed samples, and those --rollout-sample-filter-path removed, are never trained
        trained = s.status in (Status.COMPLETED, Status.TRUNCATED) and not s.remove_sample
        if trained and (len(s.loss_mask) != R or len(s.rollout_log_probs) != R):
            raise ValueError(f"sample {s.index}: response_length {R} but {len(s.loss_mask)} loss-mask entries and "
                             f"{len(s.rollout_log_probs)} rollout log-probs (one per response token expected)")
        toks += s.tokens
        pos += list(range(L))
        mask += [0.0] * P + ([float(m) for m in s.loss_mask] if trained else [0.0] * R)
        adv += [0.0] * P + [float(a)] * R
        rlp += [0.0] * P + (list(s.rollout_log_probs) if trained else [0.0] * R)
        if teacher:
            if trained and len(s.teacher_log_probs or []) != R:
                raise ValueError(f"sample {s.index}: response_length {R} but "
                                 f"{len(s.teacher_log_probs or [])} teacher log-probs (--opd-type sglang scores "
                                 "every response token)")
            tlp += [0.0] * P + (list(s.teacher_log_probs) if trained else [0.0] * R)
        if routes is not None:
            routed.append(sample_routes(s, routes, trained))
        cu.append(cu[-1] + L)
        resp.append(R)
    pad = (-len(toks)) % pad_to_multiple
    if pad:  # one padding pseudo-sample, fully masked
        toks += [0] * pad
        pos += list(range(pad))
        mask += [0.0] * pad
        adv += [0.0] * pad
        rlp += [0.0] * pad
        tlp += [0.0] * pad if teacher else []
        if routes is not None:
            routed.append(np.full((pad, len(routes.moe_layers), routes.top_k), -1, dtype=np.int16))
        cu.append(cu[-1] + pad)
        resp.append(0)
    return MicroBatch(tokens=torch.tensor(toks, dtype=torch.long), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                      position_ids=torch.tensor(pos, dtype=torch.long),
                      loss_mask=torch.tensor(mask, dtype=torch.float32),
                      advantages=torch.tensor(adv, dtype=torch.float32),
                      rollout_log_probs=torch.tensor(rlp, dtype=torch.float32),
                      sample_ids=[s.index for s in samples], response_lengths=resp,
                      teacher_log_probs=torch.tensor(tlp, dtype=torch.float32) if teacher else None,
                      routed_experts=torch.from_numpy(np.concatenate(routed)) if routes is not None else None)


def regroup(mbs: list[MicroBatch], cap: int) -> list[MicroBatch]:
    """The samples of `mbs`, in their order, re-packed into micro-batches of at most `cap` tokens (a sample longer
    than `cap` alone in its own), for the no-grad forwards (--log-probs-max-tokens-per-gpu): no activations are kept
    for a backward there, so they can run fewer, larger micro-batches than the training step's.

    The flat rows of the result, concatenated, are those of `mbs` concatenated (a padding segment stays a segment),
    so `split_like` gives each original micro-batch its per-token results back. Advantages are not carried: the
    forwards run before they exist.
    """
    out: list[MicroBatch] = []
    parts: list[tuple[MicroBatch, int, int, int | None, int]] = []  # (mb, start, end, sample id, response length)
    for mb in mbs:
        cu = mb.cu_seqlens.tolist()
        resp = mb.response_lengths or [0] * (len(cu) - 1)
        for i in range(len(cu) - 1):
            parts.append((mb, cu[i], cu[i + 1], mb.sample_ids[i] if i < len(mb.sample_ids) else None, resp[i]))
    cur: list[tuple[MicroBatch, int, int, int | None, int]] = []
    size = 0
    for p in parts:
        n = p[2] - p[1]
        if cur and size + n > cap:
            out.append(_joined(cur))
            cur, size = [], 0
        cur.append(p)
        size += n
    if cur:
        out.append(_joined(cur))
    return out


def _joined(parts: list[tuple[MicroBatch, int, int, int | None, int]]) -> MicroBatch:
    def cat(get) -> torch.Tensor:
        return torch.cat([get(mb)[a:e] for mb, a, e, _, _ in parts])

    lens = [e - a for _, a, e, _, _ in parts]
    teacher = all(mb.teacher_log_probs is not None for mb, *_ in parts)
    routed = all(mb.routed_experts is not None for mb, *_ in parts)
    return MicroBatch(tokens=cat(lambda m: m.tokens),
                      cu_seqlens=torch.tensor([0, *accumulate(lens)], dtype=torch.int32),
                      position_ids=cat(lambda m: m.position_ids), loss_mask=cat(lambda m: m.loss_mask),
                      advantages=torch.zeros(sum(lens)), rollout_log_probs=cat(lambda m: m.rollout_log_probs),
                      sample_ids=[sid for *_, sid, _ in parts if sid is not None],
                      response_lengths=[r for *_, r in parts],
                      teacher_log_probs=cat(lambda m: m.teacher_log_probs) if teacher else None,
                      routed_experts=cat(lambda m: m.routed_experts) if routed else None)


def split_like(outs: list[torch.Tensor], mbs: list[MicroBatch]) -> list[torch.Tensor]:
    """Per-token results [T'] of `regroup(mbs, cap)`'s micro-batches back as one [T] tensor per micro-batch of
    `mbs`."""
    flat = torch.cat(outs) if outs else torch.zeros(0)
    if flat.numel() != sum(mb.num_tokens for mb in mbs):
        raise ValueError(f"{flat.numel()} per-token results for {sum(mb.num_tokens for mb in mbs)} tokens")
    return list(flat.split([mb.num_tokens for mb in mbs]))
