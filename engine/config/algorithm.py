"""RL algorithm flags (defaults as slime)."""
from typing import Literal

from pydantic import Field

from engine.config.base import Section


class AlgorithmArgs(Section):
    advantage_estimator: Literal["grpo"] = "grpo"
    """Advantage estimator."""

    eps_clip: float = Field(0.2, gt=0)
    """PPO clip range ε: ratio clipped to [1-ε, 1+ε_high]."""

    use_kl_loss: bool = False
    """Add kl_loss_coef · KL(π‖π_ref) to the loss."""

    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL loss term."""

    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator for the loss and the logged metric."""

    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight (loss -= entropy_coef · entropy)."""
