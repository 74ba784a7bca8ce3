"""Pack/balance flags (varlen packing is always on: there is no flag to turn it off)."""
import logging
from typing import Literal, Optional

from pydantic import Field, field_validator

from engine.config.base import Section

log = logging.getLogger("rollflow.packing")


class PackingArgs(Section):
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token count under --max-tokens-per-gpu instead of --micro-batch-size samples."""

    max_tokens_per_gpu: Optional[int] = Field(None, ge=1)
    """Token cap per micro-batch per GPU (× context-parallel size); required by --use-dynamic-batch-size (RF03)."""

    context_parallel_size: int = Field(1, ge=1)
    """Context parallelism (CP): GPUs that split one sequence; the micro-batch cap is max_tokens_per_gpu·CP and DP = train GPUs / CP (megatron backend only)."""

    balance_data: bool = False
    """Assign micro-batches to DP ranks by Karmarkar–Karp on estimated FLOPs (equal count per rank) instead of strided."""

    balance_by_flops: bool = False
    """Form micro-batches by estimated FLOPs instead of tokens (still under the token cap in dynamic mode)."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    """MoE token dispatcher (megatron backend); allgather cannot handle packed variable-length sequences and is switched to alltoall (RF07)."""

    @field_validator("moe_token_dispatcher_type")
    @classmethod
    def _varlen_dispatcher(cls, value: str) -> str:
        # slime does the same in validate_args: packing is always on, and allgather does not support it
        if value == "allgather":
            log.warning("[RF07] --moe-token-dispatcher-type allgather does not support variable-length (packed) "
                        "sequences, and packing is always on: switched to alltoall")
            return "alltoall"
        return value
