"""Packed attention and packed log-probs (pure tensors, CPU): no attention across samples, the MicroBatch
alignment of the torch backend, vocabulary-parallel softmax sums with their gradients."""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp
from conftest import spawn_ranks

from engine.packing.microbatch import MicroBatch
from engine.train.attention import packed_causal_attention
from engine.train.megatron_attention import PackedCoreAttention
from engine.train.packed_logprobs import align_to_tokens, shift_targets, vocab_parallel_log_probs

LENS = [5, 9, 3, 7]  # four samples in one packed row
CU = torch.tensor([0, 5, 14, 17, 24], dtype=torch.int32)


def dense_reference(q, k, v, cu):
    """softmax(QKᵀ/√d + M)V with M = 0 where key j ≤ query i in the same sample, −∞ elsewhere (built by hand)."""
    T, a, d = q.shape
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (seg[:, None] == seg[None, :]) & (j <= i)  # [T, T] block-diagonal causal
    k = k.repeat_interleave(a // k.shape[1], dim=1)
    v = v.repeat_interleave(a // v.shape[1], dim=1)
    scores = torch.einsum("iad,jad->aij", q, k) / d ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("aij,jad->iad", scores.softmax(-1), v)


def test_packed_attention_is_block_diagonal_causal_with_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(24, 4, 8), torch.randn(24, 2, 8), torch.randn(24, 2, 8)  # a = 4, g = 2
    out = packed_causal_attention(q, k, v, CU, max(LENS))
    torch.testing.assert_close(out, dense_reference(q, k, v, CU), atol=1e-5, rtol=1e-5)


def test_changing_one_sample_leaves_the_others_alone():
    torch.manual_seed(1)
    q, k, v = torch.randn(24, 4, 8), torch.randn(24, 2, 8), torch.randn(24, 2, 8)
    base = packed_causal_attention(q, k, v, CU, 9)
    k2, v2 = k.clone(), v.clone()
    k2[5:14] += 3.0  # sample 1's keys and values only
    v2[5:14] -= 2.0
    out = packed_causal_attention(q, k2, v2, CU, 9)
    assert torch.equal(out[:5], base[:5]) and torch.equal(out[14:], base[14:])
    assert not torch.allclose(out[5:14], base[5:14])


def test_core_attention_module_thd_and_sbhd_shapes():
    cfg = SimpleNamespace(context_parallel_size=1, attention_dropout=0.0)
    attn = PackedCoreAttention(cfg, layer_number=1)
    q, k, v = torch.randn(24, 4, 8), torch.randn(24, 2, 8), torch.randn(24, 2, 8)
    psp = SimpleNamespace(cu_seqlens_q=CU, max_seqlen_q=9)
    out = attn(q, k, v, None, packed_seq_params=psp)
    assert out.shape == (24, 32)
    # one unpacked sequence as SBHD [s, b=1, a, d] is the same as a pack of one sample
    one = attn(q[:9, None], k[:9, None], v[:9, None], None)
    assert one.shape == (9, 1, 32)
    alone = packed_causal_attention(q[:9], k[:9], v[:9], torch.tensor([0, 9], dtype=torch.int32), 9)
    torch.testing.assert_close(one[:, 0], alone.reshape(9, 32))


def test_packed_log_probs_follow_the_torch_backend_layout():
    """A packed forward whose logits equal per-sample logits must give exactly the torch backend's
    per-token log-probs and entropies (engine.train.forward.packed_forward): entry t is about tokens[t] given its
    own sample's prefix, 0 at sample starts."""
    from engine.train.forward import packed_forward

    torch.manual_seed(2)
    V = 11
    table = torch.randn(V, V)  # a "model": logits of the next token depend on the current token only

    class Bigram(torch.nn.Module):
        def forward(self, input_ids, logits_to_keep=None, **_):
            logits = table[input_ids]  # [1, T, V]
            return SimpleNamespace(logits=logits if logits_to_keep is None else logits[:, logits_to_keep])

    tokens = torch.randint(0, V, (24,))
    positions = torch.cat([torch.arange(n) for n in LENS])
    mb = MicroBatch(tokens=tokens, cu_seqlens=CU, position_ids=positions, loss_mask=(positions > 0).float(),
                    advantages=torch.zeros(24), rollout_log_probs=torch.zeros(24), sample_ids=[0, 1, 2, 3])
    want_lp, want_ent = packed_forward(Bigram(), mb, temperature=1.0)
    lp, ent = vocab_parallel_log_probs(table[tokens], shift_targets(tokens))  # the packed row's logits
    lp, ent = align_to_tokens(lp, CU), align_to_tokens(ent, CU)
    torch.testing.assert_close(lp, want_lp)
    torch.testing.assert_close(ent, want_ent)
    assert lp[CU[:-1].long()].abs().sum() == 0


def test_single_rank_is_log_softmax_with_its_gradient():
    torch.manual_seed(3)
    logits = torch.randn(6, 13, requires_grad=True)
    targets = torch.randint(0, 13, (6,))
    lp, ent = vocab_parallel_log_probs(logits, targets)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, ref.gather(-1, targets[:, None]).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    g, = torch.autograd.grad((lp + 0.5 * ent).sum(), logits)
    logits2 = logits.detach().requires_grad_()
    r2 = torch.log_softmax(logits2, -1)
    ((r2.gather(-1, targets[:, None]).squeeze(-1) - 0.5 * (r2.exp() * r2).sum(-1)).sum()).backward()
    torch.testing.assert_close(g, logits2.grad)


def test_entropy_without_grad_keeps_log_prob_grad():
    logits = torch.randn(4, 7, requires_grad=True)
    lp, ent = vocab_parallel_log_probs(logits, torch.tensor([0, 1, 2, 3]), entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad


# ---- TP = 2 over gloo: each rank holds half the (padded) vocabulary --------------------------------------
class _SumIdentityBackward(torch.autograd.Function):
    """Forward all-reduce SUM, backward identity: Megatron's reduce_from_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _tp_worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(4)
    V, Vp = 11, 12  # 11 ids padded to 12 = 2 × 6; id 11 is padding on rank 1
    full = torch.randn(8, V)
    targets = torch.tensor([0, 5, 6, 10, 3, 7, 9, 1])
    shard = torch.cat([full, torch.zeros(8, Vp - V)], 1)[:, rank * 6:(rank + 1) * 6].clone().requires_grad_()

    def rmax(x):
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    lp, ent = vocab_parallel_log_probs(shard, targets, vocab_start=rank * 6, vocab_size=V,
                                       reduce_sum=_SumIdentityBackward.apply, reduce_max=rmax)
    (lp.sum() + 0.3 * ent.sum()).backward()
    out[rank] = (lp.detach(), ent.detach(), shard.grad.clone())
    dist.destroy_process_group()


def test_two_vocab_shards_give_the_full_softmax_and_its_gradient():
    """Both sums must be reduced before use: reducing a partial Σ p·z instead gave right values but wrong
    entropy gradients at TP = 2 (seen in the Megatron CPU check)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn_ranks(_tp_worker, args=(port, out), nprocs=2)
    torch.manual_seed(4)
    full = torch.randn(8, 11).requires_grad_()
    targets = torch.tensor([0, 5, 6, 10, 3, 7, 9, 1])
    ref = torch.log_softmax(full, -1)
    lp_ref, ent_ref = ref.gather(-1, targets[:, None]).squeeze(-1), -(ref.exp() * ref).sum(-1)
    (lp_ref.sum() + 0.3 * ent_ref.sum()).backward()
    for rank in (0, 1):
        lp, ent, grad = out[rank]
        torch.testing.assert_close(lp, lp_ref.detach())
        torch.testing.assert_close(ent, ent_ref.detach())
    grad = torch.cat([out[0][2], out[1][2]], 1)  # [8, 12]
    torch.testing.assert_close(grad[:, :11], full.grad)
    assert torch.isfinite(grad).all() and grad[:, 11].abs().sum() == 0  # padding: no NaN, no gradient


# ---- RoPE inside the packed attention ------------------------------------------------------------------
def test_packed_positions_restart_per_sample():
    from engine.train.megatron_attention import packed_positions

    assert packed_positions(CU, 24).tolist() == [p for n in LENS for p in range(n)]


def test_rope_frequencies_match_transformers_default_and_llama3():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.train.megatron_attention import Rope

    torch.testing.assert_close(Rope(1e6).inv_freq(128), 1.0 / 1e6 ** (torch.arange(0, 128, 2).float() / 128))
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(Rope(500000.0, 8.0).inv_freq(128), want.float())


def test_rope_in_attention_equals_rotating_each_sample_from_zero():
    """The core attention's own RoPE (one cos/sin table per micro-batch) = HF's rotate-half applied to each
    sample separately with positions 0..L−1."""
    from engine.train.megatron_attention import Rope

    torch.manual_seed(5)
    q, k, v = torch.randn(24, 4, 8), torch.randn(24, 2, 8), torch.randn(24, 2, 8)
    rope = Rope(10000.0)
    attn = PackedCoreAttention(SimpleNamespace(context_parallel_size=1, attention_dropout=0.0), 1, rope=rope)
    out = attn(q, k, v, None, packed_seq_params=SimpleNamespace(cu_seqlens_q=CU, max_seqlen_q=9))

    def rot(x, n):  # HF: q·cos + rotate_half(q)·sin for positions 0..n−1
        f = torch.arange(n).float()[:, None] * rope.inv_freq(8)[None]
        emb = torch.cat([f, f], -1)[:, None]
        return x * emb.cos() + torch.cat([-x[..., 4:], x[..., :4]], -1) * emb.sin()

    bounds = CU.tolist()
    qr = torch.cat([rot(q[a:b], b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    kr = torch.cat([rot(k[a:b], b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(out, dense_reference(qr, kr, v, CU).reshape(24, 32), atol=1e-5, rtol=1e-5)


def test_fused_formula_equals_the_reference():
    """The function torch.compile fuses (TP = 1, bf16 logits, temperature) against the reference formula;
    the compiled kernels themselves are checked on the GPU (bench parity, gpu tests)."""
    from engine.train.packed_logprobs import _log_probs_entropy

    torch.manual_seed(6)
    logits = torch.randn(9, 50, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50, (9,))
    lp, ent = _log_probs_entropy(logits, targets, 1 / 0.7, True)
    (lp.sum() + 0.3 * ent.sum()).backward()
    g = logits.grad.clone()
    logits.grad = None
    lp2, ent2 = vocab_parallel_log_probs(logits.float() / 0.7, targets)
    (lp2.sum() + 0.3 * ent2.sum()).backward()
    torch.testing.assert_close(lp, lp2)
    torch.testing.assert_close(ent, ent2)
    torch.testing.assert_close(g, logits.grad)
    _, ent3 = _log_probs_entropy(logits, targets, 1.0, False)
    assert not ent3.requires_grad
