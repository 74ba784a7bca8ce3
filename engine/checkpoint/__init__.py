"""Checkpoints in the Megatron-compatible layout (design.md, "Checkpoints"), on local disk or S3.

    <save>/iter_%07d/manifest.json   rollout_id, next_rollout_id, resumable, data state, run ids, config hash,
                                     origin, history, every file with size + sha256 (written last in the dir)
    <save>/iter_%07d/model/ optim/   the backend's state (optim/ absent with --no-save-optim)
    <save>/iter_%07d/hf_config/      the HF config + tokenizer files, so the iteration converts to HF alone
    <save>/iter_%07d/hf/             --save-hf: a Hugging Face export of the weights
    <save>/latest_checkpointed_iteration.txt   "<N>\\n", written LAST and atomically
    <save>/rollflow_run.json         the MLflow run id before the first checkpoint exists

Invariants (tests/test_checkpoint.py asserts each):
- the marker only ever names an iteration whose files were all durable before it moved (save.py);
- nothing is loaded unless every file's sha256 matches its manifest; a damaged marker iteration falls back to
  the newest complete older one, and says so (resolve.py);
- retention runs after the marker moved and never deletes the marker's iteration;
- the iteration number is the rollout id; a resumed run starts at N + 1.
"""
from engine.checkpoint.layout import MANIFEST, MARKER, RUN_FILE, file_table, hf_files, is_hf_dir, iter_dir, \
    iter_name, list_iterations, marker_text, read_manifest, read_marker, read_run_file, sha256_file, write_marker, \
    write_run_file
from engine.checkpoint.resolve import StartPoint, complete_iterations, describe_dir, materialize, origin_of, \
    peek_start, problem_with, resolve_ref, resolve_start, rf01
from engine.checkpoint.save import SaveReport, Staged, apply_retention, clean_leftovers, commit_iteration, \
    retention_plan, save_iteration, stage_iteration
from engine.checkpoint.storage import Store, is_remote, normalize


def load_manifest(save, iteration: int) -> dict:
    """The manifest of an iteration (FileNotFoundError when it is missing or unreadable)."""
    m = read_manifest(save, iteration)
    if m is None:
        raise FileNotFoundError(f"{save}/{iter_name(iteration)}/{MANIFEST} is missing or unreadable")
    return m


__all__ = ["MANIFEST", "MARKER", "RUN_FILE", "SaveReport", "Staged", "StartPoint", "Store", "apply_retention",
           "clean_leftovers", "commit_iteration", "complete_iterations", "describe_dir", "file_table", "hf_files", "is_hf_dir",
           "is_remote", "iter_dir", "iter_name", "list_iterations", "load_manifest", "marker_text", "materialize",
           "normalize", "origin_of", "peek_start", "problem_with", "read_manifest", "read_marker", "read_run_file",
           "resolve_ref", "resolve_start", "retention_plan", "rf01", "save_iteration", "sha256_file", "stage_iteration",
           "write_marker", "write_run_file"]
