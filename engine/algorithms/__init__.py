"""RL math as pure functions of tensors and numbers (no config, no torch.distributed, no Ray)."""
from engine.algorithms.advantages import (ESTIMATORS, compute_advantages, discounted_returns, gae, grpo_advantages,
                                          masked_whiten, reinforce_plus_plus_baseline_advantages,
                                          reinforce_plus_plus_returns, whiten_stats)
from engine.algorithms.losses import (cispo_policy_loss, gspo_policy_loss, kl, masked_mean, policy_loss,
                                      rollout_correction, value_loss)
from engine.algorithms.objective import (LossSpec, StepHooks, aggregate, custom_objective, policy_objective,
                                         sft_objective, step_objective, value_objective)

__all__ = ["ESTIMATORS", "LossSpec", "StepHooks", "aggregate", "cispo_policy_loss", "compute_advantages", "custom_objective",
           "discounted_returns",
           "gae", "grpo_advantages", "gspo_policy_loss", "kl", "masked_mean", "masked_whiten", "policy_loss",
           "policy_objective", "reinforce_plus_plus_baseline_advantages", "reinforce_plus_plus_returns",
           "rollout_correction", "sft_objective", "step_objective", "value_loss", "value_objective", "whiten_stats"]
