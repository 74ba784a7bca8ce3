"""Checkpoints on S3 through s3fs, against a local moto server on 127.0.0.1 (tests/conftest.py: s3_server).

The traps: recursive put nesting a directory under a trailing slash, s3fs's listing cache hiding a new marker,
no rename on S3 (the marker must be one PUT after every other object), credentials leaking into files or messages.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from engine import checkpoint, faults
from engine.checkpoint import MARKER, Store
from ckpt_fakes import fake_state, save, start

ROOT = Path(__file__).resolve().parent.parent


def s3fs():
    return fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)


def test_save_and_resume_on_s3_with_a_trailing_slash_url(s3_bucket, tmp_path):
    url = s3_bucket + "/runs/a/"  # trailing slash: keys must still be runs/a/iter_…/model/…, not nested
    for i in range(2):
        rep = save(url, i)
    assert rep.uri == f"{s3_bucket}/runs/a/iter_0000001"
    keys = sorted(k.split("/", 1)[1] for k in s3fs().find(s3_bucket.removeprefix("s3://")))
    want = [f"runs/a/iter_000000{i}/{f}" for i in range(2)
            for f in ("manifest.json", "model/model.safetensors", "optim/state.pt")]
    assert keys == sorted(want + ["runs/a/" + MARKER])
    s = start(url, staging=tmp_path / "stage")
    assert (s.iteration, s.next_rollout_id, s.source) == (1, 2, f"{s3_bucket}/runs/a")
    assert Path(s.local_dir) == tmp_path / "stage" / "iter_0000001"  # downloaded, then verified
    assert (Path(s.local_dir) / "model" / "model.safetensors").read_bytes() == b"\x01" * 4096


def test_marker_is_one_put_after_every_other_object(s3_bucket, tmp_path):
    store = Store(s3_bucket + "/order")
    store.fs = s3fs()  # its own client: the patch below must not leak into the process-wide cached instance
    calls = []
    put_file, pipe_file = store.fs.put_file, store.fs.pipe_file
    store.fs.put_file = lambda lpath, rpath, **kw: (calls.append(("put", rpath.rsplit("/order/", 1)[1])),
                                                    put_file(lpath, rpath, **kw))[1]
    store.fs.pipe_file = lambda path, data, **kw: (calls.append(("pipe", path.rsplit("/order/", 1)[1])),
                                                   pipe_file(path, data, **kw))[1]
    checkpoint.save_iteration(store, 7, fake_state(7), {}, staging=tmp_path)
    assert calls[-1] == ("pipe", MARKER)  # one PUT of the whole marker object, last
    assert calls[-2] == ("put", "iter_0000007/manifest.json")  # the iteration is complete once this exists
    assert sorted(c[1] for c in calls[:-2]) == ["iter_0000007/model/model.safetensors", "iter_0000007/optim/state.pt"]
    assert [c[1] for c in calls].count(MARKER) == 1


def test_a_poller_sees_the_new_marker_and_iteration_at_once(s3_bucket):
    url = s3_bucket + "/poll"
    poller = Store(url)
    save(url, 0)
    assert checkpoint.list_iterations(poller) == [0] and checkpoint.read_marker(poller) == 0
    writer = Store(url)
    writer.fs = fsspec.filesystem("s3", skip_instance_cache=True)  # another client, as in another process
    save(writer, 1)
    assert checkpoint.read_marker(poller) == 1  # no stale listing cache
    assert checkpoint.list_iterations(poller) == [0, 1]


@pytest.mark.parametrize("how", ["bitflip", "missing_file", "no_manifest"])
def test_damaged_s3_iteration_falls_back(s3_bucket, tmp_path, how):
    url = s3_bucket + "/dmg"
    for i in range(2):
        save(url, i)
    fs, key = s3fs(), s3_bucket.removeprefix("s3://") + "/dmg/iter_0000001"
    if how == "bitflip":
        fs.pipe_file(key + "/model/model.safetensors", b"\x01" * 4095 + b"\x00")
    elif how == "missing_file":
        fs.rm(key + "/optim/state.pt")
    else:
        fs.rm(key + "/manifest.json")
    s = start(url, staging=tmp_path / "stage")
    assert s.iteration == 0 and "iter_0000001" in s.notes[0] and "fell back" in s.notes[-1]


def test_sigkill_during_an_s3_upload_leaves_the_previous_marker(s3_bucket, s3_server, tmp_path):
    url = s3_bucket + "/kill"
    save(url, 0)
    script = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
              f"from ckpt_fakes import save; save({url!r}, 1)")
    env = {**os.environ, **s3_server, faults.ENV: "during_save@1", "TMPDIR": str(tmp_path)}
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=120).returncode == -9
    store = Store(url)
    uploaded = store.files("iter_0000001")
    assert uploaded and "manifest.json" not in uploaded  # half the files are there, the manifest is not
    assert checkpoint.read_marker(store) == 0
    s = start(url, staging=tmp_path / "stage")
    assert s.iteration == 0 and s.notes == []
    assert checkpoint.clean_leftovers(store, 0) == [f"{url}/iter_0000001"]
    assert checkpoint.list_iterations(store) == [0]


def test_rf01_on_an_empty_prefix_and_no_secret_anywhere(s3_bucket, s3_server, tmp_path):
    from engine.config import RunConfig
    from engine.doctor.checks import Environment, run_preflight

    url = s3_bucket + "/nothing"
    diags = run_preflight(RunConfig(load=url, eval_prompt_data=""), Environment.local())
    (d,) = [d for d in diags if d.code == "RF01"]
    assert d.severity == "error" and "nothing: the directory is empty or does not exist" in d.what
    save(s3_bucket + "/s", 0)
    texts = [d.model_dump_json() for d in diags] + [repr(Store(url))]
    texts += [o.decode(errors="replace") for o in s3fs().cat(s3fs().find(s3_bucket.removeprefix("s3://"))).values()]
    secret, key_id = s3_server["AWS_SECRET_ACCESS_KEY"], s3_server["AWS_ACCESS_KEY_ID"]
    assert not any(secret in t or key_id in t for t in texts)
