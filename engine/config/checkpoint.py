"""Checkpoint flags."""
from typing import Optional

from pydantic import Field

from engine.config.base import Section


class CheckpointArgs(Section):
    save: Optional[str] = None
    """Checkpoint directory: iter_%07d/ per save plus latest_checkpointed_iteration.txt (written last)."""

    save_interval: Optional[int] = Field(None, ge=1)
    """Save every N rollouts (the last rollout is always saved when --save is set)."""

    load: Optional[str] = None
    """Resume from this checkpoint directory (it must hold latest_checkpointed_iteration.txt: RF01)."""

    ref_load: Optional[str] = None
    """Reference model for KL: a checkpoint directory (with its marker) or a Hugging Face directory; default: the initial weights (--hf-checkpoint)."""
