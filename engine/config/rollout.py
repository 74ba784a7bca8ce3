"""Rollout flags: how many samples, how they are generated, by which engine."""
from typing import Literal, Optional

from pydantic import Field

from engine.config.base import Section


class RolloutArgs(Section):
    rollout_batch_size: int = Field(8, ge=1)
    """Prompts per rollout (B). One rollout yields B × n samples."""

    n_samples_per_prompt: int = Field(8, ge=1)
    """Samples generated per prompt (n); GRPO normalises rewards within each group of n."""

    num_rollout: int = Field(30, ge=1)
    """Number of rollouts (RL iterations) in the run; rollout ids are 0..num_rollout-1."""

    rollout_max_response_len: int = Field(1024, ge=1)
    """Maximum new tokens per sample; a sample that reaches it is TRUNCATED."""

    rollout_temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy). Log-probs are computed at this temperature."""

    rollout_top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold."""

    rollout_top_k: int = -1
    """Top-k sampling (-1 = off)."""

    rollout_stop: list[str] = []
    """Stop strings sent to the engine as `stop` (RF10)."""

    rollout_stop_token_ids: list[int] = []
    """Stop token ids sent to the engine as `stop_token_ids`, added to the model's EOS (RF10)."""

    rollout_engine: Literal["builtin", "sglang"] = "builtin"
    """Rollout server kind: builtin (transformers, CPU or GPU, same HTTP API) or sglang (python -m sglang.launch_server)."""

    rollout_num_gpus_per_engine: int = Field(1, ge=1)
    """GPUs per rollout engine (its tensor-parallel size)."""

    rollout_num_engines: int = Field(1, ge=1)
    """Rollout engines started on this run when no GPUs are used (CPU / built-in engine)."""

    rollout_concurrency: int = Field(64, ge=1)
    """Most generate requests in flight across all engines."""

    rollout_timeout: float = Field(600.0, gt=0)
    """Seconds a whole rollout may take before it fails (and may be retried)."""

    deterministic_rollout: bool = False
    """Send each engine one batched /generate request per rollout (prompt groups split in order across engines), so a redone rollout is batched, and therefore sampled, exactly as the first time (bitwise-reproducible resume on CPU); gives up batching across in-flight requests."""

    sglang_args: dict[str, str | bool] = {}
    """Verbatim `--sglang-*` flags for the SGLang launcher (filled from the command line; key without the prefix)."""
