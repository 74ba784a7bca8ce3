"""Hooks for tests/test_hooks.py, loaded by path as a user's would be (`hook_fakes:two_turns`)."""
from __future__ import annotations

from engine.rollout.hooks import DynamicFilterOutput, RolloutFnTrainOutput
from engine.samples import Sample, Status

TOOL_TEXT = "<out>7</out>"
CALLS: list[dict] = []  # what the hooks saw, for assertions


async def two_turns(args, sample, sampling_params):
    """Model turn (≤ 3 tokens), a fixed tool output (mask 0), model turn again: the multi-turn contract."""
    tok = args.tokenizer
    CALLS.append({"seed": sampling_params.get("sampling_seed"), "rollout_id": args.rollout_id,
                  "n": args.n_samples_per_prompt})
    first = await args.engine.generate(sample.tokens, {**sampling_params, "max_new_tokens": 3, "stop_token_ids": []})
    t1 = [int(t[1]) for t in first["meta_info"]["output_token_logprobs"]]
    l1 = [float(t[0]) for t in first["meta_info"]["output_token_logprobs"]]
    tool = tok.encode(TOOL_TEXT, add_special_tokens=False)
    second = await args.engine.generate(sample.tokens + t1 + tool,
                                        {**sampling_params, "max_new_tokens": 3, "stop_token_ids": []})
    t2 = [int(t[1]) for t in second["meta_info"]["output_token_logprobs"]]
    l2 = [float(t[0]) for t in second["meta_info"]["output_token_logprobs"]]
    sample.tokens = sample.tokens + t1 + tool + t2
    sample.response_length = len(t1) + len(tool) + len(t2)
    sample.loss_mask = [1] * len(t1) + [0] * len(tool) + [1] * len(t2)
    sample.rollout_log_probs = l1 + [0.0] * len(tool) + l2
    sample.response = tok.decode(t1) + TOOL_TEXT + tok.decode(t2)
    sample.status = Status.COMPLETED
    sample.metadata["turns"] = (len(t1), len(tool), len(t2))
    sample.metadata["round_number"] = 2
    return sample


async def raises(args, sample, sampling_params):
    raise KeyError("the tool server's reply had no 'result'")


async def short_mask(args, sample, sampling_params):
    out = await args.engine.generate(sample.tokens, sampling_params)
    new = [int(t[1]) for t in out["meta_info"]["output_token_logprobs"]]
    sample.tokens += new
    sample.response_length = len(new)
    sample.loss_mask = [1] * (len(new) - 1)  # one short
    sample.rollout_log_probs = [float(t[0]) for t in out["meta_info"]["output_token_logprobs"]]
    sample.status = Status.COMPLETED
    return sample


async def fan_out(args, sample, sampling_params):
    return [sample, sample]


def slime_filter(args, samples):
    """slime's filter signature: (args, samples) -> DynamicFilterOutput."""
    keep = len({s.scalar_reward for s in samples}) > 1
    return DynamicFilterOutput(keep=keep, reason=None if keep else "zero_std")


def broken_filter(args, samples):
    return 1 / 0


def drop_truncated(args, groups):
    """--rollout-sample-filter-path: truncated samples stay out of the loss."""
    for g in groups:
        for s in g:
            s.remove_sample = s.status == Status.TRUNCATED


def broken_sample_filter(args, groups):
    return groups.samples  # a list has no .samples


def minus_one(args, samples):
    """--custom-reward-post-process-path: raw rewards, and raw − 1 as the advantage input."""
    raw = [s.scalar_reward for s in samples]
    return raw, [r - 1.0 for r in raw]


def wrong_count(args, samples):
    return [0.0], [0.0]


def _fixed_groups(args, data_source, reward):
    """B groups of n fixed one-token answers ("0", "1", …) from the data source's prompts; reward(j) for answer j."""
    groups = data_source.get_samples(args.rollout_batch_size)
    for g in groups:
        for j, s in enumerate(g):
            s.tokens = s.tokens + [48 + j]
            s.response_length, s.loss_mask, s.rollout_log_probs = 1, [1], [-0.5]
            s.response, s.status = str(j), Status.COMPLETED
            s.reward = reward(j)
    return groups


def fixed_rollout(args, rollout_id, data_source, evaluation=False):
    """--rollout-function-path without an engine: B groups of n fixed samples from the data source's prompts."""
    groups = _fixed_groups(args, data_source, lambda j: None if j == 0 else float(j))  # None: the run's reward
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/custom_metric": 3.0, "note": "text dropped"})


def short_rollout(args, rollout_id, data_source, evaluation=False):
    return data_source.get_samples(args.rollout_batch_size)[:1]


class CountingSource:
    """--data-source-path: prompts made on the fly, resumable through state_dict / load_state_dict."""

    def __init__(self, args):
        self.args, self.next = args, 0

    def get_samples(self, num_samples):
        tok, out = self.args.tokenizer, []
        for _ in range(num_samples):
            a = self.next
            self.next += 1
            prompt = f"{a}+1="
            ids = tok.encode(prompt, add_special_tokens=False)
            out.append([Sample(index=0, group_index=0, rollout_id=-1, prompt=prompt, tokens=list(ids),
                               label=str(a + 1), metadata={"source": "counting"})
                        for _ in range(self.args.n_samples_per_prompt)])
        return out

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, d):
        self.next = d["next"]


class WrongGroups(CountingSource):
    def get_samples(self, num_samples):
        return [g[:1] for g in super().get_samples(num_samples)]


def raising_rollout(args, rollout_id, data_source, evaluation=False):
    raise ValueError("boom in the rollout")


def raising_post_process(args, samples):
    raise ValueError("boom in the post-process")


class RaisingSource(CountingSource):
    def get_samples(self, num_samples):
        raise ValueError("boom in the data source")


class RaisingInit:
    def __init__(self, args):
        raise ValueError("boom building the data source")


async def slime_reward(args, sample, **kwargs):
    """slime's custom reward signature: (args, sample)."""
    assert args.n_samples_per_prompt >= 1  # the run's flags are there
    return float(sample.response.strip() == sample.label) + 10.0


def two_part_reward(sample):
    """--custom-rm-path returning a dict: "correct" (exact match) and "format" (1.0 for any answer): --reward-key
    picks the training reward from them."""
    return {"correct": float(sample.response.strip() == sample.label), "format": 1.0}


def reward_with_a_reason(sample):
    """--custom-rm-path returning a dict with a category: why the answer scored as it did."""
    text = sample.response.strip()
    why = "correct" if text == sample.label else "empty" if not text else "not a number" if not text.isdigit() \
        else "wrong number"
    return {"score": float(why == "correct"), "why": why}


def reason_rollout(args, rollout_id, data_source, evaluation=False):
    """--rollout-function-path setting dict rewards with a category itself."""
    return _fixed_groups(args, data_source, lambda j: {"score": float(j), "why": "right" if j else "wrong"})


def dict_reward_rollout(args, rollout_id, data_source, evaluation=False):
    """--rollout-function-path that sets dict rewards itself (never scored by the run's reward)."""
    return _fixed_groups(args, data_source, lambda j: {"correct": float(j), "format": 0.5})


ALL_SAMPLES: list = []


def record_all_samples(args, all_samples, data_source):
    """--rollout-all-samples-process-path (slime's signature): keeps what it was given."""
    ALL_SAMPLES.append((args.rollout_id, all_samples, data_source))
    return "ignored"


def broken_all_samples(args, all_samples, data_source):
    return all_samples[99]


POSTPROCESS_CALLS: list = []


def halve_masks(args, rollout_id, rollout_data):
    """--rollout-data-postprocess-path: each sample's second half of its response leaves the loss."""
    POSTPROCESS_CALLS.append((rollout_id, {k: v for k, v in rollout_data.items()}))
    masks = [m.clone() for m in rollout_data["loss_masks"]]
    for m in masks:
        m[len(m) // 2:] = 0
    rollout_data["loss_masks"] = masks


def double_advantages(args, rollout_id, rollout_data):
    rollout_data["advantages"] = [2 * a for a in rollout_data["advantages"]]


def scale_advantages(args, rollout_id, rollout_data):
    """Reads a --custom-config argument (args.adv_scale) on the train worker."""
    rollout_data["advantages"] = [args.adv_scale * a for a in rollout_data["advantages"]]


def raise_masks(args, rollout_id, rollout_data):
    rollout_data["loss_masks"] = [m + 1 for m in rollout_data["loss_masks"]]  # above the rollout's own


def record_only(args, rollout_id, rollout_data):
    """--rollout-data-postprocess-path that changes nothing and keeps what it was given."""
    POSTPROCESS_CALLS.append((rollout_id, dict(rollout_data)))


MEGATRON_CALLS: list = []


def megatron_init(args):
    """--custom-megatron-init-path."""
    MEGATRON_CALLS.append(("init", args.train_backend))


def megatron_before_log_prob(args, model, store_prefix):
    """--custom-megatron-before-log-prob-hook-path."""
    MEGATRON_CALLS.append(("log_prob", len(model), store_prefix))


def megatron_before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    """--custom-megatron-before-train-step-hook-path."""
    MEGATRON_CALLS.append(("train_step", rollout_id, step_id, len(model), optimizer is not None, opt_param_scheduler))


# ---- --rollout-sample-hook-path --------------------------------------------------------------------------------
SAMPLE_HOOKS: list[dict] = []


def tag_sample(args, sample, *, rollout_id=None, evaluation=False):
    """Sync, changes the sample in place, returns None: the sample is kept; records what it was given."""
    SAMPLE_HOOKS.append({"hook": "tag", "rollout_id": rollout_id, "evaluation": evaluation, "index": sample.index,
                         "reward": sample.reward, "response_length": sample.response_length})
    sample.metadata["tagged"] = True


async def truncate_to_two(args, sample):
    """Async, without the keyword arguments, returns a new Sample: the response cut to 2 tokens."""
    import copy

    SAMPLE_HOOKS.append({"hook": "truncate", "tagged": sample.metadata.get("tagged", False)})
    out = copy.deepcopy(sample)
    cut = sample.response_length - min(sample.response_length, 2)
    if cut:
        out.tokens, out.response_length = out.tokens[:-cut], 2
        out.loss_mask, out.rollout_log_probs = out.loss_mask[:2], out.rollout_log_probs[:2]
        out.response = args.tokenizer.decode(out.tokens[-2:])
    return out


def returns_a_string(args, sample):
    return "not a sample"


def breaks_the_mask(args, sample):
    sample.loss_mask = sample.loss_mask + [1]


def cut_to_custom_length(args, sample):
    """Reads a --custom-config-path argument (args.cut_to) in the rollout."""
    SAMPLE_HOOKS.append({"hook": "cut", "cut_to": args.cut_to})
    keep = min(sample.response_length, args.cut_to)
    cut = sample.response_length - keep
    if cut:
        sample.tokens, sample.response_length = sample.tokens[:-cut], keep
        sample.loss_mask, sample.rollout_log_probs = sample.loss_mask[:keep], sample.rollout_log_probs[:keep]
