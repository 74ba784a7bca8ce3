"""The objective of one optimizer step, micro-batch by micro-batch, so that it is the same for any DP layout.

Total per-token loss  ℓ_t = w_t·pg_t − entropy_coef·H_t + kl_loss_coef·KL_t   (KL term with --use-kl-loss, times
π/π_old with --use-unbiased-kl; w_t the TIS weight with --use-tis, else 1). Aggregation over the G samples of the step:
  default                      L = (1/G) Σ_i mean_{t ∈ trained(i)} ℓ_t     (per-sample token mean, as slime)
  --calculate-per-token-loss   L = (1/N) Σ_i Σ_{t ∈ trained(i)} ℓ_t        (N = trained tokens of the step)
Each micro-batch contributes its samples' terms divided by the *global* G (or N), so summing gradients over
micro-batches and DP ranks (all-reduce SUM) gives exactly ∇L, however the samples are split. The value loss
(PPO's critic) aggregates the same way.

Invariants (tests/test_objective.py): the sum of `policy_objective` over any split of a batch into micro-batches
equals the loss of the whole batch, and so do its gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch

from engine.algorithms.losses import (cispo_policy_loss, gspo_policy_loss, kl, policy_loss, rollout_correction,
                                      value_loss)
from engine.algorithms.packed import per_sample_mean, response_spans, segment_ids


@dataclass(frozen=True)
class LossSpec:
    """The numbers of the RL objective, unpacked once from the run's flags (`LossSpec.of(cfg)`)."""

    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"  # ppo = the clipped surrogate (grpo, reinforce++, ppo)
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"  # --loss-type
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    unbiased_kl: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_level: str = "token"  # --tis-level
    tis_mode: str = "clip"  # --tis-mode
    use_rs: bool = False  # --use-rs: rejection sampling (slime's MIS helper)
    rs_level: str = "token"
    rs_low: float = 0.5  # --rs-lower-bound, resolved (RunConfig.rs_bounds)
    rs_high: float = 2.0
    rs_veto: float | None = None  # --rs-veto-threshold
    mismatch_metrics: bool = False  # --get-mismatch-metrics: the custom TIS function runs without --use-tis
    use_opsm: bool = False
    opsm_delta: float = 1e-4
    per_token_loss: bool = False
    value_clip: float = 0.2
    advantages: bool = True  # False: --disable-compute-advantages-and-returns (a custom loss gets None for them)

    @classmethod
    def of(cls, cfg: Any) -> "LossSpec":
        est = cfg.advantage_estimator
        return cls(policy_loss=est if est in ("gspo", "cispo") else "ppo", loss_type=cfg.loss_type,
                   eps_clip=cfg.eps_clip,
                   eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c, entropy_coef=cfg.entropy_coef,
                   use_kl_loss=cfg.use_kl_loss, kl_loss_coef=cfg.kl_loss_coef, kl_loss_type=cfg.kl_loss_type,
                   unbiased_kl=cfg.use_unbiased_kl, use_tis=cfg.use_tis, tis_clip=cfg.tis_clip,
                   tis_clip_low=cfg.tis_clip_low, tis_level=cfg.tis_level, tis_mode=cfg.tis_mode, use_rs=cfg.use_rs,
                   rs_level=cfg.rs_level, rs_low=cfg.rs_bounds[0], rs_high=cfg.rs_bounds[1],
                   rs_veto=cfg.rs_veto_threshold, mismatch_metrics=cfg.get_mismatch_metrics,
                   use_opsm=cfg.use_opsm, opsm_delta=cfg.opsm_delta,
                   per_token_loss=cfg.calculate_per_token_loss, value_clip=cfg.value_clip,
                   advantages=not cfg.disable_compute_advantages_and_returns)


Hook = tuple[Callable, str, Any]  # a user function, the path its flag gave, the args it is called with


@dataclass(frozen=True)
class StepHooks:
    """The train step's user functions (engine.train.backend.step_hooks loads them from the flags), each a Hook
    or None: --custom-loss-function-path, --custom-tis-function-path, --custom-pg-loss-reducer-function-path."""

    custom_loss: Optional[Hook] = None
    tis: Optional[Hook] = None
    pg_reducer: Optional[Hook] = None


def response_index(cu_seqlens: torch.Tensor, response_lengths: list[int] | None, flag: str
                   ) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """Each sample's response tokens in a packed micro-batch: their (start, end) spans and their flat index [ΣR]
    (slime's hooks see the response tokens only, concatenated)."""
    if response_lengths is None:
        raise ValueError(f"{flag} needs the micro-batch's response lengths")
    spans = response_spans(cu_seqlens, response_lengths)
    idx = torch.cat([torch.arange(a, b, device=cu_seqlens.device) for a, b in spans]) if spans else \
        torch.zeros(0, dtype=torch.long, device=cu_seqlens.device)
    return spans, idx


def aggregate(token_loss: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, *, per_token: bool,
              denominator: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(this micro-batch's share of the step loss, per-sample losses [S]); see the module docstring."""
    per_sample = per_sample_mean(token_loss, loss_mask, cu_seqlens)  # [S]
    if per_token:
        return (token_loss * loss_mask).sum() / denominator, per_sample
    return per_sample.sum() / denominator, per_sample


def policy_objective(spec: LossSpec, *, log_probs: torch.Tensor, entropy: torch.Tensor,
                     old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None,
                     rollout_log_probs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                     cu_seqlens: torch.Tensor, denominator: float, tis: Hook | None = None,
                     pg_reducer: Hook | None = None, response_lengths: list[int] | None = None,
                     tis_scale: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss share, token sums for metrics, per-sample loss [S]) of one packed micro-batch.

    log_probs, entropy [T] carry gradients; old_log_probs (trainer, before the rollout's first update),
    ref_log_probs (frozen reference), rollout_log_probs (engine), advantages, loss_mask [T] are constants.
    tis: --custom-tis-function-path's Hook, which then weights the policy loss in place of --use-tis's clamp
    (custom_tis); pg_reducer: --custom-pg-loss-reducer-function-path's, which then aggregates the policy-gradient
    term alone (reduced_pg; entropy and KL keep the default aggregate). Both need the samples' response_lengths.
    --use-tis / --use-rs without a hook: losses.rollout_correction's weight and rejection (tis_scale: the step's
    --tis-batch-normalize factor, which the trainer computed over all micro-batches and ranks; None without it);
    a rejected token's policy loss is dropped while its sample's token count stays, as slime.
    """
    m = loss_mask
    if spec.policy_loss == "gspo":
        pg, clipped = gspo_policy_loss(log_probs, old_log_probs, advantages, m, cu_seqlens,
                                       eps_clip=spec.eps_clip, eps_clip_high=spec.eps_clip_high)
    elif spec.policy_loss == "cispo":
        pg, clipped = cispo_policy_loss(log_probs, old_log_probs, advantages, eps_clip=spec.eps_clip,
                                        eps_clip_high=spec.eps_clip_high)
    else:
        pg, clipped = policy_loss(log_probs, old_log_probs, advantages, eps_clip=spec.eps_clip,
                                  eps_clip_high=spec.eps_clip_high, eps_clip_c=spec.eps_clip_c)
    stats: dict[str, torch.Tensor] = {}
    pg_mask = m  # the masks a custom reducer sees: the custom TIS function's when it ran (slime)
    if spec.use_opsm:  # slime's compute_opsm_mask: a drifted sample with a negative advantage leaves the loss
        with torch.no_grad():
            seq_kl = per_sample_mean(old_log_probs - log_probs.detach(), m, cu_seqlens)  # [S]
            masked = ((advantages < 0) & (seq_kl[segment_ids(cu_seqlens)] > spec.opsm_delta)).to(pg.dtype) * m
        pg = pg * (1 - masked)
        stats["opsm_masked"] = masked.sum()
    if (spec.use_tis or spec.mismatch_metrics) and tis is not None:
        pg, tis_stats, pg_mask = custom_tis(tis, pg_loss=pg, old_log_probs=old_log_probs,
                                            rollout_log_probs=rollout_log_probs, loss_mask=m, cu_seqlens=cu_seqlens,
                                            response_lengths=response_lengths)
        stats.update(tis_stats)
        pg_mask = pg_mask * m  # never a token the loss mask leaves out
    elif spec.use_tis or spec.use_rs:
        w, keep, tis_stats = rollout_correction(
            old_log_probs, rollout_log_probs, m, cu_seqlens, tis=spec.use_tis, mode=spec.tis_mode,
            level=spec.tis_level, low=spec.tis_clip_low, high=spec.tis_clip, rs=spec.use_rs, rs_level=spec.rs_level,
            rs_low=spec.rs_low, rs_high=spec.rs_high, veto=spec.rs_veto, scale=tis_scale)
        pg = pg * w * keep  # [T]
        pg_mask = m * keep
        stats.update(tis_stats)
    if ref_log_probs is None:
        kl_t = torch.zeros_like(pg)
    else:  # --use-unbiased-kl: weighted by π/π_old (with its gradient), as slime
        kl_t = kl(log_probs, ref_log_probs, spec.kl_loss_type,
                  torch.exp(log_probs - old_log_probs) if spec.unbiased_kl else None)
    tok = pg - spec.entropy_coef * entropy  # [T]
    if spec.use_kl_loss:
        tok = tok + spec.kl_loss_coef * kl_t
    if pg_reducer is None:
        loss, per_sample = aggregate(tok, m, cu_seqlens, per_token=spec.per_token_loss, denominator=denominator)
    else:  # the policy-gradient term reduced by the user's function, the rest as always
        rest, _ = aggregate(tok - pg, m, cu_seqlens, per_token=spec.per_token_loss, denominator=denominator)
        loss = reduced_pg(pg_reducer, spec, pg, pg_mask, cu_seqlens, response_lengths) / denominator + rest
        per_sample = per_sample_mean(tok.detach(), m, cu_seqlens)
    with torch.no_grad():
        ratio = torch.exp(log_probs - old_log_probs)
        stats.update(pg_loss=(pg * m).sum(), entropy=(entropy * m).sum(), kl=(kl_t * m).sum(),
                     clipfrac=(clipped * m).sum(), ratio=(ratio * m).sum(),
                     mismatch=((rollout_log_probs - old_log_probs).abs() * m).sum(), tokens=m.sum())
    return loss, stats, per_sample.detach()


def custom_tis(tis: Hook, *, pg_loss: torch.Tensor, old_log_probs: torch.Tensor,
               rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
               response_lengths: list[int] | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """--custom-tis-function-path on one packed micro-batch, with slime's contract: the function sees each sample's
    response tokens ([R_i] tensors in lists, the policy loss concatenated [ΣR]) and returns (pg_loss [ΣR], masks,
    metrics). Returns the policy loss [T] (times the returned masks: a token they zero leaves the loss, while the
    aggregate's per-sample denominators stay the original mask's, as in slime), the metrics' token sums over
    the original trained tokens, keyed tis_<key> (or <key> when it starts with tis), and the returned masks [T]."""
    from engine.rollout.hooks import HookError, call_hook

    flag = "--custom-tis-function-path"
    fn, path, args = tis
    spans, idx = response_index(cu_seqlens, response_lengths, flag)
    ends = cu_seqlens[1:].tolist()

    def per_sample(x: torch.Tensor) -> list[torch.Tensor]:
        return [x[a:b] for a, b in spans]

    total = sum(b - a for a, b in spans)
    out = call_hook(flag, path, fn, args, pg_loss=pg_loss[idx], train_log_probs=per_sample(old_log_probs),
                    rollout_log_probs=per_sample(rollout_log_probs), loss_masks=per_sample(loss_mask),
                    total_lengths=[int(b - a) for a, b in zip(cu_seqlens[:-1].tolist(), ends)],
                    response_lengths=list(response_lengths))
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], torch.Tensor) and isinstance(out[2], dict)):
        raise HookError.of(flag, path, f"returned {type(out).__name__}; expected (pg_loss, loss_masks, metrics)")
    pg, masks, metrics = out
    masks = torch.cat(list(masks)) if isinstance(masks, (list, tuple)) else masks
    if pg.shape != (total,) or not isinstance(masks, torch.Tensor) or masks.shape != (total,):
        raise HookError.of(flag, path, f"returned pg_loss of shape {tuple(pg.shape)} and masks of "
                                       f"{tuple(getattr(masks, 'shape', ()))}; both must cover the {total} response "
                                       "tokens it was given ([ΣR], or masks as a list of [R_i])")
    full, kept = torch.zeros_like(pg_loss), torch.zeros_like(loss_mask)
    full[idx], kept[idx] = pg.to(pg_loss.dtype), masks.to(loss_mask.dtype).detach()
    stats: dict[str, torch.Tensor] = {}
    for k, v in metrics.items():
        v = torch.as_tensor(v, device=pg_loss.device)
        if not str(k).isidentifier() or v.numel() not in (1, total):
            raise HookError.of(flag, path, f"returned metric {k!r} of {v.numel()} values; metrics are per-token "
                                           f"tensors [{total}] (or scalars) under names like 'tis_abs'")
        t = torch.zeros_like(pg_loss)
        t[idx] = v.detach().to(pg_loss.dtype).expand(total)
        stats[k if str(k).startswith("tis") else f"tis_{k}"] = (t * loss_mask).sum()
    return full * kept, stats, kept


def reduced_pg(hook: Hook, spec: LossSpec, pg: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
               response_lengths: list[int] | None) -> torch.Tensor:
    """--custom-pg-loss-reducer-function-path on one packed micro-batch, with slime's contract:
    `fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)` returns a reducer, which maps the
    response tokens' policy loss [ΣR] to this micro-batch's sum in the default's units (Σ over its samples of what
    each contributes: the per-sample mean by default, the token sum with --calculate-per-token-loss); the caller
    divides by the step's G (or N) as for the default. Dr.GRPO: Σ_t pg_t / a constant per sample."""
    from engine.rollout.hooks import HookError, call_hook

    flag = "--custom-pg-loss-reducer-function-path"
    fn, path, _args = hook
    spans, idx = response_index(cu_seqlens, response_lengths, flag)
    reducer = call_hook(flag, path, fn, [int(b - a) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())],
                        list(response_lengths or []), [loss_mask[a:b] for a, b in spans], spec.per_token_loss)
    if not callable(reducer):
        raise HookError.of(flag, path, f"returned {type(reducer).__name__}; expected a reducer: a function of the "
                                       "response tokens' pg_loss [ΣR] returning a scalar tensor")
    out = call_hook(flag, path, reducer, pg[idx])
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise HookError.of(flag, path, f"its reducer returned {type(out).__name__} "
                                       f"{tuple(getattr(out, 'shape', ()))}; expected a scalar tensor")
    if pg.requires_grad and not out.requires_grad:
        raise HookError.of(flag, path, "its reducer returned a value without a gradient: reduce the pg_loss tensor "
                                       "it is given (not a copy of its numbers)")
    return out.reshape(()).to(pg.dtype)


def sft_objective(spec: LossSpec, *, log_probs: torch.Tensor, entropy: torch.Tensor, loss_mask: torch.Tensor,
                  cu_seqlens: torch.Tensor, denominator: float
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """--loss-type sft_loss: ℓ_t = −log π(token t), aggregated as the policy loss (slime's sft_loss_function).
    (loss share, token sums {nll, entropy, tokens}, per-sample loss [S])."""
    nll = -log_probs  # [T]
    loss, per_sample = aggregate(nll, loss_mask, cu_seqlens, per_token=spec.per_token_loss, denominator=denominator)
    with torch.no_grad():
        stats = {"nll": (nll * loss_mask).sum(), "entropy": (entropy * loss_mask).sum(), "tokens": loss_mask.sum()}
    return loss, stats, per_sample.detach()


def custom_objective(fn: Callable, path: str, args: Any, spec: LossSpec, *, log_probs: torch.Tensor,
                     entropy: torch.Tensor, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None,
                     rollout_log_probs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                     cu_seqlens: torch.Tensor, sample_ids: list[int], denominator: float
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """--loss-type custom_loss: `fn(args, batch, sum_of_sample_mean) -> (loss, metrics)` on one micro-batch.

    sum_of_sample_mean(x [T]) is this micro-batch's share of the step's aggregate of x (per-sample token means
    summed over the step's samples / G, or with --calculate-per-token-loss Σ x / N), so the shares of every
    micro-batch and DP rank add up to the step's value: what the loss must return, as the built-in losses do.
    Metrics (scalars the function reduced the same way) come back as `custom_<key>` step sums. A function that
    raises or returns something else is a HookError naming the flag. Per-sample losses: the micro-batch's loss for
    each of its samples (which sample made a NaN cannot be told apart)."""
    from engine.rollout.hooks import HookError, call_hook

    flag = "--custom-loss-function-path"

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        return aggregate(x, loss_mask, cu_seqlens, per_token=spec.per_token_loss, denominator=denominator)[0]

    batch = {"log_probs": log_probs, "entropy": entropy, "old_log_probs": old_log_probs,
             "ref_log_probs": ref_log_probs, "rollout_log_probs": rollout_log_probs, "advantages": advantages,
             "loss_mask": loss_mask, "cu_seqlens": cu_seqlens, "sample_ids": list(sample_ids)}
    out = call_hook(flag, path, fn, args, batch, sum_of_sample_mean)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and out[0].numel() == 1
            and isinstance(out[1], dict)):
        raise HookError.of(flag, path, f"returned {type(out).__name__}; expected (loss, metrics): a scalar tensor "
                                       "and a dict of scalars")
    loss, metrics = out
    if not loss.requires_grad:
        raise HookError.of(flag, path, "returned a loss without a gradient: compute it from batch['log_probs'] "
                                       "(or batch['entropy'])")
    stats: dict[str, torch.Tensor] = {"tokens": loss_mask.sum()}
    for k, v in metrics.items():
        if not (isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)) \
                or isinstance(v, bool) or not str(k).isidentifier():
            raise HookError.of(flag, path, f"returned metric {k!r} = {type(v).__name__}; metrics are scalars "
                                           "(e.g. sum_of_sample_mean(x).detach()) under names like 'my_term'")
        stats[f"custom_{k}"] = torch.as_tensor(v, dtype=torch.float64).detach().reshape(())
    S = cu_seqlens.numel() - 1
    return loss.reshape(()), stats, loss.detach().reshape(()).expand(S).clone()


def step_objective(spec: LossSpec, *, hooks: StepHooks | None, sample_ids: list[int],
                   log_probs: torch.Tensor, entropy: torch.Tensor, old_log_probs: torch.Tensor | None,
                   ref_log_probs: torch.Tensor | None, rollout_log_probs: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, denominator: float,
                   response_lengths: list[int] | None = None, tis_scale: float | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The --loss-type's (loss share, stats, per-sample losses) of one packed micro-batch: the one dispatch every
    train backend calls, with the run's StepHooks (None: none set); old_log_probs may be None only for sft_loss,
    which reads none of them, and with --disable-compute-advantages-and-returns (the custom loss gets None)."""
    hooks = hooks or StepHooks()
    if spec.loss_type == "sft_loss":
        return sft_objective(spec, log_probs=log_probs, entropy=entropy, loss_mask=loss_mask, cu_seqlens=cu_seqlens,
                             denominator=denominator)
    if not spec.advantages:  # --disable-compute-advantages-and-returns (custom_loss only): none was computed
        old_log_probs = ref_log_probs = advantages = None
    elif old_log_probs is None:
        raise ValueError(f"--loss-type {spec.loss_type} needs the old log-probs of the micro-batch")
    tensors = dict(log_probs=log_probs, entropy=entropy, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                   rollout_log_probs=rollout_log_probs, advantages=advantages, loss_mask=loss_mask,
                   cu_seqlens=cu_seqlens, denominator=denominator)
    if spec.loss_type == "custom_loss":
        if hooks.custom_loss is None:
            raise ValueError("--loss-type custom_loss without its function (--custom-loss-function-path)")
        fn, path, args = hooks.custom_loss
        return custom_objective(fn, path, args, spec, sample_ids=sample_ids, **tensors)
    return policy_objective(spec, **tensors, tis=hooks.tis, pg_reducer=hooks.pg_reducer,
                            response_lengths=response_lengths, tis_scale=tis_scale)


def value_objective(spec: LossSpec, *, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                    loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, denominator: float
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss share, token sums, per-sample loss [S]) of the critic on one packed micro-batch."""
    vl, clipped = value_loss(values, old_values, returns, value_clip=spec.value_clip)  # [T], [T]
    loss, per_sample = aggregate(vl, loss_mask, cu_seqlens, per_token=spec.per_token_loss, denominator=denominator)
    stats = {"value_loss": (vl.detach() * loss_mask).sum(), "value_clipfrac": (clipped * loss_mask).sum(),
             "tokens": loss_mask.sum()}
    return loss, stats, per_sample.detach()

