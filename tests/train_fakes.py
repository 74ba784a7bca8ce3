"""Hand-made rollouts for the train-stage tests: samples with known tokens, rewards and masks (no engine)."""
from __future__ import annotations

import torch

from engine.packing.microbatch import MicroBatch, make_micro_batch
from engine.samples import Sample, Status


def fake_samples(lengths: list[tuple[int, int]], *, n: int, seed: int = 0, vocab: int = 259,
                 rewards: list[float] | None = None) -> list[Sample]:
    """One Sample per (prompt_len, response_len); groups of n consecutive samples; random tokens and rewards."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        toks = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        reward = rewards[i] if rewards is not None else float(torch.randint(0, 2, (1,), generator=g))
        lps = (-torch.rand(r, generator=g) * 3).tolist()
        out.append(Sample(index=i, group_index=i // n, rollout_id=0, prompt="x", tokens=toks, response_length=r,
                          reward=reward, loss_mask=[1] * r, rollout_log_probs=lps, status=Status.COMPLETED))
    return out


def pack(samples: list[Sample], groups: list[list[int]]) -> list[MicroBatch]:
    """Micro-batches holding the given sample indices (advantages left 0: the trainer computes them)."""
    return [make_micro_batch([samples[i] for i in idx], [0.0] * len(idx)) for idx in groups]
