"""Micro-batch materialisation: several samples packed into one flat row (varlen).

Per-token tensors are aligned with the flat token ids: entry t describes predicting tokens[t] from the tokens
before it *in the same sample*. The first token of each sample has no prediction (mask 0). Packing is always on:
a micro-batch is one flat row of T = Σ L_i tokens, never S padded rows (the trainer's attention must not cross
the cu_seqlens boundaries). E.g. samples of 3 and 2 tokens: tokens [a0 a1 a2 b0 b1], cu_seqlens [0, 3, 5],
position_ids [0 1 2 0 1].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.samples import Sample, Status


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


def make_micro_batch(samples: list[Sample], advantages: list[float], pad_to_multiple: int = 1) -> MicroBatch:
    """Pack `samples` (with one advantage each) into a MicroBatch; optional padding to a multiple (TP / CP)."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    toks, pos, mask, adv, rlp, cu, resp = [], [], [], [], [], [0], []
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
        cu.append(cu[-1] + pad)
        resp.append(0)
    return MicroBatch(tokens=torch.tensor(toks, dtype=torch.long), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                      position_ids=torch.tensor(pos, dtype=torch.long),
                      loss_mask=torch.tensor(mask, dtype=torch.float32),
                      advantages=torch.tensor(adv, dtype=torch.float32),
                      rollout_log_probs=torch.tensor(rlp, dtype=torch.float32),
                      sample_ids=[s.index for s in samples], response_lengths=resp,
                      teacher_log_probs=torch.tensor(tlp, dtype=torch.float32) if teacher else None)
