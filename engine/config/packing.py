"""Pack/balance flags (varlen packing is always on)."""
from typing import Optional

from pydantic import Field

from engine.config.base import Section


class PackingArgs(Section):
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token count under --max-tokens-per-gpu instead of --micro-batch-size samples."""

    max_tokens_per_gpu: Optional[int] = Field(None, ge=1)
    """Token cap per micro-batch per GPU (× context-parallel size); required by --use-dynamic-batch-size (RF03)."""
