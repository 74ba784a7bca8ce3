"""Decoder CUDA graphs of the megatron backend: the shape buckets and the padding (CPU), and on a GPU (marked
`gpu`) the same log-probs and steps as the eager decoder."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.train.megatron_attention import packed_positions
from engine.train.megatron_graphs import graph_key, pad_micro_batch
from engine.train.megatron_model import Kernels, cuda_graphs_off_reason, swiglu_fusion, use_cuda_graphs


def test_graph_key_buckets_tokens_and_leaves_room_for_the_pad_segment():
    assert graph_key(4096, 4, 1024) == (4096, 8)
    assert graph_key(4097, 4, 1024) == (5120, 8)
    assert graph_key(1, 1, 1024) == (1024, 8)
    assert graph_key(3000, 7, 1024) == (3072, 8)
    assert graph_key(3000, 8, 1024) == (3072, 16)  # 8 samples + the pad segment need 9 segments
    assert graph_key(3000, 31, 1024) == (3072, 32)
    with pytest.raises(ValueError, match="0 tokens"):
        graph_key(0, 1, 1024)


def test_padding_keeps_every_real_token_and_sample_and_adds_one_pad_segment():
    tokens = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3])
    key = graph_key(7, 2, 4)  # (8, 8)
    tok, cu_p, pos_p = pad_micro_batch(tokens, cu, pos, key, pad_id=0)
    assert tok.tolist() == [5, 6, 7, 8, 9, 10, 11, 0]
    assert cu_p.tolist() == [0, 3, 7, 8, 8, 8, 8, 8, 8] and cu_p.dtype == torch.int32
    assert pos_p.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    # RoPE positions from the padded cu_seqlens (empty samples included) restart at every real sample
    assert packed_positions(cu_p, 8).tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


def test_an_exactly_full_micro_batch_gets_an_empty_pad_segment():
    tokens, cu = torch.arange(8), torch.tensor([0, 5, 8], dtype=torch.int32)
    tok, cu_p, _ = pad_micro_batch(tokens, cu, torch.arange(8), (8, 8))
    assert tok.tolist() == list(range(8)) and cu_p.tolist() == [0, 5, 8, 8, 8, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="does not fit"):
        pad_micro_batch(torch.arange(9), torch.tensor([0, 9]), torch.arange(9), (8, 8))


def test_graphs_only_where_no_collective_or_host_sync_is_inside_the_decoder():
    bf16 = torch.bfloat16
    te = importlib.util.find_spec("transformer_engine") is not None
    assert use_cuda_graphs(Kernels(), tp=1, pp=1, dtype=bf16) is (not te)
    assert not use_cuda_graphs(Kernels(), tp=2, pp=1, dtype=bf16)
    assert not use_cuda_graphs(Kernels(), tp=1, pp=2, dtype=bf16)
    assert not use_cuda_graphs(Kernels(), tp=1, pp=1, dtype=torch.float32)  # per-sample attention syncs
    assert not use_cuda_graphs(Kernels(rope_in_attention=False), tp=1, pp=1, dtype=bf16)
    assert not use_cuda_graphs(Kernels(cuda_graphs=False), tp=1, pp=1, dtype=bf16)
    if not te:  # the backend logs why the decoder runs eagerly
        assert "TP=2" in cuda_graphs_off_reason(Kernels(), tp=2, pp=1, dtype=bf16)
        assert "float32" in cuda_graphs_off_reason(Kernels(), tp=1, pp=1, dtype=torch.float32)
        assert cuda_graphs_off_reason(Kernels(cuda_graphs=False), tp=1, pp=1, dtype=bf16) == \
            "--no-megatron-cuda-graphs"
    # Megatron's compiled SwiGLU follows the graphs unless set: eager, its guard checks cost more than it saves
    assert swiglu_fusion(Kernels(), tp=1, pp=1, dtype=bf16) is (not te)
    assert not swiglu_fusion(Kernels(), tp=2, pp=1, dtype=bf16)
    assert swiglu_fusion(Kernels(fused_swiglu=True), tp=2, pp=1, dtype=bf16)
    assert not swiglu_fusion(Kernels(fused_swiglu=False), tp=1, pp=1, dtype=bf16)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None,
                               reason="needs CUDA and megatron-core")


@pytest.mark.gpu
@needs_gpu
def test_gpu_graphed_decoder_gives_the_eager_log_probs_and_steps(tmp_path, small_cfg):
    """bf16, same weights and batch: the graphed (padded) decoder against the eager one. The two differ by bf16
    GEMM rounding of other row counts and flash attention's atomic backward, nothing more."""
    from test_megatron_backend import _micro_batches, _tiny_qwen2

    from engine.train.megatron_backend import MegatronBackend

    cfg = small_cfg(hf_checkpoint=_tiny_qwen2(tmp_path / "hf"), train_backend="megatron", lr=1e-3,
                    use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    mbs = _micro_batches()
    eager = MegatronBackend(cfg, params_dtype="bfloat16", kernels=Kernels(cuda_graphs=False))
    graphed = MegatronBackend(cfg, params_dtype="bfloat16", kernels=Kernels())
    assert eager.graphs is None and graphed.graphs is not None
    old_e, old_g = eager.compute_log_probs(mbs), graphed.compute_log_probs(mbs)
    assert len(graphed.graphs.graphs) == 1 and graphed.graphs.replays == len(mbs)
    for a, b, mb in zip(old_e, old_g, mbs):
        assert a.shape == b.shape == (mb.num_tokens,)
        assert float((a - b).abs().max()) < 3e-2
    ref = eager.compute_log_probs(mbs, ref=True)
    for step in range(3):
        m_e, m_g = eager.train_step(mbs, old_e, ref, 8), graphed.train_step(mbs, old_e, ref, 8)
        assert abs(m_e["loss_total"] - m_g["loss_total"]) < 2e-3 * max(1.0, abs(m_e["loss_total"])), step
        assert abs(m_e["grad_norm"] - m_g["grad_norm"]) < 2e-2 * m_e["grad_norm"], step
    assert graphed.graphs.replays == 4 * len(mbs)  # log-probs, then three steps; nothing ran eagerly
