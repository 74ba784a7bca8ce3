"""Where a run starts: fresh, from Hugging Face weights, or from a verified checkpoint iteration.

Rules, first match wins (design.md "Checkpoints", catalog RF01 / RF05):
 1. `--save` holds a marker and (`--load` is unset, or this run was started from the same `--load` /
    `--ckpt-step` — recorded as `origin` in every manifest) → automatic resume from `--save`.
    `--save` holding another run's checkpoints while `--load` names a different start is an error.
 2. `--load DIR --ckpt-step N` → exactly iter_N (verified; no fallback: the user named it).
 3. `--load DIR` with a marker → resume from it (`--load` = `--save` is the usual resume).
 4. `--load DIR` is a Hugging Face directory → its weights are the starting weights (converted at the start).
 5. `--load DIR` with none of these → RF01, listing what DIR holds.
 6. nothing → fresh start from `--hf-checkpoint`.
A marker's iteration is loaded only after every file's sha256 matches its manifest. A damaged one (missing or
half-written directory, missing file, wrong size, checksum mismatch) is skipped for the newest complete older
iteration, and the skip is recorded in `notes` (the convert task logs them and publishes an artifact).
A checkpoint saved with --no-save-optim holds no optimizer state: resuming from it needs --no-load-optim.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.checkpoint.layout import MANIFEST, MARKER, hf_files, is_hf_dir, iter_name, list_iterations, \
    marker_text, read_manifest, read_marker, sha256_file
from engine.checkpoint.storage import Store, normalize
from engine.diagnosis import ConfigError, Diagnosis, DiagnosisError


@dataclass
class StartPoint:
    kind: Literal["fresh", "hf", "checkpoint"]
    source: str | None = None  # the checkpoint root or HF directory, as a URI
    iteration: int | None = None
    local_dir: str | None = None  # what the trainers load: a verified local iteration dir, or the HF dir
    manifest: dict[str, Any] = field(default_factory=dict)
    next_rollout_id: int = 0
    automatic: bool = False  # resumed from --save without --load
    notes: list[str] = field(default_factory=list)  # fallbacks and clean-ups, for the log and the artifact

    def describe(self) -> str:
        if self.kind == "fresh":
            return "fresh start from --hf-checkpoint"
        if self.kind == "hf":
            return f"starting weights from the Hugging Face directory {self.source}"
        how = "automatic resume" if self.automatic else "--load"
        return (f"{how} from {self.source}/{iter_name(self.iteration)}: next rollout {self.next_rollout_id}"
                + ("" if self.manifest.get("resumable", True) else " (weights only: optimizer starts fresh)"))

    def markdown(self) -> str:
        lines = [f"### start: {self.describe()}", ""]
        if self.notes:
            lines += ["| what happened |", "|---|"] + [f"| {n.replace('|', '/')} |" for n in self.notes]
        return "\n".join(lines) + "\n"


# ---- checking one iteration ------------------------------------------------------------------------------------
def problem_with(store: Store, iteration: int, manifest: dict | None = None) -> str | None:
    """Cheap check from the listing: the manifest is readable and every file it lists exists with its size."""
    m = manifest if manifest is not None else read_manifest(store, iteration)
    if m is None:
        if iteration not in list_iterations(store):
            return f"{iter_name(iteration)}/ does not exist"
        return f"{iter_name(iteration)}/ has no readable {MANIFEST} (half-written)"
    if m.get("rollout_id") != iteration:
        return f"{iter_name(iteration)}/{MANIFEST} says rollout_id {m.get('rollout_id')}"
    sizes = store.files(iter_name(iteration))
    for rel, f in sorted(m["files"].items()):
        if rel not in sizes:
            return f"{iter_name(iteration)}/{rel} is missing"
        if sizes[rel] != f["size"]:
            return f"{iter_name(iteration)}/{rel} has {sizes[rel]} bytes, the manifest says {f['size']}"
    return None


def complete_iterations(store: Store) -> list[int]:
    """Iterations that pass the cheap check (ascending)."""
    return [i for i in list_iterations(store) if problem_with(store, i) is None]


def materialize(store: Store, iteration: int, staging: str | Path) -> tuple[Path | None, dict | None, str | None]:
    """(local dir, manifest, None) once every file's sha256 matches, else (None, None, problem).

    A local iteration is verified in place; a remote one is downloaded into `staging` first.
    """
    m = read_manifest(store, iteration)
    problem = problem_with(store, iteration, m)
    if problem:
        return None, None, problem
    if store.remote:
        local = Path(staging) / iter_name(iteration)
        shutil.rmtree(local, ignore_errors=True)
        for rel in [*m["files"], MANIFEST]:
            store.get_file(f"{iter_name(iteration)}/{rel}", local / rel)
    else:
        local = Path(store.path(iter_name(iteration)))
    for rel, f in sorted(m["files"].items()):
        got = sha256_file(local / rel)
        if got != f["sha256"]:
            return None, None, f"{iter_name(iteration)}/{rel}: sha256 {got[:12]}… ≠ manifest {f['sha256'][:12]}…"
    return local, m, None


def materialize_hf(store: Store, staging: str | Path) -> Path:
    """A Hugging Face directory as a local path (a remote one is downloaded into `staging`)."""
    if not store.remote:
        return Path(store.path())
    local = Path(staging) / "hf"
    shutil.rmtree(local, ignore_errors=True)
    for rel in store.files(""):
        store.get_file(rel, local / rel)
    return local


# ---- listing for RF01 ------------------------------------------------------------------------------------------
def describe_dir(store: Store) -> str:
    """What a directory that cannot be loaded holds, for RF01 messages."""
    iters = list_iterations(store)
    if iters:
        complete = complete_iterations(store)
        shown = ", ".join(iter_name(i) for i in iters[-5:])
        return (f"iteration dirs without a marker: {shown}" + (f" ({len(iters)} in all)" if len(iters) > 5 else "")
                + (f"; complete: {complete[-5:]}" if complete else "; none complete"))
    hf = hf_files(store)
    if hf:
        return f"Hugging Face files without {'weights' if hf == ['config.json'] else 'config.json'}: {hf[:4]}"
    names = sorted(e["name"] for e in store.listdir())
    if names:
        return f"nothing loadable ({len(names)} entries: {', '.join(names[:6])})"
    return "nothing: the directory is empty or does not exist"


def rf01(flag: str, store: Store, *, step_flag: str = "--ckpt-step") -> Diagnosis:
    complete = complete_iterations(store)
    fix = (f"{flag} a directory written by --save (it holds {MARKER}); for a Hugging Face model pass its directory "
           f"(config.json + weights)")
    if complete:
        fix = f"{step_flag} {complete[-1]} to load the newest complete iteration, or " + fix
    return Diagnosis(code="RF01", severity="error",
                     what=f"{flag} {store.url} has no {MARKER} and is not a Hugging Face model; found "
                          f"{describe_dir(store)}",
                     fix=fix, facts={"path": store.url, "iterations": list_iterations(store), "complete": complete})


# ---- resolution ------------------------------------------------------------------------------------------------
def origin_of(load: str | None, ckpt_step: int | None) -> dict[str, Any]:
    """What a run was started from; recorded in every manifest so a restart can tell its own checkpoints."""
    return {"load": normalize(load) if load else None, "ckpt_step": ckpt_step}


def _same_dir(a: str | None, b: str | None) -> bool:
    return bool(a and b) and normalize(a) == normalize(b)


def _newest_loadable(store: Store, marker: int | None, staging: str | Path) -> tuple[int, Path, dict, list[str]]:
    """The marker's iteration if it verifies, else the newest older one that does (with a note per skip).

    marker=None means the marker file exists but does not hold an iteration number: every iteration is a candidate.
    """
    notes = [] if marker is not None else [f"{store.uri(MARKER)} holds {marker_text(store)!r}, not an iteration "
                                           "number; looking for the newest complete iteration"]
    older = [i for i in reversed(list_iterations(store)) if marker is None or i < marker]
    for it in ([marker] if marker is not None else []) + older:
        local, m, problem = materialize(store, it, staging)
        if problem is None:
            if it != marker:
                notes.append(f"fell back to {store.uri(iter_name(it))}, the newest complete iteration")
            return it, local, m, notes
        notes.append(f"{'the marker names ' if it == marker else 'skipped '}{store.uri(iter_name(it))}: "
                     f"{problem}; not loaded")
    head = (f"{MARKER} names iteration {marker} but no iteration at or below it is complete"
            if marker is not None else "no complete iteration")
    raise DiagnosisError(Diagnosis(
        code="RF01", severity="error", what=f"{store.url}: {head}: " + "; ".join(notes),
        fix=f"restore the checkpoint files, or start over with a new --save (or delete {store.uri(MARKER)})",
        facts={"path": store.url, "marker": marker, "problems": notes}))


def _checkpoint(store: Store, it: int, local: Path, m: dict, *, automatic: bool, load_optim: bool,
                notes: list[str]) -> StartPoint:
    nxt = int(m.get("next_rollout_id", it + 1))
    if nxt > 0 and not m.get("resumable", True) and load_optim:
        raise ConfigError(Diagnosis(
            code="RF05", severity="error",
            what=f"{store.uri(iter_name(it))} was saved with --no-save-optim: weights only, no optimizer state, so "
                 f"the run cannot resume exactly from it",
            fix="--no-load-optim to continue from its weights with a fresh optimizer (the LR schedule restarts), "
                "or a new --save to start over",
            facts={"path": store.uri(iter_name(it))}))
    return StartPoint("checkpoint", store.url, it, str(local), m, nxt, automatic, notes)


def resolve_start(*, load: str | None, save: str | None, ckpt_step: int | None, load_optim: bool,
                  staging: str | Path) -> StartPoint:
    """Apply the rules in the module docstring; verifies (and for S3 downloads) the chosen iteration."""
    origin = origin_of(load, ckpt_step)
    if save and not _same_dir(load, save):
        own = Store(save)
        if marker_text(own) is not None:
            it, local, m, notes = _newest_loadable(own, read_marker(own), staging)
            if load is None or m.get("origin") == origin:
                return _checkpoint(own, it, local, m, automatic=True, load_optim=load_optim, notes=notes)
            raise ConfigError(Diagnosis(
                code="RF05", severity="error",
                what=f"--save {own.url} already holds iteration {it} of a run started from {m.get('origin')}, "
                     f"while this run starts from --load {load}" + (f" --ckpt-step {ckpt_step}" if ckpt_step
                                                                    is not None else ""),
                fix=f"--load {own.url} (and no --ckpt-step) to continue that run, or a new --save for this one",
                facts={"save": own.url, "iteration": it, "origin": m.get("origin"), "this_origin": origin}))
    if not load:
        if ckpt_step is not None:
            raise ConfigError(Diagnosis(code="RF01", severity="error",
                                        what=f"--ckpt-step {ckpt_step} is set but --load is not",
                                        fix=f"--load DIR --ckpt-step {ckpt_step}, or drop --ckpt-step"))
        return StartPoint("fresh")
    src = Store(load)
    if ckpt_step is not None:
        local, m, problem = materialize(src, ckpt_step, staging)
        if problem:
            complete = complete_iterations(src)
            raise ConfigError(Diagnosis(
                code="RF01", severity="error", what=f"--load {src.url} --ckpt-step {ckpt_step}: {problem}",
                fix=(f"--ckpt-step one of {complete}" if complete else f"--load a directory with a complete "
                     f"iteration; {src.url} has none"), facts={"path": src.url, "complete": complete}))
        return _checkpoint(src, ckpt_step, local, m, automatic=False, load_optim=load_optim, notes=[])
    if marker_text(src) is not None:
        it, local, m, notes = _newest_loadable(src, read_marker(src), staging)
        return _checkpoint(src, it, local, m, automatic=False, load_optim=load_optim, notes=notes)
    if is_hf_dir(src):
        return StartPoint("hf", src.url, None, str(materialize_hf(src, staging)))
    raise ConfigError(rf01("--load", src))


def peek_start(*, load: str | None, save: str | None, ckpt_step: int | None) -> tuple[int, dict, bool] | None:
    """(iteration, manifest, automatic) of the checkpoint resolve_start would start from, from manifests alone
    (no checksums, no downloads): enough to know the run's MLflow run id before anything is verified. None for a
    fresh start, HF weights or a converted iteration (starting weights: no run to continue)."""
    origin = origin_of(load, ckpt_step)

    def newest(store: Store) -> tuple[int, dict] | None:
        marker = read_marker(store)
        older = [i for i in reversed(list_iterations(store)) if marker is None or i < marker]
        for it in ([marker] if marker is not None else []) + older:
            if (m := read_manifest(store, it)) is not None:
                return it, m
        return None

    found = None
    if save and not _same_dir(load, save) and marker_text(Store(save)) is not None:
        own = newest(Store(save))
        if own and (load is None or own[1].get("origin") == origin):
            found = (*own, True)
    if found is None and load:
        src = Store(load)
        if ckpt_step is not None:
            m = read_manifest(src, ckpt_step)
            found = (ckpt_step, m, False) if m else None
        elif marker_text(src) is not None and (it_m := newest(src)):
            found = (*it_m, False)
    if found is None or int(found[1].get("next_rollout_id", found[0] + 1)) == 0:
        return None
    return found


def resolve_ref(*, ref_load: str | None, ref_ckpt_step: int | None, load: str | None, start: StartPoint,
                staging: str | Path) -> str | None:
    """The reference model's weights as a local dir (HF dir or iteration dir); None = --hf-checkpoint's.

    --ref-load wins; else, when --load names starting weights (an HF dir or a converted iteration that starts at
    rollout 0), the reference is those same weights, so KL = 0 on the first step; else --hf-checkpoint.
    """
    if ref_load:
        st = Store(ref_load)
        it = ref_ckpt_step if ref_ckpt_step is not None else read_marker(st)
        if it is not None:
            local, _, problem = materialize(st, it, Path(staging) / "ref")
            if problem:
                raise ConfigError(Diagnosis(code="RF01", severity="error",
                                            what=f"--ref-load {st.url}: {problem}",
                                            fix=f"--ref-ckpt-step one of {complete_iterations(st)}, or restore "
                                                "the files", facts={"path": st.url}))
            return str(local)
        if ref_ckpt_step is None and is_hf_dir(st):
            return str(materialize_hf(st, Path(staging) / "ref"))
        raise ConfigError(rf01("--ref-load", st, step_flag="--ref-ckpt-step"))
    if ref_ckpt_step is not None:
        raise ConfigError(Diagnosis(code="RF01", severity="error",
                                    what=f"--ref-ckpt-step {ref_ckpt_step} is set but --ref-load is not",
                                    fix=f"--ref-load DIR --ref-ckpt-step {ref_ckpt_step}, or drop --ref-ckpt-step"))
    if not load:
        return None
    if start.kind == "hf" or (start.kind == "checkpoint" and _same_dir(start.source, load)
                              and start.manifest.get("next_rollout_id") == 0):
        return start.local_dir
    st = Store(load)
    if is_hf_dir(st) and read_marker(st) is None:
        return str(materialize_hf(st, Path(staging) / "ref"))
    marker = read_marker(st)
    if marker is not None and (m := read_manifest(st, marker)) and m.get("next_rollout_id") == 0:
        local, _, problem = materialize(st, marker, Path(staging) / "ref")
        if problem:
            raise ConfigError(Diagnosis(code="RF01", severity="error", what=f"--load {st.url}: {problem}",
                                        fix="restore the files, or pass --ref-load", facts={"path": st.url}))
        return str(local)
    return None
