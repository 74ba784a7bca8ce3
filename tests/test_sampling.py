"""Batched device sampling (engine/rollout/sampling.py): per-row reproducible whatever the batch, correct filters.

These run on the CPU; the GPU engine runs the same functions on CUDA tensors.
"""
from __future__ import annotations

import pytest
import torch
from model_families import FAMILIES

from engine.rollout.sampling import BLOCK, counter_uniform, draw, sample_tokens, splitmix64

MASK = (1 << 64) - 1


def splitmix64_reference(z: int) -> int:
    """splitmix64's finaliser on Python ints (Vigna's reference, without the increment)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_splitmix64_on_int64_tensors_equals_the_unsigned_reference():
    xs = [0, 1, 2**31, 2**62 + 12345, 2**63 - 1, 2**64 - 1, 0x9E3779B97F4A7C15]
    signed = torch.tensor([x - 2**64 if x >= 2**63 else x for x in xs], dtype=torch.long)
    got = [v & MASK for v in splitmix64(signed).tolist()]
    assert got == [splitmix64_reference(x) for x in xs]


def test_uniforms_depend_on_seed_and_step_only():
    seeds = torch.tensor([5, 7, 5, 123456789012], dtype=torch.long)
    u = counter_uniform(seeds, 3)
    assert u[0] == u[2] and u[0] != u[1]  # same seed → same draw
    assert counter_uniform(seeds[3:], 3)[0] == u[3]  # alone or in a batch: the same number
    assert counter_uniform(seeds, 4)[0] != u[0]  # the next step draws anew
    for step in range(4):  # small seeds and steps (a user's sampling_seed 0 at the first step) never draw u = 0
        assert bool((counter_uniform(torch.arange(-8, 2000), step) > 0).all())
    many = counter_uniform(torch.arange(20000), 0)
    assert 0 <= float(many.min()) and float(many.max()) < 1
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005


def _knobs(b, temperature=1.0, top_p=1.0, top_k=-1):
    return dict(temperature=torch.full((b,), temperature), top_p=torch.full((b,), top_p),
                top_k=torch.full((b,), top_k, dtype=torch.long))


def test_inverse_cdf_draw_follows_the_distribution():
    # p = softmax(log [0.5, 0.3, 0.2]) = [0.5, 0.3, 0.2]; 30,000 rows, one uniform each → frequencies within ±0.01
    b = 30000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).repeat(b, 1)
    toks = sample_tokens(logits, uniforms=counter_uniform(torch.arange(b), 0), **_knobs(b))
    freq = torch.bincount(toks, minlength=3).double() / b
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.01)
    # temperature 2: p ∝ [0.5, 0.3, 0.2]^(1/2) = [0.7071, 0.5477, 0.4472] / 1.7020 = [0.4155, 0.3218, 0.2628]
    toks = sample_tokens(logits, uniforms=counter_uniform(torch.arange(b), 1), **_knobs(b, temperature=2.0))
    freq = torch.bincount(toks, minlength=3).double() / b
    assert torch.allclose(freq, torch.tensor([0.4155, 0.3218, 0.2628], dtype=torch.float64), atol=0.012)


def test_a_row_draws_the_same_token_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    seeds = torch.tensor([11, 12, 13, 14, 15, 16])
    kw = dict(temperature=torch.tensor([1.0, 0.7, 1.3, 1.0, 0.0, 1.0]), top_p=torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0]),
              top_k=torch.tensor([-1, -1, 5, -1, -1, 3]))
    batch = sample_tokens(logits, uniforms=counter_uniform(seeds, 7), **kw)
    for i in range(6):
        alone = sample_tokens(logits[i:i + 1], uniforms=counter_uniform(seeds[i:i + 1], 7),
                              **{k: v[i:i + 1] for k, v in kw.items()})
        assert int(alone) == int(batch[i]), i
    assert int(batch[4]) == int(logits[4].argmax())  # temperature 0 is greedy


def test_top_k_and_top_p_never_draw_outside_their_set():
    torch.manual_seed(1)
    b = 4000
    logits = torch.randn(1, 30).repeat(b, 1)
    order = logits[0].argsort(descending=True)
    toks = sample_tokens(logits, uniforms=counter_uniform(torch.arange(b), 0), **_knobs(b, top_k=4))
    assert set(toks.tolist()) == set(order[:4].tolist())  # all four drawn, nothing else
    # top-p 0.5: the smallest prefix of the sorted distribution whose mass reaches 0.5
    p = torch.softmax(logits[0], -1)[order]
    keep = int((p.cumsum(0) - p < 0.5).sum())
    toks = sample_tokens(logits, uniforms=counter_uniform(torch.arange(b), 1), **_knobs(b, top_p=0.5))
    assert set(toks.tolist()) == set(order[:keep].tolist())


def reference_draw(logits, *, temperature, top_p, top_k, uniforms):
    """The sampler's definition in one level: filters on the softmax, a full-vocabulary fp64 cumsum, the first
    entry above u × total; greedy rows take the argmax."""
    greedy = temperature <= 0
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    out = []
    for i in range(x.shape[0]):
        p = torch.softmax(x[i].double(), -1)
        if 0 < int(top_k[i]) < x.shape[1]:
            p = p.masked_fill(x[i] < x[i].topk(int(top_k[i])).values[-1], 0.0)
        if float(top_p[i]) < 1:
            sp = p.sort(descending=True).values
            kept = int(((sp.cumsum(0) - sp) <= float(top_p[i]) * sp.sum()).sum())
            p = p.masked_fill(p < sp[kept - 1], 0.0)
        cdf = p.cumsum(0)
        drawn = torch.searchsorted(cdf, uniforms[i] * cdf[-1], right=True)
        out.append(int(x[i].argmax()) if greedy[i] else int(drawn))
    return torch.tensor(out)


def test_the_two_level_draw_equals_the_full_vocabulary_inverse_cdf_and_returns_log_softmax():
    """Several blocks and a short last one (V = 2.5 blocks); peaked and flat rows; every filter; the log-probs are
    log softmax(logits / T) of the unfiltered distribution at the drawn token."""
    g = torch.Generator().manual_seed(3)
    b, V = 64, BLOCK * 2 + BLOCK // 2
    logits = torch.randn(b, V, generator=g) * torch.linspace(0.5, 8, b)[:, None]  # flat to peaked rows
    for knobs in (_knobs(b), _knobs(b, temperature=0.7, top_p=0.9), _knobs(b, top_k=50),
                  dict(temperature=torch.rand(b, generator=g) * 1.5,
                       top_p=torch.where(torch.arange(b) % 3 == 0, 0.8, 1.0),
                       top_k=torch.where(torch.arange(b) % 4 == 1, 200, -1))):
        for step in range(3):
            u = counter_uniform(torch.arange(b) * 7 + 1, step)
            toks, lps = draw(logits, uniforms=u, **knobs)
            assert torch.equal(toks, reference_draw(logits, uniforms=u, **knobs))
            t = knobs["temperature"]
            ref = torch.log_softmax(logits / torch.where(t > 0, t, 1.0)[:, None], -1).gather(-1, toks[:, None])[:, 0]
            assert torch.allclose(lps, ref, atol=1e-5)


def test_the_draw_never_takes_a_filtered_or_padding_token_even_at_the_edges_of_u():
    """u next to 1 and 0 (where rounding could step past the last kept token of a block or into the short block's
    padding): the token is always one of positive probability."""
    V = BLOCK + 10
    logits = torch.full((4, V), -1e4)
    logits[:, 5] = 0.0
    logits[:, BLOCK + 3] = 0.0  # two kept tokens, one in the short block
    uniforms = torch.tensor([0.0, 1 - 2.0 ** -53, 0.5 - 1e-17, 0.5 + 1e-17], dtype=torch.float64)
    toks = sample_tokens(logits, uniforms=uniforms, **_knobs(4, top_k=2))
    assert set(toks.tolist()) <= {5, BLOCK + 3} and int(toks[0]) == 5 and int(toks[1]) == BLOCK + 3


# ---- the engine's GPU decode path, run on the CPU ------------------------------------------------------------
def test_the_device_sampling_path_of_the_engine(tiny_model):
    """Generator with `on_gpu` (what a CUDA engine runs, forced here on the CPU): counter-based draws, last-position
    prefill logits. Log-probs are the served model's; a row's tokens do not depend on the rest of the batch."""
    from engine.modeling import eos_token_ids, load_causal_lm, load_tokenizer
    from engine.rollout.generation import GenRequest, Generator

    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model).eval()
    gen = Generator(model, tok, eos_token_ids(tiny_model, tok))
    gen.on_gpu = True
    prompt = tok("<|im_start|>user\n57+38=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    other = tok("<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    reqs = [GenRequest(rid=f"r{i}", input_ids=prompt, max_new_tokens=8, seed=100 + i) for i in range(6)]
    batch = gen.generate(reqs + [GenRequest(rid="o", input_ids=other, max_new_tokens=8, seed=1, top_k=3)])
    alone = gen.generate([GenRequest(rid="a", input_ids=prompt, max_new_tokens=8, seed=102)])[0]
    assert alone.output_ids == batch[2].output_ids  # same seed, same tokens, with or without other rows
    assert len({tuple(r.output_ids) for r in batch[:6]}) > 1  # different seeds sample differently
    for r in batch:
        assert r.finish_reason["type"] in ("stop", "length") and len(r.output_ids) == len(r.logprobs) <= 8
        seq = r.input_ids + r.output_ids
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        direct = logp[len(r.input_ids) - 1:-1].gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(r.logprobs), direct, atol=1e-4)


def test_the_cpu_engine_prefills_each_distinct_prompt_once(tiny_model):
    """A GRPO group's n rows share one prefill row (the cache is indexed out to them): the same tokens and
    log-probs as each row generated alone, prompt log-probs included, and one prefill row per distinct prompt."""
    from engine.modeling import eos_token_ids, load_causal_lm, load_tokenizer
    from engine.rollout.generation import GenRequest, Generator

    tok = load_tokenizer(tiny_model)
    gen = Generator(load_causal_lm(tiny_model).eval(), tok, eos_token_ids(tiny_model, tok))
    prompts = [tok(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
               for q in ("57+38=", "3+4=")]
    reqs = [GenRequest(rid=f"r{i}", input_ids=prompts[i % 2], max_new_tokens=8, seed=10 + i,
                       logprob_start_len=0 if i == 3 else -1) for i in range(6)]
    batch = gen.generate(reqs)
    assert gen.prefill_rows == 2
    for r, got in zip(reqs, batch):
        alone = gen.generate([r])[0]
        assert got.output_ids == alone.output_ids and got.finish_reason == alone.finish_reason
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    assert batch[3].input_logprobs is not None and batch[3].input_logprobs[0] is None
    one = gen.generate([reqs[3]])[0].input_logprobs
    assert torch.allclose(torch.tensor(batch[3].input_logprobs[1:]), torch.tensor(one[1:]), atol=1e-5)
    assert len({tuple(r.output_ids) for r in batch[0::2]}) > 1  # same prompt, different seeds, different samples


def test_a_device_step_counter_draws_the_same_uniforms_and_known_filters_the_same_tokens():
    """What a CUDA graph uses: the step as an int64 tensor (the same bits as the int), and the filter shape passed
    in instead of read from the tensors (the same tokens)."""
    seeds = torch.tensor([0, 1, 2**61 + 5, 12345])
    for step in (0, 1, 7, 2**40 + 3):
        assert torch.equal(counter_uniform(seeds, step), counter_uniform(seeds, torch.tensor([step])))
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 50, generator=g)
    knobs = {"temperature": torch.tensor([1.0, 0.7, 0.0, 1.3]), "top_p": torch.tensor([1.0, 0.6, 1.0, 0.9]),
             "top_k": torch.tensor([-1, 5, -1, 12])}
    u = counter_uniform(seeds, 3)
    assert torch.equal(sample_tokens(logits, uniforms=u, **knobs),
                       sample_tokens(logits, uniforms=u, filters=(True, 12, True), **knobs))


def test_the_graph_decode_logic_equals_the_eager_loop_on_the_cpu(tiny_model):
    """engine/rollout/cuda_graphs.py without the capture (the CPU cannot capture): a preallocated cache written at
    the step's slot, a 4D mask, the sampler's step on the device. Same tokens and log-probs as the eager loop for
    left-padded prompts of different lengths, padding rows, greedy and sampled rows, a top-k row, a stop token;
    a prompt sent twice is prefilled once."""
    from engine.modeling import eos_token_ids, load_causal_lm, load_tokenizer
    from engine.rollout.cuda_graphs import GraphDecoder
    from engine.rollout.generation import GenRequest, Generator

    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, impl="transformers").eval()  # the GPU's model code
    eager = Generator(model, tok, eos_token_ids(tiny_model, tok))
    eager.on_gpu = True  # the device sampler, on the CPU
    graphed = Generator(model, tok, eos_token_ids(tiny_model, tok))
    graphed.on_gpu = True
    graphed.graphs = GraphDecoder(model, graphed._cache_kw, capture=False)
    prompts = [tok(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
               for q in ("57+38=", "3+4=", "120-99=")]
    reqs = [GenRequest(rid=f"r{i}", input_ids=prompts[i % 3], max_new_tokens=8, seed=100 + i,
                       temperature=0.0 if i == 1 else 1.0, top_k=3 if i == 2 else -1) for i in range(5)]
    a, b = eager.generate(reqs), graphed.generate(reqs)  # 5 rows: a bucket of 8, 3 padding rows
    assert graphed.graphs.graphs and next(iter(graphed.graphs.graphs))[:2] == (8, 256)
    # one prefill row per distinct prompt: 3 prompts + the padding rows' one, copied to the 8 rows' cache
    assert graphed.graphs.prefill_rows == 4
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids and x.finish_reason == y.finish_reason
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert {r.finish_reason["type"] for r in b} <= {"stop", "length"} and any(len(r.output_ids) > 1 for r in b)
    again = graphed.generate(reqs[:4] + reqs[:2])  # 6 rows, same bucket and filters: the same graph, reused
    assert [r.output_ids for r in again] == [r.output_ids for r in a[:4] + a[:2]]
    assert len(graphed.graphs.graphs) == 1
    graphed.generate(reqs[:3])  # 3 rows: a bucket of 4, a second shape
    assert [k[0] for k in graphed.graphs.graphs] == [8, 4]
    # weights that moved (a release and resume of GPU memory re-allocates them): every graph is dropped and
    # captured again over the new addresses, with the same results
    for p in model.parameters():
        p.data = p.data.clone()
    moved = graphed.generate(reqs)
    assert [k[0] for k in graphed.graphs.graphs] == [8] and graphed.graphs.captures == 0  # (no capture on CPU)
    assert [r.output_ids for r in moved] == [r.output_ids for r in a]
    # a row that runs past slot 256: its later steps attend over the next span (slots [0, 512)), same results
    long = [GenRequest(rid="L", input_ids=prompts[0], max_new_tokens=300, seed=7, ignore_eos=True)]
    x, y = eager.generate(long)[0], graphed.generate(long)[0]
    assert len(y.output_ids) == 300 and x.output_ids == y.output_ids
    assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)


def test_decode_attention_folds_query_heads_onto_their_kv_head_with_the_same_result():
    """One query token under grouped-query attention: the folded call equals transformers' sdpa (which repeats K/V
    under a mask) for a padded [B, 1, 1, S] bool mask; other shapes go to sdpa itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.rollout.cuda_graphs import decode_attention

    class Attn(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    class Plain(Attn):
        num_key_value_groups = 1

    g = torch.Generator().manual_seed(0)
    b, hkv, s, d = 4, 2, 37, 16
    q = torch.randn(b, hkv * 3, 1, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    mask = torch.rand(b, 1, 1, s, generator=g) > 0.3
    mask[..., -1] = True
    ours, _ = decode_attention(Attn(), q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(Plain(), q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask,
                                    scaling=0.25)
    assert ours.shape == ref.shape == (b, 1, hkv * 3, d)
    assert torch.allclose(ours, ref, atol=1e-6)
    q2 = torch.randn(b, hkv * 3, 5, d, generator=g)  # a prefill (5 queries): sdpa's own path, same as sdpa
    m2 = torch.ones(b, 1, 5, s, dtype=torch.bool).tril(s - 5)
    assert torch.equal(decode_attention(Attn(), q2, k, v, m2)[0], sdpa_attention_forward(Attn(), q2, k, v, m2)[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_graph_decoder_keeps_sliding_windows_and_logit_softcapping(tiny_model, family):
    """The CUDA-graph decoder's masks are used as given by transformers for every layer, so it narrows them on
    sliding-window layers itself, and runs Gemma 2's capped scores (eager in transformers) on them: its tokens and
    log-probs are transformers' own (its attention and masks, the eager loop), for left-padded prompts longer than
    the window, and for a request that joins the running batch."""
    import copy

    from engine.modeling import eos_token_ids, load_tokenizer
    from engine.rollout.cuda_graphs import GraphDecoder
    from engine.rollout.generation import Feed, GenRequest, Generator
    from model_families import WINDOW, random_model

    tok = load_tokenizer(tiny_model)
    model = random_model(family, len(tok))
    reference = copy.deepcopy(model)  # transformers' own attention: sdpa, or eager (Gemma 2)
    assert reference.config._attn_implementation == ("eager" if family == "gemma2" else "sdpa")
    eos = eos_token_ids(tiny_model, tok)
    eager = Generator(reference, tok, eos)
    eager.on_gpu = True  # the device sampler, on the CPU
    graphed = Generator(model, tok, eos)
    graphed.on_gpu = True
    graphed.graphs = GraphDecoder(model, graphed._cache_kw, capture=False)
    assert graphed.graphs.folded_gqa  # switched to the decoder's attention

    def req(rid, q, n, seed):
        ids = tok(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        return GenRequest(rid=rid, input_ids=ids, max_new_tokens=n, seed=seed, ignore_eos=True)

    reqs = [req(f"r{i}", q, 20, 100 + i) for i, q in enumerate(("57+38=", "3+4=", "120-99=+7"))]
    assert min(len(r.input_ids) for r in reqs) > WINDOW  # the window binds from the prompt on
    a, b = eager.generate(reqs), graphed.generate(reqs)
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
        seq = x.input_ids + x.output_ids  # teacher-forced through transformers' own model, one row
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([seq])).logits[0].float(), -1)
        direct = logp[len(x.input_ids) - 1:-1].gather(-1, torch.tensor(x.output_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(y.logprobs), direct, atol=1e-4)
    # a batch that asks for prompt log-probs runs the eager loop on the decoder's attention (transformers' masks;
    # two prompt lengths: the shorter one's padding queries see no key, and must not turn into NaN)
    scored = [GenRequest(rid=f"p{i}", input_ids=r.input_ids, max_new_tokens=4, seed=3, logprob_start_len=0)
              for i, r in enumerate(reqs[1:])]
    for x, y, r in zip(eager.generate(scored), graphed.generate(scored), scored):
        assert x.output_ids == y.output_ids and len(y.input_logprobs) == len(r.input_ids)
        assert torch.allclose(torch.tensor(x.input_logprobs[1:]), torch.tensor(y.input_logprobs[1:]), atol=1e-4)
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
    # a request that joins the running batch (its prompt prefilled apart, its K/V copied to later slots)
    late = req("late", "8+9=", 12, 7)
    alone = eager.generate([late])[0]
    feed, joined = Feed(), {}
    feed.put([late])
    graphed.generate(reqs, feed=feed, deliver=lambda q, r: joined.setdefault(q.rid, r))
    assert graphed.graphs.joined_rows == 1
    assert joined["late"].output_ids == alone.output_ids
    assert torch.allclose(torch.tensor(joined["late"].logprobs), torch.tensor(alone.logprobs), atol=1e-4)


def test_window_mask_narrows_each_query_to_its_last_w_slots():
    from engine.rollout.cuda_graphs import window_mask

    valid = torch.zeros(2, 1, 1, 12, dtype=torch.bool)
    valid[0, 0, 0, 2:10] = True  # a decode step at slot 9 (a row whose prompt starts at slot 2)
    valid[1, 0, 0, 5:8] = True  # a joined row whose own slot is 7, shorter than the window
    got = window_mask(valid, 4)
    assert got[0, 0, 0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert torch.equal(got[1], valid[1])
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]  # a prefill: query a sees b in (a − 3, a]
    assert torch.equal(window_mask(causal, 3)[0, 0], torch.ones(5, 5, dtype=torch.bool).tril() &
                       torch.ones(5, 5, dtype=torch.bool).triu(-2))
    assert torch.equal(window_mask(window_mask(causal, 3), 3), window_mask(causal, 3))  # a windowed mask: unchanged
    with pytest.raises(TypeError, match="bool mask"):
        window_mask(torch.zeros(1, 1, 1, 4), 2)


def test_decode_attention_refuses_an_argument_it_does_not_implement():
    from engine.rollout.cuda_graphs import decode_attention

    class Attn(torch.nn.Module):
        num_key_value_groups = 1

    q = k = v = torch.randn(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match=r"\['s_aux'\].*--sglang-disable-cuda-graph"):
        decode_attention(Attn(), q, k, v, None, s_aux=torch.zeros(2))
    decode_attention(Attn(), q, k, v, None, position_ids=torch.arange(3)[None], use_cache=True)  # harmless ones


def test_an_fp32_mixture_of_experts_is_known_to_decode_without_cuda_graphs():
    """transformers runs experts through torch's grouped_mm, which reads the host in float32 (a CUDA graph cannot
    hold it; seen on an H100): the engine decides that before any capture and says why; bf16 and dense models keep
    their graphs."""
    from engine.rollout.cuda_graphs import graphs_off_reason
    from model_families import random_model

    moe = random_model("qwen3moe", 64)
    assert "4 experts" in graphs_off_reason(moe) and "grouped_mm" in graphs_off_reason(moe)
    assert graphs_off_reason(moe.to(torch.bfloat16)) is None
    assert graphs_off_reason(random_model("mistral", 64)) is None
