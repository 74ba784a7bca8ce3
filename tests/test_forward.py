"""The packed (varlen) forward equals a plain per-sample forward: attention never crosses samples."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from train_fakes import fake_samples, pack

from engine.train.forward import packed_forward, use_varlen_attention
from model_families import FAMILIES

LENGTHS = [(5, 1), (9, 14), (3, 2), (12, 7), (2, 20), (7, 3)]  # (prompt, response) tokens


@pytest.fixture(scope="module")
def qwen2(tiny_model):
    from engine.modeling import load_causal_lm

    ref = load_causal_lm(tiny_model, impl="transformers").eval()  # transformers' sdpa attention, one sample at a time
    packed = copy.deepcopy(ref)
    use_varlen_attention(packed)
    return ref, packed


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    ref = LlamaForCausalLM(cfg).eval()
    packed = copy.deepcopy(ref)
    use_varlen_attention(packed)
    return ref, packed


@functools.lru_cache(maxsize=None)
def family_pair(family: str):
    """A model of another family (tests/model_families.py: sliding windows, softcapping, Gemma's norms, q/k norms,
    a fused qkv projection, experts, Llama 3's RoPE) next to its packed copy; transformers' reference runs its own
    masks and attention (Gemma 2: eager, the only one it defines it by)."""
    from model_families import random_model

    ref = random_model(family, 259)
    packed = copy.deepcopy(ref)
    use_varlen_attention(packed)
    return ref, packed


def models(request, family: str):
    """(reference, packed copy) of the bundled Qwen2 or the Llama fixture, or of a family of model_families."""
    return request.getfixturevalue(family) if family in ("qwen2", "llama") else family_pair(family)


@pytest.fixture(params=["padded", "per-sample"])
def path(request, monkeypatch):
    """Both CPU attention paths of a packed row: padded rows (one SDPA call) and one SDPA call per sample."""
    import engine.train.forward as fw

    monkeypatch.setattr(fw, "PAD_FACTOR", float("inf") if request.param == "padded" else 0.0)
    return request.param


def test_padded_rows_only_when_they_waste_little():
    from engine.train.forward import padded_is_cheaper

    assert padded_is_cheaper([20, 24, 30, 22])  # the demo's micro-batches
    assert not padded_is_cheaper([1000] + [50] * 10)  # 11 × 1000² against 1000² + 10 · 50²
    assert not padded_is_cheaper([7])  # one sample: nothing to batch


def per_sample_reference(model, mb, temperature=1.0):
    """log π and entropy of every trained token, one unpadded sample at a time (no packing, no varlen)."""
    lp, ent = torch.zeros(mb.num_tokens), torch.zeros(mb.num_tokens)
    cu = mb.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        logits = model(input_ids=mb.tokens[None, a:b], use_cache=False).logits[0].float() / temperature  # [L, V]
        logp = torch.log_softmax(logits[:-1], -1)  # [L−1, V] predicts tokens a+1..b−1
        lp[a + 1:b] = logp.gather(-1, mb.tokens[a + 1:b, None]).squeeze(-1)
        ent[a + 1:b] = -(logp.exp() * logp).sum(-1)
    return lp * mb.loss_mask, ent * mb.loss_mask


@pytest.mark.parametrize("family", ("qwen2", "llama") + FAMILIES)
def test_packed_equals_per_sample_forward(family, request, path):
    ref, packed = models(request, family)
    samples = fake_samples(LENGTHS, n=2, seed=1)
    (mb,) = pack(samples, [list(range(len(samples)))])
    with torch.no_grad():
        lp, ent = packed_forward(packed, mb)
        lp_ref, ent_ref = per_sample_reference(ref, mb)
    assert float((lp - lp_ref).abs().max()) <= 1e-5
    assert float((ent - ent_ref).abs().max()) <= 1e-5
    assert (lp[mb.loss_mask > 0] < 0).all()  # real log-probs were compared, not zeros
    assert float((lp * (1 - mb.loss_mask)).abs().max()) == 0.0  # untrained entries are 0


@pytest.mark.parametrize("family", ("llama",) + FAMILIES)
def test_packed_gradients_equal_per_sample_gradients(family, request, path):
    ref, packed = models(request, family)
    samples = fake_samples(LENGTHS[:4], n=2, seed=2)
    (mb,) = pack(samples, [[0, 1, 2, 3]])
    packed.zero_grad()
    packed_forward(packed, mb)[0].sum().backward()
    ref.zero_grad()
    per_sample_reference(ref, mb)[0].sum().backward()
    for (name, p), q in zip(packed.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_sample_does_not_see_its_neighbours(qwen2, path):
    _, packed = qwen2
    a = fake_samples(LENGTHS[:3], n=1, seed=3)
    b = fake_samples(LENGTHS[:3], n=1, seed=4)
    b[1] = a[1]  # same middle sample, different neighbours
    with torch.no_grad():
        (mb_a,), (mb_b,) = pack(a, [[0, 1, 2]]), pack(b, [[0, 1, 2]])
        lp_a, lp_b = packed_forward(packed, mb_a)[0], packed_forward(packed, mb_b)[0]
    s, e = int(mb_a.cu_seqlens[1]), int(mb_a.cu_seqlens[2])
    assert int(mb_b.cu_seqlens[1]) == s  # same offset: only the neighbours' tokens differ
    torch.testing.assert_close(lp_a[s:e], lp_b[s:e], rtol=0, atol=1e-6)
    assert float((lp_a[e:] - lp_b[e:]).abs().max()) > 1e-3  # the neighbours themselves did change


def test_log_probs_are_at_the_rollout_temperature(qwen2):
    ref, packed = qwen2
    (mb,) = pack(fake_samples(LENGTHS[:2], n=2, seed=5), [[0, 1]])
    with torch.no_grad():
        lp, _ = packed_forward(packed, mb, temperature=0.7)
        lp_ref, _ = per_sample_reference(ref, mb, temperature=0.7)
        lp1, _ = packed_forward(packed, mb, temperature=1.0)
    assert float((lp - lp_ref).abs().max()) <= 1e-5
    assert float((lp - lp1).abs().max()) > 1e-3


def test_varlen_attention_refuses_unpacked_calls(qwen2):
    _, packed = qwen2
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packed(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def grpo_samples(seed: int, prompts=((6, (1, 5, 3, 8)), (4, (2, 7)), (9, (4,)))) -> list:
    """Groups of samples that repeat their prompt (GRPO), of different response lengths, plus a lone sample;
    one response has an untrained middle token and one sample is not trained at all."""
    from engine.samples import Sample, Status

    g = torch.Generator().manual_seed(seed)
    out = []
    for gi, (p, resp) in enumerate(prompts):
        prompt = torch.randint(0, 259, (p,), generator=g).tolist()
        for r in resp:
            toks = prompt + torch.randint(0, 259, (r,), generator=g).tolist()
            out.append(Sample(index=len(out), group_index=gi, rollout_id=0, prompt="x", tokens=toks,
                              response_length=r, loss_mask=[1] * r, rollout_log_probs=[-1.0] * r,
                              status=Status.COMPLETED))
    out[1].loss_mask[2] = 0  # a tool-output-like token inside a response: not trained, still attended to
    out[5].status = Status.FAILED  # never trained: left out of the compact row
    return out


@pytest.mark.parametrize("family", ("qwen2", "llama") + FAMILIES)
def test_shared_prompts_give_the_per_sample_log_probs(family, request):
    from engine.train.forward import shared_layout

    ref, packed = models(request, family)
    samples = grpo_samples(seed=7)
    (mb,) = pack(samples, [[4, 0, 1, 6, 2, 3, 5]])  # group members need not be adjacent
    keep = (mb.loss_mask > 0).nonzero().squeeze(-1)
    layout = shared_layout(mb, keep)
    assert layout is not None
    # prompts 6 (4 samples) + 4 (one trained sample) + 9 (lone): each prompt once, the failed sample left out
    assert layout.tokens.numel() == 6 + (1 + 5 + 3 + 8) + 4 + 2 + 9 + 4
    assert layout.tokens.numel() < mb.num_tokens
    with torch.no_grad():
        lp, ent = packed_forward(packed, mb, share_prefix=True)
        lp_plain, _ = packed_forward(packed, mb)
        lp_ref, ent_ref = per_sample_reference(ref, mb)
    assert float((lp - lp_ref).abs().max()) <= 1e-5
    assert float((ent - ent_ref).abs().max()) <= 1e-5
    assert float((lp - lp_plain).abs().max()) <= 1e-5
    assert (lp[mb.loss_mask > 0] < 0).all() and float((lp * (1 - mb.loss_mask)).abs().max()) == 0.0


@pytest.mark.parametrize("family", ("llama",) + FAMILIES)
def test_shared_prompts_give_the_per_sample_gradients(family, request):
    ref, packed = models(request, family)
    samples = grpo_samples(seed=8)
    (mb,) = pack(samples, [list(range(len(samples)))])
    w = torch.randn(mb.num_tokens, generator=torch.Generator().manual_seed(0))  # a loss that weighs every token
    packed.zero_grad()
    lp, ent = packed_forward(packed, mb, share_prefix=True)
    ((lp * w).sum() + ent.sum()).backward()
    ref.zero_grad()
    lp_r, ent_r = per_sample_reference(ref, mb)
    ((lp_r * w).sum() + ent_r.sum()).backward()
    for (name, p), q in zip(packed.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_no_shared_prompt_keeps_the_plain_layout():
    from engine.train.forward import shared_layout

    (mb,) = pack(fake_samples(LENGTHS, n=1, seed=9), [list(range(len(LENGTHS)))])  # every prompt different
    assert shared_layout(mb, (mb.loss_mask > 0).nonzero().squeeze(-1)) is None


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_chunked_log_probs_give_the_whole_heads_values_and_gradients(family, share, request):
    """--log-probs-chunk-size: the head and log-softmax run 5 positions at a time (recomputed in the backward);
    values, entropies and every gradient match the whole head's, with the chunked head's own forward restored."""
    _, packed = request.getfixturevalue(family)
    samples = grpo_samples(seed=10)
    (mb,) = pack(samples, [list(range(len(samples)))])
    w = torch.randn(mb.num_tokens, generator=torch.Generator().manual_seed(1))
    runs = []
    for chunk in (0, 5):
        packed.zero_grad()
        lp, ent = packed_forward(packed, mb, share_prefix=share, chunk=chunk, temperature=0.8)
        ((lp * w).sum() + 0.3 * ent.sum()).backward()
        runs.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in packed.named_parameters()}))
    assert int((mb.loss_mask > 0).sum()) > 3 * 5  # several chunks, the last one partial
    (lp0, ent0, g0), (lp5, ent5, g5) = runs
    torch.testing.assert_close(lp5, lp0, rtol=1e-6, atol=1e-5)  # the matrix product's rounding only
    torch.testing.assert_close(ent5, ent0, rtol=1e-6, atol=1e-5)
    assert (lp5[mb.loss_mask > 0] < 0).all() and float((lp5 * (1 - mb.loss_mask)).abs().max()) == 0.0
    for name in g0:
        # the weight gradients sum the chunks' shares in another order: rounding, |g| up to ~11 here
        torch.testing.assert_close(g5[name], g0[name], rtol=1e-4, atol=5e-5, msg=name)
    assert "forward" not in vars(packed.lm_head)  # the head's own forward is back
    with torch.no_grad():
        assert packed(input_ids=mb.tokens[None], position_ids=mb.position_ids[None], use_cache=False,
                      cu_seq_lens_q=mb.cu_seqlens.int(), cu_seq_lens_k=mb.cu_seqlens.int(),
                      max_length_q=mb.max_seqlen, max_length_k=mb.max_seqlen).logits.shape[-1] == 259


def _head_inputs(K: int, H: int, V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states [K, H] and head weight [V, H] (both trained) and targets [K]."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(K, H, generator=g).requires_grad_(), torch.randn(V, H, generator=g).requires_grad_(),
            torch.randint(0, V, (K,), generator=g))


def test_chunked_log_probs_hold_one_chunks_logits_at_a_time():
    """The memory the flag is for: the largest tensor autograd saves for the backward of the head is a chunk's
    hidden states, never [K, V] logits (counted with saved-tensor hooks)."""
    from engine.train.forward import chunked_log_probs

    K, H, V = 64, 16, 1000
    hidden, weight, targets = _head_inputs(K, H, V)
    sizes = []

    def pack_hook(t):
        sizes.append(t.numel())
        return t

    from engine.train.forward import token_log_probs

    for chunk in (None, 8):  # None: the whole head, as without the flag
        sizes.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            if chunk is None:
                lp, ent = token_log_probs(torch.nn.functional.linear(hidden, weight), targets, temperature=1.0,
                                          fused=False)
            else:
                lp, ent = chunked_log_probs(hidden, weight, targets, chunk=chunk, temperature=1.0, fused=False)
        biggest = max(s for s in sizes if s != V * H)  # the weight itself is saved either way
        if chunk is None:
            whole = biggest
        (lp.sum() + ent.sum()).backward()
    assert whole >= K * V  # the whole head: the [K, V] logits (or their log-softmax) are kept
    assert biggest <= 8 * H  # chunks of 8: only each chunk's [8, H] input is kept


def test_chunks_run_the_compiled_log_softmax_in_their_recomputation(monkeypatch):
    """The CUDA path's compiled kernel (fused_log_probs) inside the chunks' checkpoints: with the checkpoint's early
    stop the recomputation raised through the compiled code (found on the H100). Compiled here by AOTAutograd
    without inductor's code generation (the same failure, ~10× faster than inductor on this CPU); the GPU tests
    run inductor's kernel."""
    import engine.train.packed_logprobs as pl
    from engine.train.forward import chunked_log_probs, token_log_probs
    from engine.train.packed_logprobs import _FUSED

    if torch.cuda.is_available():  # on a GPU machine the compile would initialise CUDA inside the checkpoint's
        torch.cuda.init()  # forward, which the checkpoint refuses (a trainer on a GPU has it initialised long before)
    monkeypatch.setitem(_FUSED, "fn", torch.compile(pl._log_probs_entropy, dynamic=False, backend="aot_eager"))
    monkeypatch.setitem(_FUSED, "error", None)
    hidden, weight, targets = _head_inputs(40, 16, 300)
    grads = []
    for chunked in (True, False):
        hidden.grad = weight.grad = None
        if chunked:
            lp, ent = chunked_log_probs(hidden, weight, targets, chunk=16, temperature=0.7, fused=True)
        else:
            lp, ent = token_log_probs(torch.nn.functional.linear(hidden, weight), targets, temperature=0.7,
                                      fused=False)
        (lp.sum() + 0.5 * ent.sum()).backward()
        grads.append((lp.detach(), hidden.grad.clone(), weight.grad.clone()))
    assert _FUSED["error"] is None, _FUSED["error"]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_kernel_that_does_not_compile_is_said_once_and_the_eager_formula_gives_the_same_numbers(monkeypatch,
                                                                                                   caplog):
    import engine.train.packed_logprobs as pl

    def broken(*a):
        raise RuntimeError("no Triton on this node")

    monkeypatch.setitem(pl._FUSED, "fn", broken)
    monkeypatch.setitem(pl._FUSED, "error", None)
    logits, targets = torch.randn(6, 11), torch.randint(0, 11, (6,))
    with caplog.at_level("WARNING", logger="rollflow"):
        got = [pl.fused_log_probs(logits, targets, temperature=0.7) for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if "compiled log-prob kernel did not build" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: no Triton on this node" in said[0]
    want = pl._log_probs_entropy(logits, targets, 1 / 0.7, True)
    for lp, ent in got:
        torch.testing.assert_close(lp, want[0])
        torch.testing.assert_close(ent, want[1])


def test_the_flag_refuses_a_head_it_cannot_chunk_and_bad_sizes():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from engine.config import RunConfig
    from engine.diagnosis import ConfigError
    from engine.train.forward import check_chunkable

    cfg = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0)
    assert "final_logit_softcapping" in check_chunkable(Gemma2ForCausalLM(cfg))
    for bad in (0, -2):
        with pytest.raises(ConfigError, match="log-probs-chunk-size"):
            RunConfig(log_probs_chunk_size=bad)
    with pytest.raises(ConfigError, match="TP = 1"):
        RunConfig(log_probs_chunk_size=1024, train_backend="megatron", tensor_model_parallel_size=2)
