"""The whole megatron backend (engine/train/megatron_backend.py: DDP, the distributed optimizer, the steps, save and
load, the weights it sends) on CPU processes over gloo, for what no one-GPU machine can run: expert parallelism.

Runs only where megatron-core is installed (`pip install --no-deps megatron-core==0.16.1` works on a CPU machine).
megatron-core assumes CUDA in a few places that do not change the math; each child process replaces exactly these:
`torch.cuda.current_device()` / `set_device` / `device_count` / `synchronize`, tensor factories asked for
`device="cuda"` in the few megatron-core modules that do (the optimizer's overflow buffer; _CUDA_TENSORS),
`Tensor.type()` names (the distributed optimizer accepts only `torch.cuda.*Tensor` parameters), `Tensor.cuda()`
(kept on the host), the
model-parallel RNG tracker (on the CPU generator), the alltoall dispatcher's side stream
(tests/test_megatron_cpu_model.py: _host_streams), and the backend's own "needs CUDA" guard.

Checked: two data-parallel ranks with --expert-model-parallel-size 2 (experts 0–1 on rank 0, 2–3 on rank 1) give
the log-probs, three GRPO steps' losses and grad norms, and the weights sent to the engines of the same two ranks
without it (EP = 1); a checkpoint saved after those steps, loaded into the same backend and into a new one, goes on
with the steps of the run that never stopped; no-grad forwards with fewer micro-batches on one rank still run (the
backend evens them out), a train step with fewer is refused by name instead of hanging.

And tests/test_megatron_backend.py's GPU tests that need no CUDA kernel run here as they are (GPU_TESTS_ON_CPU):
the megatron backend against the torch backend step by step in fp32, for the dense model, the three mixtures of
experts, --use-routing-replay, --use-rollout-routing-replay, slime's loss types and hooks, and kept weights.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent))
from conftest import spawn_ranks  # noqa: E402
from test_megatron_cpu_model import _host_streams, rendezvous  # noqa: E402


#: megatron-core's modules that make tensors with device="cuda" on the steps' path
_CUDA_TENSORS = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                 "megatron.core.optimizer.grad_scaler", "megatron.core.distributed.param_and_grad_buffer",
                 "megatron.core.dist_checkpointing.exchange_utils",
                 "megatron.core.dist_checkpointing.strategies.state_dict_saver",
                 "megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.utils",
                 "megatron.core.rerun_state_machine", "megatron.core.utils", "megatron.core.transformer.utils",
                 "megatron.core.transformer.moe.moe_utils", "megatron.core.tensor_parallel.data")


class _HostTorch:
    """`torch` for one of _CUDA_TENSORS: its factories make on the host what it asks for on "cuda"."""

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in ("tensor", "empty", "zeros", "ones", "full", "empty_like"):
            return attr

        def on_host(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return attr(*a, **k)

        return on_host


def _cpu_megatron() -> None:
    """See the module docstring: what a CPU process changes for megatron-core (math untouched)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = lambda *a, **k: None
    import importlib

    for module in _CUDA_TENSORS:  # their own `torch`: replacing torch's factories process-wide made transformers'
        importlib.import_module(module).torch = _HostTorch()  # MoE forward read garbage (seen: NaN log-probs)
    type_name = torch.Tensor.type

    def cuda_type_name(self, *a, **k):
        t = type_name(self, *a, **k)
        return t.replace("torch.", "torch.cuda.", 1) if not (a or k or t.startswith("torch.cuda.")) else t

    torch.Tensor.type = cuda_type_name
    torch.Tensor.cuda = lambda self, *a, **k: self  # (the optimizer's fully_reshardable gather sends from "cuda")
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    from engine.train import megatron_backend

    megatron_backend.require_megatron = lambda: None
    _host_streams()


def _rank(rank: int, world: int, init: str, flags: dict, hf: str, work: str, out: dict) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    _cpu_megatron()
    from test_megatron_backend import _micro_batches

    from engine.config import RunConfig
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.megatron_model import Kernels

    cfg = RunConfig(hf_checkpoint=hf, train_backend="megatron", actor_num_gpus_per_node=world, lr=1e-3,
                    rollout_batch_size=4, n_samples_per_prompt=4, micro_batch_size=2, work_dir=work, **flags)
    ep = cfg.expert_model_parallel_size
    # the compiled and CUDA-only kernels off (Kernels: each leaves the math unchanged)
    kernels = Kernels(fused_log_probs=False, fused_swiglu=False, fused_adam=False, wgrad_fusion=False,
                      cuda_graphs=False)

    def backend():
        return MegatronBackend(cfg, rank=rank, world_size=world, params_dtype="float32", kernels=kernels)

    b = backend()
    mbs = _micro_batches()[rank::world]  # 4 micro-batches of 2 samples: 2 a rank
    old = b.compute_log_probs(mbs)
    res: dict = {"lp": [x.clone() for x in old], "steps": []}
    for _ in range(3):
        m = b.train_step(mbs, old, old, 8)
        res["steps"].append((m["loss_total"], m["grad_norm"]))
    res["state"] = b.engine_state()  # rank 0: the HF-named weights the engines get
    ck = f"{work}/ck_ep{ep}"
    b.save(ck)
    if ep == 1:  # also in the format that loads into any layout, gathered over gloo onto DP rank 0
        b.cfg, kept = cfg.model_copy(update={"dist_ckpt_optim_fully_reshardable": True,
                                             "distrib_optim_fully_reshardable_mem_efficient": True}), b.cfg
        b.save(f"{work}/ck_ep1_full")
        b.cfg = kept
    res["on"] = [b.train_step(mbs, old, old, 8)["loss_total"] for _ in range(2)]
    b.load(ck)
    res["reloaded"] = [b.train_step(mbs, old, old, 8)["loss_total"] for _ in range(2)]
    fresh = backend()  # a resumed run: a new backend, then its checkpoint
    fresh.load(ck)
    res["resumed"] = [fresh.train_step(mbs, old, old, 8)["loss_total"] for _ in range(2)]
    if ep > 1:  # the EP = 1 run's checkpoint (the first spawn's), resumed at EP = 2
        other = backend()
        try:
            other.load(f"{work}/ck_ep1")
        except RuntimeError as e:
            res["layout_refused"] = str(e)
        other.load(f"{work}/ck_ep1", load_optim=False)  # the weights reshard; Adam starts over
        res["weights_only"] = [other.train_step(mbs, old, old, 8)["loss_total"] for _ in range(2)]
        full = backend()  # the same state saved fully_reshardable: the optimizer state loads at EP = 2 too
        full.load(f"{work}/ck_ep1_full")
        res["full"] = [full.train_step(mbs, old, old, 8)["loss_total"] for _ in range(2)]
    if ep > 1:
        fewer = mbs[:1] if rank == 1 else mbs
        uneven = fresh.compute_log_probs(fewer)
        res["uneven"] = max(float((x - y).abs().max()) for x, y in zip(uneven, fresh.compute_log_probs(fewer)))
        res["uneven_count"] = len(uneven)
        try:
            fresh.train_step(fewer, old, old, 8)
        except RuntimeError as e:
            res["refused"] = str(e)
    out[(ep, rank)] = res
    dist.destroy_process_group()


def test_expert_parallel_backend_equals_data_parallel_and_resumes(tmp_path):
    from safetensors import safe_open
    from test_megatron_backend import _random_moe

    _random_moe("qwen2moe", tmp_path / "hf")  # 4 experts, 2 a token, a gated shared expert, a dense layer 0
    out = mp.Manager().dict()
    for ep in (1, 2):
        spawn_ranks(_rank, args=(2, rendezvous(tmp_path, f"rendezvous-ep{ep}"), {"expert_model_parallel_size": ep},
                                 str(tmp_path / "hf"), str(tmp_path), out), nprocs=2)
    files = set(safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt").keys())
    for rank in (0, 1):
        dp, ep = out[(1, rank)], out[(2, rank)]
        assert max(float((a - b).abs().max()) for a, b in zip(dp["lp"], ep["lp"])) < 1e-6, rank
        for (loss_dp, gn_dp), (loss_ep, gn_ep) in zip(dp["steps"], ep["steps"]):
            assert abs(loss_dp - loss_ep) < 1e-6 and abs(gn_dp - gn_ep) < 1e-6 * gn_dp, (rank, dp["steps"],
                                                                                         ep["steps"])
        for run in (dp, ep):  # a checkpoint goes on exactly as the run that never stopped
            assert run["reloaded"] == run["on"] == run["resumed"], (rank, run["on"], run["reloaded"],
                                                                    run["resumed"])
        assert ep["uneven"] == 0.0 and ep["uneven_count"] == (1 if rank == 1 else 2)
        # another layout: the optimizer state is refused by name, the weights alone load (the same loss as the EP = 1
        # run's first step after its save)
        assert "expert_model_parallel_size 1 in the checkpoint, 2 now" in ep["layout_refused"]
        assert "--no-load-optim" in ep["layout_refused"]
        assert abs(ep["weights_only"][0] - dp["on"][0]) < 1e-6, (ep["weights_only"], dp["on"])
        # saved fully_reshardable (with --distrib-optim-fully-reshardable-mem-efficient: gathered over gloo), the
        # optimizer state loads too: the EP = 1 run's next two losses (without it, the second differs: Adam started
        # over)
        assert max(abs(a - b) for a, b in zip(ep["full"], dp["on"])) < 1e-6, (ep["full"], dp["on"])
        assert abs(ep["weights_only"][1] - dp["on"][1]) > 1e-4, (ep["weights_only"], dp["on"])
        assert "expert parallelism" in ep["refused"] and "1 to 2 micro-batches" in ep["refused"]
    sent_dp, sent_ep = out[(1, 0)]["state"], out[(2, 0)]["state"]
    assert set(sent_ep) == set(sent_dp) == files  # every expert, under the checkpoint's names
    assert max(float((sent_dp[k] - sent_ep[k]).abs().max()) for k in files) < 1e-4
    assert out[(2, 1)]["state"] == {}  # (the gather lands on rank 0)


def _layout_rank(rank: int, world: int, init: str, flags: dict, hf: str, work: str, load_from: str | None,
                 out: dict) -> None:
    """Save after three steps at `flags` (load_from None), in both optimizer formats, then train two more steps; or
    load those saves in this layout: the default format's optimizer state (refused by name, unless this layout is
    the saved one), its weights alone, and the fully_reshardable format's whole state, each then trained two steps.
    Log-probs of all four micro-batches after each."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    _cpu_megatron()
    from megatron.core import parallel_state
    from test_megatron_backend import _micro_batches

    from engine.config import RunConfig
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.megatron_model import Kernels

    cfg = RunConfig(hf_checkpoint=hf, train_backend="megatron", actor_num_gpus_per_node=world, lr=1e-3,
                    rollout_batch_size=4, n_samples_per_prompt=4, micro_batch_size=2, work_dir=work, **flags)

    def backend():
        return MegatronBackend(cfg, rank=rank, world_size=world, params_dtype="float32", kernels=Kernels(
            fused_log_probs=False, fused_swiglu=False, fused_adam=False, wgrad_fusion=False, cuda_graphs=False))

    b = backend()
    every = _micro_batches()  # 4 micro-batches of 2 samples; each data-parallel replica trains its share
    mbs = every[parallel_state.get_data_parallel_rank()::parallel_state.get_data_parallel_world_size()]
    old = b.compute_log_probs(mbs)  # (from the Hugging Face weights, in every layout)

    def two_steps(backend):
        for _ in range(2):
            backend.train_step(mbs, old, old, 8)
        return [x.clone() for x in backend.compute_log_probs(every)]

    res: dict = {"last_stage": parallel_state.is_pipeline_last_stage()}
    if load_from is None:
        for _ in range(3):
            b.train_step(mbs, old, old, 8)
        b.save(f"{work}/ck")
        b.cfg, kept = cfg.model_copy(update={"dist_ckpt_optim_fully_reshardable": True}), b.cfg
        b.save(f"{work}/ck_full")
        b.cfg = kept
        res["lp"] = [x.clone() for x in b.compute_log_probs(every)]
        res["on"] = two_steps(b)
    else:
        try:
            b.load(f"{load_from}/ck")
        except RuntimeError as e:
            res["refused"] = str(e)
        b.load(f"{load_from}/ck", load_optim=False)
        res["lp"] = [x.clone() for x in b.compute_log_probs(every)]
        res["weights_on"] = two_steps(b)
        full = backend()
        full.load(f"{load_from}/ck_full")
        res["full_on"] = two_steps(full)
    out[rank] = res
    dist.destroy_process_group()


def test_a_checkpoint_saved_at_tp2_resumes_at_tp1_and_pp2(tmp_path):
    """dist_checkpointing reshards the weights (TP = 2 → 1 on two ranks: two data-parallel replicas; → PP = 2): the
    same log-probs. The default optimizer format of another layout is refused by name, with --no-load-optim as the
    fix; saved with --dist-ckpt-optim-fully-reshardable, the optimizer state loads into TP = 1 and into PP = 2, and
    two more steps give the log-probs of the run that never stopped (the weights alone give others: Adam started
    over)."""
    from test_megatron_backend import _tiny_qwen2

    _tiny_qwen2(tmp_path / "hf")
    got = {}
    for name, flags, frm in (("save", {"tensor_model_parallel_size": 2}, None),
                             ("tp1", {}, str(tmp_path / "save")),
                             ("pp2", {"pipeline_model_parallel_size": 2}, str(tmp_path / "save"))):
        out = mp.Manager().dict()
        (tmp_path / name).mkdir()
        spawn_ranks(_layout_rank, args=(2, rendezvous(tmp_path, f"rendezvous-{name}"), flags, str(tmp_path / "hf"),
                                        str(tmp_path / name), frm, out), nprocs=2)
        got[name] = dict(out)

    def diff(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    saved = got["save"][0]
    for name, changed in (("tp1", "tensor_model_parallel_size 2 in the checkpoint, 1 now"),
                          ("pp2", "pipeline_model_parallel_size 1 in the checkpoint, 2 now")):
        for rank in (0, 1):
            run = got[name][rank]
            assert changed in run["refused"] and "--no-load-optim" in run["refused"], run["refused"]
            assert "--dist-ckpt-optim-fully-reshardable" in run["refused"]
            if not run["last_stage"]:  # (a first pipeline stage has no log-probs of its own)
                continue
            assert diff(saved["lp"], run["lp"]) < 1e-5, (name, rank)
            assert diff(saved["on"], run["full_on"]) < 1e-5, (name, rank, diff(saved["on"], run["full_on"]))
            assert diff(saved["on"], run["weights_on"]) > 1e-3, (name, rank)
    assert [got["pp2"][r]["last_stage"] for r in (0, 1)] == [False, True]


def _parallel_rank(rank: int, world: int, init: str, flags: dict, hf: str, work: str, routes: bool,
                   out: dict, moved: str | None = None) -> None:
    """Two ranks of one data-parallel replica (TP = 2 or PP = 2 in `flags`): log-probs, three GRPO steps, the
    weights the engines get; routes: the micro-batches carry a random engine routing, replayed
    (--use-rollout-routing-replay); moved (with --use-routing-replay in `flags`): the no-grad forward records the
    routing, then the steps start from these weights (routers moved) and replay it."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    _cpu_megatron()
    from megatron.core import parallel_state
    from test_megatron_backend import _micro_batches

    from engine.config import RunConfig
    from engine.model_shape import read
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.megatron_model import Kernels
    from engine.train.routing import RouteLayout

    cfg = RunConfig(hf_checkpoint=hf, train_backend="megatron", actor_num_gpus_per_node=world, lr=1e-3,
                    rollout_batch_size=4, n_samples_per_prompt=4, micro_batch_size=2, work_dir=work,
                    use_rollout_routing_replay=routes, **flags)
    b = MegatronBackend(cfg, rank=rank, world_size=world, params_dtype="float32", kernels=Kernels(
        fused_log_probs=False, fused_swiglu=False, fused_adam=False, wgrad_fusion=False, cuda_graphs=False))
    mbs = _micro_batches(routes=RouteLayout.of_shape(read(hf)) if routes else None)
    old = b.compute_log_probs(mbs, record_routing=moved is not None)
    if moved is not None:
        b.load_weights(moved)
    res = {"lp": [x.clone() for x in old], "steps": [b.train_step(mbs, old, old, 8) for _ in range(3)],
           "last_stage": parallel_state.is_pipeline_last_stage(), "reports": b.reports_metrics}
    res["state"] = b.engine_state()
    out[rank] = res
    dist.destroy_process_group()


def test_sp_and_pp_steps_equal_the_torch_backends_with_the_engines_routing(tmp_path):
    """Against the torch backend on the same weights and batch, fp32: log-probs, three GRPO steps' loss and grad
    norm, and the weights after them, on two ranks of one replica.
    - --sequence-parallel at TP = 2 (each rank's norms and residuals hold half the tokens; micro-batches of odd
      length padded): the dense model, and a mixture of experts, which megatron-core trains under TP only with
      sequence parallelism: its experts run whole on both TP ranks (their gradients summed over them), the
      engine's routing replayed (--use-rollout-routing-replay: each rank its own tokens); and with
      --expert-model-parallel-size 2 on the same two ranks (an EP group of TP ranks: half the experts each); and
      --use-routing-replay, each TP rank recording its tokens' experts in the no-grad forward and replaying them
      in the steps, from weights whose routers moved.
    - PP = 2 with a mixture of experts whose layers are all MoE (Qwen3-MoE), the engine's routing replayed: each
      stage replays its own layers' routers; the share of routings that differ is summed over the stages."""
    from test_megatron_backend import _micro_batches, _random_moe, _tiny_qwen2

    from engine.config import RunConfig
    from engine.model_shape import read
    from engine.train.routing import RouteLayout
    from engine.train.torch_backend import TorchBackend

    _tiny_qwen2(tmp_path / "dense")
    _random_moe("qwen2moe", tmp_path / "qwen2moe")
    _random_moe("qwen3moe", tmp_path / "qwen3moe")
    assert any(mb.num_tokens % 2 for mb in _micro_batches())  # (the padding runs)
    sp = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    moved = _random_moe("qwen3moe", tmp_path / "moved")
    with torch.no_grad():  # the routers moved: routing afresh picks other experts than the recorded ones
        for n, p in moved.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p) * 0.9)
    moved.save_pretrained(tmp_path / "moved")
    own = {**sp, "use_routing_replay": True}
    for name, model, flags, routes in (("sp", "dense", sp, False), ("sp-moe", "qwen2moe", sp, True),
                                       ("sp-ep-moe", "qwen3moe", {**sp, "expert_model_parallel_size": 2}, True),
                                       ("sp-own-moe", "qwen3moe", own, False),
                                       ("pp-moe", "qwen3moe", {"pipeline_model_parallel_size": 2}, True)):
        hf = str(tmp_path / model)
        replayed = str(tmp_path / "moved") if "use_routing_replay" in flags else None
        out = mp.Manager().dict()
        spawn_ranks(_parallel_rank, args=(2, rendezvous(tmp_path, f"rendezvous-{name}"), flags, hf, str(tmp_path),
                                          routes, out, replayed), nprocs=2)
        tb = TorchBackend(RunConfig(hf_checkpoint=hf, lr=1e-3, rollout_batch_size=4, n_samples_per_prompt=4,
                                    micro_batch_size=2, work_dir=str(tmp_path), use_rollout_routing_replay=routes,
                                    use_routing_replay=replayed is not None))
        mbs = _micro_batches(routes=RouteLayout.of_shape(read(hf)) if routes else None)
        old = tb.compute_log_probs(mbs, record_routing=replayed is not None)
        if replayed is not None:
            tb.load_weights(replayed)
        for rank in (0, 1):
            if out[rank]["last_stage"]:
                assert max(float((a - b).abs().max()) for a, b in zip(out[rank]["lp"], old)) < 1e-5, (name, rank)
        (reporter,) = [out[r] for r in (0, 1) if out[r]["reports"]]
        for step in range(3):
            t, m = tb.train_step(mbs, old, old, 8), reporter["steps"][step]
            assert abs(m["loss_total"] - t["loss_total"]) < 1e-5, (name, step, m["loss_total"], t["loss_total"])
            assert abs(m["grad_norm"] - t["grad_norm"]) < 1e-4 * max(1.0, t["grad_norm"]), (name, step)
            assert out[0]["steps"][step]["grad_norm"] == pytest.approx(out[1]["steps"][step]["grad_norm"], rel=1e-6)
            if routes:  # every rank's routers and tokens counted, as the torch backend counts them all
                assert m["routing_replay_diff_count"] == t["routing_replay_diff_count"] > 0, (name, step, m, t)
                assert m["routing_replay_diff_sum"] == t["routing_replay_diff_sum"], (name, step, m, t)
        mine, sent = tb.engine_state(), out[0]["state"]
        assert set(sent) == set(mine)
        assert max(float((sent[k].float() - mine[k].float()).abs().max()) for k in mine) < 1e-4, name


def _recompute_rank(rank: int, tmp: str, out: dict) -> None:
    """One rank: two GRPO steps without recompute and with each of slime's recompute settings, counting how often
    layer 0 and its core attention run."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=rendezvous(Path(tmp), "rendezvous-recompute"), rank=0, world_size=1)
    _cpu_megatron()
    from test_megatron_backend import _micro_batches, _tiny_qwen2

    from engine.config import RunConfig
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.megatron_model import Kernels

    hf = _tiny_qwen2(Path(tmp) / "hf")
    mbs = _micro_batches()
    for name, flags in (("none", {}), ("activations", {"recompute_activations": True}),
                        ("block", {"recompute_granularity": "full", "recompute_method": "block",
                                   "recompute_num_layers": 1}),
                        ("selective", {"recompute_granularity": "selective"})):
        cfg = RunConfig(hf_checkpoint=hf, train_backend="megatron", lr=1e-3, rollout_batch_size=4,
                        n_samples_per_prompt=4, micro_batch_size=2, work_dir=tmp, **flags)
        b = MegatronBackend(cfg, rank=0, world_size=1, params_dtype="float32", kernels=dataclasses.replace(
            Kernels.of(cfg), fused_log_probs=False, fused_swiglu=False, fused_adam=False, wgrad_fusion=False,
            cuda_graphs=False))
        runs = {"layer0": 0, "layer1": 0, "attention0": 0}
        layers = b.gpt.decoder.layers
        for key, module in (("layer0", layers[0]), ("layer1", layers[1]),
                            ("attention0", layers[0].self_attention.core_attention)):
            module.register_forward_hook(lambda *_, key=key: runs.__setitem__(key, runs[key] + 1))
        old = b.compute_log_probs(mbs)
        forward_only = dict(runs)
        steps = [b.train_step(mbs, old, old, 8) for _ in range(2)]
        out[name] = {"steps": [(m["loss_total"], m["grad_norm"]) for m in steps],
                     "runs": {k: runs[k] - forward_only[k] for k in runs}}
    dist.destroy_process_group()


def test_slimes_recompute_settings_recompute_what_they_name_and_change_no_number(tmp_path):
    """--recompute-activations (full, uniform, 1 layer), --recompute-granularity full --recompute-method block
    --recompute-num-layers 1 (the first layer only) and --recompute-granularity selective (the core attention only):
    two GRPO steps give the losses and grad norms of the run without recompute, and in the steps the recomputed
    modules run twice per micro-batch (forward, then again in the backward), the others once."""
    out = mp.Manager().dict()
    spawn_ranks(_recompute_rank, args=(str(tmp_path), out), nprocs=1)
    base = out["none"]
    n = base["runs"]["layer0"]  # one forward per micro-batch and step
    assert n > 0 and base["runs"] == {"layer0": n, "layer1": n, "attention0": n}
    assert out["activations"]["runs"] == {"layer0": 2 * n, "layer1": 2 * n, "attention0": 2 * n}
    assert out["block"]["runs"] == {"layer0": 2 * n, "layer1": n, "attention0": 2 * n}
    assert out["selective"]["runs"] == {"layer0": n, "layer1": n, "attention0": 2 * n}
    for name in ("activations", "block", "selective"):
        for (loss, gn), (loss0, gn0) in zip(out[name]["steps"], base["steps"]):
            assert abs(loss - loss0) < 1e-6 and abs(gn - gn0) < 1e-6 * max(1.0, gn0), (name, loss, loss0, gn, gn0)


#: tests/test_megatron_backend.py's GPU tests that run unchanged on this harness (fp32, one rank), with the family
#: where they take one. Not here: the second half of test_gpu_megatron_log_probs_chunk_size_takes_the_plain_steps
#: (bf16 decoder CUDA graphs) and test_megatron_graphs.py (CUDA graphs).
GPU_TESTS_ON_CPU = [
    ("test_gpu_megatron_steps_equal_torch_steps_in_fp32", None),
    *[(name, family) for name in ("test_gpu_megatron_moe_steps_equal_torch_steps_in_fp32",
                                  "test_gpu_megatron_routing_replay_equals_the_torch_backends",
                                  "test_gpu_megatron_rollout_routing_replay_equals_the_torch_backends")
      for family in ("qwen3moe", "mixtral", "qwen2moe")],
    ("test_gpu_megatron_has_the_torch_backends_loss_types_opsm_opd_ref_update_and_reset", None),
    ("test_gpu_megatron_scores_with_kept_weights_and_restores_its_own", None),
]


def _gpu_tests(rank: int, tmp: str, out: dict) -> None:
    """Every GPU_TESTS_ON_CPU case in this one process, one after another as pytest runs them on a GPU; out gets
    None or the traceback of each."""
    import traceback

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=rendezvous(Path(tmp)), rank=0, world_size=1)
    _cpu_megatron()
    import test_megatron_backend
    from conftest import small_configs

    from engine.train.megatron_backend import MegatronBackend
    from engine.train.megatron_model import Kernels

    # the tests' MegatronBackend(cfg, params_dtype=...) takes the default kernels: the CPU ones instead (the
    # compiled log-softmax, fused Adam and wgrad GEMM leave the math unchanged; bench/results/gpu_megatron.md)
    MegatronBackend.__init__.__kwdefaults__["kernels"] = Kernels(
        fused_log_probs=False, fused_swiglu=False, fused_adam=False, wgrad_fusion=False, cuda_graphs=False)
    for name, family in GPU_TESTS_ON_CPU:
        where = Path(tmp) / f"{name}-{family}"
        where.mkdir()
        try:
            getattr(test_megatron_backend, name)(tmp_path=where, small_cfg=small_configs(where),
                                                 **({"family": family} if family else {}))
            out[(name, family)] = None
        except BaseException:  # noqa: BLE001 (reported by the case's own test)
            out[(name, family)] = traceback.format_exc()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gpu_tests_on_cpu(tmp_path_factory) -> dict:
    """One process runs them all (the harness replaces CUDA calls process-wide; one start-up instead of 13)."""
    out = mp.Manager().dict()
    spawn_ranks(_gpu_tests, args=(str(tmp_path_factory.mktemp("gpu_tests")), out), nprocs=1)
    return dict(out)


@pytest.mark.parametrize("name,family", GPU_TESTS_ON_CPU,
                         ids=[n.removeprefix("test_gpu_megatron_")[:40] + (f"-{f}" if f else "")
                              for n, f in GPU_TESTS_ON_CPU])
def test_the_gpu_tests_of_the_megatron_backend_on_cpu(name, family, gpu_tests_on_cpu):
    """tests/test_megatron_backend.py's GPU test `name` as it runs on a GPU: the megatron backend against the torch
    backend, step by step (here fp32 on the CPU harness)."""
    assert gpu_tests_on_cpu[(name, family)] is None, gpu_tests_on_cpu[(name, family)]
