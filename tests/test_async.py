"""Asynchronous RL, piece by piece: the flags and their refusals, the staleness guard, masked importance sampling
(closed form, and in the train worker), and the one-step flow under the Prefect harness (rollout i+1 overlaps
train i; every sample one version old)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import served_engine
from train_fakes import fake_samples, pack

from engine.config import RunConfig
from engine.diagnosis import ConfigError


# ---- flags -------------------------------------------------------------------------------------------------------
def test_async_flags_and_what_they_refuse():
    assert [RunConfig(async_mode=m).staleness_bound for m in ("off", "one-step", "bounded")] == [0, 1, 2]
    assert RunConfig(async_mode="bounded", max_staleness=4).staleness_bound == 4
    with pytest.raises(ConfigError, match="--async-mode one-step with --colocate.*cannot overlap"):
        RunConfig(async_mode="one-step", colocate=True)
    with pytest.raises(ConfigError, match="--async-mode bounded with --offload-train"):
        RunConfig(async_mode="bounded", offload_train=True)
    with pytest.raises(ConfigError, match="--max-staleness 3 bounds --async-mode bounded"):
        RunConfig(async_mode="one-step", max_staleness=3)
    with pytest.raises(ConfigError, match="--partial-rollout pauses rollouts in flight"):
        RunConfig(partial_rollout=True)
    with pytest.raises(ConfigError, match="--partial-rollout with --custom-generate-function-path"):
        RunConfig(async_mode="one-step", partial_rollout=True, custom_generate_function_path="m.f")
    assert RunConfig(async_mode="one-step", partial_rollout=True).partial_rollout
    with pytest.raises(ConfigError, match="--mis-low 2.0 is not below --mis-high 2.0"):
        RunConfig(use_mis=True, mis_low=2.0)


# ---- the staleness guard -----------------------------------------------------------------------------------------
def test_samples_older_than_the_bound_are_never_trained(tiny_model):
    from engine.packing.microbatch import make_micro_batch
    from engine.run import Run
    from engine.stages import sample_version, staleness_guard

    samples = fake_samples([(3, 2)] * 6, n=2)
    versions = ["5", "4", "3", "default", None, "4"]
    for s, v in zip(samples, versions):
        s.metadata["weight_version"] = v
    samples[5].metadata["weight_versions"] = ["2", "4"]  # a partial rollout continued under newer weights
    assert [sample_version(s) for s in samples] == [5, 4, 3, 0, 0, 2]
    run = Run(RunConfig(hf_checkpoint=tiny_model, async_mode="bounded", max_staleness=2))
    m = staleness_guard(run, 5, samples)  # the trainer has trained 5 steps: staleness 0 1 2 5 5 3
    assert [s.remove_sample for s in samples] == [False, False, False, True, True, True]
    assert m == {"async/staleness_mean": pytest.approx(16 / 6), "async/staleness_max": 5.0,
                 "async/stale_dropped": 3.0}
    mb = make_micro_batch(samples, [1.0] * 6)
    assert float(mb.loss_mask.sum()) == 6  # 3 samples × 2 response tokens: the stale ones carry no loss

    on_policy = fake_samples([(3, 2)] * 2, n=2)
    assert staleness_guard(Run(RunConfig(hf_checkpoint=tiny_model)), 7, on_policy) == {}  # off: nothing judged
    assert not any(s.remove_sample for s in on_policy)


# ---- masked importance sampling ----------------------------------------------------------------------------------
def test_mis_mask_closed_form():
    from engine.algorithms.losses import mis_mask

    old = torch.zeros(6)
    rollout = -torch.log(torch.tensor([0.4, 0.5, 1.0, 1.9, 2.0, 3.0]))  # π_old / π_rollout = those ratios
    assert mis_mask(old, rollout, low=0.5, high=2.0).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert mis_mask(old, rollout, low=0.3, high=5.0).tolist() == [1.0] * 6


def _worker(tiny_model, **over):
    from engine.train.worker import TrainWorker

    cfg = RunConfig(hf_checkpoint=tiny_model, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                    micro_batch_size=2, lr=1e-3, num_rollout=1, train_threads=1, **over)
    return TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=2, threads=1)


def test_mis_drops_exactly_the_tokens_out_of_range_in_the_train_step(tiny_model):
    torch.manual_seed(0)
    samples = fake_samples([(4, 5), (3, 6), (5, 4), (4, 3)], n=2, rewards=[1.0, 0.0, 0.0, 1.0])
    steps = [pack(samples, [[0, 1], [2, 3]])]
    probe = _worker(tiny_model)
    probe.set_rollout(copy.deepcopy(steps), [1.0, 0.0, 0.0, 1.0], need_ref=False)
    # the behaviour policy's log-probs: the trainer's, but 3 tokens far off (ratio e^±2 ∉ [0.5, 2])
    far = {(0, 6): 2.0, (0, 12): -2.0, (1, 14): 2.0}
    for j, mb in enumerate(steps[0]):
        mb.rollout_log_probs = probe.old[0][j].clone()
        for (jj, t), d in far.items():
            if jj == j:
                assert mb.loss_mask[t] == 1
                mb.rollout_log_probs[t] -= d
    trained = sum(float(mb.loss_mask.sum()) for mb in steps[0])

    mis = _worker(tiny_model, use_mis=True)
    facts = mis.set_rollout(copy.deepcopy(steps), [1.0, 0.0, 0.0, 1.0], need_ref=False)
    assert facts["mis_masked_share_sum"] == 3 and facts["mis_masked_share_count"] == trained
    for j, mb in enumerate(mis.steps[0]):
        off = [t for (jj, t) in far if jj == j]
        assert all(mb.loss_mask[t] == 0 for t in off) and all(mb.advantages[t] == 0 for t in off)

    wide = _worker(tiny_model, use_mis=True, mis_low=0.1, mis_high=10.0)  # e^±2 inside [0.1, 10]: none masked
    assert wide.set_rollout(copy.deepcopy(steps), [1.0, 0.0, 0.0, 1.0], need_ref=False)["mis_masked_share_sum"] == 0

    # the same as training without MIS on a loss mask with those tokens removed by hand
    by_hand = copy.deepcopy(steps)
    for (j, t) in far:
        by_hand[0][j].loss_mask[t] = 0.0
    plain = _worker(tiny_model)
    plain.set_rollout(by_hand, [1.0, 0.0, 0.0, 1.0], need_ref=False)
    a, b = mis.train_step(0, 4), plain.train_step(0, 4)
    assert a["loss_total"] == pytest.approx(b["loss_total"], rel=1e-6, abs=1e-9)
    for (n1, p1), (_, p2) in zip(mis.backend.model.named_parameters(), plain.backend.model.named_parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=1e-7, msg=n1)


def test_rejection_sampling_veto_and_batch_normalized_tis_in_the_train_step(tiny_model):
    """--use-tis --tis-mode truncate --tis-batch-normalize --use-rs --rs-veto-threshold (slime's mis.yaml) on the
    torch backend: off-range tokens (ratio e^±2 ∉ [0.5, 2]) and a sample with a catastrophic token (e^-12 < 1e-4)
    leave the policy loss while the token counts stay; the other tokens (ratio 1, weight 1) are divided by the
    step's mean truncated weight. The same step as training without them on advantages scaled by hand (at ratio 1
    the clipped surrogate's gradient is linear in A)."""
    torch.manual_seed(0)
    samples = fake_samples([(4, 5), (3, 6), (5, 4), (4, 3)], n=2, rewards=[1.0, 0.0, 0.0, 1.0])
    steps = [pack(samples, [[0, 1], [2, 3]])]
    probe = _worker(tiny_model)
    probe.set_rollout(copy.deepcopy(steps), [1.0, 0.0, 0.0, 1.0], need_ref=False)
    off = {(0, 6): 2.0, (0, 12): -2.0, (1, 14): 2.0, (1, 6): -12.0}  # (1, 6): sample 2, tokens 5–8
    for j, mb in enumerate(steps[0]):
        mb.rollout_log_probs = probe.old[0][j].clone()
        for (jj, t), d in off.items():
            if jj == j:
                assert mb.loss_mask[t] == 1
                mb.rollout_log_probs[t] -= d
    rejected = {(0, 6), (0, 12), (1, 14), (1, 5), (1, 6), (1, 7), (1, 8)}
    trained = sum(float(mb.loss_mask.sum()) for mb in steps[0])  # 18
    mean = (trained - 4 + 2 + math.exp(-2) + 2 + math.exp(-12)) / trained  # truncate: e^2 → 2

    rs = _worker(tiny_model, use_tis=True, tis_mode="truncate", tis_batch_normalize=True, use_rs=True,
                 rs_veto_threshold=1e-4)
    rs.set_rollout(copy.deepcopy(steps), [1.0, 0.0, 0.0, 1.0], need_ref=False)
    assert all(mb.tis_scale == pytest.approx(mean, rel=1e-6) for mb in rs.steps[0])
    by_hand = copy.deepcopy(steps)
    plain = _worker(tiny_model)
    plain.set_rollout(by_hand, [1.0, 0.0, 0.0, 1.0], need_ref=False)
    for j, mb in enumerate(by_hand[0]):
        scale = torch.full_like(mb.advantages, 1 / mean)
        for (jj, t) in rejected:
            if jj == j:
                scale[t] = 0.0
        mb.advantages = mb.advantages * scale
    a, b = rs.train_step(0, 4), plain.train_step(0, 4)
    assert a["rs_rejected_sum"] == 7 and a["rs_vetoed_sum"] == 4 and a["rs_rejected_count"] == trained
    assert a["tis_norm_sum"] / a["tis_norm_count"] == pytest.approx(mean, rel=1e-6)
    assert a["loss_total"] == pytest.approx(b["loss_total"], rel=1e-6, abs=1e-9)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    # the gradients (Adam's first update, ≈ lr·sign(g), would magnify the rounding of near-zero entries)
    for (n1, p1), (_, p2) in zip(rs.backend.model.named_parameters(), plain.backend.model.named_parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-6, msg=n1)


# ---- the one-step flow ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_one_step_async_flow_overlaps_rollout_and_train(prefect_harness, shared_ray, small_cfg):
    from test_orchestration import _runs

    from flows.train import rl_train

    cfg = small_cfg(async_mode="one-step", num_rollout=4, eval_prompt_data="", use_tis=True, use_mis=True,
                    run_name="one-step")
    result = rl_train(cfg)
    h = result["history"]
    assert result["rollouts"] == 4 and result["async_mode"] == "one-step" and result["loop_wall_s"] > 0
    # rollout and training overlap: the engine has a process of its own (--rollout-engine-process auto)
    (eng,), (rank0,) = result["placement"]["engines"], result["placement"]["train"]
    assert not result["placement"]["engine_in_trainer"] and eng["pid"] != rank0["pid"], result["placement"]
    assert [h["async/staleness_max"][str(i)] for i in range(4)] == [0.0, 1.0, 1.0, 1.0]  # rollout 0: on-policy
    assert all(h["async/stale_dropped"][str(i)] == 0.0 for i in range(4))
    assert [h["sync/weight_version"][str(i)] for i in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert "train/mis_masked_share" in h
    fr, trs = _runs(result["flow_run_id"])
    assert fr.state.is_completed()
    runs = {t.name: t for t in trs}
    for i in range(4):
        assert runs[f"rollout-{i}"].run_count == 1 and runs[f"train-{i}"].run_count == 1
    # rollout i+1 started before train i ended: they ran at the same time
    for i in range(3):
        assert runs[f"rollout-{i + 1}"].start_time < runs[f"train-{i}"].end_time


def test_one_step_trains_while_the_engines_load_and_a_retried_sync_pushes_what_was_handed_over(
        prefect_harness, shared_ray, small_cfg, monkeypatch):
    """Step v trains while the engines load the weights v steps made (the trainer handed them over first); the driver
    packs rollout i+1 while step i trains; a sync that fails after the hand-over is retried with the weights that
    were handed over (the same object), not with what the trainer holds by then (it has trained on since)."""
    import time

    from test_orchestration import _runs

    import engine.weights.sync as weight_sync
    from engine import stages
    from flows.train import rl_train

    real_push, real_train = weight_sync.push_object_store, stages.train
    pushes = []  # (version, the weights' object id, start, end, ok)

    def slow_push(slots, ref, version, *, timeout_s):
        t0 = time.time()
        time.sleep(0.3)  # engines that take a while to load
        ok = not (version == 2 and not any(p[0] == 2 for p in pushes))  # the first push of version 2 fails
        if ok:
            real_push(slots, ref, version, timeout_s=timeout_s)
        pushes.append((version, ref.hex(), t0, time.time(), ok))
        if not ok:
            raise RuntimeError("injected: the engines did not take version 2")

    def slow_train(run, packed):
        time.sleep(1.0)  # a step longer than a rollout
        return real_train(run, packed)

    monkeypatch.setattr(weight_sync, "push_object_store", slow_push)
    monkeypatch.setattr(stages, "train", slow_train)
    cfg = small_cfg(async_mode="one-step", num_rollout=4, eval_prompt_data="", run_name="hand-over")
    result = rl_train(cfg)
    h = result["history"]
    assert result["rollouts"] == 4
    assert [h["sync/weight_version"][str(i)] for i in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert [h["async/staleness_max"][str(i)] for i in range(4)] == [0.0, 1.0, 1.0, 1.0]
    v2 = [p for p in pushes if p[0] == 2]
    assert [p[4] for p in v2] == [False, True] and v2[0][1] == v2[1][1], pushes  # the same handed-over weights
    fr, trs = _runs(result["flow_run_id"])
    assert fr.state.is_completed()
    runs = {t.name: t for t in trs}
    assert runs["sync-1"].run_count == 2 and runs["sync-0"].run_count == 1
    loaded = {p[0]: p[3] for p in pushes if p[4]}
    # step v began before the engines had loaded the weights of v steps (not v = 1: the process's first probe has
    # the trainer score what the engines sample, so that hand-over ends after the load)
    for v in (2, 3):
        assert runs[f"train-{v}"].start_time.timestamp() < loaded[v], (v, runs[f"train-{v}"].start_time, loaded)
    for i in (0, 1):  # rollout i+1, generated while step i trained, was packed before that step ended
        assert runs[f"pack-{i + 1}"].start_time < runs[f"train-{i}"].end_time, i


def test_bounded_flow_trains_every_rollout_once_within_its_staleness(prefect_harness, shared_ray, small_cfg):
    """--async-mode bounded --max-staleness 2: several rollouts in flight, a sync only when the engines are idle, the
    next rollout packed during a step; every rollout is trained once and no trained sample is over the bound."""
    from collections import Counter

    from test_orchestration import _runs

    from flows.train import rl_train

    cfg = small_cfg(async_mode="bounded", max_staleness=2, num_rollout=5, eval_prompt_data="", use_tis=True,
                    run_name="bounded")
    result = rl_train(cfg)
    h = result["history"]
    assert result["rollouts"] == 5 and result["async_mode"] == "bounded"
    assert all(h["async/staleness_max"][str(i)] <= 2 for i in range(5)), h["async/staleness_max"]
    assert max(h["async/staleness_max"].values()) >= 1  # rollouts did run ahead of the trainer
    assert all(h["async/stale_dropped"][str(i)] == 0.0 for i in range(5))
    fr, trs = _runs(result["flow_run_id"])
    assert fr.state.is_completed()
    names = Counter(t.name for t in trs)
    for i in range(5):  # one task run each, run once
        assert names[f"rollout-{i}"] == names[f"pack-{i}"] == names[f"train-{i}"] == 1, names
    assert all(t.run_count == 1 and t.state.is_completed() for t in trs if not t.name.startswith("sync-"))


def test_one_step_sync_that_fails_for_good_after_the_hand_over_fails_the_run(prefect_harness, shared_ray, small_cfg,
                                                                               monkeypatch):
    """The trainer trains on after the hand-over; when the engines never take that version (every attempt fails),
    the run fails with the sync's error instead of waiting for weights that never load (the loop waits for them
    while the step trains)."""
    import time

    import engine.weights.sync as weight_sync
    from flows.train import rl_train

    real_push = weight_sync.push_object_store

    def push(slots, ref, version, *, timeout_s):
        if version == 2:
            raise RuntimeError("injected: the engines never take version 2")
        real_push(slots, ref, version, timeout_s=timeout_s)

    monkeypatch.setattr(weight_sync, "push_object_store", push)
    cfg = small_cfg(async_mode="one-step", num_rollout=4, eval_prompt_data="", run_name="sync-fails")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="never take version 2"):
        rl_train(cfg)
    assert time.monotonic() - t0 < 120


# ---- partial rollouts: pause, continue under new weights, resume from a checkpoint's buffer -----------------------
KEY = "adm1n"


@pytest.fixture(scope="module")
def keyed_engine(tiny_model):
    with served_engine(tiny_model, max_new_tokens=64, api_key=KEY) as served:
        yield served


def _perturbed(state, eps: float) -> dict:
    return {k: v.detach().clone() + eps for k, v in state.generator.model.named_parameters()}


def _restore(state, original: dict) -> None:
    state.update_from_named(original, "default")


def _wait_busy(state, steps_after: float = 0.05, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while state.generator.busy_since is None:
        assert time.monotonic() < deadline, "the engine never started the batch"
        time.sleep(0.002)
    time.sleep(steps_after)  # a few decode steps in


def test_pause_generation_aborts_in_flight_and_holds_new_requests_until_continue(keyed_engine):
    """SGLang's /pause_generation (mode abort) and /continue_generation: what runs returns at once with its tokens
    (finish_reason abort); a request sent while paused waits, then runs under the weights loaded meanwhile."""
    import threading

    import httpx

    state, url = keyed_engine
    auth = {"Authorization": f"Bearer {KEY}"}
    ids = state.tokenizer("37+48=", add_special_tokens=False)["input_ids"]
    original = _perturbed(state, 0.0)
    out: dict = {}

    def post(key, max_new):
        out[key] = httpx.post(url + "/generate", headers=auth, timeout=120, json={
            "input_ids": [ids] * 2, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True}}).json()

    long = threading.Thread(target=post, args=("long", 400))
    long.start()
    _wait_busy(state)
    r = httpx.post(url + "/pause_generation", headers=auth, json={"mode": "abort"}).json()
    assert r["success"] is True and r["aborted"] == 2
    long.join(60)
    for o in out["long"]:
        assert o["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < o["meta_info"]["completion_tokens"] < 400 and o["meta_info"]["weight_version"] == "default"
    held = threading.Thread(target=post, args=("held", 3))
    held.start()
    held.join(0.5)
    assert held.is_alive() and "held" not in out  # waits for /continue_generation
    try:
        state.update_from_named(_perturbed(state, 1e-3), "7")
        assert httpx.post(url + "/continue_generation", headers=auth, json={}).json()["success"] is True
        held.join(60)
        assert [o["meta_info"]["weight_version"] for o in out["held"]] == ["7", "7"]
    finally:
        _restore(state, original)
    bad = httpx.post(url + "/pause_generation", headers=auth, json={"mode": "retract"})
    assert bad.status_code == 400 and "mode 'abort' only" in bad.json()["message"]
    assert httpx.post(url + "/pause_generation", json={}).status_code == 401  # an admin endpoint


class _Zero:
    def score_group(self, group):
        for s in group:
            s.reward = 0.0


def _prompts(state, k: int):
    from engine.data import PromptRow
    from engine.rollout.loop import Prompt

    return [Prompt(PromptRow(row=i + 1, prompt=f"{i}+{i}=", label=str(2 * i), metadata={}),
                   state.tokenizer(f"{i}+{i}=", add_special_tokens=False)["input_ids"]) for i in range(k)]


def _scored(state, sample, temperature: float) -> torch.Tensor:
    """log π(response token | prefix) under the engine's current weights, at the sampling temperature."""
    with torch.no_grad():
        logits = state.generator.model(torch.tensor([sample.tokens])).logits[0].float() / temperature
    P = len(sample.tokens) - sample.response_length
    lp = torch.log_softmax(logits[P - 1:-1], -1)
    return lp.gather(-1, torch.tensor(sample.tokens[P:])[:, None]).squeeze(-1)


def test_partial_rollout_continues_paused_samples_under_the_new_weights(keyed_engine):
    """A weight sync in the middle of a rollout: the engine aborts, the loop keeps each sample's tokens and
    continues it under the new weights; every token's log-prob is the one of the weights that generated it, the
    length budget holds across segments, and the buffer records where every sample got. With
    --mask-offpolicy-in-partial-rollout a continued sample trains on its last segment only."""
    import threading

    from engine.rollout.client import EngineClient
    from engine.rollout.loop import PartialBuffer, SamplingParams, StaticEngines, generate_rollout
    from engine.samples import Status

    state, url = keyed_engine
    T, max_new = 1.0, 160  # long enough (~1.5 s) that the pause finds them generating, even on a loaded machine
    original = _perturbed(state, 0.0)
    talkative = _perturbed(state, 0.0)  # EOS's (tied) embedding zeroed: answers run long, a pause finds them mid-way
    talkative["model.embed_tokens.weight"][state.generator.eos_ids[0]] = 0
    state.update_from_named(talkative, "default")
    new = {k: v + 2e-3 for k, v in talkative.items()}
    client = EngineClient(url, api_key=KEY)

    def sync_in_the_middle():
        _wait_busy(state)
        client.pause_generation()
        state.update_from_named(new, "1")
        client.continue_generation()

    buf = PartialBuffer(5)
    buf.mask_offpolicy = True  # --mask-offpolicy-in-partial-rollout
    syncer = threading.Thread(target=sync_in_the_middle)
    syncer.start()
    try:
        prompts = _prompts(state, 2)
        result = generate_rollout(lambda k: [prompts.pop(0) for _ in range(k)], rollout_id=5, batch_size=2, n=4,
                                  params=SamplingParams(max_new_tokens=max_new, temperature=T),
                                  reward_model=_Zero(), seed=3, engines=StaticEngines([url], api_key=KEY),
                                  partial=buf)
        syncer.join(60)
        samples = [s for g in result.groups for s in g]
        continued = [s for s in samples if "weight_versions" in s.metadata]
        new_scores = {}
        assert continued and result.stats["continued"] >= len(continued)
        for s in samples:
            if s not in continued:
                assert s.loss_mask == [1] * s.response_length
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.response_length <= max_new
            assert len(s.rollout_log_probs) == s.response_length == len(s.tokens) - len(prompts_ids(state, s))
        for s in continued:
            assert s.metadata["weight_versions"][0] == "default" and s.metadata["weight_versions"][-1] == "1"
            assert sum(s.metadata["segment_lengths"]) == s.response_length
            last = s.metadata["segment_lengths"][-1]  # only the newest weights' tokens are trained on
            assert s.loss_mask == [0] * (s.response_length - last) + [1] * last
            first = s.metadata["segment_lengths"][0]
            got = torch.tensor(s.rollout_log_probs)
            new_scores[id(s)] = _scored(state, s, T)
            # batched vs alone moves a log-prob by a few 1e-4 here (long rows, engine batching); the two weight
            # versions differ by far more (asserted below), so the tolerance still tells them apart
            torch.testing.assert_close(got[first:], new_scores[id(s)][first:], atol=1e-3, rtol=0)
        state.update_from_named(talkative, "default")
        for s in continued:  # the first segment was generated by the old weights, and carries their log-probs
            first = s.metadata["segment_lengths"][0]
            old_scores = _scored(state, s, T)
            torch.testing.assert_close(torch.tensor(s.rollout_log_probs)[:first], old_scores[:first], atol=1e-3,
                                       rtol=0)
            assert float((old_scores - new_scores[id(s)]).abs().max()) > 1e-2
        snap = buf.snapshot()
        assert snap["rollout_id"] == 5 and len(snap["rows"]) == 8
        assert all(r["finish_reason"]["type"] in ("stop", "length") for r in snap["rows"])
    finally:
        syncer.join(60)
        _restore(state, original)


def prompts_ids(state, s):
    return state.tokenizer(s.prompt, add_special_tokens=False)["input_ids"]


def test_a_rollout_resumed_from_a_checkpoint_buffer_keeps_its_samples(keyed_engine):
    """What a checkpoint kept of a rollout in flight (PartialBuffer.snapshot, JSON): finished samples come back as
    they were, without a request; unfinished ones continue from their tokens."""
    import json

    from engine.rollout.loop import PartialBuffer, SamplingParams, StaticEngines, generate_rollout

    state, url = keyed_engine
    prompts = _prompts(state, 1)
    snap = {"rollout_id": 2, "rows": [
        {"draw": 0, "j": 0, "ids": [5, 6, 7], "logprobs": [-1.0, -2.0, -3.0], "text": "abc", "versions": ["1"],
         "finish_reason": None, "lengths": [3]},
        {"draw": 0, "j": 1, "ids": [8, 9], "logprobs": [-0.5, -0.25], "text": "de", "versions": ["1"],
         "finish_reason": {"type": "stop", "matched": 9}, "lengths": [2]}]}
    buf = PartialBuffer.from_snapshot(json.loads(json.dumps(snap)))
    batches = len(state.scheduler.batch_sizes)
    result = generate_rollout(lambda k: prompts[:k], rollout_id=2, batch_size=1, n=2,
                              params=SamplingParams(max_new_tokens=10, temperature=1.0), reward_model=_Zero(),
                              seed=0, engines=StaticEngines([url], api_key=KEY), partial=buf)
    a, b = result.groups[0]
    assert a.tokens[len(prompts[0].ids):][:3] == [5, 6, 7] and a.rollout_log_probs[:3] == [-1.0, -2.0, -3.0]
    assert a.response.startswith("abc") and 3 < a.response_length <= 10
    assert a.metadata["weight_versions"] == ["1", "default"] and a.metadata["segment_lengths"][0] == 3
    assert b.tokens[len(prompts[0].ids):] == [8, 9] and b.rollout_log_probs == [-0.5, -0.25]
    assert b.metadata["weight_version"] == "1" and "weight_versions" not in b.metadata
    assert len(state.scheduler.batch_sizes) == batches + 1 and state.scheduler.batch_sizes[-1] == 1  # only `a`


@pytest.mark.slow
def test_update_weights_interval_syncs_every_n_rollouts_and_reports_the_staleness(prefect_harness, shared_ray,
                                                                                   small_cfg, tmp_path):
    """slime's --update-weights-interval 2: syncs after rollouts 1 and 3 only; rollouts 1 and 3 are generated by
    weights one version old (async/staleness_max 1, no sample dropped), 0 and 2 by the current ones; the run is
    not stopped by RF14 on the stale rollouts. With --keep-old-actor a stale rollout is scored by the weights that
    generated it."""
    from flows.train import rl_train

    out = rl_train(small_cfg(num_rollout=4, save_interval=2, update_weights_interval=2, eval_prompt_data=[],
                             use_tis=True))
    h = out["history"]
    assert sorted(h["sync/mb"]) == ["1", "3"], sorted(h["sync/mb"])
    assert h["async/staleness_max"] == {"0": 0.0, "1": 1.0, "2": 0.0, "3": 1.0}
    assert set(h["async/stale_dropped"].values()) == {0.0}
    assert sorted(h["train/loss"]) == ["0", "1", "2", "3"]
    mm = h["train/mismatch"]  # the stale rollouts' old log-probs come from the trainer's newer weights
    assert max(mm["0"], mm["2"]) < 1e-5 < 1e-3 < min(mm["1"], mm["3"]), mm

    # --keep-old-actor: rollout 1's old log-probs from the weights that generated it: the mismatch is the
    # engine–trainer difference alone, as on-policy (fp32 noise here)
    kept = rl_train(small_cfg(num_rollout=2, update_weights_interval=2, eval_prompt_data=[], use_tis=True,
                              keep_old_actor=True, save=None, work_dir=str(tmp_path / "kept")))
    assert kept["history"]["async/staleness_max"] == {"0": 0.0, "1": 1.0}
    assert max(kept["history"]["train/mismatch"].values()) < 1e-5, kept["history"]["train/mismatch"]


@pytest.mark.parametrize("kw, says", [
    (dict(async_mode="one-step"), "--async-mode one-step (it schedules its own syncs)"),
    (dict(colocate=True), "--colocate"),
    (dict(save="ck", save_interval=3), "--save-interval 3, not a multiple of 2"),
])
def test_update_weights_interval_refuses_what_it_cannot_keep(kw, says):
    with pytest.raises(ConfigError) as e:
        RunConfig(update_weights_interval=2, **kw)
    assert says in str(e.value), str(e.value)
    assert RunConfig(update_weights_interval=2, save="ck", save_interval=4).staleness_bound == 1


@pytest.mark.parametrize("kw, says", [
    (dict(), "no older weights to keep"),
    (dict(async_mode="one-step", partial_rollout=True), "--partial-rollout"),
    (dict(async_mode="one-step", use_rollout_logprobs=True), "--use-rollout-logprobs"),
    (dict(update_weights_interval=2, loss_type="sft_loss"), "sft_loss"),
])
def test_keep_old_actor_refuses_runs_where_it_would_change_nothing(kw, says):
    from engine.config import RunConfig
    from engine.diagnosis import ConfigError

    with pytest.raises(ConfigError, match="--keep-old-actor") as e:
        RunConfig(keep_old_actor=True, **kw)
    assert says in str(e.value)
    assert RunConfig(keep_old_actor=True, async_mode="bounded").keep_old_actor
