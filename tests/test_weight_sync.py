"""Weight sync trainer → engine over real HTTP: after a sync the engine's log-probs equal the trainer's (1e-4)."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from engine.rollout.server import EngineState, ServerThread
from engine.rollout.ports import free_loopback_port

SEQ_TEXT = "<|im_start|>user\n57+38=<|im_end|>\n<|im_start|>assistant\n95<|im_end|>"
KEY = "sync-test-key"  # a run's engines answer only to its own token; weights need one
AUTH = {"Authorization": f"Bearer {KEY}"}


_free_port = free_loopback_port  # engine/rollout/ports.py


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    from engine.config import RunConfig
    from engine.train.torch_backend import TorchBackend

    work = tmp_path_factory.mktemp("work")  # the run's work dir: its weights/ is where disk syncs load from
    state = EngineState(tiny_model, threads=1, max_new_tokens=8, api_key=KEY, weight_dirs=[str(work / "weights")])
    server = ServerThread(state, "127.0.0.1", _free_port())
    url = server.start()
    trainer = TorchBackend(RunConfig(hf_checkpoint=tiny_model, rollout_temperature=1.0))
    yield state, url, trainer, work
    server.stop()


def _trainer_logprobs(trainer, seq: list[int]) -> torch.Tensor:
    from engine.packing.microbatch import make_micro_batch
    from engine.samples import Sample, Status

    s = Sample(index=0, group_index=0, rollout_id=0, prompt="", tokens=seq, response_length=len(seq) - 1,
               loss_mask=[1] * (len(seq) - 1), rollout_log_probs=[0.0] * (len(seq) - 1), status=Status.COMPLETED)
    (lp,) = trainer.compute_log_probs([make_micro_batch([s], [0.0])])
    return lp[1:]  # [L-1] log π(seq[k] | seq[:k]), k ≥ 1


def _engine_logprobs(url: str, seq: list[int]) -> tuple[torch.Tensor, str]:
    r = httpx.post(url + "/generate", headers=AUTH, json={"input_ids": seq, "return_logprob": True,
                                                          "logprob_start_len": 0,
                                            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}},
                   timeout=60).json()
    return torch.tensor([t[0] for t in r["meta_info"]["input_token_logprobs"][1:]]), r["meta_info"]["weight_version"]


def _train_a_little(trainer, seed: int) -> None:
    """Stand-in for an optimizer step: move every weight (the sync must carry all of them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


def test_tensor_sync_in_buckets_makes_engine_logprobs_equal_the_trainers(setup):
    from engine.weights.sync import push_tensors

    state, url, trainer, work = setup
    seq = state.tokenize(SEQ_TEXT)
    _train_a_little(trainer, 1)
    before, _ = _engine_logprobs(url, seq)
    assert (before - _trainer_logprobs(trainer, seq)).abs().max() > 1e-2  # the weights did differ

    # 3.2 MB of weights in 256 KiB buckets → many requests; the version moves only with the last
    stats = push_tensors([url], trainer.model_state(), 7, bucket_bytes=256 * 1024, timeout_s=60, api_key=KEY)
    assert stats["buckets"] > 5
    after, version = _engine_logprobs(url, seq)
    assert version == "7" and httpx.get(url + "/get_model_info", headers=AUTH).json()["weight_version"] == "7"
    assert (after - _trainer_logprobs(trainer, seq)).abs().max() < 1e-4


def test_disk_sync_through_the_stage_is_versioned_and_deleted_after_use(setup, tmp_path):
    from engine import stages
    from engine.config import RunConfig
    from engine.weights import save_weights_dir

    state, url, trainer, work = setup
    seq = state.tokenize(SEQ_TEXT)
    _train_a_little(trainer, 2)
    written = []

    told = []

    class FakeTrainGroup:  # the one train worker, in-process
        def save_weights(self, path: str, engines=None) -> str:
            written.append(Path(path))
            told.append(engines)  # for --custom-update-weight-post-write-path
            save_weights_dir(trainer.model_state(), path)
            return path

    from types import SimpleNamespace

    class FakeRun:
        cfg = RunConfig(weight_sync_method="disk")
        work_dir = work
        train_group = FakeTrainGroup()
        sync_transport = "disk"
        engines = SimpleNamespace(api_key=KEY)
        handed_over: dict = {}

    run = FakeRun()
    (work / "weights" / "v000003").mkdir(parents=True)  # what a failed run left
    out = stages.push_weights(run, [SimpleNamespace(url=url)], 8)
    assert out["sync/mb"] > 3.0
    after, version = _engine_logprobs(url, seq)
    assert version == "8" and (after - _trainer_logprobs(trainer, seq)).abs().max() < 1e-4
    stages.push_weights(run, [SimpleNamespace(url=url)], 8)  # a retry: the directory already handed over
    assert written == [work / "weights" / "v000008"] and written[0].exists() and told == [[url]]
    stages.forget_handed(run)  # the sync is done (stages.sync, after its probe)
    assert not written[0].exists() and not (work / "weights" / "v000003").exists()  # deleted after use


def test_sampled_rollout_logprobs_match_the_trainer_after_sync(setup):
    from engine.weights.sync import push_tensors

    state, url, trainer, work = setup
    _train_a_little(trainer, 3)
    push_tensors([url], trainer.model_state(), 9, bucket_bytes=2**30, timeout_s=60, api_key=KEY)
    prompt = state.tokenize("<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n")
    r = httpx.post(url + "/generate", headers=AUTH, json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 5}}, timeout=60).json()
    resp = r["output_ids"]
    engine_lp = torch.tensor([t[0] for t in r["meta_info"]["output_token_logprobs"]])
    trainer_lp = _trainer_logprobs(trainer, prompt + resp)[len(prompt) - 1:]
    assert len(resp) > 0 and (engine_lp - trainer_lp).abs().max() < 1e-4  # the train-inference mismatch


def test_wrong_weights_are_refused_and_change_nothing(setup):
    from engine.weights import encode_tensors

    state, url, _, _ = setup
    version = state.weight_version
    bad = encode_tensors({"model.embed_tokens.weight": torch.zeros(3, 3)})
    r = httpx.post(url + "/update_weights_from_tensor", headers=AUTH, json={
        "serialized_named_tensors": [bad], "load_format": "safetensors", "weight_version": "99"})
    assert r.status_code == 400 and "RF14" in r.json()["message"] and "shapes that differ" in r.json()["message"]
    assert httpx.get(url + "/weight_version", headers=AUTH).json()["weight_version"] == version
    r = httpx.post(url + "/update_weights_from_tensor", headers=AUTH,
                   json={"serialized_named_tensors": [bad], "load_format": None})
    assert r.status_code == 400 and "load_format" in r.json()["message"]


def test_sglang_shaped_json_body_also_updates(setup):
    from engine.rollout.client import EngineClient
    from engine.weights import encode_tensors, unique_tensors

    state, url, trainer, work = setup
    seq = state.tokenize(SEQ_TEXT)
    _train_a_little(trainer, 4)
    # SGLang's UpdateWeightsFromTensorReqInput shape: one serialized entry per TP rank, version as a string
    EngineClient(url, api_key=KEY).update_weights_from_tensor([encode_tensors(unique_tensors(trainer.model_state()))],
                                                 load_format="safetensors", version=11, flush_cache=True)
    after, version = _engine_logprobs(url, seq)
    assert version == "11" and (after - _trainer_logprobs(trainer, seq)).abs().max() < 1e-4


def test_the_probe_after_a_sync_catches_an_engine_serving_other_weights(setup, tiny_model):
    """RF14 at the sync itself: every engine answers the probe prompts and the trainer must give those tokens the
    engine's log-probs, or the run stops there (before a rollout generates from wrong weights)."""
    from types import SimpleNamespace

    from engine import stages
    from engine.config import RunConfig
    from engine.diagnosis import DiagnosisError
    from engine.modeling import eos_token_ids, load_tokenizer
    from engine.weights.sync import push_tensors

    state, url, trainer, work = setup
    _train_a_little(trainer, 5)
    push_tensors([url], trainer.model_state(), 12, bucket_bytes=2**30, timeout_s=60, api_key=KEY)
    cfg = RunConfig(hf_checkpoint=tiny_model, apply_chat_template=True, rollout_max_response_len=8)
    rows = [SimpleNamespace(prompt=f"{a}+{b}=") for a, b in [(1, 2), (30, 45), (7, 9)]]
    scored = []

    def score(mb):
        scored.append(mb)
        return trainer.compute_log_probs([mb])[0]

    tok = load_tokenizer(tiny_model)
    run = SimpleNamespace(cfg=cfg, tokenizer=tok, eos_ids=eos_token_ids(tiny_model, tok), eval_sets={"test": rows},
                          dataset=None, engine_dtype="float32", train_dtype="float32",
                          train_group=SimpleNamespace(score=score, score_start=lambda mb: lambda: score(mb)),
                          engines=SimpleNamespace(serving=lambda: [url], api_key=KEY))
    run.probe = stages.probe_prompts(run)
    assert len(run.probe) == 3
    assert stages.probe_engines(run, 12)["sync/probe_mismatch"] < 1e-5  # the same weights, fp32
    assert float(scored[0].loss_mask.sum()) >= 3  # the engine's own answers were scored
    # later probes: the trainer scores those answers before its weights leave it, the engine after (teacher-forced)
    assert len(run.probe_seqs) == 3 and all(r for _, r in run.probe_seqs)
    ref = stages.probe_reference(run)
    assert ref.numel() == sum(len(r) for _, r in run.probe_seqs)
    assert stages.probe_engines(run, 12, ref)["sync/probe_mismatch"] < 1e-5
    # as sync passes it: the trainer's answer waited for once the engine has scored
    assert stages.probe_engines(run, 12, stages.probe_reference_start(run))["sync/probe_mismatch"] < 1e-5

    _train_a_little(trainer, 6)  # the trainer moves on, the engine is not told: a stale sync
    for reference in (None, stages.probe_reference(run), stages.probe_reference_start(run)):
        with pytest.raises(DiagnosisError) as e:
            stages.probe_engines(run, 13, reference)
        (d,) = e.value.diagnoses
        assert d.code == "RF14" and "weight sync to version 13" in d.what and d.facts["mean"] > 1e-2


def test_the_sync_reply_carries_the_version_check(monkeypatch):
    """The built-in engine's last /update_weights_from_tensor reply says which version it serves: push_tensors
    checks that instead of asking again, and a reply with another version fails the sync naming both; a reply
    without one (another server) is checked with /get_model_info as before."""
    from engine.rollout.client import EngineClient, EngineError
    from engine.weights.sync import push_tensors

    asked = []
    monkeypatch.setattr(EngineClient, "weight_version", lambda self, timeout_s=None: asked.append(1) or "4")
    sd = {"w": torch.ones(4)}
    for reply, fails, asks in (({"success": True, "weight_version": "4"}, False, 0),
                               ({"success": True, "weight_version": "3"}, True, 0),
                               ({"success": True}, False, 1)):
        asked.clear()
        monkeypatch.setattr(EngineClient, "update_weights_from_tensor_raw", lambda self, blob, **kw: reply)
        if fails:
            with pytest.raises(EngineError, match="weight_version '3' after the sync, expected 4"):
                push_tensors(["http://127.0.0.1:9"], sd, 4, bucket_bytes=2**20, timeout_s=5)
        else:
            push_tensors(["http://127.0.0.1:9"], sd, 4, bucket_bytes=2**20, timeout_s=5)
        assert len(asked) == asks


def test_an_engine_in_the_train_workers_process_is_probed_in_the_sync_call(tiny_model, monkeypatch):
    """--rollout-engine-process trainer: the weight copy, the trainer's and the engine's probe scores are one call
    (TrainWorker.engine_take_weights). The engine's numbers are what its HTTP /generate answers for the same
    sequences, and a copy that did not land is RF14 at that sync."""
    from types import SimpleNamespace

    from engine import stages
    from engine.config import RunConfig
    from engine.diagnosis import DiagnosisError
    from engine.modeling import eos_token_ids
    from engine.rollout.client import EngineClient
    from engine.train.worker import TrainWorker

    cfg = RunConfig(hf_checkpoint=tiny_model, rollout_temperature=1.0, train_threads=1)
    worker = TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=4, threads=1)
    state = EngineState(tiny_model, threads=1, max_new_tokens=8)
    server = ServerThread(state, "127.0.0.1", _free_port())
    url = server.start()
    try:
        worker._engine = SimpleNamespace(state=state)  # what engine_start leaves (without Ray's port registry)
        seqs = [([11, 12, 13, 14], [20, 21, 22]), ([30, 31], [40, 41, 42, 43, 44])]
        probe_run = SimpleNamespace(probe_seqs=seqs)
        probe = (stages._probe_batch(probe_run), 1.0, [p + r for p, r in seqs])
        _train_a_little(worker.backend, 7)
        version, copied, (ref, lps, scored_under) = worker.engine_take_weights("3", probe)
        assert version == scored_under == "3" and copied > 0
        assert lps == EngineClient(url).score([p + r for p, r in seqs], 1.0)  # the HTTP answer, number for number
        assert ref.numel() == 8 and float(stages._answer_diffs(seqs, ref, lps).max()) < 1e-5

        run = SimpleNamespace(cfg=cfg, probe=[p for p, _ in seqs], probe_seqs=seqs, eos_ids=eos_token_ids(tiny_model),
                              engine_dtype="float32", train_dtype="float32",
                              engines=SimpleNamespace(serving=lambda: [url], api_key=None))
        assert stages.probe_engines(run, 3, scored={url: (ref, lps)})["sync/probe_mismatch"] < 1e-5
        # a copy that does not land: the engine says version 4 but keeps version 3's weights
        monkeypatch.setattr(state, "update_from_named",
                            lambda named, v: (setattr(state, "weight_version", v), 0)[1])
        _train_a_little(worker.backend, 8)
        _, _, (ref, lps, scored_under) = worker.engine_take_weights("4", probe)
        assert scored_under == "4"
        with pytest.raises(DiagnosisError) as e:
            stages.probe_engines(run, 4, scored={url: (ref, lps)})
        (d,) = e.value.diagnoses
        assert d.code == "RF14" and "weight sync to version 4" in d.what and d.facts["mean"] > 1e-2
    finally:
        server.stop()


# ---- --weight-sync-method distributed: a process group of train rank 0 and the engines (gloo on CPUs) -----------
def _final_weights(save: str) -> dict:
    from safetensors.torch import load_file

    from engine import checkpoint

    return load_file(str(checkpoint.iter_dir(save, checkpoint.read_marker(save)) / "model" / "model.safetensors"))


@pytest.mark.slow
def test_distributed_sync_trains_as_the_object_store_does(prefect_harness, shared_ray, small_cfg, tmp_path):
    """The broadcast carries every weight: the same rewards, losses and final weights as the object-store path, on
    engines in processes of their own (the engine in the trainer's process would take a copy instead)."""
    from flows.train import rl_train

    over = dict(num_rollout=3, eval_prompt_data=[], lr=1e-3, rollout_engine_process="own")
    store = rl_train(small_cfg(save=str(tmp_path / "store"), work_dir=str(tmp_path / "w1"), **over))
    dist = rl_train(small_cfg(save=str(tmp_path / "dist"), work_dir=str(tmp_path / "w2"),
                              weight_sync_method="distributed", **over))
    assert dist["placement"]["engine_in_trainer"] is False
    for key in ("rollout/reward_mean", "train/loss", "sync/weight_version"):
        assert dist["history"][key] == store["history"][key], key
    assert max(dist["history"]["sync/probe_mismatch"].values()) < 1e-5
    a, b = _final_weights(str(tmp_path / "dist")), _final_weights(str(tmp_path / "store"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.mark.slow
def test_a_restarted_engine_rejoins_the_weight_group(prefect_harness, shared_ray, small_cfg, tmp_path, monkeypatch):
    """--use-fault-tolerance with distributed sync: the engine that died mid-rollout is restarted, the group is
    opened again with its new process and it gets the current weights before it serves; the run then finishes
    with every engine on the last version."""
    from flows.train import rl_train

    # /generate requests of engine 0: 0 is rollout 0 (one request: join_rows), 1 the RF14 probe after sync 0,
    # 2 rollout 1 — the engine exits there
    monkeypatch.setenv("ROLLFLOW_ENGINE_FAULT", "exit@2")
    monkeypatch.setenv("ROLLFLOW_FAULT_STATE", str(tmp_path / "fired"))
    cfg = small_cfg(num_rollout=3, eval_prompt_data=[], save="", weight_sync_method="distributed",
                    use_fault_tolerance=True, rollout_health_check_timeout=10)
    result = rl_train(cfg)
    assert (tmp_path / "fired").read_text() == "engine-exit@2\n"
    assert result["history"]["sync/weight_version"] == {"0": 1.0, "1": 2.0, "2": 3.0}
    assert max(result["history"]["sync/probe_mismatch"].values()) < 1e-5
    assert result["history"]["rollout/retried_requests"]["1"] >= 1


def test_distributed_is_refused_where_it_cannot_work_and_picks_nccl_only_on_gpus(small_cfg):
    from types import SimpleNamespace

    from engine.diagnosis import ConfigError
    from engine.run import Run
    from engine.rollout.engines import Slot
    from engine.stages import group_backend

    with pytest.raises(ConfigError, match="cannot join two ranks on one GPU"):
        small_cfg(weight_sync_method="distributed", colocate=True)
    with pytest.raises(ConfigError, match="--weight-sync-method distributed"):
        small_cfg(weight_sync_method="distributed", rollout_engine_process="trainer")
    assert not small_cfg(weight_sync_method="distributed").engine_in_trainer_on_cpu()  # auto: its own process

    def backend(cfg, on_gpu: bool, *infos) -> str:
        run = Run(cfg)
        run.on_gpu = on_gpu
        run.engines = SimpleNamespace(slots=[Slot(i, -1, info=dict(info)) for i, info in enumerate(infos)])
        return group_backend(run)

    own = small_cfg(weight_sync_method="distributed")
    assert backend(own, False, {}) == "gloo" and backend(own, True, {}, {}) == "nccl"
    ext = dict(weight_sync_method="distributed", rollout_external_engine_addrs=["h:1"], sglang_args={"api-key": "k"})
    builtin = small_cfg(**ext)
    assert backend(builtin, True, {"external": True, "kind": "builtin", "device": "cuda:0"}) == "nccl"
    assert backend(builtin, True, {"external": True, "kind": "builtin", "device": "cpu"}) == "gloo"
    sglang = small_cfg(**ext, rollout_engine="sglang")
    assert backend(sglang, True, {"external": True, "kind": "sglang"}) == "nccl"
    with pytest.raises(ConfigError, match="SGLang engines needs NCCL"):
        backend(sglang, False, {"external": True, "kind": "sglang"})


def test_weights_checker_catches_a_weight_the_sync_did_not_write(setup):
    """SGLang's /weights_checker on the built-in engine: after reset_tensors every weight is random, so a compare
    passes only once a sync has written all of them again."""
    from engine.weights.sync import push_tensors

    state, url, trainer, _ = setup
    check = lambda action: httpx.post(url + "/weights_checker", headers=AUTH, json={"action": action}, timeout=60)  # noqa: E731
    assert httpx.post(url + "/weights_checker", json={"action": "snapshot"}).status_code == 401  # it can wipe weights
    push_tensors([url], trainer.model_state(), 20, bucket_bytes=2**30, timeout_s=60, api_key=KEY)
    assert check("snapshot").json()["success"] is True
    sums = check("checksum").json()["checksums"]
    assert check("reset_tensors").json()["success"] is True
    assert check("checksum").json()["checksums"].keys() == sums.keys() != set()
    assert all(check("checksum").json()["checksums"][k] != v for k, v in sums.items())  # every weight overwritten
    every = trainer.model_state()
    partial = {k: v for k, v in every.items() if k != "model.norm.weight"}
    push_tensors([url], partial, 21, bucket_bytes=2**30, timeout_s=60, api_key=KEY)  # a sync that forgot one
    r = check("compare")
    assert r.status_code == 400 and "1 of" in r.json()["message"] and "model.norm.weight" in r.json()["message"]
    push_tensors([url], every, 22, bucket_bytes=2**30, timeout_s=60, api_key=KEY)
    assert check("compare").json()["success"] is True and check("checksum").json()["checksums"] == sums
    assert check("nonsense").status_code == 400


def test_check_weight_update_equal_passes_a_faithful_sync_and_stops_a_wrong_one(setup):
    """The stage with the run's own sync (disk here): a sync that writes every weight right passes; one that hands
    over a weight transposed (same shape: the kind of mapping bug no name or shape check sees) stops the run with
    RF14 naming it, before any rollout."""
    import threading
    from types import SimpleNamespace

    from engine import stages
    from engine.config import RunConfig
    from engine.diagnosis import DiagnosisError
    from engine.rollout.client import EngineClient
    from engine.rollout.engines import EngineGroup
    from engine.weights import save_weights_dir
    from engine.weights.sync import push_tensors

    state, url, trainer, work = setup
    group = SimpleNamespace(serving=lambda: [url], client=lambda u: EngineClient(u, api_key=KEY))
    wrong = "model.layers.0.self_attn.q_proj.weight"
    assert trainer.model_state()[wrong].shape[0] == trainer.model_state()[wrong].shape[1]
    mangle = {"on": False}

    class TrainGroup:
        def save_weights(self, path: str, engines=None) -> str:
            st = dict(trainer.model_state())
            if mangle["on"]:
                st[wrong] = st[wrong].t().contiguous()
            save_weights_dir(st, path)
            return path

    def run_for():
        return SimpleNamespace(
            cfg=RunConfig(weight_sync_method="disk", check_weight_update_equal=True), work_dir=work,
            train_group=TrainGroup(), sync_transport="disk", handed_over={}, served_versions=set(),
            state=SimpleNamespace(weight_version=None), start=SimpleNamespace(kind="fresh", next_rollout_id=0),
            engines=SimpleNamespace(api_key=KEY, lock=threading.RLock(), serving=lambda: [url],
                                    serving_slots=lambda: [SimpleNamespace(url=url)],
                                    check_weights=lambda a: EngineGroup.check_weights(group, a)))

    push_tensors([url], trainer.model_state(), 30, bucket_bytes=2**30, timeout_s=60, api_key=KEY)  # = its HF load
    run = run_for()
    stages.check_weight_update_equal(run)
    assert run.state.weight_version == 0 and state.weight_version == "0"
    mangle["on"] = True
    with pytest.raises(DiagnosisError) as e:
        stages.check_weight_update_equal(run_for())
    (d,) = e.value.diagnoses
    assert d.code == "RF14" and "compare failed on 1 of 1 engine" in d.what and wrong in d.what
    assert d.facts["field"] == "check_weight_update_equal" and d.facts["engines"] == [url]


def publish_weights(args, version_dir, rollout_engines):
    """A --custom-update-weight-post-write-path function: copies the written directory where "remote" engines
    would read it, and records what it was told."""
    import json
    import shutil

    assert (Path(version_dir) / "model.safetensors").is_file()  # called after the files are written
    dest = Path(args.work_dir) / "published" / Path(version_dir).name
    shutil.copytree(version_dir, dest)
    (dest / "told.json").write_text(json.dumps({"engines": rollout_engines, "sync": args.weight_sync_method}))


def test_the_post_write_hook_runs_on_rank_0_after_a_disk_syncs_files_and_before_the_engines(tmp_path):
    """slime's --custom-update-weight-post-write-path: train rank 0 calls it with the version directory it has just
    written and the engines' URLs (a disk sync's save_weights); not for other writes; a failing function fails
    the sync naming the flag; refused without --weight-sync-method disk."""
    import json

    from engine.config import RunConfig
    from engine.config.data import BUNDLED_MODEL
    from engine.diagnosis import ConfigError, DiagnosisError
    from engine.train.worker import TrainWorker
    from engine.weights import load_weights_dir

    def worker(fn: str):
        cfg = RunConfig(hf_checkpoint=BUNDLED_MODEL, weight_sync_method="disk", work_dir=str(tmp_path),
                        custom_update_weight_post_write_path=f"tests/test_weight_sync.py:{fn}")
        return TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=1, threads=1)

    w = worker("publish_weights")
    w.save_weights(str(tmp_path / "weights" / "v000003"), ["http://10.0.0.7:30000"])
    pub = tmp_path / "published" / "v000003"
    assert json.loads((pub / "told.json").read_text()) == {"engines": ["http://10.0.0.7:30000"], "sync": "disk"}
    want = w.backend.model_state()
    got = load_weights_dir(pub)
    assert all(torch.equal(got[k], want[k]) for k in want)
    w.save_weights(str(tmp_path / "weights" / "v000004"))  # not a sync: an export, no engines to tell
    assert not (tmp_path / "published" / "v000004").exists()
    with pytest.raises(DiagnosisError, match="--custom-update-weight-post-write-path"):
        worker("no_such_function").save_weights(str(tmp_path / "weights" / "v000005"), ["http://e"])
    with pytest.raises(ConfigError, match="--weight-sync-method is tensor: it would never be called"):
        RunConfig(custom_update_weight_post_write_path="m:f")


#: family (tests/model_families.py): an expert's up projection in the files, the MoE layers
MOE_FILES = {"qwen3moe": ("mlp.experts.{e}.up_proj.weight", (0, 1)),
             "mixtral": ("block_sparse_moe.experts.{e}.w3.weight", (0, 1)),  # in memory: mlp.experts…
             "qwen2moe": ("mlp.experts.{e}.up_proj.weight", (1,))}  # layer 0 is dense


@pytest.mark.parametrize("family", sorted(MOE_FILES))
def test_a_mixture_of_experts_is_sent_under_its_checkpoint_names_and_the_engine_takes_them(family, tiny_model,
                                                                                          tmp_path):
    """transformers 5 fuses a mixture of experts in memory (mlp.experts.gate_up_proj); its files, and SGLang's
    loaders, name them per expert (Mixtral: under block_sparse_moe, w1 / w3 / w2). The trainer sends the files'
    names (what save_pretrained writes), the built-in engine copies them into its fused tensors, also from buckets
    that split a layer's experts, and a sync missing one expert is refused naming the fused tensor."""
    from safetensors import safe_open

    from engine.config import RunConfig
    from engine.diagnosis import DiagnosisError
    from engine.train.torch_backend import TorchBackend
    from engine.weights.sync import push_tensors
    from model_families import save_model

    up, layers = MOE_FILES[family]
    last = f"model.layers.{layers[-1]}."
    model = save_model(tmp_path / "moe", family, tiny_model)
    on_disk = set(safe_open(str(Path(model) / "model.safetensors"), "pt").keys())
    trainer = TorchBackend(RunConfig(hf_checkpoint=model, rollout_temperature=1.0))
    sent = trainer.engine_state()
    assert set(sent) == on_disk and last + up.format(e=3) in sent
    assert last + "mlp.experts.gate_up_proj" in trainer.model_state()  # the in-memory layout differs

    state = EngineState(model, threads=1, max_new_tokens=8, api_key=KEY)
    server = ServerThread(state, "127.0.0.1", _free_port())
    url = server.start()
    try:
        seq = state.tokenize(SEQ_TEXT)
        _train_a_little(trainer, 3)
        assert (_engine_logprobs(url, seq)[0] - _trainer_logprobs(trainer, seq)).abs().max() > 1e-2
        stats = push_tensors([url], trainer.engine_state(), 2, bucket_bytes=4096, timeout_s=60, api_key=KEY)
        assert stats["buckets"] > 10  # each expert's 8 KiB gate, up or down tensor in a request of its own
        after, version = _engine_logprobs(url, seq)
        assert version == "2" and (after - _trainer_logprobs(trainer, seq)).abs().max() < 1e-4
        served = dict(state.generator.model.named_parameters())
        mine = dict(trainer.model.named_parameters())
        for n in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            assert torch.equal(served[last + n], mine[last + n])

        from engine.weights.layout import _blocks, _geometry, _revert  # layer 1 reuses layer 0's probe: the same
        probed = {}                                                       # geometry as probing every tensor
        for n, p in state.generator.model.named_parameters():
            if ".experts." in n or (family == "mixtral" and ".mlp.gate." in n):  # Mixtral's router is renamed
                probed.update(_blocks(_revert(), state.generator.model, n, p))  # too: block_sparse_moe.gate
        routers = len(layers) if family == "mixtral" else 0
        assert _geometry(state.generator.model) == probed and len(probed) == len(layers) * 4 * 3 + routers

        partial = {k: v for k, v in trainer.engine_state().items() if k != last + up.format(e=2)}
        with pytest.raises(DiagnosisError, match=f"served parameters not sent: {last}mlp.experts.gate_up_proj"):
            state.update_from_named(partial, "3")
        assert state.weight_version == "2"
    finally:
        server.stop()
