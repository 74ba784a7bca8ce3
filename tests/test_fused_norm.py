"""engine/rollout/fused.py: the fused RMSNorm computes what transformers' RMSNorm computes (CPU, the bundled model)."""
import torch

from engine.config.data import BUNDLED_MODEL
from engine.modeling import load_causal_lm
from engine.rollout.fused import fuse_rms_norms


def test_fused_rms_norm_matches_transformers():
    ref = load_causal_lm(BUNDLED_MODEL, dtype="float32", device="cpu", impl="transformers").eval()
    ids = torch.randint(0, ref.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    for exact in (True, False):
        model = load_causal_lm(BUNDLED_MODEL, dtype="float32", device="cpu", impl="transformers").eval()
        n = fuse_rms_norms(model, exact=exact)
        assert n == 2 * model.config.num_hidden_layers + 1  # two per layer and the final norm
        with torch.no_grad():
            got = model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bf16: the exact variant rounds as transformers does (normalise in fp32, round, times the weight); the
    # engine's one-kernel variant rounds once, so it is within a bf16 rounding of it
    norm = next(m for m in ref.modules() if type(m).__name__.endswith("RMSNorm"))
    x = torch.randn(64, norm.weight.shape[0], generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
        norm.to(torch.bfloat16)
        want = norm(x)
        fuse_rms_norms(norm, exact=True)
        assert torch.equal(norm(x), want)
        fuse_rms_norms(norm)
        torch.testing.assert_close(norm(x), want, rtol=2 ** -7, atol=0)


def test_fused_rotary_leaves_cpu_and_autograd_calls_to_transformers():
    """fuse_rotary replaces the modeling module's apply_rotary_pos_emb for every model of the class; the Triton
    kernel only takes CUDA bf16/fp16 inference calls (checked bitwise on a GPU by bench/gpu_fused_norm.py), so a
    CPU model — the trainer's, the tests' — computes exactly what it did, with and without autograd."""
    import sys

    from engine.rollout.fused import fuse_rotary, unfuse_rotary

    model = load_causal_lm(BUNDLED_MODEL, dtype="float32", device="cpu", impl="transformers").eval()
    mod = sys.modules[type(model).__module__]
    orig = mod.apply_rotary_pos_emb
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    try:
        assert fuse_rotary(model) and fuse_rotary(model)  # idempotent
        assert mod.apply_rotary_pos_emb is not orig and mod.apply_rotary_pos_emb.original is orig
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, want)
        out = model(input_ids=ids).logits
        out.sum().backward()  # autograd goes through transformers' function
        assert torch.equal(out.detach(), want)
    finally:
        unfuse_rotary(model)
    assert mod.apply_rotary_pos_emb is orig


def test_an_rms_norm_of_another_formula_keeps_its_own_forward():
    """Gemma's RMSNorm multiplies by (1 + w), not w (its weights start at 0): fusing it as x̂ · w would zero every
    hidden state (found on an H100: a Gemma 2 engine's log-probs were log(1/V), every token alike)."""
    from model_families import random_model

    model = random_model("gemma2", 259)
    ids = torch.randint(0, 259, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert fuse_rms_norms(model) == 0
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=0)
        assert float(want.std()) > 0.01  # real logits, not a uniform row
