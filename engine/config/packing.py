"""Pack/balance flags (varlen packing is always on: there is no flag to turn it off)."""
from typing import Literal, Optional

from pydantic import Field

from engine.config.base import Section


class PackingArgs(Section):
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token count under --max-tokens-per-gpu instead of --micro-batch-size samples."""

    max_tokens_per_gpu: Optional[int] = Field(None, ge=1)
    """Token cap per micro-batch per GPU (× context-parallel size); required by --use-dynamic-batch-size (RF03)."""

    log_probs_max_tokens_per_gpu: Optional[int] = Field(None, ge=1)
    """Token cap per micro-batch of the no-grad forwards before the steps (slime's flag): the old and reference log-probs, --use-opd's teacher and PPO's values. With --use-dynamic-batch-size; default: the step's own micro-batches (under --max-tokens-per-gpu). They keep no activations for a backward, so a larger cap runs fewer, larger forwards (the samples re-packed in order; the same log-probs up to the matrix products' rounding)."""

    context_parallel_size: int = Field(1, ge=1)
    """Context parallelism (CP) as in slime: the micro-batch cap is max_tokens_per_gpu·CP and DP = train GPUs / CP; no rollflow backend runs CP yet, so CP > 1 is a preflight error."""

    balance_data: bool = False
    """Assign micro-batches to DP ranks by Karmarkar–Karp on estimated FLOPs (equal count per rank) instead of strided."""

    balance_by_flops: bool = False
    """Form micro-batches by estimated FLOPs instead of tokens (still under the token cap in dynamic mode)."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    """MoE token dispatcher (megatron backend); allgather cannot handle packed variable-length sequences and is switched to alltoall (RF07)."""

    @property
    def moe_dispatcher(self) -> str:
        """The MoE dispatcher a run uses: allgather cannot handle packed (variable-length) sequences and packing is
        always on, so it becomes alltoall, as slime's validate_args does (the doctor reports it as RF07)."""
        return "alltoall" if self.moe_token_dispatcher_type == "allgather" else self.moe_token_dispatcher_type
