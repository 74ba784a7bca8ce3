"""Saved rollouts (slime's --save-debug-rollout-data / --load-debug-rollout-data): one rollout's scored samples and
metrics in a file, and a run that trains on those files instead of generating.

A file is one JSON document (gzip-compressed when the path ends in `.gz`):
`{"format": "rollflow-debug-rollout", "version": 1, "rollout_id", "hf_checkpoint", "rollout_batch_size",
"n_samples_per_prompt", "weight_version", "metrics", "groups"}`, `groups` being B lists of n `Sample.to_dict()`
(tokens, response length, reward, loss mask, the engine's log-probs, status, metadata, any attribute a custom
rollout set). It is written to a temporary file and renamed, so a crash never leaves half a file under the name.
Replayed, the samples are trained exactly as the recording run trained them: the same tokens, rewards, masks and
engine log-probs (`tests/test_debug_rollout.py` checks that a replay of a synchronous run ends on the same weights,
bit for bit, on the CPU).
"""
from __future__ import annotations

import glob
import gzip
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from engine.diagnosis import Diagnosis, DiagnosisError
from engine.samples import Sample

log = logging.getLogger(__name__)

FORMAT = "rollflow-debug-rollout"
VERSION = 1
SLOT = "{rollout_id}"


def path_of(pattern: str, rollout_id: int) -> Path:
    """The file of `rollout_id` (`{rollout_id}` replaced; other braces are kept as they are)."""
    return Path(pattern.replace(SLOT, str(rollout_id)))


def saved_ids(pattern: str) -> list[int]:
    """The rollout ids that have a file under `pattern`, sorted."""
    head, _, tail = pattern.partition(SLOT)
    rx = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + r"\Z")
    found = (rx.match(p) for p in glob.glob(glob.escape(head) + "*" + glob.escape(tail)))
    return sorted({int(m.group(1)) for m in found if m})


def _error(what: str, fix: str, **facts: Any) -> DiagnosisError:
    return DiagnosisError(Diagnosis(code="DATA", severity="error", what=what, fix=fix, facts=facts))


def save(pattern: str, rollout_id: int, groups: list[list[Sample]], metrics: dict[str, float],
         meta: dict[str, Any]) -> Path:
    """Write rollout `rollout_id` (its groups, metrics and `meta`: the settings a replay checks) to its file."""
    path = path_of(pattern, rollout_id)
    doc = {"format": FORMAT, "version": VERSION, "rollout_id": rollout_id, **meta, "metrics": metrics,
           "groups": [[s.to_dict() for s in g] for g in groups]}
    try:
        data = json.dumps(doc).encode()
    except TypeError as e:  # an attribute a custom rollout or hook set that JSON cannot hold
        raise _error(f"--save-debug-rollout-data: rollout {rollout_id}'s samples cannot be written as JSON ({e})",
                     "keep the attributes your rollout function or hooks set on samples to JSON types (str, "
                     "numbers, lists, dicts), or drop --save-debug-rollout-data", path=str(path)) from e
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would create it (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it process-wide, under other threads' feet):
    /proc on Linux, else the usual 022."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def subsample(groups: list[list[Sample]], share: float) -> list[list[Sample]]:
    """--load-debug-rollout-data-subsample: k = int(len(groups) × share) whole groups, the first ⌊k/2⌋ and the
    last ⌈k/2⌉ (slime's load_debug_rollout_data takes its rows so)."""
    k = int(len(groups) * share)
    return groups[:k // 2] + groups[len(groups) - (k - k // 2):]


def load(pattern: str, rollout_id: int, *, batch_size: int, n: int, vocab_size: int | None,
         hf_checkpoint: str, share: float | None = None) -> tuple[list[list[Sample]], dict[str, float], dict[str, Any]]:
    """Rollout `rollout_id`'s groups, metrics and header from its file, checked against the run: B groups of n
    samples (after --load-debug-rollout-data-subsample's `share`), token ids inside the model's vocabulary. A file
    written for another --hf-checkpoint is only warned about (the same tokenizer may serve another model on
    purpose)."""
    path = path_of(pattern, rollout_id)
    if not path.is_file():
        raise DiagnosisError(missing_diagnosis(pattern, [rollout_id], f"({path} does not exist)"))
    try:
        raw = path.read_bytes()
        doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, ValueError) as e:
        raise _error(f"--load-debug-rollout-data: {path} is not a saved rollout ({type(e).__name__}: {e})",
                     "record it again with --save-debug-rollout-data", path=str(path)) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise _error(f"--load-debug-rollout-data: {path} is not a rollflow saved rollout of version {VERSION} "
                     f"(format {found!r})", "record it with this rollflow's --save-debug-rollout-data",
                     path=str(path))
    groups = [[Sample.from_dict(d) for d in g] for g in doc["groups"]]
    B, N = doc.get("rollout_batch_size"), doc.get("n_samples_per_prompt")
    if share is not None:
        kept = subsample(groups, share)
        if len(kept) != batch_size or any(len(g) != n for g in kept):
            raise _error(f"--load-debug-rollout-data-subsample {share}: {path} holds {len(groups)} groups of "
                         f"{sorted({len(g) for g in groups})} samples, of which the share keeps {len(kept)}; the "
                         f"run trains {batch_size} groups of {n}",
                         f"--rollout-batch-size {len(kept)} --n-samples-per-prompt {N}" if kept else
                         f"a share of at least {1 / len(groups):.3g} (one group of the {len(groups)})",
                         path=str(path), recorded={"rollout_batch_size": B, "n_samples_per_prompt": N},
                         kept_groups=len(kept))
        groups = kept
    elif len(groups) != batch_size or any(len(g) != n for g in groups):
        raise _error(f"--load-debug-rollout-data: {path} holds {len(groups)} groups of "
                     f"{sorted({len(g) for g in groups})} samples, the run trains {batch_size} groups of {n}",
                     f"--rollout-batch-size {B} --n-samples-per-prompt {N} (as recorded)", path=str(path),
                     recorded={"rollout_batch_size": B, "n_samples_per_prompt": N})
    if vocab_size is not None:
        top = max((max(s.tokens, default=0) for g in groups for s in g), default=0)
        if top >= vocab_size:
            raise _error(f"--load-debug-rollout-data: {path} has token id {top}, outside this model's vocabulary "
                         f"of {vocab_size} (recorded with --hf-checkpoint {doc.get('hf_checkpoint')})",
                         f"--hf-checkpoint {doc.get('hf_checkpoint')} (the recording run's model)", path=str(path))
    if doc.get("hf_checkpoint") not in (None, hf_checkpoint):
        log.warning("--load-debug-rollout-data: %s was recorded with --hf-checkpoint %s; this run trains %s",
                    path, doc.get("hf_checkpoint"), hf_checkpoint)
    meta = {k: v for k, v in doc.items() if k not in ("groups", "metrics")}
    return groups, dict(doc.get("metrics") or {}), meta


def _prefix(ids: list[int]) -> list[int]:
    """0, 1, … as far as `ids` has them without a gap."""
    out = []
    for i in ids:
        if i != len(out):
            break
        out.append(i)
    return out


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] → "0–2, 5"."""
    out, start = [], None
    for k, i in enumerate(ids):
        if start is None:
            start = i
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            out.append(f"{start}" if start == i else f"{start}–{i}")
            start = None
    return ", ".join(out)


def missing(pattern: str, num_rollout: int) -> list[int]:
    """The rollout ids 0 … num_rollout − 1 with no file under `pattern` (preflight)."""
    have = set(saved_ids(pattern))
    return [i for i in range(num_rollout) if i not in have]


def missing_diagnosis(pattern: str, gone: list[int], context: str) -> Diagnosis:
    """DATA: rollout ids `gone` have no file under `pattern` (preflight, or a file removed since); the fix is the
    --num-rollout the saved files cover from 0, else recording them."""
    have = saved_ids(pattern)
    run_from = _prefix(have)
    return Diagnosis(code="DATA", severity="error",
                     what=f"--load-debug-rollout-data {pattern!r} has no file for rollout(s) {_ranges(gone)} "
                          f"{context} (saved: {_ranges(have) or 'none'})",
                     fix=(f"--num-rollout {len(run_from)} (the saved rollouts 0–{len(run_from) - 1})" if run_from
                          else "record the rollouts first: the same run with --save-debug-rollout-data "
                               f"{pattern!r} instead of --load-debug-rollout-data"),
                     facts={"field": "load_debug_rollout_data", "missing": gone[:20], "saved": have[:20]})
