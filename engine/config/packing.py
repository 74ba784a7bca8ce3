"""Pack/balance flags (varlen packing is always on: there is no flag to turn it off)."""
import logging
from typing import Literal, Optional

from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from engine.config.base import Section

log = logging.getLogger("rollflow.packing")


class PackingArgs(Section):
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token count under --max-tokens-per-gpu instead of --micro-batch-size samples."""

    max_tokens_per_gpu: Optional[int] = Field(None, ge=1)
    """Token cap per micro-batch per GPU (× context-parallel size); required by --use-dynamic-batch-size (RF03)."""

    context_parallel_size: int = Field(1, ge=1)
    """Context parallelism (CP) as in slime: the micro-batch cap is max_tokens_per_gpu·CP and DP = train GPUs / CP; no rollflow backend runs CP yet, so CP > 1 is a preflight error."""

    balance_data: bool = False
    """Assign micro-batches to DP ranks by Karmarkar–Karp on estimated FLOPs (equal count per rank) instead of strided."""

    balance_by_flops: bool = False
    """Form micro-batches by estimated FLOPs instead of tokens (still under the token cap in dynamic mode)."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    """MoE token dispatcher (megatron backend); allgather cannot handle packed variable-length sequences and is switched to alltoall (RF07)."""

    # True when the config asked for allgather and got alltoall (the doctor reports it as RF07)
    _moe_dispatcher_switched: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _varlen_dispatcher(cls, data: Any, handler) -> "PackingArgs":
        # slime does the same in validate_args: packing is always on, and allgather does not support it
        asked = data.get("moe_token_dispatcher_type") if isinstance(data, dict) else None
        if asked == "allgather":
            data = {**data, "moe_token_dispatcher_type": "alltoall"}
            log.warning("[RF07] --moe-token-dispatcher-type allgather does not support variable-length (packed) "
                        "sequences, and packing is always on: switched to alltoall")
        obj = handler(data)
        obj._moe_dispatcher_switched = asked == "allgather"
        return obj
