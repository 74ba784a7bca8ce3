"""The flow and its pieces on CUDA (`pytest -m gpu`; skipped without a GPU, as in CI).

- the torch backend on CUDA: the same log-probs and step as on the CPU (fp32); flash-attention varlen in bf16 keeps
  samples apart; bf16 masters, activation recompute and offload;
- CUDA IPC buckets between two processes on one GPU;
- the built-in engine on CUDA: bf16 weights, batched device sampling, memory released and re-taken;
- `rollflow train` colocated on one GPU with each backend: every sync by CUDA IPC, the train–inference mismatch
  under the fp32 threshold after every sync and every rollout, the engine's memory released during training.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parent.parent


def _samples(n: int = 6, seed: int = 0):
    from train_fakes import fake_samples

    lengths = [(5 + i % 4, 6 + (3 * i) % 9) for i in range(n)]
    return fake_samples(lengths, n=2, seed=seed)


def _mbs(samples, per: int = 3):
    from train_fakes import pack

    return pack(samples, [list(range(j, min(j + per, len(samples)))) for j in range(0, len(samples), per)])


def _share_equal(a: dict, b: dict, tol: float) -> float:
    """The share of parameter entries of two models within tol of each other."""
    same = sum(int(((a[k] - b[k]).abs() <= tol).sum()) for k in a)
    return same / sum(v.numel() for v in a.values())


def _backend(tiny_model, device: str, **over):
    from engine.config import RunConfig
    from engine.train.torch_backend import TorchBackend

    cfg = RunConfig(hf_checkpoint=tiny_model, rollout_batch_size=3, n_samples_per_prompt=2, global_batch_size=6,
                    micro_batch_size=3, lr=1e-3, **over)
    return TorchBackend(cfg, device=device)


# ---- torch backend ---------------------------------------------------------------------------------------------
def test_torch_backend_on_cuda_matches_the_cpu_in_fp32(tiny_model):
    torch.backends.cuda.matmul.allow_tf32 = False
    mbs = _mbs(_samples())
    cpu, gpu = _backend(tiny_model, "cpu"), _backend(tiny_model, "cuda")
    assert next(gpu.model.parameters()).is_cuda
    lp_cpu, lp_gpu = cpu.compute_log_probs(mbs), gpu.compute_log_probs(mbs)
    assert max(float((a - b).abs().max()) for a, b in zip(lp_cpu, lp_gpu)) < 1e-4
    for mb in mbs:
        mb.advantages = torch.linspace(-1, 1, mb.num_tokens) * mb.loss_mask
    out = [b.train_step(mbs, lp_cpu, None, 6) for b in (cpu, gpu)]
    assert out[1]["grad_norm"] == pytest.approx(out[0]["grad_norm"], rel=1e-4)
    # fused AdamW, the same update: Adam's first step is ≈ lr·sign(g), so an entry whose gradient is ~0 may flip
    assert _share_equal(cpu.named_parameters_full(), gpu.named_parameters_full(), 1e-6) > 0.99


def test_flash_varlen_in_bf16_keeps_samples_apart(tiny_model):
    from engine.train.attention import FLASH

    samples = _samples()
    b = _backend(tiny_model, "cuda", bf16=True)
    f32 = _backend(tiny_model, "cuda")
    mbs = _mbs(samples)
    lp16, lp32 = b.compute_log_probs(mbs), f32.compute_log_probs(mbs)
    d = torch.cat([(x - y).abs()[mb.loss_mask > 0] for x, y, mb in zip(lp16, lp32, mbs)])
    assert float(d.mean()) < 0.05, float(d.mean())  # bf16 rounding of the same model
    assert FLASH["error"] is None  # the varlen flash kernel ran (grouped kv heads read in place)
    # change the second sample of the first micro-batch: the first sample's log-probs must not move at all
    samples[1].tokens = [(t + 7) % 200 for t in samples[1].tokens]
    lp16b = b.compute_log_probs(_mbs(samples))
    first = slice(0, len(samples[0].tokens))
    assert torch.equal(lp16[0][first], lp16b[0][first])


@pytest.mark.parametrize("window", [None, 1, 8])
def test_flash_varlen_sliding_window_equals_the_masked_reference(window):
    """The flash kernel's own window (left W − 1, right 0) is transformers' sliding window (a token sees itself and
    the W − 1 before it): output and gradients equal an fp32 SDPA under the explicit band mask, samples apart."""
    from engine.train.attention import FLASH, causal_band, packed_causal_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [5, 37, 64, 12]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    T, a, kv, d = sum(lens), 8, 2, 64
    # inputs that bf16 holds exactly, so that the reference differs by the kernel's own roundings only
    q, k, v = (torch.randn(T, h, d, generator=g, device="cuda").bfloat16().float() for h in (a, kv, kv))
    w = torch.randn(T, a, d, generator=g, device="cuda")
    outs, grads = [], []
    for dtype in (torch.bfloat16, torch.float32):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        if dtype == torch.bfloat16:
            out = packed_causal_attention(*x, cu, max(lens), 0.125, window)
        else:  # the reference: per sample, kv heads repeated, the band as a mask
            parts = []
            for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
                qi, ki, vi = (t[s:e].transpose(0, 1) for t in x)
                ki, vi = ki.repeat_interleave(a // kv, 0), vi.repeat_interleave(a // kv, 0)
                mask = causal_band(e - s, window, qi.device)
                parts.append(torch.nn.functional.scaled_dot_product_attention(
                    qi[None], ki[None], vi[None], attn_mask=mask, scale=0.125)[0].transpose(0, 1))
            out = torch.cat(parts)
        (out.float() * w).sum().backward()
        outs.append(out.detach().float())
        grads.append([t.grad.float() for t in x])
    assert FLASH["error"] is None
    assert float((outs[0] - outs[1]).abs().max()) < 0.02  # bf16 rounding (an off-by-one window: ~0.3)
    for g16, g32 in zip(*grads):
        assert float((g16 - g32).abs().max()) < 0.06 * max(1.0, float(g32.abs().max()))


def test_bf16_recompute_and_offload_on_cuda(tiny_model):
    mbs = _mbs(_samples())
    plain = _backend(tiny_model, "cuda", bf16=True)
    other = _backend(tiny_model, "cuda", bf16=True, recompute_activations=True, offload_train=True)
    old = plain.compute_log_probs(mbs)
    for mb in mbs:
        mb.advantages = torch.linspace(-1, 1, mb.num_tokens) * mb.loss_mask
    plain.train_step(mbs, old, None, 6)
    held = torch.cuda.memory_allocated()
    other.offload()
    assert torch.cuda.memory_allocated() < held  # its weights, masters and optimizer state left the GPU
    assert all(not p.is_cuda for p in other.model.parameters())
    other.onload()
    other.train_step(mbs, old, None, 6)
    # recompute and a round trip through host memory change nothing (up to the sign of ~0 gradients, see above)
    assert _share_equal(plain.named_parameters_full(), other.named_parameters_full(), 1e-6) > 0.99


def test_log_probs_chunk_size_on_cuda_through_the_fused_kernel(tiny_model):
    """--log-probs-chunk-size 4 on CUDA in bf16: the compiled log-softmax runs per chunk (also when recomputed in
    the backward) and the step is the unchunked one (up to the sign of ~0 gradients, see above)."""
    from engine.train.packed_logprobs import _FUSED

    mbs = _mbs(_samples())
    plain = _backend(tiny_model, "cuda", bf16=True)
    chunked = _backend(tiny_model, "cuda", bf16=True, log_probs_chunk_size=4)
    old, old_c = plain.compute_log_probs(mbs), chunked.compute_log_probs(mbs)
    assert max(float((a - b).abs().max()) for a, b in zip(old, old_c)) < 2e-2  # bf16 products in other blocks
    for mb in mbs:
        mb.advantages = torch.linspace(-1, 1, mb.num_tokens) * mb.loss_mask
    a, b = plain.train_step(mbs, old, None, 6), chunked.train_step(mbs, old, None, 6)
    assert _FUSED["error"] is None  # the compiled kernel ran, chunks included
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)
    assert _share_equal(plain.named_parameters_full(), chunked.named_parameters_full(), 1e-5) > 0.99


# ---- CUDA IPC ----------------------------------------------------------------------------------------------------
def _open_and_sum(buckets, queue):  # in a child process (spawn): open the parent's buckets, sum every tensor
    from engine.weights import ipc

    sums = {}
    for b in buckets:
        for name, t in ipc.unflatten(ipc.open_bucket(b), b.metadata).items():
            sums[name] = float(t.double().sum())
    torch.cuda.synchronize()
    queue.put(sums)


def test_cuda_ipc_buckets_reach_another_process_without_a_copy_through_the_host():
    import torch.multiprocessing as mp

    from engine.weights import ipc

    g = torch.Generator(device="cuda").manual_seed(0)
    named = {f"w{i}": torch.randn(257, 33 + i, device="cuda", generator=g) for i in range(5)}
    export = ipc.export(named, torch.bfloat16, bucket_bytes=3 * 257 * 40 * 2)
    assert len(export.buckets) >= 2 and all(b.dtype == "bfloat16" for b in export.buckets)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_open_and_sum, args=(export.buckets, queue))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    want = {k: float(v.to(torch.bfloat16).double().sum()) for k, v in named.items()}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-6 for k in want)


# ---- the built-in engine on CUDA -------------------------------------------------------------------------------
def test_engine_on_cuda_serves_bf16_and_gives_its_memory_back(tiny_model):
    from engine.rollout.generation import GenRequest
    from engine.rollout.server import EngineState

    state = EngineState(tiny_model, device="cuda:0", dtype="bfloat16", max_new_tokens=8)
    assert next(state.generator.model.parameters()).dtype == torch.bfloat16
    assert state.generator.fused_norms == 2 * state.generator.model.config.num_hidden_layers + 1  # all fused
    tok = state.tokenizer
    prompt = tok("<|im_start|>user\n57+38=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    reqs = [GenRequest(rid=f"r{i}", input_ids=prompt, max_new_tokens=8, seed=i) for i in range(64)]
    outs = state.generator.generate(reqs)
    again = state.generator.generate(reqs)
    assert [o.output_ids for o in outs] == [o.output_ids for o in again]  # seeded: the same batch, the same tokens
    model = state.generator.model
    for o in outs[:4]:
        seq = o.input_ids + o.output_ids
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq], device="cuda")).logits[0].float(), -1)
        direct = logp[len(o.input_ids) - 1:-1].gather(-1, torch.tensor(o.output_ids, device="cuda")[:, None])
        assert float((direct.squeeze(-1).cpu() - torch.tensor(o.logprobs)).abs().mean()) < 0.02
    before = torch.cuda.memory_reserved()
    state.set_released(True)
    assert torch.cuda.memory_reserved() < before and not next(model.parameters()).is_cuda
    state.set_released(False)
    assert next(model.parameters()).is_cuda and len(state.generator.generate(reqs[:2])[0].output_ids) > 0


FAMILIES = ("mistral", "gemma2", "gemma3", "phi3", "olmo2", "qwen3moe", "mixtral", "qwen2moe",
            "llama3rope")  # tests/model_families.py


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_model_families_on_cuda(family, dtype, tmp_path, tiny_model):
    """Models of other families (tests/model_families.py: sliding-window layers, Gemma 2's softcapping, eager in
    transformers, Gemma's x̂ · (1 + w) norms, …): the engine's captured CUDA graphs and the torch backend's packed
    forward give transformers' own log-probs (its masks and attention, one row at a time), with prompts and answers
    longer than the window."""
    from model_families import WINDOW, save_model
    from transformers import AutoModelForCausalLM

    from engine.rollout.generation import GenRequest
    from engine.rollout.server import EngineState

    torch.backends.cuda.matmul.allow_tf32 = False
    path = save_model(tmp_path / family, family, tiny_model)
    reference = AutoModelForCausalLM.from_pretrained(  # Gemma 2: eager, the attention its softcapping is defined by
        path, dtype=getattr(torch, dtype), attn_implementation="eager" if family == "gemma2" else None).to("cuda").eval()
    tol = 1e-3 if dtype == "float32" else 0.05  # mean |Δ log p|: float rounding only (a window left out: ~0.5)

    def teacher_forced(seq: list[int], start: int) -> torch.Tensor:
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([seq], device="cuda")).logits[0].float(), -1)
        return logp[start - 1:-1].gather(-1, torch.tensor(seq[start:], device="cuda")[:, None]).squeeze(-1).cpu()

    state = EngineState(path, device="cuda:0", dtype=dtype, max_new_tokens=24)
    # known before capture: torch's fp32 grouped_mm reads the host
    eager = family in ("qwen3moe", "mixtral", "qwen2moe") and dtype == "float32"
    assert (state.generator.graphs is None) == eager, state.generator.graphs_off
    assert eager or state.generator.graphs.folded_gqa
    assert not eager or "grouped_mm" in state.generator.graphs_off
    assert (state.generator.fused_norms == 0) == family.startswith("gemma")  # Gemma's x̂ · (1 + w): its own forward
    tok = state.tokenizer
    prompts = [tok(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
               for q in ("57+38=", "3+4=", "120-99=+7")]
    assert min(map(len, prompts)) > WINDOW
    reqs = [GenRequest(rid=f"r{i}", input_ids=prompts[i % 3], max_new_tokens=24, seed=i, ignore_eos=True)
            for i in range(6)]
    outs = state.generator.generate(reqs)  # a failed capture would raise, naming --sglang-disable-cuda-graph
    assert eager or state.generator.graphs.graphs  # decoded through captured graphs
    for o in outs:
        got = torch.tensor(o.logprobs)
        assert len(got) == 24 and float((got - teacher_forced(o.input_ids + o.output_ids, len(o.input_ids)))
                                        .abs().mean()) < tol
    # the torch backend's packed forward over those rows (masked attention on CUDA, not the flash kernel)
    from engine.config import RunConfig
    from engine.samples import Sample, Status
    from engine.train.torch_backend import TorchBackend
    from train_fakes import pack

    samples = [Sample(index=i, group_index=i // 2, rollout_id=0, prompt="x", tokens=o.input_ids + o.output_ids,
                      response_length=24, loss_mask=[1] * 24, rollout_log_probs=list(o.logprobs),
                      status=Status.COMPLETED) for i, o in enumerate(outs)]
    cfg = RunConfig(hf_checkpoint=path, rollout_batch_size=3, n_samples_per_prompt=2, global_batch_size=6,
                    micro_batch_size=3, bf16=dtype == "bfloat16")
    lps = TorchBackend(cfg, device="cuda").compute_log_probs(pack(samples, [[0, 1, 2], [3, 4, 5]]))
    flat = torch.cat([lp.float().cpu() for lp in lps])
    want = torch.cat([torch.cat([torch.zeros(len(s.tokens) - 24), teacher_forced(s.tokens, len(s.tokens) - 24)])
                      for s in samples])
    assert float((flat - want).abs().sum() / (24 * len(samples))) < tol


@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe"])
def test_engine_on_cuda_records_routed_experts_inside_its_graphs(family, tmp_path, tiny_model):
    """--enable-return-routed-experts on the CUDA-graph decoder (bf16): the batch and the requests that join it
    decode through captured graphs, and each request's experts are those transformers' routers pick for its tokens
    in one forward (bf16 on the GPU; a near-tie may round the other way: at least 98% of the rows), and those of
    the eager loop (--sglang-disable-cuda-graph) on the rows where both drew the same tokens."""
    from model_families import save_model
    from test_rollout_routing_replay import _alone, _same_sets

    from engine.rollout.generation import Feed, GenRequest
    from engine.rollout.server import EngineState

    path = save_model(tmp_path / family, family, tiny_model)
    state = EngineState(path, device="cuda:0", dtype="bfloat16", max_new_tokens=24, return_routed_experts=True)
    eager = EngineState(path, device="cuda:0", dtype="bfloat16", max_new_tokens=24, return_routed_experts=True,
                        cuda_graphs=False)
    gen = state.generator
    assert gen.graphs is not None and gen.graphs.tape is gen.routers

    def reqs(rids, start=0):
        return [GenRequest(rid=r, input_ids=[5 + i, 6, 7, 8, 9 + i][:5 - i % 3], max_new_tokens=8 + 4 * (i % 3),
                           seed=start + i, ignore_eos=True, return_routed_experts=True) for i, r in enumerate(rids)]

    first, late = reqs(["a", "b", "c", "d"]), reqs(["e", "f"], start=10)
    feed, got = Feed(), {}
    feed.put(late)
    gen.generate(first, feed=feed, deliver=lambda q, r: got.setdefault(q.rid, (q, r)))
    assert gen.graphs.graphs and gen.graphs.captures > 0 and gen.graphs.joined_rows == 2 and len(got) == 6
    plain = {q.rid: r for q, r in zip(first + late, eager.generator.generate(first + late))}
    same = total = 0
    for rid, (q, res) in got.items():
        tokens = q.input_ids + res.output_ids
        assert len(res.output_ids) == q.max_new_tokens
        assert res.routed_experts.shape == (len(tokens) - 1, len(gen.routers.routers), gen.route_layout.top_k)
        hits = _same_sets(res.routed_experts.cpu(), _alone(gen.model, tokens[:-1]))
        same, total = same + int(hits.sum()), total + hits.numel()
        if plain[rid].output_ids == res.output_ids:  # the eager loop drew the same tokens: the same experts too
            agree = _same_sets(res.routed_experts.cpu(), plain[rid].routed_experts.cpu())
            assert float(agree.float().mean()) >= 0.98, rid
    assert same / total >= 0.98, (same, total)


# ---- the whole flow, colocated on one GPU ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_flow_on_one_gpu(backend, tmp_path, tiny_model):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", str(ROOT / "examples/demo.yaml"), "--colocate",
           "--train-backend", backend, "--num-rollout", "3", "--eval-max-samples", "16",
           "--work-dir", str(tmp_path / "w"), "--save", str(tmp_path / "ck"), "--summary-json", str(summary),
           "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(summary.read_text())
    assert out["weight_sync"] == "cuda_ipc" and out["engine_dtype"] == "float32"
    h = out["history"]
    assert sorted(h["rollout/reward_mean"]) == ["0", "1", "2"]
    # fp32 trainer and engine (no --bf16): the fp32 threshold, after every sync and on every rollout
    assert all(v < 1e-3 for v in h["sync/probe_mismatch"].values()), h["sync/probe_mismatch"]
    assert all(v < 1e-3 for v in h["train/mismatch"].values()), h["train/mismatch"]
    assert all(v > 0 for v in h["sync/gb_per_s"].values())
    # the engine held GPU memory while generating, none while the trainer trained, and took it back for the sync
    for i in ("0", "1", "2"):
        assert h["memory/rollout_engine_gib"][i] > 0 and h["memory/train_train_gib"][i] > 0
        assert h["memory/train_engine_gib"][i] == 0.0  # weights, cached blocks and cuBLAS workspaces all given back
    assert all(h["memory/sync_engine_gib"][i] > 0 for i in ("0", "1", "2"))


# ---- --weight-sync-method distributed over NCCL: trainer and engine on GPUs of their own -----------------------
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the engine on two GPUs")
def test_distributed_weight_sync_over_nccl_equals_the_object_store(tmp_path, tiny_model):
    """Decoupled on 2 GPUs (1 train, 1 rollout): the NCCL broadcast gives the engine the trainer's weights as the
    object store does — the same rewards and final weights, and the probe within the fp32 threshold."""
    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    outs = {}
    for method in ("tensor", "distributed"):
        summary = tmp_path / f"{method}.json"
        cmd = [sys.executable, "-m", "flows.cli", "train", "--config", str(ROOT / "examples/demo.yaml"),
               "--rollout-num-gpus", "1", "--weight-sync-method", method, "--num-rollout", "3",
               "--eval-max-samples", "16", "--work-dir", str(tmp_path / f"w_{method}"),
               "--save", str(tmp_path / f"ck_{method}"), "--summary-json", str(summary), "--no-progress"]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        outs[method] = json.loads(summary.read_text())
    assert outs["tensor"]["weight_sync"] == "object_store" and outs["distributed"]["weight_sync"] == "distributed"
    h, ref = outs["distributed"]["history"], outs["tensor"]["history"]
    assert all(v < 1e-3 for v in h["sync/probe_mismatch"].values()), h["sync/probe_mismatch"]
    assert h["rollout/reward_mean"] == ref["rollout/reward_mean"]
    a = load_file(str(tmp_path / "ck_distributed" / "iter_0000002" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "ck_tensor" / "iter_0000002" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
