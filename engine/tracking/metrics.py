"""Every metric a run logs to MLflow: its name, which direction is better, and what it means.

The metric table of docs/mlflow.md is generated from `METRICS` (`python -m engine.tracking.metrics --write
docs/mlflow.md`) and a test keeps them equal; an integration test fails on a logged metric that is not listed here.
Names are `<stage>/<what>`; `<key>`, `<i>`, `<q>`, `<set>` and `<k>` stand for a (reward or metric) key, a GPU
index, a percentile, an eval set's name and a sample count. Steps are rollout ids, except `eval/*` (rollouts
trained: 0 = before training, num_rollout = after) and `system/*` (seconds since the MLflow run was created).
`better` drives `rollflow compare`'s "best" column: "max", "min", or None (no best: a count or a setting).
"""
from __future__ import annotations

import re
import sys
from typing import NamedTuple


class MetricDoc(NamedTuple):
    name: str
    better: str | None
    meaning: str


METRICS: list[MetricDoc] = [
    MetricDoc("0-overview/1-reward_mean", "max", "copy of rollout/reward_mean: the `0-overview` section, what says "
                                                 "whether training works, is the first of MLflow's chart page"),
    MetricDoc("0-overview/2-eval_<set>_accuracy", "max", "copy of eval/<set>_accuracy"),
    MetricDoc("0-overview/3-response_len_mean", None, "copy of rollout/response_len_mean"),
    MetricDoc("0-overview/4-kl", None, "copy of train/kl"),
    MetricDoc("0-overview/5-entropy", None, "copy of train/entropy"),
    MetricDoc("0-overview/6-grad_norm", None, "copy of train/grad_norm"),
    MetricDoc("0-overview/7-mismatch", "min", "copy of train/mismatch (RF14)"),
    MetricDoc("0-overview/8-step_seconds", "min", "the rollout's whole step: rollout + pack + train + save + sync "
                                                  "seconds"),
    MetricDoc("rollout/reward_mean", "max", "mean reward of the rollout's B·n samples"),
    MetricDoc("rollout/reward_std", None, "standard deviation of those rewards (0 → GRPO has no signal)"),
    MetricDoc("rollout/pass_at_<k>", "max", "--log-passrate: pass@k over the rollout's groups (k = 1, 2, 4, … ≤ "
                                            "--n-samples-per-prompt; unbiased estimator, a reward of 1 is correct)"),
    MetricDoc("rollout/offpolicy_masked_share", None, "`--mask-offpolicy-in-partial-rollout`: share of the "
                                                     "response tokens masked because older weights generated them"),
    MetricDoc("rollout/multi_turn_trained_len_mean", None, "`--log-multi-turn`: mean model tokens of a response "
                                                          "(loss mask 1; also _max, _min)"),
    MetricDoc("rollout/multi_turn_trained_len_max", None, "`--log-multi-turn`: the most model tokens of a response"),
    MetricDoc("rollout/multi_turn_trained_len_min", None, "`--log-multi-turn`: the fewest model tokens of a response"),
    MetricDoc("rollout/multi_turn_observation_len_mean", None, "`--log-multi-turn`: mean tool / environment tokens "
                                                              "of a response (loss mask 0)"),
    MetricDoc("rollout/multi_turn_response_len_min", None, "`--log-multi-turn`: the shortest response, all tokens"),
    MetricDoc("rollout/multi_turn_clip_ratio", "min", "`--log-multi-turn`: share of responses at "
                                                     "--rollout-max-response-len"),
    MetricDoc("rollout/multi_turn_round_number_mean", None, "`--log-multi-turn`: mean conversation rounds, from the "
                                                           "samples' metadata[\"round_number\"] (also _max, _min)"),
    MetricDoc("rollout/multi_turn_round_number_max", None, "`--log-multi-turn`: the most rounds of a sample"),
    MetricDoc("rollout/multi_turn_round_number_min", None, "`--log-multi-turn`: the fewest rounds of a sample"),
    MetricDoc("rollout/correct_samples", "max", "`--log-correct-samples`: samples of the rollout with reward 1"),
    *(MetricDoc(f"rollout/correct_length_p{q}", None, f"`--log-correct-samples`: share of the correct responses "
                f"whose length is in the {['first', 'second', 'third', 'last'][q // 25 - 1]} quarter of "
                "`--rollout-max-response-len`") for q in (25, 50, 75, 100)),
    MetricDoc("rollout/correct_entropy", None, "`--log-correct-samples`: the correct samples' mean per-token −log p "
                                               "under the engine (each sample's mean over its trained tokens)"),
    MetricDoc("rollout/reward_category/<key>", None, "`--log-reward-category`: share of the rollout's samples "
                                                     "whose reward dict named this category (\"none\": no "
                                                     "category)"),
    MetricDoc("rollout/reward_<key>_mean", "max", "mean of one key of a dict reward (a custom reward returning a dict)"),
    MetricDoc("rollout/response_len_mean", None, "response tokens per sample, mean"),
    MetricDoc("rollout/response_len_max", None, "response tokens per sample, max"),
    MetricDoc("rollout/response_len_p<q>", None, "response tokens per sample, the q-th percentile (q = 10, 50, "
                                                 "90): the distribution per rollout, drawn in "
                                                 "plots/response_length.png"),
    MetricDoc("rollout/truncated_share", "min", "share of samples that hit `--rollout-max-response-len` (high → RF10)"),
    MetricDoc("rollout/failed_share", "min", "share of samples that failed (reward error, engine abort)"),
    MetricDoc("rollout/seconds", "min", "rollout stage wall time"),
    MetricDoc("rollout/tokens_per_s", "max", "generated tokens per second in the rollout stage"),
    MetricDoc("rollout/groups_drawn", None, "prompts drawn for the rollout (> B when over-sampling with a dynamic "
                                            "filter)"),
    MetricDoc("rollout/groups_filtered", None, "groups the dynamic filter (`--dynamic-sampling-filter-path`) dropped"),
    MetricDoc("rollout/groups_aborted", None, "groups cut off (aborted) once enough groups had passed the filter"),
    MetricDoc("rollout/retried_requests", "min", "group requests resent after an engine failed "
                                                 "(`--use-fault-tolerance`)"),
    MetricDoc("rollout/continued_samples", None, "`--partial-rollout`: sample segments continued after a pause "
                                                 "(a weight sync aborted them mid-generation)"),
    MetricDoc("rollout/replayed", None, "`--load-debug-rollout-data`: 1 on every rollout read from a saved file "
                                        "(its other rollout/ metrics are the recording run's; rollout/seconds is the "
                                        "read)"),
    MetricDoc("async/staleness_mean", "min", "`--async-mode` or `--update-weights-interval` > 1: mean over the "
                                             "rollout's samples of (steps the trainer "
                                             "has taken − the weight version that generated the sample)"),
    MetricDoc("async/staleness_max", "min", "`--async-mode` or `--update-weights-interval` > 1: the largest "
                                            "staleness of a sample of the rollout (never "
                                            "above the bound for a trained sample)"),
    MetricDoc("async/stale_dropped", "min", "`--async-mode` or `--update-weights-interval` > 1: samples older than "
                                            "the bound (one-step 1, bounded `--max-staleness`, interval N − 1), kept "
                                            "out of the loss"),
    MetricDoc("rollout/opd_teacher_seconds", "min", "`--opd-type sglang`: seconds the teacher server took to score "
                                                    "the rollout's samples"),
    MetricDoc("rollout/removed_samples", None, "samples `--rollout-sample-filter-path` kept out of the loss "
                                               "(`remove_sample`)"),
    MetricDoc("<any numeric metric a --rollout-function-path returns>", None, "logged as the function names it "
              "(slime's RolloutFnTrainOutput.metrics), e.g. `rollout/my_metric`"),
    MetricDoc("pack/seconds", "min", "pack stage wall time (advantages, DP schedule, micro-batches)"),
    MetricDoc("pack/micro_batches", None, "micro-batches in the rollout, all ranks"),
    MetricDoc("pack/micro_batches_per_rank", None, "micro-batches per DP rank"),
    MetricDoc("pack/tokens", None, "tokens (prompt + response) packed for training"),
    MetricDoc("pack/efficiency", "max", "real tokens / (micro-batches × cap), cap = `max_tokens_per_gpu·cp`; in "
                                        "static mode the largest micro-batch stands for the cap"),
    MetricDoc("pack/dp_imbalance", "min", "Σ over steps of max-rank FLOPs / Σ of mean-rank FLOPs (1.0 = no rank "
                                          "waits)"),
    MetricDoc("pack/max_micro_batch_tokens", None, "tokens in the largest micro-batch"),
    MetricDoc("pack/oversize_samples", "min", "samples longer than the cap (each alone in its micro-batch)"),
    MetricDoc("train/loss", "min", "the optimised objective (per-sample token mean, averaged over the global batch; "
                                    "mean over the rollout's optimizer steps)"),
    MetricDoc("train/pg_loss", None, "policy-gradient term, token mean over trained tokens"),
    MetricDoc("train/nll", "min", "`--loss-type sft_loss`: negative log-likelihood of the trained tokens, token mean "
                                  "(train/loss aggregates the same per sample)"),
    MetricDoc("train/custom_<key>", None, "`--loss-type custom_loss`: a metric the custom loss returned, summed over "
                                          "the step's micro-batches and ranks (mean over the rollout's steps)"),
    MetricDoc("train/entropy", None, "policy entropy, token mean"),
    MetricDoc("train/kl", None, "KL to the frozen reference (`--ref-load`, else the initial weights), token mean, "
                                "`--kl-loss-type`; logged every rollout with a KL term (`--use-kl-loss`, "
                                "`--kl-coef`) or `--log-kl`, else on the run's first step only (RF01)"),
    MetricDoc("train/tis_clipfrac", None, "`--use-tis`: share of the trained tokens whose importance weight was "
                                          "bounded (`--tis-mode mask`: rejected; with `--custom-tis-function-path`: "
                                          "the function's own `tis_clipfrac`, if it returns one)"),
    MetricDoc("train/tis_norm", None, "`--tis-batch-normalize`: the step's mean bounded TIS weight, which the "
                                      "weights were divided by"),
    MetricDoc("train/rs_rejected", None, "`--use-rs`: share of the trained tokens rejected from the policy loss "
                                         "(ratio outside the bounds, or a vetoed sample)"),
    MetricDoc("train/rs_vetoed", None, "`--rs-veto-threshold`: share of the trained tokens in samples rejected "
                                       "whole for a token below it"),
    MetricDoc("train/tis_<key>", None, "`--custom-tis-function-path`: a per-token metric the function returned "
                                       "(`tis_<key>`, or `<key>` itself when it starts with tis, e.g. train/tis and "
                                       "train/tis_abs of examples/hooks.py:icepop), the mean over the trained tokens"),
    MetricDoc("train/opsm_masked", None, "`--use-opsm`: share of the trained tokens left out of the policy loss "
                                         "(samples with a negative advantage that drifted past --opsm-delta)"),
    MetricDoc("train/value_loss", "min", "ppo: the critic's clipped value loss, token mean"),
    MetricDoc("train/value_clipfrac", None, "ppo: share of tokens whose value was clipped"),
    MetricDoc("train/critic_grad_norm", None, "ppo: the critic's gradient norm before clipping"),
    MetricDoc("train/ref_updated", None, "`--ref-update-interval`: 1 on a rollout after which the reference became "
                                         "the policy (train/kl restarts from 0)"),
    MetricDoc("train/critic_only", None, "ppo, `--num-critic-only-steps`: 1 on a rollout that trained the critic "
                                         "only (no policy metric is logged for it)"),
    MetricDoc("train/clipfrac", None, "share of tokens whose ratio was clipped"),
    MetricDoc("train/ratio", None, "mean importance ratio π/π_old (1 on the first step)"),
    MetricDoc("train/mismatch", "min", "mean \\|log π_engine − log π_trainer\\| over the rollout's trained tokens, "
                                       "trainer before the update (train–inference mismatch; above "
                                       "`--logprob-mismatch-threshold` → RF14)"),
    MetricDoc("train/mismatch_max", "min", "largest \\|log π_engine − log π_trainer\\| of one trained token"),
    MetricDoc("train/mis_masked_share", "min", "`--use-mis`: share of the trained tokens masked because π_old / "
                                               "π_engine left [`--mis-low`, `--mis-high`]"),
    MetricDoc("train/postprocess_masked_share", None, "`--rollout-data-postprocess-path`: share of the trained "
                                                     "tokens (mask weight) the function took out of the loss"),
    MetricDoc("train/opd_reverse_kl", "min", "`--use-opd`: mean over the trained tokens of log π_old − log "
                                             "π_teacher, the reverse KL to the teacher on the student's samples "
                                             "(its --opd-kl-coef multiple is subtracted from each advantage)"),
    MetricDoc("train/routing_replay_diff", "min",
              "`--use-rollout-routing-replay`: share of the (token, MoE layer) routings of the steps' "
              "forwards where the trainer's router alone picks other experts than the engine's, which are replayed "
              "(about 0 at a rollout's first step, on the weights that generated it)"),
    MetricDoc("train/grad_norm", None, "gradient norm before clipping, mean over the rollout's optimizer steps"),
    MetricDoc("train/grad_norm_max", None, "largest gradient norm of the rollout's optimizer steps"),
    MetricDoc("train/lr", None, "learning rate, mean over the rollout's optimizer steps"),
    MetricDoc("train/skipped_steps", "min", "optimizer steps of this rollout skipped for NaN/Inf (RF13, "
                                            "`--no-check-for-nan-in-loss-and-grad`)"),
    MetricDoc("train/skipped_steps_total", "min", "optimizer steps skipped for NaN/Inf since the run started"),
    MetricDoc("train/grad_norm_spikes", "min", "optimizer steps whose grad norm spiked (> 10× the running median; "
                                               "RF09, reported with the step's sample ids)"),
    MetricDoc("train/seconds", "min", "train stage wall time (log-probs + optimizer steps)"),
    MetricDoc("train/tokens_per_s", "max", "packed tokens per second in the train stage"),
    MetricDoc("save/seconds", "min", "checkpoint save wall time (rollouts that save), from the state's write to the "
                                     "marker"),
    MetricDoc("save/state_seconds", "min", "of which the backend writing its state"),
    MetricDoc("save/commit_seconds", "min", "of which the commit: sha256, fsync or upload, manifest, marker, retention "
                                            "(`--async-save`: while the next rollouts train)"),
    MetricDoc("save/wait_seconds", "min", "`--async-save`: how long this save waited for the previous checkpoint's "
                                          "commit (0 when it had already landed)"),
    MetricDoc("save/mb", None, "MiB in the saved iteration"),
    MetricDoc("save/mb_per_s", "max", "save/mb / save/seconds"),
    MetricDoc("sync/seconds", "min", "weight sync to every engine, wall time"),
    MetricDoc("sync/mb", None, "size of the synced weights, MiB"),
    MetricDoc("sync/weight_version", None, "weight version the engines serve after the sync"),
    MetricDoc("sync/gb_per_s", "max", "synced GB (10⁹ bytes, in the engines' dtype) per second of the transfer"),
    MetricDoc("sync/paused_requests", None, "`--partial-rollout`: requests the engines aborted to take the weights "
                                            "(continued under them)"),
    MetricDoc("sync/probe_mismatch", "min", "after the sync: mean \\|log π_engine − log π_trainer\\| on short answers "
                                            "to a few fixed prompts (sampled by the engines at the first probe, then "
                                            "the same tokens scored by both, in the sync call itself for an engine in "
                                            "the train worker's process; above `--logprob-mismatch-threshold` → "
                                            "RF14)"),
    MetricDoc("memory/<stage>_peak_gib", "min", "GPU runs: the most GPU memory (GiB, reserved by the allocators) held "
                                               "during rollout / train / sync, trainers + engines (their sum bounds "
                                               "the peak of a shared GPU)"),
    MetricDoc("memory/<stage>_train_gib", None, "of which the train workers (max over them)"),
    MetricDoc("memory/<stage>_engine_gib", None, "of which the rollout engines (max over them)"),
    MetricDoc("eval/<set>_accuracy", "max", "mean reward on eval set <set> (`test` for one `--eval-prompt-data` "
                                            "path, else its NAME or `--eval-config`'s name): greedy (or at "
                                            "`--eval-temperature`, or the set's own temperature), or the mean of "
                                            "`--n-samples-per-eval-prompt` samples; with `--eval-function-path`, the "
                                            "mean of the rewards it returned (step = rollouts trained: 0 before "
                                            "training, every `--eval-interval`, num_rollout after)"),
    MetricDoc("eval/<set>_truncated_share", "min", "`--eval-function-path`: the share of eval set <set>'s samples "
                                                   "it reported truncated"),
    MetricDoc("eval/<set>_mean_at_k", "max", "with k = `--n-samples-per-eval-prompt` > 1: the mean reward of the k "
                                             "samples per prompt of eval set <set>"),
    MetricDoc("eval/<set>_pass_at_<k>", "max", "--log-passrate: pass@k over eval set <set>'s prompts (k = 1, 2, 4, "
                                               "… ≤ its samples per prompt; unbiased estimator)"),
    MetricDoc("eval/<set>_pass_at_k", "max", "with k > 1: the mean over the set's prompts of the best of k rewards "
                                             "(pass@k for 0/1 rewards)"),
    MetricDoc("system/cpu_utilization_percentage", None, "CPU utilisation of the driver's node"),
    MetricDoc("system/system_memory_usage_megabytes", None, "memory in use on the driver's node, MiB"),
    MetricDoc("system/system_memory_usage_percentage", None, "memory in use on the driver's node, %"),
    MetricDoc("system/gpu_<i>_utilization_percentage", None, "utilisation of GPU i (NVML; GPU machines only)"),
    MetricDoc("system/gpu_<i>_memory_usage_megabytes", None, "memory in use on GPU i, MiB"),
    MetricDoc("system/gpu_<i>_memory_usage_percentage", None, "memory in use on GPU i, %"),
]

_PATTERNS = [(re.compile("^" + re.escape(m.name).replace("<key>", ".+").replace("<i>", r"\d+")
                         .replace("<stage>", "(rollout|train|sync)").replace("<q>", r"\d+")
                         .replace("<set>", r"[\w-]+").replace("<k>", r"\d+") + "$"), m) for m in METRICS]


#: MLflow's chart page sorts its sections by name: the `0-overview/` section, copies of what says whether training
#: works, comes first (before eval/, memory/, pack/, rollout/, …), so reward is the first chart a run shows.
#: Inside a section MLflow sorts charts by name too: the digits keep this order.
OVERVIEW = {"rollout/reward_mean": "1-reward_mean", "rollout/response_len_mean": "3-response_len_mean",
            "train/kl": "4-kl", "train/entropy": "5-entropy", "train/grad_norm": "6-grad_norm",
            "train/mismatch": "7-mismatch"}  # and 2-eval_<set>_accuracy for every eval set
STAGE_SECONDS = ("rollout", "pack", "train", "save", "sync")


def overview(metrics: dict[str, float], history: dict[str, dict[int, float]], step: int) -> dict[str, float]:
    """The `0-overview/` copies of the headline metrics among `metrics`; with the sync (the rollout's last stage)
    also its whole step time, the sum of the stage seconds at `step`."""
    out = {f"0-overview/{short}": metrics[name] for name, short in OVERVIEW.items() if name in metrics}
    out.update({f"0-overview/2-eval_{name[5:]}": v for name, v in metrics.items()
                if name.startswith("eval/") and name.endswith("_accuracy")})
    if "sync/seconds" in metrics:
        out["0-overview/8-step_seconds"] = sum(history.get(f"{s}/seconds", {}).get(step, 0.0) for s in STAGE_SECONDS)
    return out


def describe(name: str) -> MetricDoc | None:
    """The documented entry of a logged metric name (templates match), or None when it is undocumented."""
    return next((m for pat, m in _PATTERNS if pat.match(name)), None)


def better(name: str) -> str | None:
    """"max" / "min" / None; an undocumented metric counts as higher-is-better."""
    m = describe(name)
    return m.better if m else "max"


START, END = "<!-- metrics:start -->", "<!-- metrics:end -->"


def metrics_markdown() -> str:
    rows = ["| metric | better | meaning |", "|---|---|---|"]
    rows += [f"| `{m.name}` | {m.better or '—'} | {m.meaning} |" for m in METRICS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    # python -m engine.tracking.metrics [--write docs/mlflow.md]
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        from pathlib import Path

        from engine.config.docs import embed

        p = Path(sys.argv[2])
        p.write_text(embed(p.read_text(), metrics_markdown(), START, END))
    else:
        print(metrics_markdown())
