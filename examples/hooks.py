"""One runnable example per custom-rollout hook (slime's flags and contracts; docs/hooks.md). Each runs on the demo
task from the repo root, e.g.

    rollflow train --config examples/demo.yaml --num-rollout 5 --custom-reward-post-process-path examples/hooks.py:leave_one_out

(--custom-generate-function-path has its own example: examples/tool_calc.py with examples/tool.yaml.)
"""
from __future__ import annotations

import asyncio
import random

from engine.rollout.hooks import DynamicFilterOutput, RolloutFnEvalOutput, RolloutFnTrainOutput
from engine.samples import Sample, Status


# --custom-reward-post-process-path examples/hooks.py:leave_one_out
def leave_one_out(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """RLOO's baseline instead of GRPO's normalisation: each reward minus the mean of the other n − 1 of its group.
    Returns (raw_rewards, rewards); the rewards are what the advantage estimator starts from."""
    n = args.n_samples_per_prompt
    raw = [s.scalar_reward for s in samples]
    out = []
    for i, r in enumerate(raw):
        group = raw[i - i % n: i - i % n + n]
        out.append(r - (sum(group) - r) / max(n - 1, 1))
    return raw, out


# --dynamic-sampling-filter-path examples/hooks.py:some_right_some_wrong --over-sampling-batch-size 16
def some_right_some_wrong(args, group: list[Sample]) -> DynamicFilterOutput:
    """DAPO's dynamic sampling: a group whose rewards all agree teaches GRPO nothing (all advantages 0)."""
    rewards = {s.scalar_reward for s in group}
    return DynamicFilterOutput(keep=len(rewards) > 1, reason=None if len(rewards) > 1 else "all_equal")


# --rollout-sample-filter-path examples/hooks.py:drop_truncated
def drop_truncated(args, groups: list[list[Sample]]) -> None:
    """Keep samples that hit the length limit out of the loss (they still count in their group's baseline)."""
    for group in groups:
        for s in group:
            if s.status == Status.TRUNCATED:
                s.remove_sample = True


# --data-source-path examples/hooks.py:AdditionCurriculum
class AdditionCurriculum:
    """Prompts made on the fly instead of read from --prompt-data: additions whose operands grow with the number
    of prompts handed out (a curriculum). state_dict / load_state_dict make it resumable: the checkpoint keeps it."""

    def __init__(self, args):
        self.args, self.drawn = args, 0

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_samples):
            rng = random.Random(f"{self.args.seed}:{self.drawn}")
            top = min(99, 9 + self.drawn // 4)  # one-digit sums first
            a, b = rng.randint(0, top), rng.randint(0, top)
            self.drawn += 1
            prompt = f"{a}+{b}="
            groups.append([Sample(index=0, group_index=0, rollout_id=-1, prompt=prompt, label=str(a + b),
                                  metadata={"top": top}) for _ in range(self.args.n_samples_per_prompt)])
        return groups  # tokens left empty: the prompt is rendered (chat template) by the rollout

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = int(state["drawn"])


# --rollout-function-path examples/hooks.py:rollout
def rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput:
    """A whole rollout written by hand: B groups of n samples, every sample one /generate on the engines (in
    flight together, so the engine batches them), scored here. What the built-in rollout does, minus over-sampling,
    as a starting point for your own."""
    tok, n = args.tokenizer, args.n_samples_per_prompt
    groups = data_source.get_samples(args.rollout_batch_size)

    async def one(s: Sample, seed: int) -> Sample:
        out = await args.engine.generate(s.tokens, {**args.sampling_params, "sampling_seed": seed})
        triples = out["meta_info"]["output_token_logprobs"]
        new = [int(t[1]) for t in triples]
        s.tokens = s.tokens + new
        s.response_length, s.loss_mask = len(new), [1] * len(new)
        s.rollout_log_probs = [float(t[0]) for t in triples]
        s.response = tok.decode(new, skip_special_tokens=True)
        s.status = Status.TRUNCATED if out["meta_info"]["finish_reason"]["type"] == "length" else Status.COMPLETED
        s.reward = float(s.response.strip() == str(s.label).strip())
        return s

    async def everything():
        return await asyncio.gather(*(one(s, (args.seed * 1_000_003 + rollout_id * 7919 + i * n + j) % 2**32)
                                      for i, g in enumerate(groups) for j, s in enumerate(g)))

    flat = asyncio.run(everything())
    groups = [flat[i * n:(i + 1) * n] for i in range(len(groups))]
    right = sum(s.reward for s in flat) / len(flat)
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/custom_accuracy": right})


# --eval-function-path examples/hooks.py:evaluate
def evaluate(args, rollout_id: int, data_source, evaluation: bool = True) -> RolloutFnEvalOutput:
    """An evaluation written by hand: every prompt of every eval set (args.eval_sets) answered greedily on the
    engines, scored by exact match. What the built-in greedy evaluation does, as a starting point for your own
    (a multi-turn agent, a judge model, pass@k over your own samples)."""
    tok = args.tokenizer
    params = {**args.sampling_params, "temperature": 0.0}

    def prompt_ids(prompt) -> list[int]:
        if not args.apply_chat_template:
            return tok(str(prompt))["input_ids"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]

    async def one(row) -> tuple[float, bool]:
        out = await args.engine.generate(prompt_ids(row.prompt), params)
        answer = tok.decode([int(t[1]) for t in out["meta_info"]["output_token_logprobs"]], skip_special_tokens=True)
        return float(answer.strip() == str(row.label).strip()), out["meta_info"]["finish_reason"]["type"] == "length"

    async def everything():
        return {name: await asyncio.gather(*(one(r) for r in rows)) for name, rows in args.eval_sets.items()}

    scored = asyncio.run(everything())
    return RolloutFnEvalOutput(data={name: {"rewards": [r for r, _ in got], "truncated": [t for _, t in got]}
                                     for name, got in scored.items()})


# --loss-type custom_loss --custom-loss-function-path examples/hooks.py:vanilla_policy_gradient
def vanilla_policy_gradient(args, batch: dict, sum_of_sample_mean) -> tuple:
    """The policy gradient without PPO's clip: ℓ_t = −ρ_t·A_t with ρ = π/π_old, and its mean ratio as a metric
    (logged as train/custom_ratio). Where π = π_old (a rollout's first step) its gradient is the clipped loss's: the
    clip is inactive at ρ = 1. batch holds [T] tensors of one packed micro-batch; sum_of_sample_mean(x) is its
    share of the step's aggregate of x, which is what a loss returns."""
    import torch

    ratio = torch.exp(batch["log_probs"] - batch["old_log_probs"])  # [T]
    loss = sum_of_sample_mean(-ratio * batch["advantages"])
    return loss, {"ratio": sum_of_sample_mean(ratio.detach())}


# --use-tis --custom-tis-function-path examples/hooks.py:icepop
def icepop(args, *, pg_loss, train_log_probs: list, rollout_log_probs: list, loss_masks: list, **kwargs) -> tuple:
    """IcePop (slime's icepop_function): a token whose ratio π_train_old / π_rollout lies outside
    [--tis-clip-low, --tis-clip] gets weight 0 (TIS would clamp it), the others weight ratio. pg_loss is the
    response tokens' policy loss [ΣR]; the log-probs and masks are lists of [R_i]. Its metrics are logged as
    train/tis (the mean ratio), train/tis_clipfrac (the share zeroed) and train/tis_abs (mean |ratio − 1|).
    Without --use-tis (--get-mismatch-metrics) it leaves the loss as it is and only measures, as slime's MIS
    helper does."""
    import torch

    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))  # [ΣR]
    weight = torch.where((ratio >= args.tis_clip_low) & (ratio <= args.tis_clip), ratio, torch.zeros_like(ratio))
    metrics = {"tis": ratio.detach(), "tis_clipfrac": (weight != ratio).float(), "tis_abs": (ratio - 1).abs().detach()}
    return (pg_loss * weight if args.use_tis else pg_loss), loss_masks, metrics


# --custom-pg-loss-reducer-function-path examples/hooks.py:dr_grpo_reducer (with --disable-grpo-std-normalization)
DR_GRPO_DIVISOR = 8.0  # a constant for every sample: the generation budget, the demo's --rollout-max-response-len


def dr_grpo_reducer(total_lengths: list, response_lengths: list, loss_masks: list,
                    calculate_per_token_loss: bool = False):
    """Dr.GRPO's aggregation (slime's examples/DrGRPO): each sample's policy loss summed over its trained tokens
    and divided by the same constant, instead of by its own token count, so that long wrong answers are not
    penalised less per token. With --calculate-per-token-loss the default token sum is already length-unbiased and
    is returned as is. The reducer maps the micro-batch's response-token pg_loss [ΣR] to its sum over samples."""
    def reduce(pg_loss):
        parts = pg_loss.split(list(response_lengths))
        if calculate_per_token_loss:
            return sum((x * m).sum() for x, m in zip(parts, loss_masks))
        return sum((x * m).sum() / DR_GRPO_DIVISOR for x, m in zip(parts, loss_masks))

    return reduce


# --rollout-data-postprocess-path examples/hooks.py:mask_confident_tokens
CONFIDENT_LOGP = -0.05  # log π_old above this (p > 0.95): the token is left out of the loss


def mask_confident_tokens(args, rollout_id: int, rollout_data: dict) -> None:
    """Train on the tokens the policy was unsure of (the idea behind training on high-entropy "forking" tokens only):
    a token whose old log-prob is above CONFIDENT_LOGP gets loss mask 0. Called once per train rank and rollout,
    after the log-probs and advantages; rollout_data's lists hold this rank's samples, one [R_i] tensor each."""
    rollout_data["loss_masks"] = [m * (lp <= CONFIDENT_LOGP) for m, lp in
                                  zip(rollout_data["loss_masks"], rollout_data["log_probs"])]


# --rollout-data-postprocess-path examples/hooks.py:keep_high_entropy_tokens --use-rollout-entropy
HIGH_ENTROPY_SHARE = 0.2  # the share of the trained tokens that keeps its loss


def keep_high_entropy_tokens(args, rollout_id: int, rollout_data: dict) -> None:
    """Train only on the highest-entropy ("forking") tokens, the top HIGH_ENTROPY_SHARE of this rank's trained
    tokens by the old policy's entropy (Wang et al. 2025, "Beyond the 80/20 rule"); needs --use-rollout-entropy,
    which puts the entropies in rollout_data["entropy"]."""
    import torch

    masks, entropy = rollout_data["loss_masks"], rollout_data["entropy"]
    trained = torch.cat([e[m > 0] for e, m in zip(entropy, masks)])
    if trained.numel() == 0:
        return
    cut = torch.quantile(trained.float(), 1 - HIGH_ENTROPY_SHARE)
    rollout_data["loss_masks"] = [m * (e >= cut) for m, e in zip(masks, entropy)]


# --custom-advantage-function-path examples/hooks.py:rloo_advantages
def rloo_advantages(args, rollout_data: dict) -> None:
    """RLOO as an advantage function (slime's contract): each sample's advantage is its reward minus the mean of
    the other n − 1 rewards of its group, on every response token. rollout_data holds this micro-batch's samples;
    all_rewards has the whole rollout's, indexed by sample id (groups of n consecutive ids)."""
    import torch

    n, every = args.n_samples_per_prompt, rollout_data["all_rewards"]
    adv = []
    for i, r, length in zip(rollout_data["sample_ids"], rollout_data["rewards"], rollout_data["response_lengths"]):
        group = every[i - i % n: i - i % n + n]
        adv.append(torch.full((length,), r - (sum(group) - r) / max(n - 1, 1)))
    rollout_data["advantages"] = adv
    rollout_data["returns"] = adv


# --custom-rm-path examples/hooks.py:no_reward — every sample scores 0, so GRPO's advantages are all 0: with
# --use-opd the teacher's penalty is the only signal (pure on-policy distillation; examples/opd.yaml)
def no_reward(sample: Sample) -> float:
    return 0.0


# --custom-rollout-log-function-path examples/hooks.py:log_answer_lengths — a metric of your own next to rollflow's;
# returning True would replace rollflow's logging of the rollout (its metrics stay in the run's history)
def log_answer_lengths(rollout_id: int, args, samples: list[Sample], rollout_extra_metrics: dict,
                       rollout_time: float) -> bool:
    digits = [sum(c.isdigit() for c in s.response) for s in samples]
    args.tracker.log_metrics({"custom/answer_digits_mean": sum(digits) / max(len(digits), 1)}, step=rollout_id)
    return False


# --custom-eval-rollout-log-function-path examples/hooks.py:log_eval_truncation — per eval set, the share of
# answers cut at --eval-max-response-len, logged next to rollflow's eval metrics
def log_eval_truncation(rollout_id: int, args, data: dict, extra_metrics: dict) -> bool:
    for name, d in data.items():
        args.tracker.log_metrics({f"custom/{name}_truncated": sum(d["truncated"]) / max(len(d["truncated"]), 1)},
                                 step=rollout_id)
    return False
