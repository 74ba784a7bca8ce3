"""Random small models of the families users train, with the attention and norm features that the packed trainer
and the engine's CUDA-graph decoder must reproduce from transformers: sliding-window layers (Mistral: every layer;
Gemma 2 and 3: some layers), attention-logit softcapping (Gemma 2, whose transformers attention is eager), Gemma's
x̂ · (1 + w) RMSNorm, q/k norms (OLMo 2), a fused qkv projection (Phi-3), experts (Qwen3-MoE; Mixtral, with a
window and its checkpoint's block_sparse_moe names; Qwen2-MoE, with a gated shared expert and a dense first layer) and
Llama 3's RoPE scaling. Used by tests/test_forward.py and tests/test_sampling.py (CPU) and tests/test_gpu_flow.py (CUDA)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

#: shorter than the tests' prompts, so that a window binds from the prompt on
WINDOW = 6
#: families with sliding-window layers or softcapping (the ones whose attention the tests check most closely)
WINDOWED = ("mistral", "gemma2")
FAMILIES = WINDOWED + ("gemma3", "phi3", "olmo2", "qwen3moe", "mixtral", "qwen2moe", "llama3rope")


def random_model(family: str, vocab: int):
    """A random 2-layer model of `family` with `vocab` entries; q/k scaled up so that attention is far from uniform
    and a window or a cap left out shows."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    window = dict(sliding_window=WINDOW)
    config = {
        "mistral": lambda: T.MistralConfig(**common, **window),
        # eager: the attention transformers defines Gemma 2 by (some versions load it with sdpa, which leaves the
        # softcapping out)
        "gemma2": lambda: T.Gemma2Config(**common, **window, head_dim=16, attn_logit_softcapping=2.0,
                                         query_pre_attn_scalar=16, attn_implementation="eager"),
        "gemma3": lambda: T.Gemma3TextConfig(**common, **window, head_dim=16, query_pre_attn_scalar=16,
                                             layer_types=["sliding_attention", "full_attention"]),
        "phi3": lambda: T.Phi3Config(**common),
        "olmo2": lambda: T.Olmo2Config(**common),
        "qwen3moe": lambda: T.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32),
        "mixtral": lambda: T.MixtralConfig(**common, **window, num_local_experts=4, num_experts_per_tok=2),
        "qwen2moe": lambda: T.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=48, decoder_sparse_step=2),
        "llama3rope": lambda: T.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}),
    }[family]()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for name in ("q_proj", "k_proj"):
                if hasattr(attn, name):
                    getattr(attn, name).weight.mul_(10.0)
            if hasattr(attn, "qkv_proj"):  # Phi-3: q and k are the first rows of the fused projection
                attn.qkv_proj.weight[:config.num_attention_heads * config.hidden_size // config.num_attention_heads
                                     + config.num_key_value_heads * config.hidden_size
                                     // config.num_attention_heads].mul_(10.0)
    return model.eval()


def save_model(path: Path, family: str, tiny_model: str) -> str:
    """`random_model` saved with the bundled model's tokenizer and chat template: a model directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    random_model(family, len(tok)).save_pretrained(path)
    for f in Path(tiny_model).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, Path(path) / f.name)
    return str(path)
