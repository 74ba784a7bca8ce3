"""The doctor: each catalog failure reproduced, with its code and the key facts in `what` and `fix`."""
from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from engine.config import RunConfig
from engine.config.cli import parse_args
from engine.doctor import ConfigError, Diagnosis, DiagnosisError
from engine.doctor.catalog import CATALOG
from engine.doctor.checks import CHECKS, Environment, run_preflight
from engine.doctor.classify import classify_exception, classify_text

GPU8 = Environment(gpus=8, cpus=64, gpus_per_node=[8], source="fake cluster")


def codes(diags: list[Diagnosis], severity: str | None = None) -> list[str]:
    return [d.code for d in diags if severity is None or d.severity == severity]


def one(diags: list[Diagnosis], code: str) -> Diagnosis:
    found = [d for d in diags if d.code == code]
    assert len(found) == 1, diags
    return found[0]


def test_catalog_has_all_fourteen_codes_and_the_docs_match():
    from engine.doctor.catalog import END, SHORT_END, SHORT_START, START, catalog_markdown, catalog_short_markdown

    assert list(CATALOG) == [f"RF{i:02d}" for i in range(1, 15)]
    root = Path(__file__).parent.parent
    block = (root / "docs" / "failures.md").read_text().split(START, 1)[1].split(END, 1)[0]
    assert block.strip() == catalog_markdown().strip(), "run: python -m engine.doctor.catalog --write docs/failures.md"
    short = (root / "README.md").read_text().split(SHORT_START, 1)[1].split(SHORT_END, 1)[0]
    assert short.strip() == catalog_short_markdown().strip(), \
        "run: python -m engine.doctor.catalog --write-short README.md"


def test_the_default_config_has_no_error(tiny_model):
    assert codes(run_preflight(RunConfig(), Environment.local()), "error") == []


# ---- RF01 -----------------------------------------------------------------------------------------------------
def test_rf01_load_dir_without_marker_lists_what_is_there(tmp_path, tiny_model):
    (tmp_path / "iter_0000004").mkdir()
    d = one(run_preflight(RunConfig(load=str(tmp_path)), Environment()), "RF01")
    assert d.severity == "error" and "latest_checkpointed_iteration.txt" in d.what and "iter_0000004" in d.what
    assert "--load" in d.fix
    # an HF model as --load is starting weights, converted at the start (issue 6), not an RF01
    assert codes(run_preflight(RunConfig(load=tiny_model), Environment()), "error") == []
    (tmp_path / "model.safetensors").write_bytes(b"")  # weights without config.json: not loadable
    shutil.rmtree(tmp_path / "iter_0000004")
    hf = one(run_preflight(RunConfig(load=str(tmp_path)), Environment()), "RF01")
    assert "Hugging Face files without config.json: ['model.safetensors']" in hf.what


# ---- RF02 -----------------------------------------------------------------------------------------------------
def test_rf02_decoupled_topology_larger_than_cluster():
    # decoupled: 1 × 8 train + 8 rollout = 16 > 8
    d = one(run_preflight(RunConfig(actor_num_gpus_per_node=8, rollout_num_gpus=8), GPU8), "RF02")
    assert "1 × 8 + 8 = 16" in d.what and "has 8" in d.what and "--colocate" in d.fix


def test_rf02_colocated_topology_larger_than_cluster():
    # colocated: 2 × 8 = 16 > 8
    d = one(run_preflight(RunConfig(actor_num_nodes=2, actor_num_gpus_per_node=8, colocate=True), GPU8), "RF02")
    assert "colocated" in d.what and "2 × 8 = 16" in d.what and "≤ 8" in d.fix


def test_rf02_fits_colocated_and_per_node_fit():
    assert "RF02" not in codes(run_preflight(RunConfig(actor_num_gpus_per_node=8, colocate=True), GPU8))
    two_nodes = Environment(gpus=8, gpus_per_node=[4, 4])
    d = one(run_preflight(RunConfig(actor_num_gpus_per_node=8, colocate=True), two_nodes), "RF02")
    assert "[4, 4]" in d.what and "--actor-num-gpus-per-node 4 --actor-num-nodes 2" in d.fix


def test_the_dead_update_weight_mode_flag_is_gone():
    # --update-weight-mode delta was validated and otherwise ignored: a flag that does nothing is refused now
    with pytest.raises(ValueError, match="update_weight_mode"):
        RunConfig(update_weight_mode="delta")


# ---- RF03 -----------------------------------------------------------------------------------------------------
def test_rf03_dynamic_batch_without_cap():
    d = one(run_preflight(RunConfig(use_dynamic_batch_size=True, rollout_max_response_len=4096), Environment()),
            "RF03")
    assert "--max-tokens-per-gpu" in d.what and "--max-tokens-per-gpu 4096" in d.fix


def test_rf03_oom_is_classified_with_the_numbers():
    cfg = RunConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=32768, rollout_max_response_len=8192)
    err = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    d = one(classify_exception(err, cfg), "RF03")
    assert "32768" in d.what and "--max-tokens-per-gpu 8192" in d.fix


def _torch_oom(asked: str, free: str, others: list[str], this: str, unallocated: str) -> str:
    """PyTorch's CUDA OOM message (c10's caching allocator, torch 2.x), as a Ray task error carries it."""
    procs = "".join(f"Process {4100 + i} has {o} memory in use. " for i, o in enumerate(others))
    return (f"ray.exceptions.RayTaskError(OutOfMemoryError): ray::TrainWorker.train_step() (pid=4242)\n"
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {asked}. GPU 0 has a total capacity of "
            f"79.19 GiB of which {free} is free. {procs}Including non-PyTorch memory, this process has {this} memory "
            f"in use. Of the allocated memory 30.00 GiB is allocated by PyTorch, and {unallocated} is reserved by "
            "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n")


def test_rf03_oom_on_a_shared_gpu_names_the_other_processes():
    """Four runs on one H100 (bench/results/gpu_2026-12-07-s43, call 3): the OOM's own numbers say the GPU is
    shared before the batch-size advice."""
    cfg = RunConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=16384, rollout_max_response_len=256)
    text = _torch_oom("9.27 GiB", "3.06 GiB", ["18.20 GiB", "17.95 GiB", "600.00 MiB"], "39.35 GiB", "512.00 MiB")
    d = one(classify_text(text, cfg), "RF03")
    assert "GPU 0: 9.27 GiB asked, 3.06 of 79.19 GiB free, this process holds 39.35 GiB" in d.what
    assert "3 other processes hold 36.74 GiB" in d.what
    assert d.fix.startswith("the GPU is shared: stop the other processes") and "--max-tokens-per-gpu 256" in d.fix
    assert "expandable_segments" not in d.fix  # 0.5 GiB unallocated is no fragmentation
    assert {k: d.facts[k] for k in ("asked_gib", "free_gib", "other_processes", "other_processes_gib",
                                    "this_process_gib", "unallocated_gib")} == {
        "asked_gib": 9.27, "free_gib": 3.06, "other_processes": 3, "other_processes_gib": 36.74,
        "this_process_gib": 39.35, "unallocated_gib": 0.5}


def test_rf03_oom_alone_on_the_gpu_or_fragmented():
    cfg = RunConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=16384, rollout_max_response_len=2048)
    alone = one(classify_text(_torch_oom("4.00 GiB", "1.20 GiB", ["450.00 MiB"], "77.40 GiB", "300.00 MiB"), cfg),
                "RF03")
    assert "4 GiB asked, 1.2 of 79.19 GiB free, this process holds 77.4 GiB" in alone.what
    assert "other process" not in alone.what  # 0.45 GiB elsewhere: not a shared GPU
    assert alone.fix.startswith("--max-tokens-per-gpu 2048")
    frag = one(classify_text(_torch_oom("3.00 GiB", "1.50 GiB", [], "77.60 GiB", "6.25 GiB"), cfg), "RF03")
    assert frag.fix.startswith("6.25 GiB are reserved by PyTorch but unallocated (fragmentation): try "
                               "--train-env-vars '{\"PYTORCH_CUDA_ALLOC_CONF\": \"expandable_segments:True\"}'")
    assert "--max-tokens-per-gpu 2048" in frag.fix


def test_an_oom_the_builtin_engine_answered_is_the_engines_not_the_trainers():
    """The built-in engine answers a /generate that ran out of memory with HTTP 500 (engine/rollout/server.py), and
    the rollout client raises that as an EngineError: RF11 with the engine's own knobs, not RF03's batch advice,
    and no --sglang-mem-fraction-static, which the built-in engine refuses."""
    oom = _torch_oom("3.00 GiB", "1.00 GiB", [], "78.00 GiB", "2.00 GiB").split("\n")[1]
    text = ("engine.rollout.client.EngineError: http://127.0.0.1:30001/generate → HTTP 500: "
            f'{{"error": {{"message": "generation failed: {oom}"}}}}')
    cfg = RunConfig(sglang_args={"max-running-requests": "64"})
    (d,) = classify_text(text, cfg)
    assert d.code == "RF11" and d.what.startswith("the built-in rollout engine ran out of GPU memory while "
                                                   "generating; GPU 0: 3 GiB asked, 1 of 79.19 GiB free")
    assert d.fix.startswith("a smaller batch for the engine: --sglang-max-running-requests 32 (now 64)")
    assert "mem-fraction-static" not in d.fix and "--train-env-vars" not in d.fix
    # the same message from a train step stays the trainer's
    assert [x.code for x in classify_text(oom, cfg)] == ["RF03"]


# ---- RF04 -----------------------------------------------------------------------------------------------------
def test_rf04_model_name_mismatch_and_multinode_hint(tiny_model):
    d = one(run_preflight(RunConfig(model_name="llama"), Environment()), "RF04")
    assert "qwen2" in d.what and "--model-name qwen2" in d.fix
    w = one(run_preflight(RunConfig(actor_num_nodes=2), Environment()), "RF04")
    assert w.severity == "warning" and "--model-name qwen2" in w.fix


def test_rf04_model_dir_lock_serialises_processes(tmp_path):
    """Processes loading the same model directory on a node hold its lock one at a time."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hold_lock, args=(str(tmp_path), out)) for _ in range(3)]
    for p in procs:
        p.start()
    spans = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, f"two processes held the model lock at once: {spans}"


def _hold_lock(path, out):
    import time

    from engine.modeling import model_dir_lock

    with model_dir_lock(path):
        t0 = time.monotonic()
        time.sleep(0.3)
        t1 = time.monotonic()
    out.put((t0, t1))


def test_rf04_every_model_load_takes_the_lock(tiny_model, monkeypatch):
    from contextlib import contextmanager

    from engine import modeling

    taken = []

    @contextmanager
    def recording_lock(path):
        taken.append(path)
        yield

    monkeypatch.setattr(modeling, "model_dir_lock", recording_lock)
    modeling.load_tokenizer(tiny_model)
    modeling.load_causal_lm(tiny_model)
    assert taken == [tiny_model, tiny_model]


# ---- RF05 -----------------------------------------------------------------------------------------------------
def saved_iteration(root, iteration: int) -> None:
    """A complete iteration (files + manifest) and the marker, as a run's save writes them."""
    from engine.checkpoint import Store, save_iteration

    def write_state(path):
        Path(path, "model").mkdir(parents=True)
        Path(path, "model", "weights.bin").write_bytes(b"w")

    save_iteration(Store(str(root)), iteration, write_state, {"next_rollout_id": iteration + 1})


def test_rf05_save_with_marker_and_no_load_resumes(tmp_path):
    saved_iteration(tmp_path, 6)
    d = one(run_preflight(RunConfig(save=str(tmp_path)), Environment()), "RF05")
    assert "iteration 6" in d.what and "rollout 7" in d.what and d.severity == "info"


def test_a_marker_with_no_iteration_behind_it_is_rf01_not_a_resume_point(tmp_path):
    from engine.checkpoint import write_marker

    write_marker(tmp_path, 6)  # the doctor used to announce "resumes automatically at rollout 7"
    diags = run_preflight(RunConfig(save=str(tmp_path)), Environment())
    assert not [d for d in diags if d.code == "RF05"]
    d = one(diags, "RF01")
    assert "no iteration at or below it has a manifest" in d.what and "new --save" in d.fix


# ---- RF06 -----------------------------------------------------------------------------------------------------
def test_rf06_inconsistent_batch_sizes_with_working_values():
    with pytest.raises(ConfigError) as e:
        parse_args(["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size", "32",
                    "--num-steps-per-rollout", "4"])
    d = one(e.value.diagnoses, "RF06")
    assert "32·8" in d.what or "256/4" in d.what
    assert "--global-batch-size 64" in d.fix  # G = B·n/k = 256/4


# ---- RF08 -----------------------------------------------------------------------------------------------------
#: an SGLang engine (it takes every --sglang-* launch flag; the built-in engine refuses those it does not read)
SGLANG = dict(rollout_engine="sglang", weight_sync_method="disk")
SGLANG_FLAGS = ["--rollout-engine", "sglang", "--weight-sync-method", "disk"]


def test_rf08_fixed_port_in_use_names_the_holder():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = one(run_preflight(RunConfig(**SGLANG, sglang_args={"port": str(port)}), Environment()), "RF08")
    assert str(port) in d.what and "in use" in d.what and "allocator" in d.fix


def test_rf08_connection_errors_are_classified():
    d = one(classify_text("requests.exceptions.ConnectionError: HTTPConnectionPool(host='10.0.0.3', port=30001): "
                          "Max retries exceeded with url: /get_model_info (Caused by NewConnectionError)"), "RF08")
    assert "fewer engines per node" in d.fix


# ---- RF09 -----------------------------------------------------------------------------------------------------
def _data(tmp_path, prompts):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": x, "label": "1"}) + "\n" for x in prompts))
    return str(p)


def test_rf09_pretemplated_with_another_template(tmp_path, tiny_model):
    llama3 = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n1+1=<|eot_id|>" \
             "<|start_header_id|>assistant<|end_header_id|>\n\n"
    d = one(run_preflight(RunConfig(prompt_data=_data(tmp_path, [llama3])), Environment()), "RF09")
    assert "line 1" in d.what and "<|start_header_id|>" in d.what and "<|im_start|>" in d.what
    assert "--apply-chat-template" in d.fix


def test_rf09_templating_twice(tmp_path, tiny_model):
    chatml = "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    cfg = RunConfig(prompt_data=_data(tmp_path, [chatml]), apply_chat_template=True)
    d = one(run_preflight(cfg, Environment()), "RF09")
    assert "second time" in d.what and "--no-apply-chat-template" in d.fix
    # the same data without --apply-chat-template matches the model's own template: no RF09
    assert "RF09" not in codes(run_preflight(RunConfig(prompt_data=cfg.prompt_data), Environment()))


# ---- RF10 -----------------------------------------------------------------------------------------------------
def test_rf10_model_without_any_stop_token(tmp_path, tiny_model):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        f = model / name
        data = json.loads(f.read_text())
        data.pop("eos_token_id", None)
        data.pop("eos_token", None)
        f.write_text(json.dumps(data))
    d = one(run_preflight(RunConfig(hf_checkpoint=str(model)), Environment()), "RF10")
    assert "no EOS" in d.what and "--rollout-stop-token-ids" in d.fix
    ok = RunConfig(hf_checkpoint=str(model), rollout_stop_token_ids=[258])
    assert "RF10" not in codes(run_preflight(ok, Environment()))


# ---- RF11 -----------------------------------------------------------------------------------------------------
def test_rf11_illegal_memory_access_in_an_engine_log():
    log = "[2026-11-29 10:00:01] Scheduler hit an exception: RuntimeError: CUDA error: an illegal memory access " \
          "was encountered\nCUDA kernel errors might be asynchronously reported"
    cfg = RunConfig(**SGLANG, sglang_args={"mem-fraction-static": "0.85"})
    d = one(classify_text(log, cfg), "RF11")
    assert "0.85" in d.what and "--sglang-mem-fraction-static" in d.fix


# ---- RF12 -----------------------------------------------------------------------------------------------------
def test_rf12_inductor_json_decode_error_is_classified():
    tb = ('File "torch/_inductor/codecache.py", line 1234, in load\n'
          "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)")
    d = one(classify_text(tb), "RF12")
    assert "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in d.fix


def test_rf12_every_worker_gets_the_cache_switch(monkeypatch):
    from engine.cluster import worker_env

    monkeypatch.delenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", raising=False)
    assert worker_env()["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] == "1"
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "0")
    d = one(run_preflight(RunConfig(), Environment(worker_env=worker_env())), "RF12")
    assert d.severity == "warning" and "'0'" in d.what


# ---- RF13 -----------------------------------------------------------------------------------------------------
def test_rf13_diagnosis_error_is_kept_by_the_classifier():
    err = DiagnosisError(Diagnosis(code="RF13", severity="error", what="NaN at step 3 (samples [4, 5])",
                                   fix="--no-check-for-nan-in-loss-and-grad skips such steps"))
    wrapped = RuntimeError("ray task failed")
    wrapped.__cause__ = err
    assert codes(classify_exception(wrapped)) == ["RF13"]


# ---- the CLI --------------------------------------------------------------------------------------------------
def test_doctor_cli_exit_codes_and_json(tmp_path, capsys, tiny_model):
    from flows.cli import main

    demo = Path(__file__).parent.parent / "examples" / "demo.yaml"
    assert main(["doctor", "--config", str(demo)]) == 0
    capsys.readouterr()
    (tmp_path / "iter_0000001").mkdir()
    assert main(["doctor", "--load", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [d["code"] for d in report if d["severity"] == "error"] == ["RF01"]
    assert main(["doctor", "--rollout-batch-size", "0"]) == 1
    assert "--rollout-batch-size" in capsys.readouterr().out


def test_every_registered_check_code_is_in_the_catalog():
    assert set(CHECKS) - set(CATALOG) <= {"DATA", "MODEL", "CONFIG", "STORAGE"}


def test_diagnosis_errors_survive_pickling():
    import pickle

    from engine.diagnosis import ConfigError

    e = pickle.loads(pickle.dumps(ConfigError(Diagnosis(code="RF13", severity="error", what="w", fix="f"))))
    assert type(e) is ConfigError and e.codes == ["RF13"] and "fix: f" in str(e)


# ---- `rollflow doctor` on a deliberately broken config, one per code ---------------------------------------------
def _chatml_data(tmp_path):
    return _data(tmp_path, ["<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"])


def _model_without_eos(tmp_path, tiny_model):
    model = tmp_path / "no-eos"
    shutil.copytree(tiny_model, model)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        data = json.loads((model / name).read_text())
        data.pop("eos_token_id", None)
        data.pop("eos_token", None)
        (model / name).write_text(json.dumps(data))
    return str(model)


def _log(tmp_path, text):
    p = tmp_path / "run.log"
    p.write_text(text)
    return ["--log", str(p)]


BROKEN = {
    # code: (argv builder, a fact that must be printed)
    "RF01": (lambda t, m: ["--load", str(t)], "latest_checkpointed_iteration.txt"),
    "RF02": (lambda t, m: ["--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "8"], "1 × 8 + 8 = 16"),
    "RF03": (lambda t, m: ["--use-dynamic-batch-size", "--rollout-max-response-len", "2048"],
             "--max-tokens-per-gpu 2048"),
    "RF04": (lambda t, m: ["--model-name", "llama"], "--model-name qwen2"),
    "RF05": (lambda t, m: (saved_iteration(t, 3), ["--save", str(t)])[1], "rollout 4"),
    "RF06": (lambda t, m: ["--global-batch-size", "48"], "--global-batch-size one of"),
    "RF07": (lambda t, m: ["--moe-token-dispatcher-type", "allgather"], "alltoall"),
    "RF09": (lambda t, m: ["--prompt-data", _chatml_data(t), "--apply-chat-template"], "--no-apply-chat-template"),
    "RF10": (lambda t, m: ["--hf-checkpoint", _model_without_eos(t, m)], "--rollout-stop-token-ids"),
    "RF11": (lambda t, m: [*SGLANG_FLAGS, "--sglang-mem-fraction-static", "0.87"] + _log(
        t, "RuntimeError: CUDA error: an illegal memory access was encountered"), "= 0.87"),
    "RF12": (lambda t, m: _log(t, 'File "torch/_inductor/codecache.py"\njson.decoder.JSONDecodeError: Expecting '
                                  "value"), "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1"),
    "RF13": (lambda t, m: _log(t, "[rank0] iteration 12: loss is nan, skipping"),
             "--no-check-for-nan-in-loss-and-grad"),
}


@pytest.mark.parametrize("code", sorted(BROKEN))
def test_rollflow_doctor_prints_each_code_with_its_facts(code, tmp_path, capsys, tiny_model, monkeypatch):
    from engine.doctor import checks
    from flows.cli import main

    if code == "RF02":  # a GPU machine's view (checks are pure functions of the config and this view)
        monkeypatch.setattr(checks.Environment, "local", staticmethod(lambda: GPU8))
    argv_of, fact = BROKEN[code]
    rc = main(["doctor", *argv_of(tmp_path, tiny_model)])
    out = capsys.readouterr().out
    assert f"[{code} " in out and fact in out, out
    severity = {"RF05": "info", "RF07": "info"}.get(code, "error")
    assert f"[{code} {severity}]" in out
    assert rc == (1 if severity == "error" else 0)


def test_rollflow_doctor_prints_rf08_for_a_taken_port(capsys):
    from flows.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["doctor", *SGLANG_FLAGS, "--sglang-port", str(port)]) == 1
    out = capsys.readouterr().out
    assert "[RF08 error]" in out and f"port {port} is already in use" in out


# ---- pass-through flags ---------------------------------------------------------------------------------------------
def test_a_misspelt_sglang_flag_is_an_error_naming_the_nearest(capsys):
    from flows.cli import main

    d = one(run_preflight(RunConfig(sglang_args={"mem-fracton-static": "0.8"}), Environment()), "CONFIG")
    assert "--sglang-mem-fracton-static" in d.what and "--sglang-mem-fraction-static" in d.fix
    assert d.facts["sglang_version"] == "0.5.23"
    assert main(["doctor", "--sglang-mem-fracton-static", "0.8"]) == 1  # and the CLI says so
    assert "did you mean --sglang-mem-fraction-static" in capsys.readouterr().out
    ok = RunConfig(**SGLANG, sglang_args={"mem-fraction-static": "0.8", "enable-deterministic-inference": True,
                                "max-running-requests": "512", "tp-size": "2"})
    assert not [d for d in run_preflight(ok, Environment()) if "sglang" in d.what]


def test_the_sglang_flag_list_is_read_from_sglang_source():
    from engine.config.sglang_args import flags_of_add_argument, flags_of_fields

    fields = ('class Model(msgspec.Struct):\n'
              '    model_path: A[str, Arg(help="p", aliases=["--model"])]\n'
              '    tp_size: A[int, Arg(help="t", cli_name="--tensor-parallel-size", aliases=["--tp-size"])]\n'
              '    trust_remote_code: A[bool, "allow custom code"] = False\n'
              '    internal: A[int, Arg(help="x", no_cli=True)] = 0\n'
              '    plain: int = 3\n')
    assert flags_of_fields(fields) == {"model-path", "model", "tensor-parallel-size", "tp-size", "trust-remote-code"}
    assert flags_of_add_argument('parser.add_argument("--reasoning-parser", type=str)') == {"reasoning-parser"}


# ---- inputs that used to crash: each a clear error from the doctor and from the train flow's preflight ------------
def _model_copy(tmp_path, tiny_model, name="model"):
    model = tmp_path / name
    shutil.copytree(tiny_model, model)
    return model


def _both(cfg, capsys, code: str, *needles: str):
    """The same diagnosis from `rollflow doctor` (exit 1) and from the train flow's first stage (preflight)."""
    from engine import stages
    from engine.diagnosis import ConfigError
    from flows.cli import main

    argv = ["doctor", "--hf-checkpoint", cfg.hf_checkpoint, "--prompt-data", cfg.prompt_data] + \
        (["--apply-chat-template"] if cfg.apply_chat_template else ["--no-apply-chat-template"])
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert f"[{code} error]" in out and all(n in out for n in needles), out
    with pytest.raises(ConfigError) as e:
        stages.preflight(cfg, Environment())
    assert code in e.value.codes and all(n in str(e.value) for n in needles)


def test_a_prompt_file_that_is_not_utf8(tmp_path, tiny_model, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"prompt": "1+1=", "label": "2"}\n{"prompt": "caf\xe9 2+2=", "label": "4"}\n'.encode("latin1"))
    cfg = RunConfig(hf_checkpoint=tiny_model, prompt_data=str(data), eval_prompt_data="")
    _both(cfg, capsys, "DATA", "line 2 is not UTF-8 (byte 0xe9", "iconv")


def test_a_config_json_that_is_not_json(tmp_path, tiny_model, capsys):
    model = _model_copy(tmp_path, tiny_model)
    (model / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 128,,}')
    cfg = RunConfig(hf_checkpoint=str(model), eval_prompt_data="")
    _both(cfg, capsys, "MODEL", "config.json is not valid JSON (line 1 column", f"repair {model}/config.json")


def test_apply_chat_template_on_a_model_without_one(tmp_path, tiny_model, capsys):
    model = _model_copy(tmp_path, tiny_model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = RunConfig(hf_checkpoint=str(model), eval_prompt_data="", apply_chat_template=True)
    _both(cfg, capsys, "MODEL", "has no chat template", "--no-apply-chat-template")


def test_a_model_directory_without_a_tokenizer(tmp_path, tiny_model, capsys):
    model = _model_copy(tmp_path, tiny_model)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / f).unlink(missing_ok=True)
    cfg = RunConfig(hf_checkpoint=str(model), eval_prompt_data="")
    _both(cfg, capsys, "MODEL", "no usable tokenizer", "copy the tokenizer files")


def _bos_model(tmp_path, tiny_model):
    """The tiny model's tokenizer made to prepend a BOS to text (as Llama's does): <|endoftext|> (id 256)."""
    model = _model_copy(tmp_path, tiny_model, "bos")
    tj = json.loads((model / "tokenizer.json").read_text())
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [256],
                                                                 "tokens": ["<|endoftext|>"]}}}
    (model / "tokenizer.json").write_text(json.dumps(tj))
    tc = json.loads((model / "tokenizer_config.json").read_text())
    tc["bos_token"] = "<|endoftext|>"
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    return model


def test_plain_prompts_get_the_bos_the_tokenizer_adds(tmp_path, tiny_model):
    from engine.modeling import load_tokenizer, render_prompt

    tok = load_tokenizer(str(_bos_model(tmp_path, tiny_model)))
    assert render_prompt(tok, "12+3=", False)[0] == 256  # as the tokenizer encodes text (slime: without)
    plain = load_tokenizer(tiny_model)
    assert render_prompt(plain, "12+3=", False) == plain("12+3=", add_special_tokens=False)["input_ids"]


def test_a_chat_template_that_drops_the_tokenizers_bos_is_a_warning(tmp_path, tiny_model):
    cfg = RunConfig(hf_checkpoint=str(_bos_model(tmp_path, tiny_model)), eval_prompt_data="",
                    apply_chat_template=True)
    d = one(run_preflight(cfg, Environment()), "MODEL")
    assert d.severity == "warning" and "BOS '<|endoftext|>' (id 256)" in d.what and "--no-apply-chat-template" in d.fix
    assert not [d for d in run_preflight(RunConfig(hf_checkpoint=cfg.hf_checkpoint, eval_prompt_data=""),
                                         Environment()) if d.code == "MODEL"]  # plain prompts carry it
