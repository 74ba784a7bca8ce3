"""Random models with the attention features the packed trainer and the graph decoder must reproduce from
transformers: sliding-window layers (Mistral: every layer; Gemma 2: every other one) and attention-logit softcapping
(Gemma 2, whose transformers attention is eager). Used by tests/test_sampling.py (the graph decoder on the CPU) and
tests/test_gpu_flow.py (the engine and the trainer on CUDA)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

#: shorter than the tests' prompts, so that the window binds from the prompt on
WINDOW = 6


def windowed_model(family: str, vocab: int):
    """A random Mistral or Gemma 2 with `vocab` entries; q/k scaled up so that attention is far from uniform and a
    window or a cap left out shows."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    elif family == "gemma2":  # eager: the attention transformers defines Gemma 2 by (some versions load it with
        # sdpa, which leaves the softcapping out)
        model = Gemma2ForCausalLM(Gemma2Config(**common, head_dim=16, attn_logit_softcapping=2.0,
                                               query_pre_attn_scalar=16, attn_implementation="eager"))
    else:
        raise ValueError(family)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10.0)
            layer.self_attn.k_proj.weight.mul_(10.0)
    return model.eval()


def save_windowed(path: Path, family: str, tiny_model: str) -> str:
    """`windowed_model` saved with the bundled model's tokenizer and chat template: a model directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    windowed_model(family, len(tok)).save_pretrained(path)
    for f in Path(tiny_model).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, Path(path) / f.name)
    return str(path)
