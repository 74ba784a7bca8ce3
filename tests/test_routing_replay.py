"""--use-routing-replay (engine/train/routing.py): the experts each token went to in the policy's no-grad forward
before the steps are the experts of every training forward of that rollout, with the current router's weights at
them. CPU, the torch backend on tests/model_families.py's random mixtures of experts; the Megatron backend's replay
is checked against this one on a GPU (tests/test_megatron_backend.py)."""
from __future__ import annotations

import pytest
import torch
from train_fakes import fake_samples, pack

from engine.diagnosis import ConfigError

FAMILIES = ("qwen3moe", "mixtral", "qwen2moe")  # tests/model_families.py
LENGTHS = [(4, 3), (4, 5), (6, 2), (6, 6), (3, 4), (3, 7), (5, 3), (5, 5)]


def _model(family: str, path, tiny_model: str) -> str:
    from model_families import save_model

    return save_model(path / family, family, tiny_model)


def _routers(model):
    from engine.train.routing import routers

    return routers(model)


def _experts_seen(model) -> tuple[list[torch.Tensor], list]:
    """Each experts module's top-k indices, per forward, in call order (hooks to remove after)."""
    seen: list[torch.Tensor] = []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts
    return seen, [m.register_forward_pre_hook(lambda m, args: seen.append(args[1].detach().clone()))
                  for m in experts]


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_weights_are_the_routers_own_at_its_own_choice(family):
    """Given the experts a router chose itself, the replayed weights are its weights (softmax, top k, renormalised
    where it renormalises: Mixtral always, Qwen with norm_topk_prob)."""
    from model_families import random_model

    from engine.train.routing import replayed_weights

    model = random_model(family, 101)
    for norm in (False, True):
        for router in _routers(model):
            if hasattr(router, "norm_topk_prob"):
                router.norm_topk_prob = norm
            h = torch.randn(9, model.config.hidden_size)
            logits, weights, idx = router(h)
            again = replayed_weights(logits, idx, renormalise=getattr(router, "norm_topk_prob", True),
                                     dtype=weights.dtype)
            assert torch.allclose(again, weights, atol=1e-6, rtol=0), (family, norm)
            if family != "mixtral":
                other = replayed_weights(logits, idx, renormalise=not norm, dtype=weights.dtype)
                assert not torch.allclose(other, weights, atol=1e-4)  # the flag matters: the check can fail


@pytest.mark.parametrize("family", FAMILIES)
def test_the_steps_train_on_the_recorded_experts_with_the_routers_current_weights(family, tmp_path, small_cfg,
                                                                                  tiny_model):
    from engine.train.torch_backend import TorchBackend

    path = _model(family, tmp_path, tiny_model)
    cfg = small_cfg(hf_checkpoint=path, use_routing_replay=True, lr=1e-3)
    samples = fake_samples(LENGTHS, n=4, seed=3, vocab=101)
    mbs = pack(samples, [[0, 1], [2, 3], [4, 5], [6, 7]])
    g = torch.Generator().manual_seed(0)
    for mb in mbs:
        mb.advantages = torch.randn(mb.num_tokens, generator=g) * mb.loss_mask
    tb = TorchBackend(cfg)
    old = tb.compute_log_probs(mbs, record_routing=True)
    layers = len(_routers(tb.model))
    assert layers == (1 if family == "qwen2moe" else 2)  # Qwen2-MoE's layer 0 is dense
    recorded = {k: [i.long() for i in v] for k, v in tb.routes.by_mb.items()}
    assert len(recorded) == len(mbs) and all(len(v) == layers for v in recorded.values())

    # Without a change of weights, replaying is the same step as routing afresh.
    plain = TorchBackend(small_cfg(hf_checkpoint=path, lr=1e-3))
    assert plain.router_hooks is None
    a, b = tb.train_step(mbs, old, None, 8), plain.train_step(mbs, old, None, 8)
    assert a["loss_total"] == pytest.approx(b["loss_total"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)

    # Routers moved far enough that routing afresh picks other experts for some tokens: the step still uses the
    # recorded ones, and the routers still get gradients (their weights move).
    with torch.no_grad():
        for r in _routers(tb.model):
            r.weight.add_(torch.randn_like(r.weight) * 3 * r.weight.std())
    before = [r.weight.detach().clone() for r in _routers(tb.model)]
    seen, hooks = _experts_seen(tb.model)
    tb.train_step(mbs, old, None, 8)
    replayed = list(seen)
    seen.clear()
    tb.compute_log_probs(mbs)  # afresh (not recording, not replaying)
    afresh = list(seen)
    for h in hooks:
        h.remove()
    want = [i for mb in mbs for i in recorded[(tuple(mb.sample_ids), mb.num_tokens)]]
    assert len(replayed) == len(want) == len(afresh)
    assert all(torch.equal(g, w) for g, w in zip(replayed, want))
    assert any(not torch.equal(g, w) for g, w in zip(afresh, want))  # replay mattered
    assert all(not torch.equal(r.weight, w) for r, w in zip(_routers(tb.model), before))

    # A micro-batch the no-grad forward did not see is refused by name.
    other = pack(samples, [[0, 2], [1, 3], [4, 5], [6, 7]])
    with pytest.raises(RuntimeError, match=r"no recorded routing for the micro-batch of samples \[0, 2\]"):
        tb.train_step(other, old, None, 8)


@pytest.mark.parametrize("old_from, records", [("forward", True), ("rollout", True), ("train", False)])
def test_the_worker_records_in_the_forward_before_the_steps_also_with_rollout_log_probs(old_from, records, tmp_path,
                                                                                        tiny_model):
    """--use-rollout-logprobs has no old-log-prob forward of its own; with --use-routing-replay the policy's forward
    runs to record the routing. The torch backend's on-policy step ("train") is the old policy: nothing to record."""
    from engine.config import RunConfig
    from engine.train.worker import TrainWorker

    cfg = RunConfig(hf_checkpoint=_model("qwen3moe", tmp_path, tiny_model), rollout_batch_size=2,
                    n_samples_per_prompt=4, global_batch_size=8, micro_batch_size=2, use_routing_replay=True)
    w = TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=2, threads=1)
    samples = fake_samples(LENGTHS, n=4, seed=3, vocab=101)
    steps = [pack(samples, [[0, 1], [2, 3], [4, 5], [6, 7]])]
    w.backend.routes.by_mb[("stale",)] = []  # a previous rollout's routing is dropped
    w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False, old_from=old_from)
    assert len(w.backend.routes.by_mb) == (4 if records else 0)
    w.train_step(0, 8)


def test_routing_replay_is_refused_where_it_cannot_replay(small_cfg, tiny_model, tmp_path):
    from engine.doctor.checks import Environment, routing_replay_has_routers

    with pytest.raises(ConfigError, match="--log-probs-max-tokens-per-gpu"):
        small_cfg(use_routing_replay=True, use_dynamic_batch_size=True, max_tokens_per_gpu=64,
                  log_probs_max_tokens_per_gpu=128)
    with pytest.raises(ConfigError, match="with --loss-type sft_loss: there is no old policy's forward"):
        small_cfg(use_routing_replay=True, loss_type="sft_loss")
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 2 and --recompute-activations"):
        small_cfg(use_routing_replay=True, train_backend="megatron", pipeline_model_parallel_size=2,
                  recompute_activations=True)
    small_cfg(use_routing_replay=True, train_backend="megatron", pipeline_model_parallel_size=2)  # (each stage its own)
    env = Environment(gpus=0.0)
    (d,) = routing_replay_has_routers(small_cfg(use_routing_replay=True), env)  # the bundled Qwen2: dense
    assert d.code == "MODEL" and "has no experts" in d.what and d.fix == "drop --use-routing-replay"
    moe = _model("qwen2moe", tmp_path, tiny_model)
    assert routing_replay_has_routers(small_cfg(use_routing_replay=True, hf_checkpoint=moe), env) == []
    assert routing_replay_has_routers(small_cfg(hf_checkpoint=tiny_model), env) == []
