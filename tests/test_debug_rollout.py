"""--save-debug-rollout-data / --load-debug-rollout-data (slime's debugging flags): rollouts written to files, and a
run that trains on them with no engine."""
from __future__ import annotations

import gzip
import json

import pytest

from engine.diagnosis import ConfigError, DiagnosisError
from engine.samples import Sample, Status


def _groups(B: int = 2, n: int = 3, rollout_id: int = 0) -> list[list[Sample]]:
    out = []
    for g in range(B):
        group = []
        for j in range(n):
            s = Sample(index=g * n + j, group_index=g, rollout_id=rollout_id,
                       prompt=[{"role": "user", "content": "1+1"}],
                       tokens=[5, 6, 7, 8 + j], response_length=2, response="2", label="2",
                       reward={"score": float(j % 2), "format": 0.5}, loss_mask=[1, 0],
                       rollout_log_probs=[-0.25, -1.5 - j], status=Status.COMPLETED if j else Status.TRUNCATED,
                       metadata={"weight_version": "3"}, remove_sample=j == 2)
            s.advantage_reward = 0.5 * j  # an attribute a hook set: kept, as slime keeps them
            group.append(s)
        out.append(group)
    return out


@pytest.mark.parametrize("kw, says", [
    (dict(save_debug_rollout_data="d/rollout.json"), "'d/rollout_{rollout_id}.json'"),
    (dict(load_debug_rollout_data="s3://b/r_{rollout_id}.json"), "driver's filesystem"),
    (dict(load_debug_rollout_data="d/r_{rollout_id}.json", async_mode="one-step"), "--async-mode one-step"),
    (dict(load_debug_rollout_data="d/r_{rollout_id}.json", eval_interval=2), "--eval-interval 2"),
    (dict(load_debug_rollout_data="d/r_{rollout_id}.json", eval_prompt_data=["x.jsonl"]), "--eval-prompt-data"),
    (dict(load_debug_rollout_data="d/r_{rollout_id}.json", rollout_engine_process="own"),
     "--rollout-engine-process own"),
    (dict(load_debug_rollout_data="d/r_{rollout_id}.json", dynamic_sampling_filter_path="m:f",
          over_sampling_batch_size=16), "--dynamic-sampling-filter-path, --over-sampling-batch-size"),
    (dict(load_debug_rollout_data="d/r_{rollout_id}.json", save_debug_rollout_data="e/r_{rollout_id}.json"),
     "--save-debug-rollout-data would do nothing"),
    (dict(debug_rollout_only=True, save="ck", eval_interval=2), "--save ck, --eval-interval 2 would do nothing"),
    (dict(debug_rollout_only=True, async_mode="one-step"), "--async-mode one-step would do nothing"),
    (dict(debug_rollout_only=True, colocate=True), "--colocate"),
    (dict(debug_rollout_only=True, load_debug_rollout_data="d/r_{rollout_id}.json"), "--load-debug-rollout-data"),
])
def test_flags_a_replay_would_ignore_are_config_errors(kw, says):
    from engine.config import RunConfig

    with pytest.raises(ConfigError) as e:
        RunConfig(**kw)
    assert says in str(e.value), str(e.value)


def test_a_replay_has_no_engine_and_keeps_its_config_through_a_round_trip():
    from engine.config import RunConfig

    cfg = RunConfig(load_debug_rollout_data="d/r_{rollout_id}.json")
    assert cfg.replay and not cfg.engine_in_trainer_on_cpu()
    assert "--load-debug-rollout-data" in " ".join(cfg.engine_in_trainer_blockers())
    RunConfig(**cfg.model_dump())  # the train worker rebuilds it: the default eval set is no error there either
    # the save pattern is not part of what is trained; the load pattern is
    assert RunConfig(save_debug_rollout_data="a_{rollout_id}.json").config_hash() == RunConfig().config_hash()
    assert cfg.config_hash() != RunConfig().config_hash()


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_a_saved_rollout_reads_back_as_it_was_written(tmp_path, suffix):
    from engine.rollout import replay

    pattern = str(tmp_path / "d" / f"rollout_{{rollout_id}}{suffix}")
    groups = _groups(rollout_id=4)
    path = replay.save(pattern, 4, groups, {"rollout/reward_mean": 0.5},
                       {"hf_checkpoint": "m", "rollout_batch_size": 2, "n_samples_per_prompt": 3, "weight_version": 3})
    assert path == tmp_path / "d" / f"rollout_4{suffix}"
    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if suffix.endswith(".gz") else raw)
    assert doc["format"] == "rollflow-debug-rollout" and doc["rollout_id"] == 4
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    got, metrics, meta = replay.load(pattern, 4, batch_size=2, n=3, vocab_size=259, hf_checkpoint="m")
    assert [[s.to_dict() for s in g] for g in got] == [[s.to_dict() for s in g] for g in groups]
    assert got[0][2].remove_sample and got[1][1].advantage_reward == 0.5 and got[0][0].status == Status.TRUNCATED
    assert metrics == {"rollout/reward_mean": 0.5} and meta["weight_version"] == 3
    assert replay.saved_ids(pattern) == [4]


def test_a_saved_rollout_that_does_not_fit_the_run_is_a_clear_error(tmp_path):
    from engine.rollout import replay

    pattern = str(tmp_path / "rollout_{rollout_id}.json")
    meta = {"hf_checkpoint": "m", "rollout_batch_size": 2, "n_samples_per_prompt": 3, "weight_version": 0}
    for i in (0, 1, 2, 5):
        replay.save(pattern, i, _groups(rollout_id=i), {}, meta)
    (tmp_path / "rollout_x.json").write_text("{}")  # not a rollout id: not counted
    assert replay.saved_ids(pattern) == [0, 1, 2, 5]
    assert replay.missing(pattern, 7) == [3, 4, 6]

    with pytest.raises(DiagnosisError) as e:  # another batch shape
        replay.load(pattern, 0, batch_size=4, n=3, vocab_size=None, hf_checkpoint="m")
    assert "--rollout-batch-size 2 --n-samples-per-prompt 3" in e.value.diagnoses[0].fix
    with pytest.raises(DiagnosisError) as e:  # another model's vocabulary
        replay.load(pattern, 0, batch_size=2, n=3, vocab_size=8, hf_checkpoint="other")
    assert "token id 10" in e.value.diagnoses[0].what and "--hf-checkpoint m" in e.value.diagnoses[0].fix
    with pytest.raises(DiagnosisError) as e:  # not saved
        replay.load(pattern, 3, batch_size=2, n=3, vocab_size=None, hf_checkpoint="m")
    d = e.value.diagnoses[0]
    assert "saved: 0–2, 5" in d.what and d.fix.startswith("--num-rollout 3"), d
    (tmp_path / "rollout_1.json").write_text('{"format": "something else"}')
    with pytest.raises(DiagnosisError, match="not a rollflow saved rollout"):
        replay.load(pattern, 1, batch_size=2, n=3, vocab_size=None, hf_checkpoint="m")
    (tmp_path / "rollout_2.json").write_bytes(b"\x1f\x8b truncated")
    with pytest.raises(DiagnosisError, match="is not a saved rollout"):
        replay.load(pattern, 2, batch_size=2, n=3, vocab_size=None, hf_checkpoint="m")

    # what JSON cannot hold fails the save, names the fix, and leaves neither the file nor a temporary one
    bad = _groups()
    bad[0][0].handle = object()
    with pytest.raises(DiagnosisError) as e:
        replay.save(str(tmp_path / "new" / "r_{rollout_id}.json"), 9, bad, {}, meta)
    assert "JSON types" in e.value.diagnoses[0].fix
    assert not (tmp_path / "new").exists() or not list((tmp_path / "new").iterdir())


def test_preflight_names_the_rollouts_that_have_no_file(tmp_path):
    from engine.config import RunConfig
    from engine.doctor.checks import Environment, saved_rollouts_present
    from engine.rollout import replay

    pattern = str(tmp_path / "r_{rollout_id}.json")
    meta = {"hf_checkpoint": "m", "rollout_batch_size": 2, "n_samples_per_prompt": 3, "weight_version": 0}
    for i in range(3):
        replay.save(pattern, i, _groups(), {}, meta)
    env = Environment()
    assert saved_rollouts_present(RunConfig(load_debug_rollout_data=pattern, num_rollout=3), env) == []
    (d,) = saved_rollouts_present(RunConfig(load_debug_rollout_data=pattern, num_rollout=5), env)
    assert d.code == "DATA" and "rollout(s) 3–4" in d.what and d.fix.startswith("--num-rollout 3"), d
    (d,) = saved_rollouts_present(RunConfig(load_debug_rollout_data=str(tmp_path / "none_{rollout_id}.json"),
                                            num_rollout=2), env)
    assert "saved: none" in d.what and "--save-debug-rollout-data" in d.fix


def test_a_replay_places_the_train_ranks_only():
    from engine.cluster.placement import train_only_layout
    from engine.config import RunConfig
    from engine.doctor.checks import Environment, topology_fits_cluster

    assert train_only_layout(cluster_gpus=0, train_gpus=1) is None
    lay = train_only_layout(cluster_gpus=8, train_gpus=2)
    assert lay.bundles == [{"GPU": 1.0}] * 2 and lay.engine_bundles == [] and lay.train_bundles == [0, 1]
    assert lay.train_gpu_fraction == 1.0
    # one GPU holds a replay's trainer; the same run with engines needs a second one (RF02)
    env = Environment(gpus=1.0, cpus=16.0, gpus_per_node=[1.0], cpus_per_node=[16.0])
    assert topology_fits_cluster(RunConfig(load_debug_rollout_data="r_{rollout_id}.json"), env) == []
    assert [d.code for d in topology_fits_cluster(RunConfig(), env)] == ["RF02"]
    # --debug-rollout-only: the engines' GPUs only, even for a trainer that would not fit
    assert topology_fits_cluster(RunConfig(debug_rollout_only=True, actor_num_gpus_per_node=8), env) == []
    assert RunConfig(debug_rollout_only=True).engine_in_trainer_blockers() == ["--debug-rollout-only (no trainer)"]


@pytest.mark.slow
def test_a_replayed_run_trains_exactly_what_was_recorded(prefect_harness, shared_ray, small_cfg, tmp_path):
    """Record 3 rollouts (--dump-details), replay them: the same metrics and, on the CPU, the same weights bit for bit; no engine,
    no sync. A replay with another lr moves away from the recording (train/mismatch ≫ RF14's threshold) and is not
    stopped for it."""
    from safetensors.torch import load_file

    from engine import checkpoint
    from flows.train import rl_train

    # recorded with --dump-details: rollouts, train data, tokenizer and flags in one directory
    dump = tmp_path / "dump"
    rec = rl_train(small_cfg(num_rollout=3, eval_prompt_data=[], dump_details=str(dump)))
    pattern = str(dump / "rollout_data" / "{rollout_id}.json.gz")
    assert sorted(p.name for p in (dump / "rollout_data").iterdir()) == [f"{i}.json.gz" for i in range(3)]
    assert sorted(p.name for p in (dump / "train_data").iterdir()) == [f"{i}_0.pt" for i in range(3)]
    assert (dump / "tokenizer" / "tokenizer_config.json").is_file()
    import yaml

    flags = yaml.safe_load((dump / "config.yaml").read_text())
    assert flags["dump_details"] == str(dump) and flags["save_debug_rollout_data"] == pattern

    rep = rl_train(small_cfg(num_rollout=3, save=str(tmp_path / "replay"), work_dir=str(tmp_path / "w2"),
                             load_debug_rollout_data=pattern))
    assert rep["weight_sync"] == "none" and rep["placement"]["engines"] == [], rep["placement"]
    assert rep["test_accuracy_before"] is None and rep["test_accuracy_after"] is None
    h, r = rec["history"], rep["history"]
    assert r["rollout/replayed"] == {"0": 1.0, "1": 1.0, "2": 1.0}
    assert not [k for k in r if k.startswith("sync/")], sorted(r)
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/pg_loss", "train/grad_norm",
                "train/mismatch", "pack/tokens"):
        assert r[key] == h[key], (key, r[key], h[key])

    def weights(save):
        return load_file(str(checkpoint.iter_dir(save, 2) / "model" / "model.safetensors"))

    a, b = weights(str(tmp_path / "ckpt")), weights(str(tmp_path / "replay"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

    other = rl_train(small_cfg(num_rollout=2, lr=0.03, save=str(tmp_path / "lr"), work_dir=str(tmp_path / "w3"),
                               load_debug_rollout_data=pattern))
    mm = other["history"]["train/mismatch"]
    assert mm["0"] == h["train/mismatch"]["0"] and mm["1"] > 100 * 1e-3, mm


@pytest.mark.slow
def test_rollout_only_generates_without_a_trainer_and_a_replay_trains_on_it(prefect_harness, shared_ray, small_cfg,
                                                                           tmp_path):
    """--debug-rollout-only: the engine alone (no train worker, no sync, no checkpoint), the evaluation before the
    loop, every rollout saved; then a replay trains on those files."""
    from flows.train import rl_train

    pattern = str(tmp_path / "debug" / "rollout_{rollout_id}.json.gz")
    only = rl_train(small_cfg(num_rollout=3, save=None, debug_rollout_only=True, save_debug_rollout_data=pattern))
    assert only["placement"]["train"] == [] and len(only["placement"]["engines"]) == 1, only["placement"]
    assert not only["placement"]["engine_in_trainer"] and only["weight_sync"] == "none"
    h = only["history"]
    assert sorted(h["rollout/reward_mean"]) == ["0", "1", "2"]
    assert not [k for k in h if k.split("/")[0] in ("train", "pack", "sync", "save")], sorted(h)
    assert only["test_accuracy_before"] is not None and only["test_accuracy_after"] is None
    assert only["last_checkpoint"] is None and not (tmp_path / "ckpt").exists()
    assert sorted(p.name for p in (tmp_path / "debug").iterdir()) == [f"rollout_{i}.json.gz" for i in range(3)]

    rep = rl_train(small_cfg(num_rollout=3, load_debug_rollout_data=pattern))
    r = rep["history"]
    assert r["rollout/reward_mean"] == h["rollout/reward_mean"] and sorted(r["train/loss"]) == ["0", "1", "2"]
    # the recording engine never moved: the first step matches it, later ones drift as the replay trains
    assert r["train/mismatch"]["0"] < 1e-5 < r["train/mismatch"]["2"], r["train/mismatch"]


def test_a_saved_rollout_gets_the_permissions_open_would_give(tmp_path):
    import os
    import stat

    from engine.rollout import replay

    old = os.umask(0o027)
    try:
        path = replay.save(str(tmp_path / "r_{rollout_id}.json"), 0, _groups(), {}, {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_replay_may_train_on_another_key_of_the_recorded_dict_rewards(tmp_path, monkeypatch):
    """--reward-key on a replay: the same recorded samples, another key of their dict rewards (the recording
    trained on "score"); the rollout's reward mean follows; a key the dicts lack is a DATA error naming theirs."""
    from types import SimpleNamespace

    from engine import model_shape, stages
    from engine.config import RunConfig
    from engine.rollout import replay

    pattern = str(tmp_path / "rollout_{rollout_id}.json")
    meta = {"hf_checkpoint": "m", "rollout_batch_size": 2, "n_samples_per_prompt": 3, "weight_version": 0}
    replay.save(pattern, 0, _groups(), {"rollout/reward_mean": 0.333}, meta)
    RunConfig(load_debug_rollout_data=pattern, eval_prompt_data=[], reward_key="format")  # a dict source now

    groups, _, _ = replay.load(pattern, 0, batch_size=2, n=3, vocab_size=None, hf_checkpoint="m")
    assert stages.rekeyed(groups, "format", pattern)
    assert [s.scalar_reward for g in groups for s in g] == [0.5] * 6
    assert not stages.rekeyed(groups, "format", pattern)  # already that key
    with pytest.raises(DiagnosisError, match="has no key 'quality'.*its keys: format, score"):
        stages.rekeyed(groups, "quality", pattern)

    # through the replayed rollout stage: what it publishes is the mean of the chosen key
    published = {}
    monkeypatch.setattr(stages, "publish", lambda run, step, m: published.update(m) or m)
    monkeypatch.setattr(model_shape, "read", lambda d: SimpleNamespace(vocab_size=None))
    cfg = SimpleNamespace(load_debug_rollout_data=pattern, rollout_batch_size=2, n_samples_per_prompt=3,
                          model_dir=None, hf_checkpoint="m", reward_key="format",
                          load_debug_rollout_data_subsample=None)
    batch = stages.replayed(SimpleNamespace(cfg=cfg, tracker=None), 0)
    assert published["rollout/reward_mean"] == 0.5 and published["rollout/reward_std"] == 0.0
    assert all(s.reward_key == "format" for g in batch.groups for s in g)


def test_a_subsampled_replay_trains_whole_groups_from_both_ends_and_reports_their_reward(tmp_path, monkeypatch):
    """--load-debug-rollout-data-subsample 0.5 of 5 recorded groups: k = 2, the first and the last group (slime's
    first ⌊k/2⌋ and last ⌈k/2⌉ rows, here whole groups); the batch must be k groups, and the published reward is
    the subsample's, with none of the recording's other rollout metrics."""
    from types import SimpleNamespace

    from engine import model_shape, stages
    from engine.config import RunConfig
    from engine.rollout import replay

    pattern = str(tmp_path / "rollout_{rollout_id}.json")
    groups = _groups(B=5)
    for g, group in enumerate(groups):  # group g's samples all score g % 2
        for smp in group:
            smp.reward = {"score": float(g % 2), "format": 0.5}
    meta = {"hf_checkpoint": "m", "rollout_batch_size": 5, "n_samples_per_prompt": 3, "weight_version": 0}
    replay.save(pattern, 0, groups, {"rollout/reward_mean": 0.4, "rollout/response_len_mean": 2.0}, meta)
    assert [[s.group_index for s in g] for g in replay.subsample(groups, 0.5)] == [[0] * 3, [4] * 3]
    assert [g[0].group_index for g in replay.subsample(groups, 0.7)] == [0, 3, 4]  # k = 3: 1 + 2
    assert replay.subsample(groups, 1.0) == groups

    published = {}
    monkeypatch.setattr(stages, "publish", lambda run, step, m: published.update(m) or m)
    monkeypatch.setattr(model_shape, "read", lambda d: SimpleNamespace(vocab_size=None))
    cfg = SimpleNamespace(load_debug_rollout_data=pattern, rollout_batch_size=2, n_samples_per_prompt=3,
                          model_dir=None, hf_checkpoint="m", reward_key=None, load_debug_rollout_data_subsample=0.5)
    batch = stages.replayed(SimpleNamespace(cfg=cfg, tracker=None), 0)
    assert [g[0].group_index for g in batch.groups] == [0, 4]
    assert published["rollout/reward_mean"] == 0.0 and "rollout/response_len_mean" not in published  # groups 0, 4
    cfg.rollout_batch_size = 5  # the batch arithmetic is the run's: it must be the k groups kept
    with pytest.raises(DiagnosisError, match="the share keeps 2; the run trains 5 groups") as e:
        stages.replayed(SimpleNamespace(cfg=cfg, tracker=None), 0)
    assert "--rollout-batch-size 2 --n-samples-per-prompt 3" in e.value.diagnoses[0].fix
    cfg.load_debug_rollout_data_subsample = 0.1  # int(5 × 0.1) = 0 groups
    with pytest.raises(DiagnosisError, match="a share of at least 0.2"):
        stages.replayed(SimpleNamespace(cfg=cfg, tracker=None), 0)
    with pytest.raises(ConfigError, match="without --load-debug-rollout-data"):
        RunConfig(load_debug_rollout_data_subsample=0.5)
    with pytest.raises(ValueError, match="load_debug_rollout_data_subsample\n.*less than or equal to 1"):
        RunConfig(load_debug_rollout_data=pattern, eval_prompt_data=[], load_debug_rollout_data_subsample=1.5)


def test_dump_details_sets_the_debug_paths_and_refuses_others():
    from engine.config import RunConfig

    cfg = RunConfig(dump_details="/tmp/d/")
    assert cfg.save_debug_rollout_data == "/tmp/d/rollout_data/{rollout_id}.json.gz"
    assert cfg.save_debug_train_data == "/tmp/d/train_data/{rollout_id}_{rank}.pt"
    assert RunConfig.from_dump(cfg.model_dump()) == cfg  # a resumed run's recorded flags pass as they are
    assert RunConfig(dump_details="/tmp/d", debug_rollout_only=True, save=None).save_debug_train_data is None
    replay = RunConfig(dump_details="/tmp/d", load_debug_rollout_data="/tmp/r/{rollout_id}.json")
    assert replay.save_debug_rollout_data is None and replay.save_debug_train_data.startswith("/tmp/d/")
    with pytest.raises(ConfigError, match="--dump-details /tmp/d writes --save-debug-train-data"):
        RunConfig(dump_details="/tmp/d", save_debug_train_data="/x/{rollout_id}.pt")
