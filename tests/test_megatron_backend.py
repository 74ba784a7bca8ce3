"""The megatron backend: what CPU machines see (a clean import, a clear error), the config it builds, the layout
check; and on a GPU (marked `gpu`, skipped elsewhere) the same losses as the torch backend."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from engine.diagnosis import ConfigError
from engine.doctor.checks import Environment, parallel_layout
from engine.train.megatron_mapping import shape_from_hf_config

QWEN25_1_5B = dict(model_type="qwen2", hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                   intermediate_size=8960, num_hidden_layers=28, vocab_size=151936, tie_word_embeddings=True,
                   rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None,
                               reason="needs CUDA and megatron-core")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cpu_machine_imports_and_gets_the_fix(small_cfg):
    from engine.train import megatron_backend  # imports cleanly: megatron-core is only imported when built

    with pytest.raises(RuntimeError) as e:
        megatron_backend.MegatronBackend(small_cfg(train_backend="megatron"))
    assert "needs CUDA" in str(e.value) and "pip install 'rollflow[megatron]'" in str(e.value)
    assert "--train-backend torch" in str(e.value)


def test_model_kwargs_of_qwen2_5_1_5b():
    from engine.train.megatron_model import Kernels, have_transformer_engine, model_kwargs

    cfg, gpt = model_kwargs(shape_from_hf_config(QWEN25_1_5B), tp=2, pp=1, dtype=torch.bfloat16)
    assert (cfg["num_query_groups"], cfg["kv_channels"], cfg["ffn_hidden_size"]) == (2, 128, 8960)
    assert cfg["add_qkv_bias"] and not cfg["add_bias_linear"] and cfg["gated_linear_unit"] and cfg["bf16"]
    assert cfg["normalization"] == "RMSNorm" and cfg["hidden_dropout"] == cfg["attention_dropout"] == 0.0
    assert cfg["calculate_per_token_loss"] and cfg["perform_initialization"]  # see megatron_model comments
    assert gpt["rotary_base"] == 1_000_000 and gpt["share_embeddings_and_output_weights"]
    assert not gpt["rope_scaling"]
    # Without TE the packed attention rotates q/k itself, so GPTModel must not (else RoPE is applied twice).
    assert gpt["position_embedding_type"] == ("rope" if have_transformer_engine() else "none")
    _, megatron_rope = model_kwargs(shape_from_hf_config(QWEN25_1_5B), tp=1, pp=1, dtype=torch.bfloat16,
                                    kernels=Kernels(rope_in_attention=False))
    assert megatron_rope["position_embedding_type"] == "rope"


def test_layout_check(small_cfg):
    assert parallel_layout(small_cfg(), Environment()) == []
    torch_tp = parallel_layout(small_cfg(tensor_model_parallel_size=2, actor_num_gpus_per_node=2), Environment())
    assert torch_tp[0].code == "CONFIG" and "--train-backend megatron" in torch_tp[0].fix
    odd = parallel_layout(small_cfg(train_backend="megatron", tensor_model_parallel_size=2,
                                    pipeline_model_parallel_size=2, actor_num_gpus_per_node=6), Environment())
    assert "6 train GPUs" in odd[0].what and "multiple of 4" in odd[0].fix


def test_expert_parallelism_is_checked_before_anything_starts(small_cfg, tmp_path):
    """--expert-model-parallel-size: the megatron backend only, a divisor of a pipeline stage's GPUs (the topology
    check) and of the model's experts; a dense model has none to place (the model check)."""
    from engine.doctor.checks import megatron_maps_the_model

    env = Environment()
    (torch_ep,) = parallel_layout(small_cfg(expert_model_parallel_size=2, actor_num_gpus_per_node=2), env)
    assert "--expert-model-parallel-size 2 with --train-backend torch" in torch_ep.what
    assert torch_ep.facts["field"] == "expert_model_parallel_size"
    assert parallel_layout(small_cfg(train_backend="megatron", expert_model_parallel_size=2,
                                     actor_num_gpus_per_node=4), env) == []
    (odd,) = parallel_layout(small_cfg(train_backend="megatron", expert_model_parallel_size=4,
                                       actor_num_gpus_per_node=6, rollout_batch_size=6), env)
    assert "does not divide the 6 GPUs of a pipeline stage" in odd.what and odd.facts["value"] == 4
    # under TP (with --sequence-parallel) an EP group also takes the tensor-parallel ranks: slime's TP 4, EP 8 on 8
    assert parallel_layout(small_cfg(train_backend="megatron", tensor_model_parallel_size=4, sequence_parallel=True,
                                     expert_model_parallel_size=8, actor_num_gpus_per_node=8), env) == []
    (dense,) = megatron_maps_the_model(small_cfg(train_backend="megatron", expert_model_parallel_size=2,
                                                 actor_num_gpus_per_node=2), env)  # the bundled Qwen2
    assert dense.code == "MODEL" and "dense model" in dense.what and dense.fix == "--expert-model-parallel-size 1"
    _random_moe("qwen3moe", tmp_path / "moe")  # 4 experts
    moe = dict(train_backend="megatron", hf_checkpoint=str(tmp_path / "moe"), actor_num_gpus_per_node=6,
               rollout_batch_size=6)
    assert megatron_maps_the_model(small_cfg(expert_model_parallel_size=2, **moe), env) == []
    (three,) = megatron_maps_the_model(small_cfg(expert_model_parallel_size=3, **moe), env)
    assert "does not divide the 4 experts" in three.what and three.facts["num_experts"] == 4
    (tp,) = megatron_maps_the_model(small_cfg(tensor_model_parallel_size=2, **moe), env)
    assert "--expert-model-parallel-size 2" in tp.fix and "sequence parallelism" in tp.what
    assert "--sequence-parallel" in tp.fix
    assert megatron_maps_the_model(small_cfg(tensor_model_parallel_size=2, sequence_parallel=True, **moe), env) == []
    for wrong, words in ((dict(train_backend="megatron", sequence_parallel=True), "--tensor-model-parallel-size 1"),
                         (dict(sequence_parallel=True), "--train-backend torch")):
        with pytest.raises(ConfigError) as e:
            small_cfg(**wrong)
        (d,) = e.value.diagnoses
        assert d.facts["field"] == "sequence_parallel" and words in d.what, d


def test_a_resume_in_another_parallel_layout_is_refused_unless_the_optimizer_starts_over(small_cfg):
    """The Megatron optimizer checkpoint is sharded by TP, PP and EP (megatron-core's dp_reshardable format): the
    manifest records them, and a resume that changes one is RF05 before anything starts, naming --no-load-optim,
    with which it passes (tests/test_megatron_cpu_backend.py loads such weights); the data-parallel size and the
    torch backend's checkpoints may change layout."""
    from engine.doctor.checks import resume_guard

    saved = small_cfg(train_backend="megatron", tensor_model_parallel_size=2, actor_num_gpus_per_node=4)
    manifest = {"settings": saved.fixed_settings()}
    assert manifest["settings"]["megatron_layout"] == {"tensor_model_parallel_size": 2,
                                                       "pipeline_model_parallel_size": 1,
                                                       "expert_model_parallel_size": 1,
                                                       "optim_format": "dp_reshardable"}
    bad = resume_guard(small_cfg(train_backend="megatron", actor_num_gpus_per_node=4), "iter_0000003", manifest)
    assert bad.code == "RF05" and "tensor_model_parallel_size: 2 in the checkpoint, 1 now" in bad.what
    assert "--no-load-optim" in bad.fix and "--allow-config-change" not in bad.fix
    assert resume_guard(small_cfg(train_backend="megatron", actor_num_gpus_per_node=4, load_optim=False),
                        "iter_0000003", manifest) is None
    assert resume_guard(small_cfg(train_backend="megatron", tensor_model_parallel_size=2, actor_num_gpus_per_node=8),
                        "iter_0000003", manifest) is None  # DP 2 → 4
    both = resume_guard(small_cfg(train_backend="megatron", actor_num_gpus_per_node=4, seed=7), "it", manifest)
    assert "--allow-config-change seed" in both.fix and "--no-load-optim" in both.fix
    torch_run = small_cfg(actor_num_gpus_per_node=2)
    assert "megatron_layout" not in torch_run.fixed_settings()
    assert resume_guard(small_cfg(actor_num_gpus_per_node=4), "it", {"settings": torch_run.fixed_settings()}) is None


def test_a_fully_reshardable_optimizer_state_resumes_in_any_layout(small_cfg):
    """--dist-ckpt-optim-fully-reshardable: the manifest records the format, and a resume of such a checkpoint may
    change TP / PP / EP with its optimizer state (tests/test_megatron_cpu_backend.py loads it); a resume that
    does not set the flag loads it the same (the backend reads the format the checkpoint was written in). The flag
    alone where it would change nothing is a CONFIG error naming it."""
    from engine.doctor.checks import resume_guard

    flag = {"dist_ckpt_optim_fully_reshardable": True}
    saved = small_cfg(train_backend="megatron", tensor_model_parallel_size=2, actor_num_gpus_per_node=4, **flag)
    manifest = {"settings": saved.fixed_settings()}
    assert manifest["settings"]["megatron_layout"]["optim_format"] == "fully_reshardable"
    for now in (dict(actor_num_gpus_per_node=4), dict(actor_num_gpus_per_node=4, **flag),
                dict(pipeline_model_parallel_size=2, actor_num_gpus_per_node=4)):
        assert resume_guard(small_cfg(train_backend="megatron", **now), "iter_0000003", manifest) is None, now
    # a resume of the default format, with the flag set now, is still refused: the checkpoint's format counts
    old = {"settings": small_cfg(train_backend="megatron", tensor_model_parallel_size=2,
                                 actor_num_gpus_per_node=4).fixed_settings()}
    bad = resume_guard(small_cfg(train_backend="megatron", actor_num_gpus_per_node=4, **flag), "it", old)
    assert bad.code == "RF05" and "--dist-ckpt-optim-fully-reshardable" in bad.fix and "--no-load-optim" in bad.fix
    for wrong, field, words in (
            (dict(train_backend="torch", **flag), "dist_ckpt_optim_fully_reshardable", "layout-free"),
            (dict(train_backend="megatron", save_optim=False, **flag), "dist_ckpt_optim_fully_reshardable",
             "--no-save-optim"),
            (dict(train_backend="megatron", distrib_optim_fully_reshardable_mem_efficient=True),
             "distrib_optim_fully_reshardable_mem_efficient", "without --dist-ckpt-optim-fully-reshardable"),
            (dict(train_backend="megatron", save=None, **flag), "dist_ckpt_optim_fully_reshardable", "no --save")):
        with pytest.raises(ConfigError) as e:
            small_cfg(**wrong)
        (d,) = e.value.diagnoses
        assert d.facts["field"] == field and words in d.what, d


def test_slimes_recompute_flags_are_checked(small_cfg):
    """--recompute-granularity / --recompute-method / --recompute-num-layers (megatron backend; the CPU harness runs
    them: tests/test_megatron_cpu_backend.py): each combination Megatron cannot take is a CONFIG error naming the
    field; --recompute-activations is the full, uniform, 1-layer case; full recompute (not selective) with pipeline
    parallelism is refused with the routing replays."""
    mg = dict(train_backend="megatron")
    assert small_cfg(recompute_activations=True, **mg).recompute == ("full", "uniform", 1)
    assert small_cfg(recompute_granularity="selective", **mg).recompute == ("selective", None, None)
    assert small_cfg(**mg).recompute is None
    for wrong, field, words in (
            (dict(recompute_granularity="selective"), "recompute_granularity", "--train-backend torch"),
            (dict(recompute_method="block", **mg), "recompute_method", "without --recompute-granularity"),
            (dict(recompute_granularity="full", recompute_method="block", **mg), "recompute_granularity",
             "needs --recompute-method"),
            (dict(recompute_granularity="selective", recompute_num_layers=2, **mg), "recompute_granularity",
             "would do nothing"),
            (dict(recompute_activations=True, recompute_granularity="selective", **mg), "recompute_granularity",
             "already"),
            (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                  use_rollout_routing_replay=True, pipeline_model_parallel_size=2, actor_num_gpus_per_node=2, **mg),
             "recompute_granularity", "--recompute-granularity full")):
        with pytest.raises(ConfigError) as e:
            small_cfg(**wrong)
        (d,) = e.value.diagnoses
        assert d.facts["field"] == field and words in d.what, d
    small_cfg(recompute_granularity="selective", use_rollout_routing_replay=True, pipeline_model_parallel_size=2,
              actor_num_gpus_per_node=2, **mg)


def test_dp_size_counts_replicas_not_gpus(small_cfg):
    cfg = small_cfg(train_backend="megatron", tensor_model_parallel_size=2, actor_num_gpus_per_node=8)
    assert (cfg.train_world_size, cfg.dp_size) == (8, 4)


# ---- GPU ---------------------------------------------------------------------------------------------------
def _tiny_qwen2(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                                         tie_word_embeddings=True))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path)
    return str(path)


def _micro_batches(n_samples: int = 8, per_mb: int = 2, routes=None):
    """routes (an engine.train.routing.RouteLayout): each sample gets a random engine routing, which the
    micro-batches carry (--use-rollout-routing-replay)."""
    from engine.algorithms import grpo_advantages
    from engine.packing.microbatch import make_micro_batch
    from engine.samples import Sample, Status

    g = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, group_index=i // 4, rollout_id=0, prompt="x",
                      tokens=torch.randint(0, 128, (5 + i % 3 + 6 + (5 * i) % 7,), generator=g).tolist(),
                      response_length=6 + (5 * i) % 7, loss_mask=[1] * (6 + (5 * i) % 7),
                      rollout_log_probs=[-4.0] * (6 + (5 * i) % 7), status=Status.COMPLETED, reward=float(i % 3))
               for i in range(n_samples)]
    if routes is not None:
        from engine.train.routing import encode_routes

        for s in samples:
            picks = torch.stack([torch.stack([torch.randperm(routes.num_experts, generator=g)[:routes.top_k]
                                              for _ in routes.moe_layers]) for _ in range(len(s.tokens) - 1)])
            s.rollout_routed_experts = encode_routes(picks, list(routes.moe_layers), routes)
    adv = grpo_advantages(torch.tensor([s.reward for s in samples]), 4).tolist()
    return [make_micro_batch(samples[j:j + per_mb], adv[j:j + per_mb], routes=routes)
            for j in range(0, n_samples, per_mb)]


@pytest.mark.gpu
@needs_gpu
def test_gpu_megatron_steps_equal_torch_steps_in_fp32(tmp_path, small_cfg):
    """Same weights, same packed batch, fp32: log-probs, then three GRPO steps' loss, KL, ratio and grad norm."""
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.torch_backend import TorchBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = small_cfg(hf_checkpoint=_tiny_qwen2(tmp_path / "hf"), train_backend="megatron", lr=1e-3,
                    use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    mbs = _micro_batches()
    mg = MegatronBackend(cfg, params_dtype="float32")
    tb = TorchBackend(cfg)
    old, ref = mg.compute_log_probs(mbs), mg.compute_log_probs(mbs, ref=True)
    t_old = tb.compute_log_probs(mbs)
    assert max(float((a - b).abs().max()) for a, b in zip(old, t_old)) < 1e-5
    for step in range(3):
        m, t = mg.train_step(mbs, old, ref, 8), tb.train_step(mbs, t_old, t_old, 8)
        assert abs(m["loss_total"] - t["loss_total"]) < 1e-5, step
        assert abs(m["grad_norm"] - t["grad_norm"]) < 1e-4 * max(1.0, t["grad_norm"]), step
        if step == 0:  # first-step invariant: KL = 0, ratio = 1
            assert m["kl_sum"] == 0.0 and m["ratio_sum"] == m["ratio_count"]
    path = tmp_path / "ckpt"
    files = mg.save(str(path))
    assert "optim/backend.pt" in files and any(f.startswith("model/") for f in files)
    before = mg.train_step(mbs, old, ref, 8)["loss_total"]
    mg.load(str(path))
    assert mg.train_step(mbs, old, ref, 8)["loss_total"] == pytest.approx(before, abs=1e-6)
    exported = tmp_path / "export"
    mg.export_hf(str(exported))
    assert json.loads((exported / "config.json").read_text())["model_type"] == "qwen2"
    # load_weights (the protocol's weights-only load): an HF directory as the reference, then as the policy
    trained = mg.compute_log_probs(mbs)
    mg.load_weights(str(exported), ref=True)  # the trained weights become the reference; the policy is unchanged
    assert all(torch.equal(a, b) for a, b in zip(mg.compute_log_probs(mbs), trained))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(mg.compute_log_probs(mbs, ref=True), trained))
    mg.load_weights(str(tmp_path / "hf"))  # the starting weights as the policy
    assert max(float((a - b).abs().max()) for a, b in zip(mg.compute_log_probs(mbs), t_old)) < 1e-5


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mem_efficient", [False, True])
def test_gpu_megatron_fully_reshardable_optimizer_state_resumes_exactly(mem_efficient, tmp_path, small_cfg):
    """--dist-ckpt-optim-fully-reshardable on CUDA (bf16 weights, the fp32 main copy, the default kernels; the gather
    over NCCL, or over gloo onto rank 0 with --distrib-optim-fully-reshardable-mem-efficient): a new backend that
    loads the checkpoint goes on with the losses of the one that never stopped, where the weights alone give others.
    (A change of layout needs two GPUs: tests/test_megatron_cpu_backend.py runs those on CPU processes.)"""
    from engine.train.megatron_backend import MegatronBackend

    cfg = small_cfg(hf_checkpoint=_tiny_qwen2(tmp_path / "hf"), train_backend="megatron", lr=1e-3,
                    dist_ckpt_optim_fully_reshardable=True,
                    distrib_optim_fully_reshardable_mem_efficient=mem_efficient)
    mbs = _micro_batches()
    mg = MegatronBackend(cfg)
    old = mg.compute_log_probs(mbs)
    for _ in range(3):
        mg.train_step(mbs, old, old, 8)
    mg.save(str(tmp_path / "ck"))
    assert torch.load(tmp_path / "ck" / "optim" / "backend.pt", weights_only=False)["format"] == "fully_reshardable"
    on = [mg.train_step(mbs, old, old, 8)["loss_total"] for _ in range(3)]
    resumed = MegatronBackend(cfg)
    resumed.load(str(tmp_path / "ck"))
    assert [resumed.train_step(mbs, old, old, 8)["loss_total"] for _ in range(3)] == pytest.approx(on, abs=1e-6)
    fresh = MegatronBackend(cfg)
    fresh.load(str(tmp_path / "ck"), load_optim=False)
    alone = [fresh.train_step(mbs, old, old, 8)["loss_total"] for _ in range(3)]
    assert alone[0] == pytest.approx(on[0], abs=1e-6) and abs(alone[2] - on[2]) > 1e-4, (alone, on)


def _random_moe(family: str, path):
    """tests/model_families.py's random `family` with N(0, 0.3) weights, saved to `path` (fp32 matmuls without TF32
    from here on). No pad token: transformers' nn.Embedding(padding_idx=pad_token_id) never trains the pad token's
    row, Megatron's embedding does (bench/debug/moe_grads.py found exactly that row as the only difference, 0.012)."""
    from model_families import random_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = random_model(family, 128)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.config.pad_token_id = None
    model.save_pretrained(path)
    return model


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", ["qwen3moe", "mixtral", "qwen2moe"])
def test_gpu_megatron_moe_steps_equal_torch_steps_in_fp32(family, tmp_path, small_cfg):
    """A mixture of experts (tests/model_families.py: 4 experts, 2 a token; Mixtral with a window, Qwen2-MoE with a
    gated shared expert and a dense layer 0) in megatron-core's MoE layer (alltoall dispatcher, SequentialMLP,
    eager): log-probs and three GRPO steps equal the torch backend's on transformers' model in fp32; the weights it
    sends to the engines and exports are under the checkpoint's names, as the HF files have them."""
    from safetensors import safe_open

    from engine.train.megatron_backend import MegatronBackend
    from engine.train.torch_backend import TorchBackend

    _random_moe(family, tmp_path / "hf")
    cfg = small_cfg(hf_checkpoint=str(tmp_path / "hf"), train_backend="megatron", lr=1e-3)
    mbs = _micro_batches()
    mg = MegatronBackend(cfg, params_dtype="float32")
    assert mg.graphs is None  # routing reads token counts on the host: no decoder graphs
    tb = TorchBackend(cfg)
    old, t_old = mg.compute_log_probs(mbs), tb.compute_log_probs(mbs)
    assert max(float((a - b).abs().max()) for a, b in zip(old, t_old)) < 1e-5
    for step in range(3):
        m, t = mg.train_step(mbs, old, old, 8), tb.train_step(mbs, t_old, t_old, 8)
        assert abs(m["loss_total"] - t["loss_total"]) < 1e-5, step
        assert abs(m["grad_norm"] - t["grad_norm"]) < 1e-4 * max(1.0, t["grad_norm"]), step
    files = set(safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt").keys())
    sent = mg.engine_state()
    assert set(sent) == files == set(tb.engine_state())
    mine = tb.engine_state()
    assert max(float((sent[k].float() - mine[k].float().cpu()).abs().max()) for k in files) < 1e-4
    mg.export_hf(str(tmp_path / "export"))
    assert set(safe_open(str(tmp_path / "export" / "model.safetensors"), "pt").keys()) == files


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", ["qwen3moe", "mixtral", "qwen2moe"])
def test_gpu_megatron_routing_replay_equals_the_torch_backends(family, tmp_path, small_cfg):
    """--use-routing-replay on megatron-core's RouterReplay against the torch backend's hooks (tests/
    test_routing_replay.py), fp32: the same experts recorded in the no-grad forward; then, on weights whose routers
    moved (so routing afresh picks other experts), three steps that replay them give the same losses and grad norms,
    and differ from the torch backend's steps routed afresh."""
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.torch_backend import TorchBackend

    model = _random_moe(family, tmp_path / "hf")
    with torch.no_grad():  # the routers moved: the weights the steps start from
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p) * 0.9)
    model.save_pretrained(tmp_path / "moved")
    cfg = small_cfg(hf_checkpoint=str(tmp_path / "hf"), train_backend="megatron", lr=1e-3, use_routing_replay=True)
    mbs = _micro_batches()
    mg = MegatronBackend(cfg, params_dtype="float32")
    tb, plain = TorchBackend(cfg), TorchBackend(small_cfg(hf_checkpoint=str(tmp_path / "hf"), lr=1e-3))
    old, t_old = mg.compute_log_probs(mbs, record_routing=True), tb.compute_log_probs(mbs, record_routing=True)
    assert max(float((a - b).abs().max()) for a, b in zip(old, t_old)) < 1e-5
    assert mg.routes.by_mb.keys() == tb.routes.by_mb.keys() and len(mg.replays) == (1 if family == "qwen2moe" else 2)
    for k, routes in tb.routes.by_mb.items():
        for a, b in zip(mg.routes.by_mb[k], routes):
            assert torch.equal(a.sort(-1).values, b.sort(-1).values), k
    for backend in (mg, tb, plain):
        backend.load_weights(str(tmp_path / "moved"))
    for step in range(3):
        m, t, p = (b.train_step(mbs, old, old, 8) for b in (mg, tb, plain))
        assert abs(m["loss_total"] - t["loss_total"]) < 1e-5, step
        assert abs(m["grad_norm"] - t["grad_norm"]) < 1e-4 * max(1.0, t["grad_norm"]), step
        assert abs(p["grad_norm"] - t["grad_norm"]) > 1e-3 * t["grad_norm"], step  # the replay mattered


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", ["qwen3moe", "mixtral", "qwen2moe"])
def test_gpu_megatron_rollout_routing_replay_equals_the_torch_backends(family, tmp_path, small_cfg):
    """--use-rollout-routing-replay on megatron-core's RouterReplay against the torch backend's hooks (tests/
    test_rollout_routing_replay.py), fp32: the micro-batches carry a random engine routing; the old log-probs'
    forward, the reference's and three steps replay it on both (a sample's last token, which the engine did not
    route, in no loss) and agree, and differ from the torch backend routing on its own."""
    from engine.model_shape import read
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.routing import RouteLayout
    from engine.train.torch_backend import TorchBackend

    _random_moe(family, tmp_path / "hf")
    mbs = _micro_batches(routes=RouteLayout.of_shape(read(str(tmp_path / "hf"))))
    cfg = small_cfg(hf_checkpoint=str(tmp_path / "hf"), train_backend="megatron", lr=1e-3,
                    use_rollout_routing_replay=True)
    mg, tb = MegatronBackend(cfg, params_dtype="float32"), TorchBackend(cfg)
    plain = TorchBackend(small_cfg(hf_checkpoint=str(tmp_path / "hf"), lr=1e-3))
    old, t_old, p_old = mg.compute_log_probs(mbs), tb.compute_log_probs(mbs), plain.compute_log_probs(mbs)
    assert max(float((a - b).abs().max()) for a, b in zip(old, t_old)) < 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(p_old, t_old)) > 1e-3  # the replay mattered
    assert max(float((a - b).abs().max()) for a, b in zip(mg.compute_log_probs(mbs, ref=True), old)) < 1e-6
    for step in range(3):
        m, t, p = (b.train_step(mbs, old, old, 8) for b in (mg, tb, plain))
        assert abs(m["loss_total"] - t["loss_total"]) < 1e-5, step
        assert abs(m["grad_norm"] - t["grad_norm"]) < 1e-4 * max(1.0, t["grad_norm"]), step
        assert abs(p["grad_norm"] - t["grad_norm"]) > 1e-3 * t["grad_norm"], step
        assert m["routing_replay_diff_count"] == t["routing_replay_diff_count"] > 0, step
        share = t["routing_replay_diff_sum"] / t["routing_replay_diff_count"]
        assert share > 0.3 and abs(m["routing_replay_diff_sum"] / m["routing_replay_diff_count"] - share) < 0.02


def _agree(mg: dict, tb: dict, keys: tuple[str, ...], what: str) -> None:
    for k in keys:
        assert k in mg and k in tb, (what, k, sorted(mg), sorted(tb))
        assert abs(mg[k] - tb[k]) <= 1e-5 * max(1.0, abs(tb[k])), (what, k, mg[k], tb[k])


@pytest.mark.gpu
@needs_gpu
def test_gpu_megatron_has_the_torch_backends_loss_types_opsm_opd_ref_update_and_reset(tmp_path, small_cfg):
    """slime's flags that were torch-only, on the megatron backend, each against the torch backend in fp32 on the
    same weights and batch: --loss-type sft_loss and custom_loss (a custom metric included), --use-opsm (the
    tokens it masks), --use-opd --opd-type megatron (the teacher's log-probs; the policy's unchanged after),
    --ref-update-interval (update_ref; the moved reference saved and loaded with the checkpoint),
    --reset-optimizer-states (Adam's moments zero; the next steps as torch's) and
    --custom-pg-loss-reducer-function-path (Dr.GRPO), --use-rollout-entropy (the forward's entropies) and the
    --custom-megatron-*-path hooks."""
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.torch_backend import TorchBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = _tiny_qwen2(tmp_path / "hf")
    mbs = _micro_batches()

    def both(**over):
        cfg = small_cfg(hf_checkpoint=hf, train_backend="megatron", lr=1e-3, **over)
        return MegatronBackend(cfg, params_dtype="float32"), TorchBackend(cfg)

    # sft_loss: no old log-probs at all
    sft = dict(loss_type="sft_loss", debug_train_only=True, rollout_function_path="engine.rollout.sft:generate_rollout",
               n_samples_per_prompt=1)
    mg, tb = both(**sft)
    for step in range(2):
        _agree(mg.train_step(mbs, None, None, 8), tb.train_step(mbs, None, None, 8),
               ("loss_total", "grad_norm", "nll_sum", "nll_count", "entropy_sum"), f"sft step {step}")
    del mg, tb

    # custom_loss: examples/hooks.py's vanilla policy gradient and its ratio metric
    mg, tb = both(loss_type="custom_loss", custom_loss_function_path="examples/hooks.py:vanilla_policy_gradient")
    old = tb.compute_log_probs(mbs)
    for step in range(2):
        m, t = mg.train_step(mbs, old, None, 8), tb.train_step(mbs, old, None, 8)
        _agree(m, t, ("loss_total", "grad_norm", "custom_ratio_stepsum"), f"custom step {step}")
    assert m["custom_ratio_stepsum"] != pytest.approx(1.0)  # the second step moved the policy
    del mg, tb

    # --use-opsm: old log-probs made far from the policy so that negative-advantage samples are masked
    mg, tb = both(use_opsm=True, opsm_delta=1e-4)
    drifted = [o + 0.5 * mb.loss_mask for o, mb in zip(tb.compute_log_probs(mbs), mbs)]
    m, t = mg.train_step(mbs, drifted, None, 8), tb.train_step(mbs, drifted, None, 8)
    _agree(m, t, ("loss_total", "grad_norm", "opsm_masked_sum", "pg_loss_sum"), "opsm")
    assert m["opsm_masked_sum"] > 0
    del mg, tb

    # --custom-tis-function-path: examples/hooks.py's IcePop on engine log-probs within ±1 of the trainer's
    mg, tb = both(use_tis=True, tis_clip=1.5, tis_clip_low=0.5, custom_tis_function_path="examples/hooks.py:icepop")
    old = tb.compute_log_probs(mbs)
    g = torch.Generator().manual_seed(3)
    for mb, lp in zip(mbs, old):
        mb.rollout_log_probs = (lp + 2 * torch.rand(lp.shape, generator=g) - 1) * mb.loss_mask
    m, t = mg.train_step(mbs, old, None, 8), tb.train_step(mbs, old, None, 8)
    _agree(m, t, ("loss_total", "grad_norm", "tis_sum", "tis_clipfrac_sum", "tis_abs_sum"), "icepop")
    assert 0 < m["tis_clipfrac_sum"] < m["tis_clipfrac_count"]
    del mg, tb
    mbs = _micro_batches()

    # --custom-pg-loss-reducer-function-path: examples/hooks.py's Dr.GRPO reducer
    mg, tb = both(custom_pg_loss_reducer_function_path="examples/hooks.py:dr_grpo_reducer")
    old = tb.compute_log_probs(mbs)
    _agree(mg.train_step(mbs, old, None, 8), tb.train_step(mbs, old, None, 8), ("loss_total", "grad_norm"),
           "dr.grpo reducer")
    del mg, tb
    # slime's Megatron hooks: called after set-up, before each log-prob forward (with its store prefix) and, by
    # the worker, before each optimizer step
    import hook_fakes

    hook_fakes.MEGATRON_CALLS.clear()
    mg, tb = both(custom_megatron_init_path="hook_fakes:megatron_init",
                  custom_megatron_before_log_prob_hook_path="hook_fakes:megatron_before_log_prob",
                  custom_megatron_before_train_step_hook_path="hook_fakes:megatron_before_train_step",
                  use_kl_loss=True, kl_loss_coef=0.1)
    mg.compute_log_probs(mbs)
    mg.compute_log_probs(mbs, ref=True)
    mg.before_train_step(4, 1)
    assert hook_fakes.MEGATRON_CALLS == [("init", "megatron"), ("log_prob", 1, ""), ("log_prob", 1, "ref_"),
                                         ("train_step", 4, 1, 1, True, None)]
    # --use-rollout-entropy: the no-grad forward's per-token entropies
    (m_lp, m_ent), (t_lp, t_ent) = mg.compute_log_probs(mbs, with_entropy=True), tb.compute_log_probs(
        mbs, with_entropy=True)
    assert max(float((a - b).abs().max()) for a, b in zip(m_ent, t_ent)) < 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(m_lp, t_lp)) < 1e-5 and float(m_ent[0].sum()) > 0
    del mg, tb

    # --use-opd --opd-type megatron: the teacher (same architecture, other weights) swapped in and out
    teacher = tmp_path / "teacher"
    from transformers import AutoModelForCausalLM

    t_model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in t_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    t_model.save_pretrained(teacher)
    mg, tb = both(use_opd=True, opd_type="megatron", opd_teacher_load=str(teacher))
    policy = mg.compute_log_probs(mbs)
    m_teacher, t_teacher = mg.compute_log_probs(mbs, teacher=True), tb.compute_log_probs(mbs, teacher=True)
    assert max(float((a - b).abs().max()) for a, b in zip(m_teacher, t_teacher)) < 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(m_teacher, policy)) > 1e-3  # a different model
    assert all(torch.equal(a, b) for a, b in zip(mg.compute_log_probs(mbs), policy))  # the policy is back
    del mg, tb

    # --ref-update-interval and --reset-optimizer-states
    mg, tb = both(ref_update_interval=1, reset_optimizer_states=True, use_kl_loss=True, kl_loss_coef=0.1)
    old = tb.compute_log_probs(mbs)
    _agree(mg.train_step(mbs, old, old, 8), tb.train_step(mbs, old, old, 8), ("loss_total", "grad_norm"), "step 1")
    mg.update_ref()
    now = mg.compute_log_probs(mbs)
    assert all(torch.equal(a, b) for a, b in zip(mg.compute_log_probs(mbs, ref=True), now))
    assert max(float((a - b).abs().max()) for a, b in zip(now, old)) > 1e-4  # the step moved it
    files = mg.save(str(tmp_path / "ck"))
    assert any(f.startswith("ref/model/") for f in files), files
    mg.reset_optimizer()
    tb.reset_optimizer()
    inner = [o.optimizer for o in getattr(mg.optimizer, "chained_optimizers", [mg.optimizer])]
    moments = [v for o in inner for st in o.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(float(v.abs().sum()) == 0.0 for v in moments)
    for step in range(2):  # after the reset, both restart Adam the same way
        _agree(mg.train_step(mbs, old, old, 8), tb.train_step(mbs, old, old, 8), ("loss_total", "grad_norm"),
               f"after reset {step}")
    mg.load(str(tmp_path / "ck"))  # the saved (moved) reference comes back with the checkpoint
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(mg.compute_log_probs(mbs, ref=True), now))


@pytest.mark.gpu
@needs_gpu
def test_gpu_megatron_log_probs_chunk_size_takes_the_plain_steps(tmp_path, small_cfg):
    """--log-probs-chunk-size on the megatron backend (TP = 1, tied embeddings: the head's weight arrives as an
    argument): fp32 against the torch backend with the same chunks, three steps; then bf16 with the default kernels
    (decoder CUDA graphs, fused log-softmax) against the same backend without chunks."""
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.torch_backend import TorchBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = _tiny_qwen2(tmp_path / "hf")
    mbs = _micro_batches()
    cfg = small_cfg(hf_checkpoint=hf, train_backend="megatron", lr=1e-3, log_probs_chunk_size=5, entropy_coef=0.01)
    mg, tb = MegatronBackend(cfg, params_dtype="float32"), TorchBackend(cfg)
    assert mg.head is not None and tb.chunk == 5
    old = tb.compute_log_probs(mbs)
    assert max(float((a - b).abs().max()) for a, b in zip(mg.compute_log_probs(mbs), old)) < 1e-5
    for step in range(3):
        _agree(mg.train_step(mbs, old, None, 8), tb.train_step(mbs, old, None, 8),
               ("loss_total", "grad_norm", "entropy_sum"), f"chunked step {step}")
    del mg, tb

    out = {}
    for chunk in (-1, 5):
        mg = MegatronBackend(small_cfg(hf_checkpoint=hf, train_backend="megatron", lr=1e-3, bf16=True,
                                       log_probs_chunk_size=chunk))
        lp = mg.compute_log_probs(mbs)
        out[chunk] = (lp, [mg.train_step(mbs, lp, None, 8)["grad_norm"] for _ in range(2)], mg.graphs is not None)
        del mg
    (lp0, g0, graphs0), (lp5, g5, graphs5) = out[-1], out[5]
    assert graphs0 and graphs5
    assert max(float((a - b).abs().max()) for a, b in zip(lp0, lp5)) < 2e-2  # bf16 products in other blocks
    assert g5 == pytest.approx(g0, rel=2e-2)


@pytest.mark.gpu
@needs_gpu
def test_gpu_megatron_scores_with_kept_weights_and_restores_its_own(tmp_path, small_cfg):
    """--keep-old-actor on the megatron backend: a snapshot of this rank's shards, two updates later, gives the
    log-probs of before the updates (bit for bit, fp32), and the policy's own weights are back afterwards."""
    from engine.train.megatron_backend import MegatronBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = small_cfg(hf_checkpoint=_tiny_qwen2(tmp_path / "hf"), train_backend="megatron", lr=1e-3,
                    keep_old_actor=True, async_mode="one-step")
    mbs = _micro_batches()
    mg = MegatronBackend(cfg, params_dtype="float32")
    before, kept = mg.compute_log_probs(mbs), mg.snapshot_weights()
    for _ in range(2):
        mg.train_step(mbs, before, None, 8)
    now = mg.compute_log_probs(mbs)
    assert max(float((a - b).abs().max()) for a, b in zip(now, before)) > 1e-4  # the updates moved the policy
    assert all(torch.equal(a, b) for a, b in zip(mg.compute_log_probs(mbs, weights=kept), before))
    assert all(torch.equal(a, b) for a, b in zip(mg.compute_log_probs(mbs), now))
