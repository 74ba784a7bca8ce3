"""RL math as pure functions of tensors and numbers (no config, no torch.distributed, no Ray)."""
from engine.algorithms.advantages import grpo_advantages
from engine.algorithms.losses import kl, masked_mean, policy_loss

__all__ = ["grpo_advantages", "kl", "masked_mean", "policy_loss"]
