"""Engines on real Ray: placement-group bundles (fake GPU counts), one port allocator, restart of a killed engine
with weight re-sync while the rollout still completes, and the SGLang launcher inside an engine actor."""
from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from engine.cluster import worker_env

    ray.shutdown()  # a cluster of its own (fake GPUs)
    ray.init(address="local", num_cpus=2, num_gpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": worker_env()})
    yield
    ray.shutdown()


KEY = "ray-test-key"  # a run's engines answer only to its own token
AUTH = {"Authorization": f"Bearer {KEY}"}


def _group(tiny_model, tmp_path, *, kind="builtin", python=None, rollout_gpus=2):
    from engine.cluster import port_registry
    from engine.cluster.placement import place, rollout_layout
    from engine.rollout.engines import EngineGroup
    from engine.rollout.actor import EngineSpec

    # decoupled: 1 train GPU (bundle 0) + rollout GPUs on bundles 1.., one GPU per engine
    layout = rollout_layout(cluster_gpus=8, train_gpus=1, colocate=False, rollout_num_gpus=rollout_gpus,
                            gpus_per_engine=1, num_engines=1)
    spec = EngineSpec(kind=kind, model_path=tiny_model, log_dir=str(tmp_path / "logs"), threads=1, max_new_tokens=8,
                      python=python, start_timeout_s=180, api_key=KEY)
    pl = place(layout, timeout_s=60)
    return EngineGroup(spec, pl, port_registry()).start(), pl


def _logprobs(url: str, seq: list[int]) -> torch.Tensor:
    r = httpx.post(url + "/generate", json={"input_ids": seq, "return_logprob": True, "logprob_start_len": 0,
                                            "sampling_params": {"max_new_tokens": 0}}, headers=AUTH, timeout=60).json()
    return torch.tensor([t[0] for t in r["meta_info"]["input_token_logprobs"][1:]])


@pytest.fixture(scope="module")
def two_engines(ray_cluster, tiny_model, tmp_path_factory):
    from ray.util.placement_group import remove_placement_group

    group, pl = _group(tiny_model, tmp_path_factory.mktemp("engines"))
    yield group
    group.stop()
    remove_placement_group(pl.pg)


def test_engines_on_their_bundles_with_distinct_gpus_and_ports(two_engines):
    from engine.rollout.ports import PortRegistry

    group = two_engines
    infos = [s.info for s in group.slots]
    assert [s.bundle for s in group.slots] == [1, 2]
    assert group.wait_started() is group and [s.info for s in group.slots] == infos  # again: nothing to wait for
    gpus = [i["gpu_ids"] for i in infos]
    assert all(len(g) == 1 for g in gpus) and gpus[0] != gpus[1]  # each on its own (fake) GPU
    ports = [p for i in infos for p in i["ports"]]
    assert len(set(ports)) == len(ports) == 2 and infos[0]["node"] == infos[1]["node"]  # RF08: no collision
    handed = PortRegistry().handed_out()  # the cluster's store, as the engines' processes wrote it
    assert set(ports) <= set(handed[infos[0]["node"]])
    for url in group.serving():
        r = httpx.post(url + "/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 2}},
                       headers=AUTH, timeout=60)
        assert r.status_code == 200


def test_the_cluster_port_registry_is_shared_by_concurrent_processes_without_collisions(ray_cluster):
    """RF08 across processes: four Ray tasks reserve ports on one node at once through the cluster's key-value
    store (no actor of its own); no port is handed out twice, and the driver sees every one of them."""
    import ray

    from engine.rollout.ports import PortRegistry

    node = f"test-node-{os.getpid()}"

    @ray.remote(num_cpus=0)
    def take(registry, k):
        return [p for _ in range(k) for p in registry.reserve(node, 1)]

    got = ray.get([take.remote(PortRegistry(), 25) for _ in range(4)], timeout=120)
    flat = [p for ports in got for p in ports]
    assert len(flat) == 100 and len(set(flat)) == 100
    assert set(flat) <= set(PortRegistry().handed_out()[node])


def test_an_engine_actor_starts_up_without_the_collector_and_turns_it_back_on(two_engines):
    """Each engine actor's process imports torch and transformers and loads the model with the cyclic collector off
    (engine/startgc.py); when `start` returns it is back on, with what start-up built frozen out of its walks."""
    from test_prestart import _gc_state

    for s in two_engines.slots:
        enabled, frozen, env = _gc_state(s.actor)
        assert enabled and frozen > 100_000 and env is None, (s.index, enabled, frozen, env)


def test_killed_engine_is_restarted_resynced_and_the_rollout_completes(two_engines, tiny_model):
    from engine.config.data import BUNDLED_TRAIN
    from engine.data import PromptDataset, load_prompts
    from engine.modeling import load_causal_lm, load_tokenizer, render_prompt
    from engine.rewards import RewardModel
    from engine.rollout.health import HealthMonitor
    from engine.rollout.loop import Prompt, SamplingParams, generate_rollout
    import ray

    from engine.weights import numpy_state
    from engine.weights.sync import push_object_store

    # the "trainer": weights that differ from the checkpoint, synced as version 3 through Ray's object store
    model = load_causal_lm(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tok = load_tokenizer(tiny_model)
    seq = tok("<|im_start|>user\n57+38=<|im_end|>\n<|im_start|>assistant\n95", add_special_tokens=False)["input_ids"]

    group = two_engines
    group.fault_tolerant = True
    ref = ray.put(numpy_state(state))
    group.resync = lambda slots: push_object_store(slots, ref, 3, timeout_s=60)
    # it sleeps until the rollout loop reports a failure (a check at start could run after the kill below, on a
    # loaded machine, and restart the engine before any request reached it: seen once, 0 retried requests)
    monitor = HealthMonitor(group, interval_s=1000, timeout_s=10, first_wait_s=1000).start()
    try:
        push_object_store(group.serving_slots(), ref, 3, timeout_s=60)
        with torch.no_grad():  # the engines serve exactly the trainer's weights
            logits = model(torch.tensor([seq])).logits[0].float()
        direct = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
        assert (_logprobs(group.slots[1].url, seq) - direct).abs().max() < 1e-4
        dead = group.slots[0]
        old_url, old_pid = dead.url, dead.info["pid"]
        os.kill(old_pid, signal.SIGKILL)  # the engine's actor process dies; nobody has told the group yet

        ds = PromptDataset(load_prompts(BUNDLED_TRAIN, input_key="prompt", label_key="label"), shuffle=False, seed=0)
        res = generate_rollout(lambda k: [Prompt(r, render_prompt(tok, r.prompt, True)) for r in ds.next_batch(k)],
                               rollout_id=0, batch_size=6, n=4, seed=1, engines=group, timeout_s=240,
                               params=SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[258]),
                               reward_model=RewardModel("exact_match", None))
        assert [len(g) for g in res.groups] == [4] * 6 and res.stats["retried_requests"] >= 1
        assert all(s.metadata["weight_version"] == "3" for g in res.groups for s in g)

        deadline = time.monotonic() + 180
        while dead.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dead.restarts == 1 and dead.serving and dead.url != old_url and dead.info["pid"] != old_pid
        # served again only after the re-sync: the same version and the same log-probs as the other engine
        assert httpx.get(dead.url + "/weight_version", headers=AUTH).json()["weight_version"] == "3"
        other = group.slots[1].url
        assert (_logprobs(dead.url, seq) - _logprobs(other, seq)).abs().max() < 1e-5

        # the periodic check finds a dead engine that nobody reported
        os.kill(group.slots[1].info["pid"], signal.SIGKILL)
        monitor.check_once()
        assert group.slots[1].restarts == 1 and len(group.serving()) == 2 and monitor.errors == []
    finally:
        monitor.stop()


def test_a_retried_rollout_first_revives_a_dead_engine_without_fault_tolerance(two_engines):
    group = two_engines
    group.fault_tolerant, group.resync = False, None
    victim = group.slots[1]
    old_pid, restarts = victim.info["pid"], victim.restarts
    os.kill(old_pid, signal.SIGKILL)
    time.sleep(0.5)
    assert group.revive(timeout_s=10) == [1]  # the healthy engine 0 is left alone
    assert victim.serving and victim.info["pid"] != old_pid and victim.restarts == restarts + 1
    assert group.revive(timeout_s=10) == [] and len(group.serving()) == 2


def _pg_state(name: str) -> set[str]:
    from ray.util.placement_group import placement_group_table

    return {row["state"] for row in placement_group_table().values() if row["name"] == name}


def test_placement_busy_vs_infeasible_and_the_pending_group_is_removed(two_engines):
    """8 fake GPUs, 3 held by the two engines' group: asking for 8 is busy (they exist), a 9-GPU bundle never fits;
    either way the pending group is removed so it cannot take GPUs later."""
    from engine.cluster.placement import Layout, PlacementBusy, PlacementInfeasible, place

    t0 = time.monotonic()
    with pytest.raises(PlacementBusy) as busy:
        place(Layout(bundles=[{"GPU": 1.0}] * 8, engine_bundles=[0]), timeout_s=1.5, name="rf02-busy")
    d = busy.value.diagnoses[0]
    assert d.code == "RF02" and busy.value.retryable and d.facts["scheduling_state"] == "NO_RESOURCES"
    assert "5 of the cluster's 8 GPUs are free" in d.what and "--placement-retries" in d.fix
    with pytest.raises(PlacementInfeasible) as never:
        place(Layout(bundles=[{"GPU": 9.0}], engine_bundles=[0]), timeout_s=1.5, name="rf02-never")
    assert not never.value.retryable and "INFEASIBLE" in never.value.diagnoses[0].what
    assert time.monotonic() - t0 < 30
    assert _pg_state("rf02-busy") == {"REMOVED"} and _pg_state("rf02-never") == {"REMOVED"}


def test_leftover_groups_of_an_earlier_attempt_are_removed(ray_cluster):
    from ray.util.placement_group import placement_group

    from engine.cluster.placement import remove_leftovers

    placement_group([{"GPU": 1.0}] * 20, name="rollflow-crashed")  # pending forever: would grab GPUs once free
    placement_group([{"CPU": 0.01}], name="someone-else")
    assert remove_leftovers("rollflow-crashed") == 1
    assert _pg_state("rollflow-crashed") == {"REMOVED"} and _pg_state("someone-else") != {"REMOVED"}
    assert remove_leftovers("rollflow-crashed") == 0


def test_sglang_engine_actor_launches_the_server_on_its_gpu_and_ports(ray_cluster, tiny_model, tmp_path):
    from ray.util.placement_group import remove_placement_group

    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} -m engine.rollout.server --threads 1 \"$@\"\n")
    fake.chmod(0o755)
    group, pl = _group(tiny_model, tmp_path, kind="sglang", python=str(fake), rollout_gpus=1)
    try:
        (slot,) = group.slots
        info = slot.info
        port, nccl, dist = info["ports"]
        log = open(info["log"]).read()
        assert f"-m sglang.launch_server --model-path {tiny_model} --host {info['node']} --port {port}" in log
        assert f"--base-gpu-id {info['gpu_ids'][0]} --nccl-port {nccl} --dist-init-addr {info['node']}:{dist}" in log
        assert "--api-key ***" in log and KEY not in log  # the run's token reaches the server, not its log
        assert httpx.post(slot.url + "/generate", json={"text": "2+2="}, timeout=60).status_code == 401
        assert httpx.post(slot.url + "/generate", json={"text": "2+2=", "sampling_params": {"max_new_tokens": 2}},
                          headers=AUTH, timeout=60).status_code == 200
        child = info["child_pid"]
        os.kill(info["pid"], signal.SIGKILL)  # the actor dies; the server it launched lives on in its own session
        time.sleep(1.0)
        assert _running(child)
    finally:
        group.stop()  # kills the orphaned server's process group on its node
        remove_placement_group(pl.pg)
    deadline = time.monotonic() + 30
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(child)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan reparented to a non-reaping init stays a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
