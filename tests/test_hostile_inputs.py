"""Issue 24's cases, as a careful user and an attacker would try them (loopback only).

Each test here failed on the main of 2026-12-01 (before the hardening): the engine took any body, any prompt
length and any max_new_tokens, served weights to anyone, ignored SIGTERM while busy; two runs could share a --save;
secrets reached Prefect's database; a resume changed settings silently; over-long prompts passed the doctor.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.rollout.server import EngineState, ServerThread
from engine.rollout.ports import free_loopback_port

ROOT = Path(__file__).resolve().parent.parent
KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


_free_port = free_loopback_port  # engine/rollout/ports.py


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    state = EngineState(tiny_model, threads=1, max_new_tokens=8, api_key=KEY, weight_dirs=[str(weights)])
    server = ServerThread(state, "127.0.0.1", _free_port())
    url = server.start()
    yield state, url, weights
    server.stop()


def _gen(url: str, body, timeout: float = 60, headers=AUTH) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, headers=headers, timeout=timeout)


def _healthy(url: str) -> bool:
    return httpx.get(url + "/health_generate", timeout=30).status_code == 200


# ---- 1. one request must not take the engine down ---------------------------------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read(engine):
    state, url, _ = engine
    big = b'{"text": "' + b"a" * (state.max_request_bytes + 1024) + b'"}'
    r = httpx.post(url + "/generate", content=big, headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "at most" in r.json()["message"]
    assert _healthy(url)


def test_a_10mb_text_or_input_ids_is_refused_in_seconds_naming_the_context(engine):
    state, url, _ = engine
    t0 = time.monotonic()
    r = _gen(url, {"text": "7+" * 5_000_000, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "context" in r.json()["message"]
    r = _gen(url, {"input_ids": [5] * 2_500_000, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and f"context length ({state.limits.context_len} tokens)" in r.json()["message"]
    assert time.monotonic() - t0 < 30  # was: OOM-killed at 24 GB / wedged for over 6 minutes
    assert _healthy(url)


def test_max_new_tokens_beyond_the_context_is_400_not_a_wedge(engine):
    state, url, _ = engine
    r = _gen(url, {"text": "1+1=", "sampling_params": {"max_new_tokens": 10**9}}, timeout=30)
    msg = r.json()["message"]
    assert r.status_code == 400 and "max_new_tokens=1000000000" in msg and str(state.limits.context_len) in msg
    # a prompt that nearly fills the context: what is left is the bound
    r = _gen(url, {"input_ids": [5] * (state.limits.context_len - 3), "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400 and "at most 3" in r.json()["message"]
    r = _gen(url, {"input_ids": [5] * (state.limits.context_len - 3), "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 3
    assert _healthy(url)


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [1.5, 2]}, "input_ids"),
    ({"input_ids": [True, 2]}, "input_ids"),
    ({"input_ids": [-1, 2]}, "input_ids"),
    ({"input_ids": [10**9]}, "input_ids"),
    ({"input_ids": "12 13"}, "input_ids"),
    ({"input_ids": [[1, 2], "x"]}, "input_ids[1]"),
    ({"text": ["ok", 3]}, "text"),
    ({"text": "1", "sampling_params": {"temperature": float("inf")}}, "temperature"),
    ({"text": "1", "sampling_params": {"temperature": float("nan")}}, "temperature"),
    ({"text": "1", "sampling_params": {"top_p": "0.9"}}, "top_p"),
    ({"text": "1", "sampling_params": {"top_k": 2.5}}, "top_k"),
    ({"text": "1", "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
    ({"text": "1", "sampling_params": {"stop": ["x"] * 1000}}, "stop"),
    ({"text": "1", "sampling_params": {"stop_token_ids": [10**9]}}, "stop_token_ids"),
    ({"text": "1", "sampling_params": {"sampling_seed": "s"}}, "sampling_seed"),
])
def test_malformed_values_are_400_naming_the_field(engine, body, field):
    _, url, _ = engine
    raw = json.dumps(body)  # Infinity / NaN as Python's json writes them (and a lenient client would)
    r = httpx.post(url + "/generate", content=raw, headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert f"`{field}`" in r.json()["message"]


def test_not_json_is_400(engine):
    _, url, _ = engine
    r = httpx.post(url + "/generate", content=b"{nope", headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["message"]


def test_a_full_queue_answers_503_with_retry_after(engine):
    state, url, _ = engine
    limit = state.scheduler.max_queued
    state.scheduler.max_queued = 3
    try:
        r = _gen(url, {"text": ["1+1="] * 4, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "max-queued" in r.json()["message"]
        assert _gen(url, {"text": ["1+1="] * 3, "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    finally:
        state.scheduler.max_queued = limit


def test_a_wedged_generator_makes_health_answer_503(engine):
    state, url, _ = engine
    g = state.generator
    watchdog = state.watchdog_s
    state.watchdog_s = 1.0
    with g.lock:  # the generator is "inside a batch" and makes no step: what a wedge looks like from outside
        g.busy_since, g.last_step = time.monotonic() - 60, 0.0
        try:
            for path in ("/health", "/health_generate"):
                r = httpx.get(url + path, timeout=10)
                assert r.status_code == 503 and "no decode step" in r.json()["message"]
        finally:
            g.busy_since = None
            state.watchdog_s = watchdog
    assert httpx.get(url + "/health").status_code == 200


# ---- 2. nobody who merely reaches an engine uses it or replaces its weights --------------------------------------
def test_without_the_key_only_health_answers(engine):
    _, url, _ = engine
    assert httpx.get(url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert _gen(url, {"text": "1", "sampling_params": {"max_new_tokens": 1}}, headers=headers).status_code == 401
        assert httpx.get(url + "/get_model_info", headers=headers).status_code == 401
        assert httpx.post(url + "/release_memory_occupation", headers=headers).status_code == 401
    assert _gen(url, {"text": "1", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_weights_load_only_from_the_allowed_directory_and_only_with_the_key(engine, tmp_path, tiny_model):
    import torch

    from engine.modeling import load_causal_lm
    from engine.weights import save_weights_dir

    state, url, allowed = engine
    sd = {k: v.detach().clone() for k, v in load_causal_lm(tiny_model).state_dict().items()}
    for k in sd:
        if "norm" in k:
            sd[k].zero_()  # the attack of the report: a zeroed norm makes the engine answer NUL tokens
    outside = save_weights_dir(sd, tmp_path / "evil")
    before = {k: v.clone() for k, v in state.generator.model.state_dict().items()}
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(outside)}, timeout=60)
    assert r.status_code == 401
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(outside)}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "outside the directories" in r.json()["message"]
    sneaky = allowed / ".." / outside.parent.name / outside.name  # a path that only looks inside
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(sneaky)}, headers=AUTH, timeout=60)
    assert r.status_code == 400
    blob = open(next(outside.glob("*.safetensors")), "rb").read()
    r = httpx.post(url + "/update_weights_from_tensor?load_format=flattened_bucket", content=blob,
                   headers={"content-type": "application/octet-stream"}, timeout=60)
    assert r.status_code == 401
    after = state.generator.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    served = {k: v.detach() for k, v in state.generator.model.state_dict().items()}  # tied weights stay shared
    inside = save_weights_dir(served, allowed / "v000001")
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(inside), "weight_version": "1"},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["weight_version"] == "1", r.text


def _serve(tiny_model: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.rollout.server", "--model-path", tiny_model,
                             "--threads", "1", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_serving_to_the_network_without_a_key_is_refused(tiny_model):
    p = _serve(tiny_model, "--host", "0.0.0.0", "--port", str(_free_port()))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 2 and "--api-key" in out


def test_a_busy_engine_stops_within_seconds_on_sigterm(tiny_model):
    port = _free_port()
    p = _serve(tiny_model, "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        # long generations: 2 × 256 rows of 240 tokens, ignoring EOS (~35 s of work on one thread)
        import threading

        body = {"text": ["1+1="] * 256, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
        for _ in range(2):
            threading.Thread(target=lambda: _safe_post(url, body), daemon=True).start()
        time.sleep(3.0)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        took = time.monotonic() - t0
        assert took < 10, f"the engine took {took:.1f} s to stop"  # was: ignored while busy
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _safe_post(url: str, body: dict) -> None:
    try:
        httpx.post(url + "/generate", json=body, headers=AUTH, timeout=120)
    except httpx.HTTPError:
        pass


# ---- 5. a resume keeps the settings it was trained with; a copy is a new MLflow run -----------------------------
@pytest.fixture(scope="module")
def trained(prefect_harness, tiny_model, tmp_path_factory):
    """One rollout saved to <tmp>/ckpt by a real flow run (MLflow: SQLite in <tmp>/work)."""
    import ray

    from engine.cluster import worker_env
    from engine.config import RunConfig
    from engine.config.data import BUNDLED_TRAIN
    from flows.train import rl_train

    tmp = tmp_path_factory.mktemp("trained")

    def cfg(**over):
        base = dict(hf_checkpoint=tiny_model, prompt_data=BUNDLED_TRAIN, eval_prompt_data="",
                    apply_chat_template=True, rollout_batch_size=4, n_samples_per_prompt=4, num_rollout=1,
                    rollout_max_response_len=8, micro_batch_size=4, work_dir=str(tmp / "work"),
                    save=str(tmp / "ckpt"), progress=False, experiment_name="guard", system_metrics_interval=0)
        return RunConfig(**{**base, **over})

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": worker_env()})
    first = rl_train(cfg())
    return {"tmp": tmp, "cfg": cfg, "first": first}


def _errors(cfg):
    from engine.doctor.checks import Environment, run_preflight

    return [d for d in run_preflight(cfg, Environment.local()) if d.severity == "error"]


def test_a_resume_that_changes_kept_settings_fails_listing_them(trained):
    from engine.diagnosis import DiagnosisError
    from flows.train import rl_train

    changed = trained["cfg"](num_rollout=2, n_samples_per_prompt=8, global_batch_size=32)
    (err,) = [d for d in _errors(changed) if d.code == "RF05"]
    assert "n_samples_per_prompt: 4 in the checkpoint, 8 now" in err.what
    assert "global_batch_size: 16 in the checkpoint, 32 now" in err.what
    assert "--allow-config-change n_samples_per_prompt global_batch_size" in err.fix and "new --save" in err.fix
    with pytest.raises(DiagnosisError, match="n_samples_per_prompt"):
        rl_train(changed)  # was: trained on with a warning about MLflow params
    from engine import checkpoint

    assert checkpoint.read_marker(trained["tmp"] / "ckpt") == 0  # nothing written
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{trained['tmp'] / 'work' / 'mlflow.db'}")
    original = client.get_run(trained["first"]["mlflow_run_id"])
    assert original.info.status == "FINISHED" and "rollflow.resumed_from" not in original.data.tags  # untouched
    assert not [d for d in _errors(trained["cfg"](num_rollout=2, n_samples_per_prompt=8, global_batch_size=32,
                                                  allow_config_change=["n_samples_per_prompt", "global_batch_size"]))
                if d.code == "RF05"]
    other_model = trained["cfg"](num_rollout=2, hf_checkpoint=str(trained["tmp"] / "elsewhere"))
    assert any("hf_checkpoint" in d.what for d in _errors(other_model) if d.code == "RF05")
    # what a resume may change (more rollouts, another lr) passes
    assert not [d for d in _errors(trained["cfg"](num_rollout=3, lr=3e-6)) if d.code == "RF05"]


def test_an_unknown_allow_config_change_field_is_a_config_error(trained):
    from engine.diagnosis import ConfigError

    with pytest.raises(ConfigError, match="--allow-config-change lr: not a setting a resume keeps"):
        trained["cfg"](allow_config_change=["lr"])


def test_a_marker_naming_a_missing_iteration_is_reported_with_the_real_start(trained, tmp_path):
    import shutil

    from engine.doctor.checks import Environment, run_preflight

    save = tmp_path / "ckpt"
    shutil.copytree(trained["tmp"] / "ckpt", save)
    (save / "latest_checkpointed_iteration.txt").write_text("5\n")
    found = {d.severity: d for d in run_preflight(trained["cfg"](num_rollout=2, save=str(save)), Environment.local())
             if d.code == "RF05"}
    assert "names iteration 5, which is missing" in found["warning"].what and "iteration 0" in found["warning"].what
    assert "resumes automatically at rollout 1" in found["info"].what  # was: "at rollout 6"


def test_a_copied_save_resumes_into_a_new_mlflow_run_linked_to_its_parent(trained):
    import shutil

    from mlflow.tracking import MlflowClient

    from flows.train import rl_train

    tmp = trained["tmp"]
    shutil.copytree(tmp / "ckpt", tmp / "copy")
    result = rl_train(trained["cfg"](num_rollout=2, save=str(tmp / "copy")))
    parent = trained["first"]["mlflow_run_id"]
    assert result["rollouts"] == 2 and result["mlflow_run_id"] not in (None, parent)
    client = MlflowClient(f"sqlite:///{tmp / 'work' / 'mlflow.db'}")
    tags = client.get_run(result["mlflow_run_id"]).data.tags
    assert tags["rollflow.parent_run_id"] == parent == tags["mlflow.parentRunId"]
    assert tags["rollflow.copied_from"] == str(tmp / "ckpt") and tags["rollflow.resumed_from"] == "0"
    # the original's run got nothing from the copy: rollout 1 was logged only by the copy's run
    assert [m.step for m in client.get_metric_history(parent, "rollout/reward_mean")] == [0]


# ---- 6. preflight: prompts vs context, storage, Ray address, RF09 over the whole file -----------------------------
def _doctor(cfg):
    from engine.doctor.checks import Environment, run_preflight

    return run_preflight(cfg, Environment.local())


def _rows(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    return str(path)


def test_prompts_longer_than_the_context_fail_the_doctor_naming_the_lines(tiny_model, tmp_path):
    from engine.config import RunConfig

    ctx = json.loads((Path(tiny_model) / "config.json").read_text())["max_position_embeddings"]
    # one token per character in the tiny model's tokenizer: a prompt of ctx characters cannot leave room
    data = _rows(tmp_path / "d.jsonl", ["1+1="] * 30 + ["7+" * (ctx // 2)] + ["2+2="] * 5 + ["8+" * (ctx // 2 - 20)])
    cfg = RunConfig(hf_checkpoint=tiny_model, prompt_data=data, rollout_max_response_len=64,
                    apply_chat_template=True)
    (d,) = [d for d in _doctor(cfg) if d.code == "DATA"]  # was: passed, and training exited 0 with reward 0.000
    assert d.severity == "error" and "2 of 37 --prompt-data prompts" in d.what and "lines 31, 37" in d.what
    assert f"context of {ctx}" in d.what and "--rollout-max-response-len ≤" in d.fix
    short = RunConfig(hf_checkpoint=tiny_model, prompt_data=_rows(tmp_path / "ok.jsonl", ["1+1="] * 50),
                      rollout_max_response_len=64, apply_chat_template=True)
    assert not [d for d in _doctor(short) if d.code == "DATA"]
    none_left = RunConfig(hf_checkpoint=tiny_model, prompt_data=data, rollout_max_response_len=ctx)
    assert any("leaves no room" in d.what for d in _doctor(none_left) if d.code == "DATA")
    # the eval prompts are checked against --eval-max-response-len when it is set (and only when there are some)
    evals = _rows(tmp_path / "e.jsonl", ["1+1="] * 5 + ["3+" * (ctx // 2 - 60)])
    longer = RunConfig(hf_checkpoint=tiny_model, prompt_data=short.prompt_data, eval_prompt_data=evals,
                       rollout_max_response_len=64, eval_max_response_len=ctx - 60, apply_chat_template=True)
    (d,) = [d for d in _doctor(longer) if d.code == "DATA"]
    assert "1 of 6 --eval-prompt-data prompts leave less than --eval-max-response-len" in d.what, d.what
    assert not [d for d in _doctor(RunConfig(**{**longer.model_dump(), "eval_max_response_len": 64}))
                if d.code == "DATA"]
    assert not [d for d in _doctor(RunConfig(**{**longer.model_dump(), "eval_prompt_data": [],
                                                 "eval_max_response_len": 2 * ctx})) if d.code == "DATA"]


def test_rf09_reads_rows_across_the_whole_file(tiny_model, tmp_path):
    from engine.config import RunConfig

    templated = "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    data = _rows(tmp_path / "d.jsonl", ["1+1="] * 200 + [templated] * 20)
    cfg = RunConfig(hf_checkpoint=tiny_model, prompt_data=data, apply_chat_template=True, rollout_max_response_len=64)
    assert [d.code for d in _doctor(cfg) if d.severity == "error"] == ["RF09"]  # was: only the first 16 rows


def test_a_save_that_cannot_be_written_fails_the_doctor_and_the_lock_naming_it(s3_server, tiny_model, tmp_path):
    from engine.checkpoint.writer import writer_lock
    from engine.config import RunConfig
    from engine.diagnosis import ConfigError

    cfg = RunConfig(hf_checkpoint=tiny_model, save="s3://no-such-bucket-rf/run1")
    (d,) = [d for d in _doctor(cfg) if d.code == "STORAGE"]
    assert "bucket 'no-such-bucket-rf' does not exist" in d.what and "AWS_ENDPOINT_URL_S3" in d.fix
    with pytest.raises(ConfigError, match="no-such-bucket-rf' does not exist"):
        with writer_lock(cfg.save):
            pass
    (tmp_path / "afile").write_text("x")
    cfg = RunConfig(hf_checkpoint=tiny_model, save=str(tmp_path / "afile" / "ckpt"))
    (d,) = [d for d in _doctor(cfg) if d.code == "STORAGE"]
    assert "is a file" in d.what and "directory this user can create" in d.fix and "AWS" not in d.fix  # local advice
    with pytest.raises(ConfigError) as e:
        with writer_lock(cfg.save):
            pass
    assert "writer lock cannot be taken" in str(e.value) and "AWS" not in e.value.diagnoses[0].fix


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a few MiB (needs mount rights: root in a container); skipped, and reported, elsewhere."""
    where = tmp_path / "disk"
    where.mkdir()

    def mount(mib: int) -> Path:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(where)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()[:100]}): the full-disk cases need it")
        return where

    yield mount
    subprocess.run(["umount", str(where)], capture_output=True)


def test_too_little_space_for_the_next_checkpoint_fails_the_doctor(small_disk, tiny_model):
    from engine.config import RunConfig

    disk = small_disk(4)
    (d,) = [d for d in _doctor(RunConfig(hf_checkpoint=tiny_model, save=str(disk / "ckpt"))) if d.code == "STORAGE"]
    assert "GiB free on its disk" in d.what and "estimated" in d.what and "--keep-last-n" in d.fix


def test_a_disk_that_fills_during_a_save_is_a_short_diagnosis_and_the_last_checkpoint_survives(
        small_disk, prefect_harness, trained):
    from engine import checkpoint
    from engine.diagnosis import DiagnosisError
    from flows.train import rl_train

    disk = small_disk(16)  # one iteration of the tiny model (~10 MB) fits, two do not
    cfg = trained["cfg"](num_rollout=3, save=str(disk / "ckpt"), save_interval=1)
    with pytest.raises(DiagnosisError) as e:
        rl_train(cfg)
    text = str(e.value)
    assert "[STORAGE error] the save of rollout 1 ran out of disk space" in text and str(disk / "ckpt") in text
    assert "GiB free when it began" in text and "--keep-last-n" in text
    assert "the marker still names iteration 0, which is complete" in text
    assert len(text.splitlines()) < 10  # was: 232 lines of SafetensorError without the path
    assert checkpoint.read_marker(disk / "ckpt") == 0 and checkpoint.list_iterations(disk / "ckpt") == [0]
    assert not list((disk / "ckpt").glob("*.tmp"))  # the half-written iteration is gone


def test_an_unreachable_ray_address_fails_the_doctor_in_seconds(tiny_model):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flows.cli", "doctor", "--hf-checkpoint", tiny_model,
                        "--ray-address", f"127.0.0.1:{_free_port()}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and "[RF02 error] --ray-address 127.0.0.1:" in r.stdout and "cannot be reached" in r.stdout
    assert time.monotonic() - t0 < 60  # was: > 90 s


# ---- 7. SIGTERM ends the flow run Cancelled; the same command resumes --------------------------------------------
def test_sigterm_cancels_the_flow_run_cleanly_and_the_same_command_resumes(prefect_harness, tmp_path):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from engine import checkpoint

    save = tmp_path / "ckpt"
    # far more rollouts than the test waits for: the run must still be going when SIGTERM comes (with 40, a fast
    # machine finished them while the second command was starting, and the run exited 0)
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", str(ROOT / "examples/demo.yaml"), "--num-rollout",
           "4000", "--save-interval", "1", "--eval-max-samples", "8", "--work-dir", str(tmp_path / "w"), "--save",
           str(save), "--summary-json", str(tmp_path / "s.json"), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": PREFECT_API_URL.value()}
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while checkpoint.read_marker(save) is None and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert checkpoint.read_marker(save) is not None, p.stdout.read() if p.poll() is not None else "no marker"
        # a second run on the same --save fails at once naming the first (was: both exit 0, one overwrites)
        second = subprocess.run(cmd[:cmd.index("--work-dir")] + ["--work-dir", str(tmp_path / "w2"), "--save",
                                                                str(save), "--no-progress"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode != 0 and "[CONCURRENCY error]" in second.stdout + second.stderr
        assert f"pid {p.pid}" in second.stdout + second.stderr
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143 and took < 40, (p.returncode, took, out[-3000:])
    assert "the flow run was cancelled: stopped by SIGTERM" in out
    assert not any(bad in out for bad in ("Traceback", "Aborted", "*** SIG", "core dumped")), out[-3000:]
    marker = checkpoint.read_marker(save)
    assert f"the same command resumes at rollout {marker + 1}" in out and marker < 3999

    async def last_state():
        async with get_client() as client:
            runs = await client.read_flow_runs(sort="START_TIME_DESC", limit=10)
            return next(r.state for r in runs if r.parameters["cfg"]["work_dir"] == str(tmp_path / "w"))

    state = asyncio.run(last_state())
    assert state.type.value == "CANCELLED", state  # was: rc 134 and a Ray C++ stack dump; the run left Running
    cmd[cmd.index("4000")] = str(marker + 3)  # the same command (fewer rollouts, to keep the test short) resumes
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert checkpoint.read_marker(save) == marker + 2
    assert json.loads((tmp_path / "s.json").read_text())["rollouts"] == marker + 3
