"""Checkpoint flags (local paths or s3://bucket/prefix)."""
from typing import Optional

from pydantic import Field

from engine.config.base import Section


class CheckpointArgs(Section):
    save: Optional[str] = None
    """Checkpoint directory (local or s3://bucket/prefix): iter_%07d/ per save plus latest_checkpointed_iteration.txt (written last). If it already holds a marker and --load is unset, the run resumes from it automatically."""

    save_interval: Optional[int] = Field(None, ge=1)
    """Save every N rollouts (the last rollout is always saved when --save is set)."""

    load: Optional[str] = None
    """Start from this directory: a checkpoint with latest_checkpointed_iteration.txt (resume; --load = --save is the usual restart) or a Hugging Face model (its weights, converted at the start). Anything else is RF01."""

    ckpt_step: Optional[int] = Field(None, ge=0)
    """Load iteration N of --load (iter_%07d, verified) instead of the one the marker names."""

    ref_load: Optional[str] = None
    """Reference model for KL: a checkpoint directory (its marker's iteration) or a Hugging Face directory. Default: the starting weights (--load when it names starting weights, else --hf-checkpoint)."""

    ref_ckpt_step: Optional[int] = Field(None, ge=0)
    """Load iteration N of --ref-load instead of the one its marker names."""

    save_optim: bool = True
    """Save optimizer, scheduler and RNG state; --no-save-optim saves weights only and marks the checkpoint not resumable (with --save; without it, an error)."""

    load_optim: bool = True
    """Restore optimizer, scheduler and RNG state on resume; --no-load-optim continues from the weights (and data position) with a fresh optimizer (needed for --no-save-optim checkpoints)."""

    dist_ckpt_optim_fully_reshardable: bool = False
    """Megatron backend (slime's / Megatron-LM's flag): save the distributed optimizer's state in megatron-core's fully_reshardable format, each parameter's state in model space, so a resume may change the tensor, pipeline, expert and data-parallel sizes and keep Adam's moments. Each save gathers the data-parallel ranks' shares onto every rank first (host memory: 12 bytes per parameter of the rank's model-parallel shard, on each rank). Without it (dp_reshardable: each rank writes its own share, in parallel) only the data-parallel size may change across a resume. A checkpoint always loads in the format it was written in. Needs --save, and optimizer state in it."""

    distrib_optim_fully_reshardable_mem_efficient: bool = False
    """With --dist-ckpt-optim-fully-reshardable (slime's / Megatron-LM's flag): gather over gloo onto data-parallel rank 0 alone instead of onto every rank, for hosts that cannot hold the gathered state on every rank; saves and loads are slower (one rank writes). The checkpoint loads either way."""

    save_hf: bool = False
    """Also write a Hugging Face export of the weights into every iteration (iter_%07d/hf/; with --save)."""

    async_save: bool = False
    """Commit checkpoints in the background (slime's flag): the save stage writes the trainer's state into the iteration's temp location and returns; a commit-<id> task then checksums (and locally fsyncs) the files, moves or uploads them into iter_%07d/, writes the marker and applies --keep-last-n while the next rollouts train. One commit at a time: the next save waits for the one before (save/wait_seconds), and the run waits for the last one before it ends, also when a later stage fails. A kill before a commit's marker leaves the previous checkpoint as the resume point, as with a plain save. The backend's files themselves are written before the loop goes on. Needs --save."""

    keep_last_n: Optional[int] = Field(None, ge=1)
    """Keep only the N newest complete checkpoints under --save; older ones are deleted after the new marker is written (never the marker's). Without --save: an error."""

    allow_config_change: list[str] = []
    """Settings a resume may change from what the checkpoint recorded, by field name: any of hf_checkpoint, prompt_data, input_key, label_key, tool_key, rollout_batch_size, n_samples_per_prompt, global_batch_size, num_steps_per_rollout, rollout_shuffle, seed, train_backend, advantage_estimator, rollout_max_prompt_len, rollout_seed, rollout_max_context_len. A resume that changes one of them without naming it here fails (RF05) and lists the differences; other flags (num_rollout, lr, …) may change freely."""

    wait_for_save_lock: float = Field(0.0, ge=0)
    """Seconds to wait when another run holds --save's writer lock (0: fail at once, naming that run; with --save)."""
