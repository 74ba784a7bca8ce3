"""The checkpoint layout on local disk: marker atomicity, corruption → fallback, retention, --ckpt-step, RF01/RF05.

Pure file operations with a fake backend state (no Ray, no torch model): milliseconds each, except the few that
run a save in a subprocess to SIGKILL it at a boundary.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ckpt_fakes import damage, fake_state, save, start
from engine import checkpoint, faults
from engine.checkpoint import MARKER, Store
from engine.doctor import ConfigError, DiagnosisError

ROOT = Path(__file__).resolve().parent.parent


# ---- the layout --------------------------------------------------------------------------------------------------
def test_save_writes_iteration_then_marker_with_a_hash_per_file(tmp_path):
    rep = save(tmp_path, 3)
    d = tmp_path / "iter_0000003"
    assert (tmp_path / MARKER).read_text() == "3\n"
    m = json.loads((d / "manifest.json").read_text())
    assert m["rollout_id"] == 3 and m["next_rollout_id"] == 4 and m["format"] == 1
    assert set(m["files"]) == {"model/model.safetensors", "optim/state.pt"}
    for rel, f in m["files"].items():
        assert f["size"] == (d / rel).stat().st_size
        assert f["sha256"] == checkpoint.sha256_file(d / rel)
    assert rep.bytes == 4096 + len(b"optim-3") and rep.uri == str(d)
    assert not list(tmp_path.glob("*.tmp"))  # the temp dir was renamed, the marker temp replaced


def test_marker_readers_never_see_a_partial_write(tmp_path):
    # A reader polling while the marker moves 0 → 99 must always read a whole number, never '' or a torn value:
    # with a plain open('w').write() it reads '' whenever it lands between truncate and write.
    checkpoint.write_marker(tmp_path, 0)
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            seen.append((tmp_path / MARKER).read_text())

    t = threading.Thread(target=poll)
    t.start()
    for i in range(1, 100):
        checkpoint.write_marker(tmp_path, i)
    stop.set()
    t.join()
    values = [int(s) for s in seen]  # raises on '' or a torn value
    assert all(s.endswith("\n") for s in seen) and values == sorted(values) and len(values) > 10


def test_resume_starts_after_the_marker_with_the_data_state(tmp_path):
    for i in range(3):
        save(tmp_path, i)
    s = start(tmp_path)
    assert (s.kind, s.iteration, s.next_rollout_id, s.automatic) == ("checkpoint", 2, 3, True)
    assert s.manifest["data_state"] == {"epoch": 0, "offset": 3} and s.notes == []
    assert Path(s.local_dir) == tmp_path / "iter_0000002"


# ---- corruption: every case falls back to the newest complete iteration and says why ---------------------------
@pytest.mark.parametrize("how", ["missing_dir", "no_manifest", "bad_manifest", "missing_file", "truncated",
                                 "bitflip"])
def test_damaged_marker_iteration_falls_back_to_newest_complete(tmp_path, how):
    for i in range(3):
        save(tmp_path, i)
    why = damage(tmp_path / "iter_0000002", how)
    s = start(tmp_path)
    assert (s.iteration, s.next_rollout_id) == (1, 2)
    assert why in s.notes[0] and "iter_0000002" in s.notes[0]
    assert "fell back to" in s.notes[-1] and "iter_0000001" in s.notes[-1]


def test_fallback_skips_every_damaged_iteration(tmp_path):
    for i in range(4):
        save(tmp_path, i)
    damage(tmp_path / "iter_0000003", "bitflip")
    damage(tmp_path / "iter_0000002", "missing_file")
    s = start(tmp_path)
    assert s.iteration == 1 and len(s.notes) == 3  # two skips, one fallback


def test_no_complete_iteration_is_an_rf01_error_not_a_fresh_start(tmp_path):
    save(tmp_path, 0)
    damage(tmp_path / "iter_0000000", "bitflip")
    with pytest.raises(DiagnosisError) as e:
        start(tmp_path)
    assert e.value.codes == ["RF01"] and "sha256" in str(e.value)


def test_unreadable_marker_falls_back_instead_of_starting_over(tmp_path):
    for i in range(2):
        save(tmp_path, i)
    (tmp_path / MARKER).write_text("release\n")  # e.g. a Megatron release marker, or damage
    s = start(tmp_path)
    assert s.iteration == 1 and "'release\\n'" in s.notes[0]


def test_half_written_tmp_and_manifestless_dirs_above_marker_are_cleaned(tmp_path):
    save(tmp_path, 0)
    (tmp_path / "iter_0000001.tmp" / "model").mkdir(parents=True)  # killed during a local save
    (tmp_path / "iter_0000002" / "model").mkdir(parents=True)  # killed mid-upload (S3 writes in place)
    (tmp_path / (MARKER + ".tmp")).write_text("1")
    (tmp_path / "notes.txt").write_text("mine")
    gone = checkpoint.clean_leftovers(Store(tmp_path), checkpoint.read_marker(tmp_path))
    assert sorted(Path(g).name for g in gone) == sorted(["iter_0000001.tmp", "iter_0000002", MARKER + ".tmp"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000000", MARKER, "notes.txt"]


def test_a_failing_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    save(tmp_path, 0)

    def boom(path):
        fake_state(1)(path)
        raise OSError("disk full")

    with pytest.raises(OSError):
        checkpoint.save_iteration(Store(tmp_path), 1, boom, {})
    assert checkpoint.read_marker(tmp_path) == 0 and start(tmp_path).iteration == 0


# ---- a save in two halves (--async-save commits in the background) ----------------------------------------------
def test_a_staged_iteration_changes_nothing_a_resume_reads_until_its_commit(tmp_path):
    from ckpt_fakes import fake_state

    save(tmp_path, 0)
    store = Store(tmp_path)
    staged = checkpoint.stage_iteration(store, 1, fake_state(1), {"data_state": {"epoch": 0, "offset": 2}})
    assert staged.tmp == tmp_path / "iter_0000001.tmp" and (staged.tmp / "optim" / "state.pt").is_file()
    assert checkpoint.read_marker(tmp_path) == 0 and checkpoint.list_iterations(tmp_path) == [0]
    assert start(tmp_path).iteration == 0  # a kill now resumes from iteration 0 (and cleans the temp dir)
    rep = checkpoint.commit_iteration(store, staged, keep_last_n=1)
    assert checkpoint.read_marker(tmp_path) == 1 and checkpoint.list_iterations(tmp_path) == [1]
    assert rep.deleted == [0] and rep.commit_seconds <= rep.seconds
    m = checkpoint.load_manifest(tmp_path, 1)
    assert m["data_state"] == {"epoch": 0, "offset": 2} and m["files"]["optim/state.pt"]["size"] == len(b"optim-1")
    assert start(tmp_path).iteration == 1 and not list(tmp_path.glob("*.tmp"))


def test_a_commit_that_failed_after_the_move_goes_on_from_the_marker_when_repeated(tmp_path, monkeypatch):
    from ckpt_fakes import fake_state

    from engine.checkpoint import save as save_mod

    store = Store(tmp_path)
    save(tmp_path, 0)
    staged = checkpoint.stage_iteration(store, 1, fake_state(1), {})
    real = save_mod.write_marker

    def flaky(store_, it):
        monkeypatch.setattr(save_mod, "write_marker", real)
        raise OSError("the marker's rename failed")

    monkeypatch.setattr(save_mod, "write_marker", flaky)
    with pytest.raises(OSError):
        checkpoint.commit_iteration(store, staged)
    assert not staged.tmp.exists() and checkpoint.read_marker(tmp_path) == 0  # moved, not committed
    rep = checkpoint.commit_iteration(store, staged)  # the task's retry
    assert checkpoint.read_marker(tmp_path) == 1 and rep.bytes == 4096 + len(b"optim-1")
    assert start(tmp_path).iteration == 1
    staged.iteration = 2  # nothing of iteration 2 was ever written: no commit can make one up
    with pytest.raises(FileNotFoundError, match="save the rollout again"):
        checkpoint.commit_iteration(store, staged)
    assert checkpoint.read_marker(tmp_path) == 1


# ---- SIGKILL inside a save (the fault hooks in engine/checkpoint/save.py) --------------------------------------
_SAVE_SCRIPT = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from ckpt_fakes import save
save({where!r}, int(sys.argv[1]), keep_last_n=1)
"""


def _save_in_subprocess(where: str, it: int, fault: str | None, tmp_path: Path) -> int:
    env = {**os.environ, faults.ENV: fault} if fault else {k: v for k, v in os.environ.items() if k != faults.ENV}
    env["TMPDIR"] = str(tmp_path)
    code = _SAVE_SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"), where=where)
    return subprocess.run([sys.executable, "-c", code, str(it)], env=env, timeout=120).returncode


@pytest.mark.parametrize("fault, marker_after, complete_after", [
    ("during_save@2", 1, [1]),  # iter_2 half written (iter_0000002.tmp): marker stays 1
    ("before_marker@2", 1, [1, 2]),  # iter_2 complete but not committed: marker stays 1, retention has not run
    ("after_marker@2", 2, [1, 2]),  # committed; retention (keep 1) had not run yet, so iter_1 is still there
])
def test_sigkill_inside_a_save_never_leaves_a_marker_on_a_partial_iteration(tmp_path, fault, marker_after,
                                                                            complete_after):
    ckpt = tmp_path / "ckpt"
    assert _save_in_subprocess(str(ckpt), 1, None, tmp_path) == 0
    assert _save_in_subprocess(str(ckpt), 2, fault, tmp_path) == -9  # SIGKILLed itself at the boundary
    assert checkpoint.read_marker(ckpt) == marker_after
    assert checkpoint.complete_iterations(Store(ckpt)) == complete_after
    s = start(ckpt)
    assert s.iteration == marker_after and s.notes == []
    # the restarted run redoes iteration 2 and commits it; retention then keeps only it
    assert _save_in_subprocess(str(ckpt), 2, None, tmp_path) == 0
    assert checkpoint.read_marker(ckpt) == 2 and checkpoint.list_iterations(ckpt) == [2]
    assert not list(ckpt.glob("*.tmp"))


def test_fault_hooks_are_inert_by_default_and_fire_once_with_a_state_file(tmp_path, monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.at("during_save", 0)  # unset: nothing happens
    assert faults.parse("during_save@2, after_marker@10") == [("during_save", 2), ("after_marker", 10)]
    with pytest.raises(ValueError, match="ROLLFLOW_FAULT"):
        faults.parse("during_sav@2")
    with pytest.raises(ValueError):
        faults.parse("during_save")
    state = tmp_path / "fired"
    env = {**os.environ, faults.ENV: "after_rollout@1", faults.STATE_ENV: str(state), "PYTHONPATH": str(ROOT)}
    code = "from engine import faults; faults.at('after_rollout', 0); faults.at('after_rollout', 1); print('alive')"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == -9 and "alive" not in first.stdout
    assert second.returncode == 0 and second.stdout.strip() == "alive"  # fired once, recorded in the state file
    assert state.read_text() == "after_rollout@1\n"


# ---- retention ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("iters, complete, marker, k, doomed", [
    (range(6), range(6), 5, 2, [0, 1, 2, 3]),  # keep {4, 5}
    (range(6), range(6), 5, 10, []),  # fewer than K: nothing to delete
    ([0, 1, 2, 3], [0, 1, 3], 3, 2, [0]),  # K counts complete ones: keep {1, 3}; damaged 2 lies between, stays
    ([0, 1, 2, 7, 8], [0, 1, 2, 7, 8], 2, 1, [0, 1]),  # 7, 8 above the marker (another lineage) are not touched
    ([0, 1, 2], [0, 1], 2, 1, [0]),  # marker's iteration damaged: it is kept AND so is 1, the newest complete
])
def test_retention_plan(iters, complete, marker, k, doomed):
    assert checkpoint.retention_plan(list(iters), list(complete), marker, k) == doomed


def test_keep_last_n_deletes_only_after_the_new_marker(tmp_path):
    for i in range(5):
        rep = save(tmp_path, i, keep_last_n=2)
    assert checkpoint.list_iterations(tmp_path) == [3, 4] and rep.deleted == [2]
    assert checkpoint.read_marker(tmp_path) == 4


# ---- --ckpt-step, --load, origin, --no-save-optim ------------------------------------------------------------------
def test_ckpt_step_loads_that_iteration_and_resumes_after_it(tmp_path):
    for i in range(4):
        save(tmp_path, i)
    s = start(tmp_path / "new", load=str(tmp_path), ckpt_step=1)
    assert (s.iteration, s.next_rollout_id, s.automatic) == (1, 2, False)


def test_ckpt_step_on_a_damaged_iteration_is_rf01_listing_the_complete_ones(tmp_path):
    for i in range(3):
        save(tmp_path, i)
    damage(tmp_path / "iter_0000001", "truncated")
    with pytest.raises(ConfigError) as e:
        start(tmp_path / "new", load=str(tmp_path), ckpt_step=1)
    assert e.value.codes == ["RF01"] and "--ckpt-step one of [0, 2]" in str(e.value)
    with pytest.raises(ConfigError, match="--ckpt-step one of"):
        start(tmp_path / "new", load=str(tmp_path), ckpt_step=9)


def test_save_progress_wins_over_the_load_it_started_from(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save(a, 4)
    # a run started from --load a writes its origin into b; restarted with the same command it continues in b
    save(b, 6, origin=checkpoint.origin_of(str(a), None))
    s = start(b, load=str(a))
    assert (s.source, s.iteration, s.automatic) == (str(b), 6, True)
    # b holding a run started from somewhere else is an error, not a silent overwrite
    with pytest.raises(ConfigError) as e:
        start(b, load=str(a), ckpt_step=4)
    assert e.value.codes == ["RF05"] and f"--load {b}" in str(e.value)


def test_weights_only_checkpoint_needs_no_load_optim(tmp_path):
    save(tmp_path, 2, resumable=False)
    with pytest.raises(ConfigError) as e:
        start(tmp_path)
    assert e.value.codes == ["RF05"] and "--no-load-optim" in str(e.value)
    assert start(tmp_path, load_optim=False).next_rollout_id == 3


def test_hf_directory_as_load_is_starting_weights_and_the_reference(tmp_path, tiny_model):
    s = start(tmp_path / "save", load=tiny_model)
    assert (s.kind, s.next_rollout_id, s.local_dir) == ("hf", 0, tiny_model)
    ref = checkpoint.resolve_ref(ref_load=None, ref_ckpt_step=None, load=tiny_model, start=s, staging=tmp_path)
    assert ref == tiny_model  # KL is measured against the weights the run starts from


def test_ref_load_resolves_marker_or_step_and_rejects_unloadable(tmp_path):
    for i in range(3):
        save(tmp_path / "ref", i)
    fresh = checkpoint.StartPoint("fresh")
    kw = dict(load=None, start=fresh, staging=tmp_path / "stage")
    assert checkpoint.resolve_ref(ref_load=str(tmp_path / "ref"), ref_ckpt_step=None, **kw).endswith("iter_0000002")
    assert checkpoint.resolve_ref(ref_load=str(tmp_path / "ref"), ref_ckpt_step=0, **kw).endswith("iter_0000000")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        checkpoint.resolve_ref(ref_load=str(tmp_path / "empty"), ref_ckpt_step=None, **kw)
    assert e.value.codes == ["RF01"] and "--ref-load" in str(e.value)


# ---- RF01 / RF05 preflight messages ------------------------------------------------------------------------------
def _diags(**over):
    from engine.config import RunConfig
    from engine.doctor.checks import load_dir_has_marker, resume_hint, Environment

    cfg = RunConfig(eval_prompt_data="", **over)
    return load_dir_has_marker(cfg, Environment.local()) + resume_hint(cfg, Environment.local())


def test_rf01_lists_iteration_dirs_without_marker_and_suggests_ckpt_step(tmp_path):
    for i in range(2):
        save(tmp_path, i)
    (tmp_path / MARKER).unlink()
    (d,) = _diags(load=str(tmp_path))
    assert (d.code, d.severity) == ("RF01", "error")
    assert "iteration dirs without a marker: iter_0000000, iter_0000001" in d.what
    assert d.fix.startswith("--ckpt-step 1 ")


@pytest.mark.parametrize("setup, expect", [
    (lambda p: None, "nothing: the directory is empty or does not exist"),
    (lambda p: (p / "config.json").write_text("{}"), "Hugging Face files without weights: ['config.json']"),
    (lambda p: (p / "notes.txt").write_text("x"), "nothing loadable (1 entries: notes.txt)"),
])
def test_rf01_says_what_the_directory_holds(tmp_path, setup, expect):
    tmp_path.mkdir(exist_ok=True)
    setup(tmp_path)
    (d,) = _diags(load=str(tmp_path))
    assert d.code == "RF01" and expect in d.what and "--load" in d.fix


def test_rf01_accepts_hf_dirs_and_checks_ckpt_and_ref_steps(tmp_path, tiny_model):
    assert _diags(load=tiny_model) == []
    save(tmp_path, 0)
    msgs = [d.what for d in _diags(load=str(tmp_path), ckpt_step=3, ref_load=str(tmp_path), ref_ckpt_step=0)]
    assert msgs == [f"--load {tmp_path} --ckpt-step 3: iter_0000003/ does not exist"]
    (d,) = _diags(ckpt_step=3)
    assert "--ckpt-step 3 is set but --load is not" in d.what
    (d,) = _diags(ref_load=str(tmp_path / "nope"))
    assert d.what.startswith(f"--ref-load {tmp_path / 'nope'} has no {MARKER}") and "--ref-load" in d.fix


def test_rf01_warns_when_the_marker_iteration_is_damaged_but_an_older_one_is_complete(tmp_path):
    for i in range(2):
        save(tmp_path, i)
    damage(tmp_path / "iter_0000001", "no_manifest")
    (d,) = [d for d in _diags(load=str(tmp_path)) if d.code == "RF01"]
    assert d.severity == "warning" and "falls back to iter_0000000" in d.fix


def test_rf05_reports_automatic_resume_and_rejects_weights_only(tmp_path):
    save(tmp_path, 4)
    (d,) = _diags(save=str(tmp_path))
    assert (d.code, d.severity) == ("RF05", "info") and "resumes automatically at rollout 5" in d.what
    save(tmp_path, 5, resumable=False)
    (d,) = _diags(save=str(tmp_path))
    assert (d.code, d.severity) == ("RF05", "error") and "--no-load-optim" in d.fix
    assert [d.severity for d in _diags(save=str(tmp_path), load_optim=False)] == ["info"]
