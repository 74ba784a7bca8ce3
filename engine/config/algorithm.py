"""RL algorithm flags (defaults as slime)."""
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from engine.config.base import Section, flags, given
from engine.diagnosis import ConfigError, Diagnosis

#: Estimators whose advantage is the group-normalised reward (no token-level reward shaping).
GROUP_ESTIMATORS = ("grpo", "gspo", "cispo")


class AlgorithmArgs(Section):
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"
    """The trainer's loss (slime's flag). policy_loss: the RL objective of --advantage-estimator. sft_loss: supervised fine-tuning, the negative log-likelihood of the trained tokens (loss mask 1), aggregated as the policy loss is (per-sample token mean, or --calculate-per-token-loss); no old-log-prob, reference or advantage computation, no mismatch check. With engine.rollout.sft:generate_rollout and --debug-train-only it fine-tunes on the prompt file's answers or conversations (docs/algorithms.md, "SFT"). custom_loss: --custom-loss-function-path's. Both train backends."""

    disable_compute_advantages_and_returns: bool = False
    """With --loss-type custom_loss: compute no advantages, returns, old or reference log-probs before the steps (slime's flag), for a loss that reads none of them (a supervised or distillation loss of your own): the rollout's no-grad forwards are skipped, and the function's batch carries old_log_probs, ref_log_probs and advantages as None. As with sft_loss there is then no per-rollout train/mismatch check (the probe after each weight sync still runs). Refused with the flags that would read them (KL, TIS/MIS, OPD, a custom advantage function, ppo's critic, …)."""

    custom_loss_function_path: Optional[str] = None
    """--loss-type custom_loss: `module:function` or `path/to/file.py:function`, called per micro-batch as fn(args, batch, sum_of_sample_mean) -> (loss, metrics). batch holds [T] tensors of the packed micro-batch: log_probs and entropy (with gradients), old_log_probs, ref_log_probs (None without KL), rollout_log_probs, advantages (the three None with --disable-compute-advantages-and-returns), loss_mask, plus cu_seqlens and sample_ids; sum_of_sample_mean(x) is this micro-batch's share of the step's aggregate of x (what the loss must return; slime's reducer). Each metric (a scalar, reduced the same way by the function) is logged as train/custom_<key>. Differs from slime's contract: batch carries the log-probs, not the logits."""

    advantage_estimator: Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                 "ppo"] = "grpo"
    """Advantage estimator: grpo, gspo (sequence-level ratio), cispo (clipped IS weight, stop-gradient), reinforce_plus_plus, reinforce_plus_plus_baseline, or ppo (GAE with a critic)."""

    custom_advantage_function_path: Optional[str] = None
    """Replace the advantage estimator's computation (slime's flag): `module:function` or `path/to/file.py:function`, called on each train rank per micro-batch as fn(args, rollout_data) before any update. rollout_data (slime's keys) holds per-sample lists over the response tokens — log_probs (the old policy's), ref_log_probs and values (None when not computed), kl (the --kl-loss-type estimate of old vs reference; zeros without a reference), rollout_log_probs, loss_masks — and per-sample numbers: rewards (the scalar rewards, as --custom-reward-post-process-path left them; not group-normalised, unlike slime's grpo path), response_lengths, total_lengths, sample_ids; plus all_rewards, every reward of the rollout indexed by sample id, for group baselines. The function sets rollout_data["advantages"] and rollout_data["returns"] (the critic's targets with ppo; else the advantages) to lists of per-sample tensors of the response's length. --normalize-advantages still applies after it."""

    rollout_data_postprocess_path: Optional[str] = None
    """After the log-probs and advantages, before the rollout's first update (slime's flag and contract): `fn(args, rollout_id, rollout_data)`, once per train rank and rollout, e.g. to mask tokens by their log-probs. rollout_data holds the rank's samples as per-sample lists over their response tokens — loss_masks, log_probs (the old policy's), ref_log_probs and values (None when not computed), rollout_log_probs, advantages, returns — plus tokens (each whole sequence), rewards, response_lengths, total_lengths and sample_ids. It may rewrite loss_masks (only lower: 0 takes a token out of the loss and the token counts; a token the rollout left out cannot be put in), advantages and returns; the share of trained tokens it takes out is logged as train/postprocess_masked_share. The old log-probs are then always computed before the step (no reuse of the step's own forward). Not with --loss-type sft_loss. module:function or path/to/file.py:function."""

    use_rollout_entropy: bool = False
    """The old policy's forward before the update also gives each trained token's entropy (slime's flag), handed to --rollout-data-postprocess-path and --custom-advantage-function-path as rollout_data["entropy"] (per-sample [R_i] tensors), e.g. to train only on high-entropy tokens. That forward then always runs (with --use-rollout-logprobs too, where it is otherwise skipped). Needs one of those two functions: nothing else reads it."""

    use_opd: bool = False
    """On-policy distillation (slime's flag): on top of --advantage-estimator, every trained token's advantage gets −opd_kl_coef × (log π_old − log π_teacher), the reverse KL to a teacher on the student's own samples, logged as train/opd_reverse_kl. Needs --opd-type; with task rewards all equal (e.g. 0) it is pure distillation. Torch backend; not with --loss-type sft_loss / custom_loss. docs/algorithms.md, "On-policy distillation"."""

    opd_type: Optional[Literal["megatron", "sglang"]] = None
    """Where the teacher's log-probs come from (slime's flag and values): megatron — the teacher (--opd-teacher-load) is loaded into each train rank and scores the samples before the update (slime's Megatron backend; here both backends: the torch backend loads it as a model of its own, of any size with the student's vocabulary; the megatron backend reads it into the student's model, as slime's does, so there it has the student's architecture). sglang — a teacher server (--opd-teacher-url: SGLang, or `rollflow serve`) scores every sample's tokens right after the rollout (a prefill, /generate with max_new_tokens 0), e.g. a teacher larger than the trainer's GPUs."""

    opd_teacher_url: Optional[str] = None
    """--opd-type sglang: the teacher server (host:port or http(s)://host:port), SGLang's HTTP API, with the student's tokenizer; its --api-key in --opd-teacher-api-key. rollflow's flag (slime routes it through --rm-url and a custom reward)."""

    opd_teacher_api_key: Optional[str] = None
    """The --opd-teacher-url server's --api-key (sent as `Authorization: Bearer`; kept out of logs and MLflow)."""

    opd_kl_coef: float = Field(1.0, ge=0)
    """Weight of the on-policy distillation penalty (slime's flag)."""

    opd_teacher_load: Optional[str] = None
    """The teacher (slime's flag), with the student's tokenizer and vocabulary: a Hugging Face directory, or a --save directory (its latest iteration, or --opd-teacher-ckpt-step's). Required with --opd-type megatron."""

    opd_teacher_ckpt_step: Optional[int] = Field(None, ge=0)
    """Which iteration of the --opd-teacher-load checkpoint directory to load (slime's flag); default its latest (the marker)."""

    use_opsm: bool = False
    """Off-policy sequence masking (slime's flag, DeepSeek-V3.2's OPSM): a sample with a negative advantage whose mean log π_old − log π over its trained tokens is above --opsm-delta (the policy being updated has drifted from the one that sampled it) is left out of the policy loss; logged as train/opsm_masked, the share of trained tokens masked. Torch backend."""

    opsm_delta: float = Field(1e-4, ge=0)
    """--use-opsm's threshold on a sample's mean log π_old − log π (slime's flag and default)."""

    eps_clip: float = Field(0.2, gt=0)
    """PPO clip range ε: ratio clipped to [1-ε, 1+ε_high]."""

    eps_clip_high: Optional[float] = Field(None, gt=0)
    """Upper clip range ε_high (clip-higher); default: --eps-clip."""

    eps_clip_c: Optional[float] = Field(None, gt=1)
    """Dual-clip bound c > 1: the loss of a token with negative advantage is at most −c·A (default: off)."""

    use_kl_loss: bool = False
    """Add kl_loss_coef · KL(π‖π_ref) to the loss."""

    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL loss term (with --use-kl-loss; without it, an error)."""

    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator for the loss, the reward shaping (--kl-coef) and the logged metric."""

    use_unbiased_kl: bool = False
    """Unbiased KL loss (DeepSeek-V3.2's correction, slime's flag): each token's KL estimate is multiplied by π/π_old (with its gradient), since the tokens were sampled from π_old, not from the π being updated. It changes the KL loss and train/kl; the --kl-coef reward shaping is unchanged. Needs --use-kl-loss."""

    ref_update_interval: Optional[int] = Field(None, ge=1)
    """Every N rollouts the reference becomes the current policy (slime's flag: after training rollout i when (i + 1) % N == 0), so the KL term pulls toward recent weights instead of the start. Needs a KL term (--use-kl-loss, --kl-coef or --log-kl). Checkpoints then also hold the reference (iter_*/ref/), so a resume continues with the same one. Torch backend."""

    kl_coef: float = Field(0.0, ge=0)
    """KL reward shaping for ppo / reinforce_plus_plus(_baseline): token reward −kl_coef · KL(π_old‖π_ref)."""

    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight (loss -= entropy_coef · entropy)."""

    disable_grpo_std_normalization: bool = False
    """Dr.GRPO: subtract the group mean reward without dividing by the group std (grpo, gspo, cispo)."""

    disable_rewards_normalization: bool = False
    """Use the rewards as they are, without GRPO's group normalisation (slime's flag): no group mean subtracted and no std divided by, for grpo, gspo, cispo and reinforce_plus_plus_baseline (the others do not normalise)."""

    normalize_advantages: bool = False
    """Whiten advantages over the trained tokens of the whole rollout (all DP ranks): (A − mean) / std."""

    use_tis: bool = False
    """Truncated importance sampling against the engine: weight each token's policy loss by the ratio π_train_old / π_rollout (at --tis-level), bounded by --tis-mode to [--tis-clip-low, --tis-clip]."""

    tis_clip: float = Field(2.0, gt=0)
    """Upper bound of the TIS weight (with --use-tis, or a --custom-tis-function-path, which may read it)."""

    tis_clip_low: float = Field(0.0, ge=0)
    """Lower bound of the TIS weight (with --use-tis, or a --custom-tis-function-path, which may read it)."""

    tis_level: Literal["token", "sequence", "geometric"] = "token"
    """What --use-tis's ratio π_train_old / π_rollout is taken over (slime's flag): token (each token its own), sequence (the product over the sample's trained tokens: exp of the summed log-ratio) or geometric (its geometric mean: exp of the mean log-ratio); sequence and geometric weigh every token of a sample alike. The weight is bounded after, as --tis-mode says. Needs --use-tis (a --custom-tis-function-path may read it)."""

    tis_mode: Literal["clip", "truncate", "mask"] = "clip"
    """How --use-tis bounds its weight w (the ratio at --tis-level): clip, clamp(w, --tis-clip-low, --tis-clip) (slime's --use-tis; at the default low 0 it is truncate); truncate, min(w, --tis-clip); mask, w itself where --tis-clip-low ≤ w ≤ --tis-clip and the token (at the sequence / geometric level, the sample) rejected elsewhere: its policy loss is dropped while its sample's token count stays (slime's MIS helper's tis_mode). Needs --use-tis (a --custom-tis-function-path may read it)."""

    use_rs: bool = False
    """Rejection sampling against the engine (slime's MIS helper's use_rs): a token (at --rs-level sequence / geometric, the whole sample) whose ratio π_train_old / π_rollout lies outside [--rs-lower-bound, --rs-upper-bound], or a sample with a token below --rs-veto-threshold, is rejected: its policy loss is dropped while its sample's token count stays, as slime. With --use-tis the kept tokens keep their weight; alone, their weight is 1. Unlike --use-mis, which takes the masked tokens out of the token counts and advantages too. Logged as train/rs_rejected (train/rs_vetoed)."""

    rs_level: Literal["token", "sequence", "geometric"] = "token"
    """What --use-rs's ratio is taken over, as --tis-level: each token, the product over the sample's trained tokens, or their geometric mean. Needs --use-rs."""

    rs_lower_bound: Optional[float] = Field(None, gt=0)
    """Lower bound of --use-rs's ratio (default: --tis-clip-low where above 0, else 1 / --tis-clip, as slime's MIS helper). Needs --use-rs."""

    rs_upper_bound: Optional[float] = Field(None, gt=0)
    """Upper bound of --use-rs's ratio (default: --tis-clip). Needs --use-rs."""

    rs_veto_threshold: Optional[float] = Field(None, gt=0, lt=1)
    """With --use-rs: a sample with any trained token whose ratio π_train_old / π_rollout is below this (slime's mis.yaml: 1e-4) is rejected whole (slime's catastrophic-token veto); logged as train/rs_vetoed, the share of trained tokens in such samples."""

    tis_batch_normalize: bool = False
    """Divide --use-tis's bounded weights by their mean, so that they average 1 (slime's MIS helper's tis_batch_normalize): over the trained tokens (--tis-level token) or the samples (sequence, geometric) of the whole optimizer step, all DP ranks (slime takes the mean of one micro-batch; over the step the loss stays the same for any micro-batch split). Needs the old log-probs before the step (the torch backend's on-policy shortcut is off with it). Logged as train/tis_norm, the mean it divided by."""

    get_mismatch_metrics: bool = False
    """Call --custom-tis-function-path on every micro-batch even without --use-tis, for its train–inference mismatch metrics (slime's flag; the function decides what it does to the loss, e.g. slime's MIS helper returns it unchanged when args.use_tis is off). Needs --custom-tis-function-path."""

    custom_tis_function_path: Optional[str] = None
    """Your importance weighting in place of --use-tis's clamp (slime's flag and contract): `fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics)`, called per micro-batch with --use-tis (or --get-mismatch-metrics). pg_loss is the response tokens' policy loss, concatenated [ΣR]; the log-probs and masks are lists of [R_i] per sample (the trainer's old log-probs, the engine's). It returns the weighted pg_loss [ΣR], the masks (a token set to 0 leaves the loss — rejection sampling — while the per-sample denominators stay), and metrics: per-token tensors [ΣR] logged as train/<key> (train/tis_<key> unless the key starts with tis), token means over the trained tokens. slime's vanilla_tis_function and icepop_function run unchanged. module:function or path/to/file.py:function."""

    custom_pg_loss_reducer_function_path: Optional[str] = None
    """Your aggregation of the policy-gradient term alone, e.g. Dr.GRPO's Σ_t pg_t / a constant in place of the per-sample token mean (slime's flag and contract): `fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)` is called per micro-batch (loss_masks: [R_i] per sample, the --custom-tis-function-path's masks when it runs) and returns a reducer, which maps the response tokens' pg_loss [ΣR] to a scalar: the micro-batch's sum in the default's units (Σ over samples of the per-sample mean, or of the token sums with --calculate-per-token-loss), divided by the step's sample (or token) count as the default is. Entropy and KL terms and every metric keep the default aggregate. --loss-type policy_loss, both train backends; example examples/hooks.py:dr_grpo_reducer. module:function or path/to/file.py:function."""

    use_mis: bool = False
    """Masked importance sampling (IcePop-style): tokens whose π_train_old / π_rollout falls outside [--mis-low, --mis-high] are masked out of the loss (and its token counts); the others keep their weight (with --use-tis, truncated)."""

    mis_low: float = Field(0.5, gt=0)
    """Lower bound of the MIS ratio: tokens below it are masked (with --use-mis, or a --custom-tis-function-path, which may read it)."""

    mis_high: float = Field(2.0, gt=0)
    """Upper bound of the MIS ratio: tokens above it are masked (with --use-mis, or a --custom-tis-function-path, which may read it)."""

    use_rollout_logprobs: bool = False
    """Use the engine's rollout log-probs as the old policy's (slime's flag): no old-log-prob forward per rollout, the ratio is π/π_rollout. train/mismatch is still reported (torch: from the train step's own forward on the same weights; megatron still runs a no-grad forward for it). Not with --use-tis / --use-mis / --use-rs (their ratio π_old/π_rollout would be 1). The run's first step still computes them (RF01 checks the policy against the reference there). Without this flag, a rollout with one optimizer step on the torch backend (and no --use-mis or --kl-coef) takes the old log-probs from the train step's own forward: no extra forward, the same numbers."""

    use_routing_replay: bool = False
    """Routing replay for a mixture of experts (slime's flag; GSPO's, arXiv 2507.18071): the experts each token was routed to in the policy's no-grad forward before the steps (the old policy's) are the ones every training forward of that rollout uses, so the importance ratio compares one routing; their weights are the current router's probabilities at those experts (renormalised where the model renormalises), so the router still trains. That forward then runs also under --use-rollout-logprobs. Where the rollout's only step runs on the old policy's weights (the torch backend's on-policy step without that forward), its own routing is the old one and nothing is replayed. Models: Qwen2-MoE, Qwen3-MoE and Mixtral (torch and megatron backends); not with --loss-type sft_loss or --disable-compute-advantages-and-returns (no old policy), --log-probs-max-tokens-per-gpu (its forwards pack other micro-batches), nor Megatron's pipeline parallelism with --recompute-activations (a recomputed forward runs after later micro-batches' have started). Under Megatron's pipeline parallelism each stage replays its own layers, under sequence parallelism each TP rank its own tokens. The engine's own routing is --use-rollout-routing-replay."""

    use_rollout_routing_replay: bool = False
    """Rollout routing replay for a mixture of experts (slime's flag; R3, arXiv 2510.11370): every forward of the policy in training (the old log-probs' and each step's) routes each token to the experts the rollout engine routed it to, so the ratio and the loss see the routing that sampled the tokens (much of a mixture of experts' train–inference mismatch is routing). The engines return them as SGLang does (`return_routed_experts`, meta_info.routed_experts): rollflow launches SGLang with --enable-return-routed-experts, and its built-in engine records them (inside its CUDA graphs, as SGLang does; eagerly under --sglang-enable-torch-compile); an engine you start yourself needs that flag. The weights at those experts are the current router's probabilities (renormalised where the model renormalises), so the router still trains. A trained sample without them is an error naming it (a --custom-generate-function-path sets sample.rollout_routed_experts to meta_info.routed_experts of the sample's last /generate); with --partial-rollout they are the last segment's call's, whose prompt holds the earlier segments. Models: Qwen2-MoE, Qwen3-MoE and Mixtral (torch and megatron backends); not with --use-routing-replay (one routing is replayed: pick one), --loss-type sft_loss (no rollout), nor Megatron's pipeline parallelism with --recompute-activations (a recomputed forward runs after later micro-batches' have started). Under Megatron's pipeline parallelism each stage replays its own layers, under sequence parallelism each TP rank its own tokens. The reference replays them too (RF01 and the KL then compare one routing); the --use-opd teacher routes on its own."""

    log_kl: bool = False
    """Run the reference forward every rollout to log train/kl even when KL is neither a loss term (--use-kl-loss) nor a reward shaping (--kl-coef). Without it that forward is skipped (the log says so) and train/kl is not logged, except on the run's first step (RF01 compares the policy with the reference there)."""

    calculate_per_token_loss: bool = False
    """Average the loss over all trained tokens of the step instead of per-sample token means averaged over samples."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor γ for ppo (GAE) and reinforce_plus_plus returns (another estimator: an error, unless a --custom-advantage-function-path may read it)."""

    lambd: float = Field(1.0, ge=0, le=1)
    """GAE λ for ppo (another estimator: an error, unless a --custom-advantage-function-path may read it)."""

    value_clip: float = Field(0.2, gt=0)
    """ppo: clip the critic's new value to old value ± value_clip in the value loss."""

    critic_lr: Optional[float] = Field(None, gt=0)
    """ppo: peak learning rate of the critic (default: --lr); same schedule as the policy."""

    num_critic_only_steps: int = Field(0, ge=0)
    """ppo: the first N rollouts train the critic only (slime's flag): the policy, its optimizer and its LR schedule wait, and its metrics are not logged for those rollouts, so the value function is fitted before it steers the policy."""

    @field_validator("opd_teacher_url")
    @classmethod
    def _teacher_url(cls, url: str | None) -> str | None:
        from engine.rollout.external import normalize_addr

        if url is None:
            return None
        try:
            return normalize_addr(url)
        except ValueError as e:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=f"--opd-teacher-url: {e}",
                                        fix="--opd-teacher-url HOST:PORT, e.g. 10.0.0.7:30000",
                                        facts={"field": "opd_teacher_url", "value": url})) from None

    def _reads_advantages(self) -> list[str]:
        """The flags set that read advantages, old or reference log-probs, or an importance weight: with
        --loss-type sft_loss or --disable-compute-advantages-and-returns they would do nothing."""
        return [f for f, on in (
            ("--custom-advantage-function-path", self.custom_advantage_function_path),
            ("--rollout-data-postprocess-path", self.rollout_data_postprocess_path),
            (f"--advantage-estimator {self.advantage_estimator}", self.advantage_estimator == "ppo"),
            ("--use-kl-loss", self.use_kl_loss), ("--kl-coef", self.kl_coef > 0), ("--log-kl", self.log_kl),
            ("--use-tis", self.use_tis), ("--use-mis", self.use_mis), ("--use-rs", self.use_rs),
            ("--use-rollout-logprobs", self.use_rollout_logprobs),
            ("--normalize-advantages", self.normalize_advantages),
            ("--disable-grpo-std-normalization", self.disable_grpo_std_normalization),
            ("--disable-rewards-normalization", self.disable_rewards_normalization),
            ("--use-unbiased-kl", self.use_unbiased_kl)) if on]

    @model_validator(mode="after")
    def _algorithm_consistent(self) -> "AlgorithmArgs":
        def err(what: str, fix: str, **facts) -> ConfigError:
            return ConfigError(Diagnosis(code="CONFIG", severity="error", what=what, fix=fix, facts=facts))

        if self.kl_coef > 0 and self.advantage_estimator in GROUP_ESTIMATORS:
            # slime ignores kl_coef for these estimators; silently not regularising would be worse than an error
            raise err(f"--kl-coef {self.kl_coef} shapes token rewards, which --advantage-estimator "
                      f"{self.advantage_estimator} does not use (its advantage is the group-normalised reward)",
                      f"--use-kl-loss --kl-loss-coef {self.kl_coef} for a KL penalty with "
                      f"{self.advantage_estimator}, or --advantage-estimator ppo / reinforce_plus_plus",
                      field="kl_coef", value=self.kl_coef)
        if self.disable_grpo_std_normalization and self.advantage_estimator not in GROUP_ESTIMATORS:
            raise err(f"--disable-grpo-std-normalization has no effect with --advantage-estimator "
                      f"{self.advantage_estimator} (it applies to {', '.join(GROUP_ESTIMATORS)})",
                      "drop --disable-grpo-std-normalization", field="disable_grpo_std_normalization")
        if self.disable_rewards_normalization and self.advantage_estimator not in (*GROUP_ESTIMATORS,
                                                                                  "reinforce_plus_plus_baseline"):
            raise err(f"--disable-rewards-normalization has no effect with --advantage-estimator "
                      f"{self.advantage_estimator} (it does not normalise rewards)",
                      "drop --disable-rewards-normalization", field="disable_rewards_normalization")
        if self.disable_rewards_normalization and self.disable_grpo_std_normalization:
            raise err("--disable-grpo-std-normalization with --disable-rewards-normalization: no normalisation runs, "
                      "so there is no std to leave out", "drop --disable-grpo-std-normalization",
                      field="disable_grpo_std_normalization")
        if self.use_rollout_logprobs and (self.use_tis or self.use_mis or self.use_rs):
            which = "--use-tis" if self.use_tis else "--use-mis" if self.use_mis else "--use-rs"
            raise err(f"--use-rollout-logprobs with {which}: the old policy would be the rollout's, so the "
                      f"importance weight π_old / π_rollout is 1 on every token and {which} does nothing",
                      f"drop --use-rollout-logprobs to correct with {which}, or drop {which}",
                      field="use_rollout_logprobs", value=True)
        if (self.loss_type == "custom_loss") != bool(self.custom_loss_function_path):
            raise err("--loss-type custom_loss needs --custom-loss-function-path" if self.loss_type == "custom_loss"
                      else f"--custom-loss-function-path {self.custom_loss_function_path!r} is called only with "
                           f"--loss-type custom_loss (now {self.loss_type})",
                      "--loss-type custom_loss --custom-loss-function-path module:function",
                      field="loss_type", value=self.loss_type)
        if self.disable_compute_advantages_and_returns:
            if self.loss_type != "custom_loss":
                raise err(f"--disable-compute-advantages-and-returns with --loss-type {self.loss_type}: "
                          + ("the policy loss is made of the advantages and old log-probs it turns off"
                             if self.loss_type == "policy_loss" else "sft_loss computes none of them anyway"),
                          "--loss-type custom_loss --custom-loss-function-path module:function (a loss that reads "
                          "neither), or drop the flag", field="disable_compute_advantages_and_returns", value=True)
            unused = self._reads_advantages() + [f for f, on in (
                ("--use-opd", self.use_opd), ("--use-rollout-entropy", self.use_rollout_entropy),
                ("--get-mismatch-metrics", self.get_mismatch_metrics),
                ("--custom-tis-function-path", self.custom_tis_function_path)) if on]
            if unused:
                raise err(f"--disable-compute-advantages-and-returns computes no advantage, old or reference "
                          f"log-prob: {', '.join(unused)} would do nothing", f"drop "
                          f"{', '.join(u.split(' ')[0] for u in unused)}, or the flag",
                          field="disable_compute_advantages_and_returns", value=True, unused=unused)
        if self.loss_type == "sft_loss":
            unused = self._reads_advantages() + (["--entropy-coef"] if self.entropy_coef > 0 else [])
            if unused:
                raise err(f"--loss-type sft_loss is the negative log-likelihood of the trained tokens: "
                          f"{', '.join(unused)} would do nothing (no advantage, reference, KL or importance weight "
                          "enters it)", f"drop {', '.join(u.split(' ')[0] for u in unused)}, or --loss-type "
                                        "policy_loss", field="loss_type", value="sft_loss", unused=unused)
        if self.num_critic_only_steps and self.advantage_estimator != "ppo":
            raise err(f"--num-critic-only-steps {self.num_critic_only_steps}: only --advantage-estimator ppo has a "
                      f"critic (now {self.advantage_estimator})", "--advantage-estimator ppo, or drop "
                      "--num-critic-only-steps", field="num_critic_only_steps", value=self.num_critic_only_steps)
        if self.ref_update_interval and not (self.use_kl_loss or self.kl_coef > 0 or self.log_kl):
            raise err(f"--ref-update-interval {self.ref_update_interval} moves the reference, which nothing reads "
                      "without a KL term", "add --use-kl-loss --kl-loss-coef C (or --kl-coef, or --log-kl), or drop "
                      "--ref-update-interval", field="ref_update_interval", value=self.ref_update_interval)
        if self.use_unbiased_kl and not self.use_kl_loss:
            raise err("--use-unbiased-kl corrects the KL loss, and --use-kl-loss is off: there is no KL loss to "
                      "correct", "add --use-kl-loss --kl-loss-coef C, or drop --use-unbiased-kl",
                      field="use_unbiased_kl", value=True)
        self._opd_consistent(err)
        if self.changed("opsm_delta") and not self.use_opsm:
            raise err(f"--opsm-delta {self.opsm_delta} without --use-opsm would do nothing", "add --use-opsm, or "
                      "drop --opsm-delta", field="opsm_delta", value=self.opsm_delta)
        if self.use_opsm and self.loss_type != "policy_loss":
            raise err(f"--use-opsm masks the policy loss, which --loss-type {self.loss_type} does not compute",
                      "--loss-type policy_loss, or drop --use-opsm", field="use_opsm", value=True)
        if self.tis_level != "token" and not self.use_tis and not self.custom_tis_function_path:
            raise err(f"--tis-level {self.tis_level} sets what --use-tis's weight is taken over: without "
                      "--use-tis there is none, so it would do nothing", "drop --tis-level, or add --use-tis",
                      field="tis_level", value=self.tis_level)
        if self.mis_low >= self.mis_high:
            raise err(f"--mis-low {self.mis_low} is not below --mis-high {self.mis_high}",
                      "--mis-low 0.5 --mis-high 2.0 (the defaults)", field="mis_low", value=self.mis_low)
        if self.custom_tis_function_path and not ((self.use_tis or self.get_mismatch_metrics)
                                                   and self.loss_type == "policy_loss"):
            raise err(f"--custom-tis-function-path {self.custom_tis_function_path!r} replaces --use-tis's weights in "
                      f"the policy loss: without --use-tis or --get-mismatch-metrics" + (
                          f" (and with --loss-type {self.loss_type})" if self.loss_type != "policy_loss" else "")
                      + " it would do nothing", "add --use-tis (with --loss-type policy_loss), or drop "
                      "--custom-tis-function-path", field="custom_tis_function_path",
                      value=self.custom_tis_function_path)
        if self.use_rollout_entropy and not (self.rollout_data_postprocess_path
                                             or self.custom_advantage_function_path):
            raise err("--use-rollout-entropy computes the old policy's entropies for rollout_data['entropy'], and "
                      "no function reads it", "add --rollout-data-postprocess-path (or "
                      "--custom-advantage-function-path) that uses rollout_data['entropy'], or drop "
                      "--use-rollout-entropy", field="use_rollout_entropy", value=True)
        if self.custom_pg_loss_reducer_function_path and self.loss_type != "policy_loss":
            raise err(f"--custom-pg-loss-reducer-function-path aggregates the policy loss, which --loss-type "
                      f"{self.loss_type} does not compute", "--loss-type policy_loss, or drop "
                      "--custom-pg-loss-reducer-function-path", field="custom_pg_loss_reducer_function_path",
                      value=self.custom_pg_loss_reducer_function_path)
        if self.get_mismatch_metrics and not self.custom_tis_function_path:
            raise err("--get-mismatch-metrics calls --custom-tis-function-path for its metrics, and none is given",
                      "--custom-tis-function-path module:function (e.g. examples/hooks.py:icepop), or drop "
                      "--get-mismatch-metrics (train/mismatch is logged anyway)", field="get_mismatch_metrics")
        if self.get_mismatch_metrics and self.use_rollout_logprobs:
            raise err("--get-mismatch-metrics with --use-rollout-logprobs: the old log-probs are the engine's, so "
                      "the function would compare the engine with itself",
                      "drop --use-rollout-logprobs (the trainer then computes the old log-probs), or drop "
                      "--get-mismatch-metrics", field="get_mismatch_metrics")
        if (tis := self.changed("tis_clip", "tis_clip_low")) and not (self.use_tis or self.custom_tis_function_path):
            raise err(f"{given(tis)} without --use-tis would do nothing: they bound the TIS weight, which is 1 with "
                      f"it off", f"add --use-tis, or drop {flags(tis)}", field=next(iter(tis)), value=tis)
        if self.tis_clip_low > self.tis_clip:
            raise err(f"--tis-clip-low {self.tis_clip_low} is above --tis-clip {self.tis_clip}",
                      f"--tis-clip-low below {self.tis_clip} (default 0.0)", field="tis_clip_low",
                      value=self.tis_clip_low)
        self._rollout_correction_consistent(err)
        self._idle_settings_consistent(err)
        return self

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """--use-rs's (lower, upper) bounds, their defaults resolved as slime's MIS helper does."""
        high = self.rs_upper_bound if self.rs_upper_bound is not None else self.tis_clip
        if self.rs_lower_bound is not None:
            return self.rs_lower_bound, high
        return (self.tis_clip_low if self.tis_clip_low > 0 else 1.0 / self.tis_clip), high

    def _rollout_correction_consistent(self, err) -> None:
        """--tis-mode, --use-rs and their settings, --tis-batch-normalize: each refused where it would do nothing.
        A --custom-tis-function-path may read any of them (slime's MIS helper does), so none is idle with one."""
        custom = bool(self.custom_tis_function_path)
        if (mode := self.changed("tis_mode")) and not (self.use_tis or custom):
            raise err(f"{given(mode)} without --use-tis would do nothing: it bounds the TIS weight, which is 1 with "
                      "it off", "add --use-tis, or drop --tis-mode", field="tis_mode", value=self.tis_mode)
        if self.tis_mode == "truncate" and self.use_tis and not custom and self.changed("tis_clip_low") \
                and not (self.use_rs and self.rs_lower_bound is None):
            raise err(f"--tis-clip-low {self.tis_clip_low} with --tis-mode truncate would do nothing: truncate "
                      "bounds the weight from above only", "--tis-mode clip to clamp from below too, or drop "
                      "--tis-clip-low", field="tis_clip_low", value=self.tis_clip_low)
        if self.use_rs and self.loss_type != "policy_loss":
            raise err(f"--use-rs rejects tokens from the policy loss, which --loss-type {self.loss_type} does not "
                      "compute", "--loss-type policy_loss, or drop --use-rs", field="use_rs", value=True)
        if not (self.use_rs or custom) and (idle := self.changed("rs_level", "rs_lower_bound", "rs_upper_bound",
                                                                  "rs_veto_threshold")):
            raise err(f"{given(idle)} without --use-rs would do nothing: they set rejection sampling",
                      f"add --use-rs, or drop {flags(idle)}", field=next(iter(idle)), value=idle)
        low, high = self.rs_bounds
        if self.use_rs and low >= high:
            raise err(f"--use-rs's lower bound {low} is not below its upper bound {high} (--rs-lower-bound "
                      f"{self.rs_lower_bound}, --rs-upper-bound {self.rs_upper_bound}; unset, they follow "
                      "--tis-clip-low / --tis-clip)", "--rs-lower-bound 0.5 --rs-upper-bound 2.0",
                      field="rs_lower_bound", value=low)
        if self.tis_batch_normalize and not (self.use_tis or custom):
            raise err("--tis-batch-normalize without --use-tis would do nothing: it normalises the TIS weights, "
                      "which are 1 with it off", "add --use-tis, or drop --tis-batch-normalize",
                      field="tis_batch_normalize", value=True)

    def _idle_settings_consistent(self, err) -> None:
        """Settings of a term the configuration does not compute would do nothing: the critic's (ppo only), γ and λ
        (the returns of ppo and reinforce_plus_plus; a --custom-advantage-function-path may read them), the KL
        loss's weight (--use-kl-loss) and MIS's bounds (--use-mis; a --custom-tis-function-path may read them).
        Checked where they differ from their defaults (`Section.changed`)."""
        if self.advantage_estimator != "ppo" and (idle := self.changed("critic_lr", "value_clip")):
            raise err(f"{given(idle)}: only --advantage-estimator ppo has a critic (now {self.advantage_estimator}), "
                      f"so it would do nothing", f"--advantage-estimator ppo, or drop {flags(idle)}",
                      field=next(iter(idle)), value=idle)
        returns = {"ppo": ("gamma", "lambd"), "reinforce_plus_plus": ("gamma",)}.get(self.advantage_estimator, ())
        if not self.custom_advantage_function_path and (idle := {
                n: v for n, v in self.changed("gamma", "lambd").items() if n not in returns}):
            raise err(f"{given(idle)} with --advantage-estimator {self.advantage_estimator} would do nothing: γ "
                      "discounts the returns of ppo and reinforce_plus_plus, λ is ppo's GAE",
                      f"drop {flags(idle)}, or --advantage-estimator "
                      f"{'ppo' if 'lambd' in idle else 'ppo / reinforce_plus_plus'}", field=next(iter(idle)),
                      value=idle)
        if self.kl_loss_coef > 0 and not self.use_kl_loss and self.loss_type != "custom_loss":
            raise err(f"--kl-loss-coef {self.kl_loss_coef} without --use-kl-loss would do nothing: the KL term is in "
                      "the loss only with --use-kl-loss", "add --use-kl-loss, or drop --kl-loss-coef",
                      field="kl_loss_coef", value=self.kl_loss_coef)
        if not (self.use_mis or self.custom_tis_function_path) and (idle := self.changed("mis_low", "mis_high")):
            raise err(f"{given(idle)} without --use-mis would do nothing: they bound masked importance sampling",
                      f"add --use-mis, or drop {flags(idle)}", field=next(iter(idle)), value=idle)

    def _opd_consistent(self, err) -> None:
        """--use-opd and its flags, as slime checks them; a flag without --use-opd would do nothing."""
        if not self.use_opd:
            idle = [f for f, on in (("--opd-type", self.opd_type), ("--opd-teacher-load", self.opd_teacher_load),
                                    ("--opd-teacher-url", self.opd_teacher_url),
                                    ("--opd-teacher-api-key", self.opd_teacher_api_key),
                                    ("--opd-teacher-ckpt-step", self.opd_teacher_ckpt_step is not None),
                                    ("--opd-kl-coef", self.changed("opd_kl_coef"))) if on]
            if idle:
                raise err(f"{', '.join(idle)} without --use-opd would do nothing", "add --use-opd, or drop them",
                          field="use_opd", value=False, idle=idle)
            return
        if self.opd_type is None:
            raise err("--use-opd needs --opd-type", "--opd-type megatron --opd-teacher-load TEACHER_DIR (the teacher "
                      "loaded into the trainer)", field="opd_type", value=None)
        if self.opd_type == "sglang":
            if not self.opd_teacher_url:
                raise err("--opd-type sglang needs --opd-teacher-url (the teacher server)",
                          "--opd-teacher-url HOST:PORT of an SGLang (or rollflow serve) server of the teacher",
                          field="opd_teacher_url", value=None)
            if self.opd_teacher_load or self.opd_teacher_ckpt_step is not None:
                raise err("--opd-teacher-load / --opd-teacher-ckpt-step load a teacher into the trainer, which "
                          "--opd-type sglang does not (its teacher is --opd-teacher-url's server)",
                          "drop them, or --opd-type megatron", field="opd_teacher_load", value=self.opd_teacher_load)
        elif self.opd_teacher_url or self.opd_teacher_api_key:
            raise err("--opd-teacher-url is read only with --opd-type sglang (now megatron: the teacher is loaded "
                      "into the trainer)", "drop --opd-teacher-url, or --opd-type sglang",
                      field="opd_teacher_url", value=self.opd_teacher_url)
        elif not self.opd_teacher_load:
            raise err("--opd-type megatron needs --opd-teacher-load (the teacher's weights)",
                      "--opd-teacher-load a Hugging Face directory or a --save directory of the teacher",
                      field="opd_teacher_load", value=None)
        if self.loss_type != "policy_loss":
            raise err(f"--use-opd changes the advantages, which --loss-type {self.loss_type} does not read",
                      "--loss-type policy_loss, or drop --use-opd", field="use_opd", value=True)
