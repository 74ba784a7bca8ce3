"""The failure catalog: thirteen failures RL users hit most (the seed document) and one found by us (RF14), each with
a stable code.

The failure table of docs/failures.md is generated from CATALOG (`python -m engine.doctor.catalog --write
docs/failures.md`), its short form the README's (`--write-short README.md`); tests keep them equal.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

START, END = "<!-- catalog:start -->", "<!-- catalog:end -->"
SHORT_START, SHORT_END = "<!-- catalog-short:start -->", "<!-- catalog-short:end -->"


@dataclass(frozen=True)
class Entry:
    code: str
    symptom: str  # what the user sees
    cause: str  # the root cause
    catches: str  # what rollflow does: the check, when it runs, the fix it names


CATALOG: dict[str, Entry] = {e.code: e for e in [
    Entry("RF01", "garbled text from the policy",
          "`--load` / `--ref-load` points at a directory without `latest_checkpointed_iteration.txt`, so the "
          "weights were not loaded",
          "preflight: a checkpoint dir is loadable only with the marker (or `--ckpt-step N` naming a complete "
          "`iter_%07d`) or as a Hugging Face model (converted at the start); the error lists what is there "
          "(iteration dirs and the `--ckpt-step` of the newest complete one, HF files, nothing). At start every "
          "file's sha256 is checked; a damaged marker iteration falls back to the newest complete one (logged, "
          "artifact). Runtime: on the first step policy and reference log-probs must agree (KL = 0, ratio = 1)"),
    Entry("RF02", "the job sits forever at Ray submission",
          "more GPUs asked than the cluster has (colocated: actor_num_nodes × actor_num_gpus_per_node; decoupled: "
          "that + rollout_num_gpus)",
          "preflight compares the topology with the cluster and names the failing formula with numbers; placement "
          "waits have a deadline, then retries with backoff, then fail with the same diagnosis; a --ray-address "
          "that does not answer, or whose cluster refuses this driver's Ray token (RAY_AUTH_MODE), fails at once"),
    Entry("RF03", "OOM mid-training",
          "`--max-tokens-per-gpu` too high (it only applies with `--use-dynamic-batch-size`, which requires it)",
          "preflight: dynamic batch without the cap is an error suggesting `rollout_max_response_len / cp_size`; "
          "a cap below the longest possible sample is a warning (use `--context-parallel-size`); an OOM at "
          "runtime is classified and reported with these numbers and the OOM's own (asked, free, this process; "
          "other processes holding the GPU, then named first; memory reserved but unallocated, then "
          "expandable_segments)"),
    Entry("RF04", "transformers cannot find the model on multi-node runs",
          "many processes read the same local model files at once",
          "model files are read behind a per-node file lock; `--model-name` names the architecture so no process "
          "infers it from files"),
    Entry("RF05", "how do I resume?", "—",
          "`--load` = `--save` resumes; a `--save` holding a marker with `--load` unset resumes automatically "
          "(reported); `--ckpt-step` picks an older iteration; flow retries resume the same way; a "
          "`--no-save-optim` checkpoint needs `--no-load-optim`; a `--save` holding another run's checkpoints is "
          "an error"),
    Entry("RF06", "batch sizes misunderstood", "`--global-batch-size` counts samples, not prompts",
          "preflight prints samples per rollout, steps per rollout and train_iters, and rejects k·G ≠ B·n or G not "
          "divisible by micro-batch × DP with the values that work"),
    Entry("RF07", "is data packed?", "—",
          "packing is always on; an MoE `allgather` token dispatcher is switched to `alltoall` (logged); packing "
          "efficiency and DP imbalance are metrics"),
    Entry("RF08", "SGLang `Max retries exceeded … /get_model_info`",
          "several SGLang servers on one machine collide on ports",
          "one port allocator for every server, router and NCCL port, checked free before launch; an engine "
          "that loses a port to another program between the check and its bind (two runs on one machine), or "
          "finds another run's server answering on its port, is started again on the next ports, twice at most; "
          "a taken port is reported with the process that holds it; an engine that fails its health check is "
          "reported with its port, log tail and the advice (fewer engines per node, e.g. larger tp)"),
    Entry("RF09", "grad norm huge, training collapses",
          "data already chat-templated with a template that differs from the model's",
          "preflight renders a few prompts with the tokenizer's template and compares them with pre-templated "
          "data (and rejects templating twice); runtime: a grad-norm spike is reported with the step's sample ids"),
    Entry("RF10", "generation takes forever, GPU at full power, no output", "the model has no stop token",
          "preflight: no EOS and no `--rollout-stop` / `--rollout-stop-token-ids` is an error; those reach the "
          "engine as `stop` / `stop_token_ids`; a high truncation share at runtime raises this diagnosis"),
    Entry("RF11", "SGLang: an illegal memory access was encountered", "usually an OOM inside the engine",
          "engine logs are scanned; the error is reported with the advice to lower `--sglang-mem-fraction-static` "
          "(and its current value); the built-in engine's out-of-memory answer to a /generate is its own RF11, with "
          "the OOM's numbers and a smaller `--sglang-max-running-requests`"),
    Entry("RF12", "JSONDecodeError from torch compile / inductor", "processes share one inductor cache",
          "`TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` is in every Ray worker's env by default; the traceback is still "
          "classified if it happens"),
    Entry("RF13", "NaN / Inf in gradients", "numerical instability or bad data",
          "loss and grads are checked every step; a NaN step fails with its sample ids, or with "
          "`--no-check-for-nan-in-loss-and-grad` is skipped (no update), counted and warned about"),
    Entry("RF14", "garbled or endless output right after a weight sync; rewards collapse",
          "the engine serves weights that differ from the trainer's: a wrong name mapping, a partial or stale sync, "
          "a dtype read wrongly (not in the seed: found by us, a bf16 Megatron → fp32 engine sync on a GPU)",
          "every synced weight name and shape is checked against the engine's model (no partial load); after every "
          "sync each engine scores fixed prompts like the trainer; every rollout, before the update, the trainer's "
          "log-probs of the sampled tokens are compared with the engine's (`train/mismatch`, mean and max). A mean "
          "above `--logprob-mismatch-threshold` (0.05 bf16, 1e-3 fp32) stops the run naming the likely causes and "
          "`--use-tis`; `--check-weight-update-equal` proves, before the first rollout, that the sync writes every weight "
          "of every engine bit for bit (SGLang's `/weights_checker`)"),
]}


def catalog_markdown() -> str:
    rows = ["| code | symptom | root cause | what rollflow does |", "|---|---|---|---|"]
    for e in CATALOG.values():
        cells = [e.code, e.symptom, e.cause, e.catches]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def catalog_short_markdown() -> str:
    """One line per code (the README's table): the code, what the user sees, the cause."""
    rows = ["| code | what you see | usual cause |", "|---|---|---|"]
    for e in CATALOG.values():
        rows.append(f"| {e.code} | {e.symptom} | {e.cause.split(':')[0].split(' (')[0]} |".replace("\n", " "))
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    # python -m engine.doctor.catalog [--write docs/failures.md | --write-short README.md]
    if len(sys.argv) == 3 and sys.argv[1] in ("--write", "--write-short"):
        from pathlib import Path

        from engine.config.docs import embed

        p = Path(sys.argv[2])
        short = sys.argv[1] == "--write-short"
        p.write_text(embed(p.read_text(), catalog_short_markdown() if short else catalog_markdown(),
                           SHORT_START if short else START, SHORT_END if short else END))
    else:
        print(catalog_markdown())
