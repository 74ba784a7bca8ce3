"""The model's shape, read once from its Hugging Face config.json: what the FLOPs estimate (engine.packing.flops),
the Megatron mapping and model (engine.train.megatron_*) and the benchmarks need. One class, one reader.

`read(model_dir)` caches per file (path, size, mtime): the pack stage asks every rollout without re-reading it.
Families the Megatron mapping cannot build are refused there (megatron_mapping.shape_from_hf_config), not here:
the FLOPs estimate works for any decoder config with the five required keys.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.diagnosis import ConfigError, Diagnosis

REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int  # h
    num_heads: int  # a
    num_kv_heads: int  # g
    head_dim: int  # d
    ffn_hidden_size: int  # f of a dense layer
    vocab_size: int  # V (unpadded)
    num_moe_layers: int = 0  # layers whose MLP is a mixture of experts (the rest are dense)
    moe_ffn_hidden_size: int = 0  # active MLP width of an MoE layer: top_k·f_expert + f_shared
    family: str = ""  # config.json's model_type: "qwen2" | "qwen3" | "llama" | …
    num_experts: int = 0  # routed experts of an MoE layer (0: dense)
    moe_top_k: int = 0  # experts per token
    moe_expert_ffn: int = 0  # f of one expert
    moe_norm_topk: bool = False  # the top-k routing weights renormalised to sum 1 (Qwen's norm_topk_prob; Mixtral)
    moe_dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP (Qwen's mlp_only_layers, …)
    moe_shared_ffn: int = 0  # f of the shared expert every token also goes through (Qwen2-MoE; 0: none)
    moe_shared_gate: bool = False  # the shared expert's output scaled by sigmoid(x · w) (Qwen2-MoE's gate)
    sliding_window: int = 0  # Mistral, Mixtral: each layer attends to itself and the W − 1 tokens before (0: full)
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: always; Qwen2-MoE: qkv_bias (default on); Llama / Qwen3: attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_type: str = "default"  # rope_parameters / rope_scaling type
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # its other keys (factor, …), sorted

    @property
    def rope_scaling_factor(self) -> float | None:
        factor = dict(self.rope_scaling).get("factor")
        return None if self.rope_type == "default" or factor is None else float(factor)

    @staticmethod
    def from_hf_config(config: dict[str, Any] | str | Path) -> "ModelShape":
        """A Hugging Face config dict, or config.json / the model directory (read through the cache)."""
        if not isinstance(config, dict):
            return read(config)
        c = config.get("text_config", config)  # multimodal configs nest the language model's
        missing = [k for k in REQUIRED if not c.get(k)]
        if missing:
            raise ConfigError(Diagnosis(
                code="MODEL", severity="error",
                what=f"the model config lacks {', '.join(missing)}: its shape (the FLOPs estimate that balances DP "
                     "ranks, the Megatron model) cannot be known",
                fix=f"--hf-checkpoint a Hugging Face decoder model (config.json with {', '.join(REQUIRED)})",
                facts={"missing": missing}))
        h, a, layers = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["num_hidden_layers"])
        top_k = c.get("num_experts_per_tok") or c.get("moe_router_topk") or 0
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
        family = c.get("model_type") or ""
        moe_layers, moe_f, dense, shared = 0, 0, (), 0
        if top_k and experts:  # Qwen-MoE / DeepSeek name the expert width; Mixtral's experts are intermediate_size
            f_expert = c.get("moe_intermediate_size") or c["intermediate_size"]
            dense = moe_dense_layers(c, layers)
            moe_layers = layers - len(dense)
            shared = int(c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * f_expert)
            moe_f = top_k * f_expert + shared
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        # transformers' own defaults: no num_key_value_heads = multi-head attention, no head_dim = h / a
        return ModelShape(
            num_layers=layers, hidden_size=h, num_heads=a, num_kv_heads=int(c.get("num_key_value_heads") or a),
            head_dim=int(c.get("head_dim") or h // a), ffn_hidden_size=int(c["intermediate_size"]),
            vocab_size=int(c["vocab_size"]), num_moe_layers=moe_layers, moe_ffn_hidden_size=moe_f, family=family,
            num_experts=int(experts if moe_layers else 0), moe_top_k=int(top_k if moe_layers else 0),
            moe_expert_ffn=int(c.get("moe_intermediate_size") or c["intermediate_size"]) if moe_layers else 0,
            # Mixtral's router always renormalises its top k (its config has no norm_topk_prob)
            moe_norm_topk=family == "mixtral" or bool(c.get("norm_topk_prob", False)),
            moe_dense_layers=dense if moe_layers else (), moe_shared_ffn=shared if moe_layers else 0,
            moe_shared_gate=bool(moe_layers and shared and family == "qwen2_moe"),
            sliding_window=int(c.get("sliding_window") or 0) if family in ("mistral", "mixtral") else 0,
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(c.get("qkv_bias", True)))
            or bool(c.get("attention_bias", False)), qk_norm=family in ("qwen3", "qwen3_moe"),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta") or 10000.0)),
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            rope_type=str(rope.get("rope_type", rope.get("type", "default"))),
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if k not in ("rope_theta", "rope_type", "type")
                                      and not isinstance(v, (list, dict)))))


def moe_dense_layers(c: dict[str, Any], layers: int) -> tuple[int, ...]:
    """The layers of a mixture-of-experts config whose MLP is dense, as transformers builds them: Qwen-MoE's
    `mlp_only_layers`, and otherwise every layer i with (i + 1) not a multiple of `decoder_sparse_step`; DeepSeek's
    first `first_k_dense_replace` layers."""
    only = {int(i) for i in c.get("mlp_only_layers") or []}
    step = int(c.get("decoder_sparse_step") or 1)
    first = int(c.get("first_k_dense_replace") or 0)
    return tuple(i for i in range(layers) if i in only or (i + 1) % step or i < first)


def read(model: str | Path) -> ModelShape:
    """The shape in a model directory's config.json (or that file), read once per version of the file."""
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    st = path.stat()
    return _read(str(path.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=16)
def _read(path: str, size: int, mtime_ns: int) -> ModelShape:
    return ModelShape.from_hf_config(json.loads(Path(path).read_text()))
