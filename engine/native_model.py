"""rollflow's own model code for the Llama family (Qwen2, Qwen3, Llama) on the CPU: transformers' modules, parameter
names, parameter order and arithmetic, without transformers' modeling tree.

Why: importing `transformers.models.qwen2.modeling_qwen2` imports `torch.distributed.tensor`, `torch._dynamo`,
`scipy.optimize` and accelerate, while a Qwen2 forward uses none of them. Loading the bundled model in a process
that already has torch and the tokenizer took 1.8–2.2 s of CPU, and takes 0.16–0.19 s with this code (3 runs each).
A train worker imports torch._dynamo anyway, for AdamW (0.8–0.9 s), so there the model and its optimizer go from
1.8–2.2 s to 1.0–1.1 s; an engine's own process keeps the whole difference. On the 2-core machine that is paid
during the run's start-up, CPU-bound beside Ray, Prefect's API server and the driver (bench/results/trl_race.md).

What it covers (`unsupported` says why a model is not covered; --model-impl auto then loads transformers' class):
- model_type qwen2 (q/k/v bias), qwen3 (RMSNorm over head_dim on q and k before RoPE), llama (attention_bias);
- default RoPE (no scaling), SiLU MLP, no sliding-window layers, no MoE, safetensors weights with transformers' names;
- the CPU. On a GPU the built-in engine's CUDA graphs and fused kernels hook transformers' modules
  (engine/rollout/cuda_graphs.py, fused.py), so the GPU keeps transformers' classes.

The calls rollflow makes are the ones it makes of transformers' model: `model(input_ids, position_ids, ...,
logits_to_keep=...)` with the packed-training attention (engine/train/forward.py: `cu_seq_lens_q`, `rollflow_shared`
passed through to it), and the engine's batched generation (`attention_mask` with left padding, `use_cache`, `cache`,
`cache.reorder_cache`). SDPA is called as transformers' sdpa path calls it (GQA through `enable_gqa` without a mask,
the query packed per KV head for a one-token decode with a mask, repeated K/V otherwise; `is_causal` only without a
mask), so the numbers are the same.

Invariant (tests/test_native_model.py): logits equal transformers' bit for bit in float32 on the CPU, per family: the
packed training forward (plain and shared prompts) and its gradients, and generation (a left-padded prefill, then
decode steps over the cache); `state_dict()` has transformers' names in transformers' order.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.diagnosis import ConfigError
from engine.model_shape import ModelShape

FAMILIES = ("qwen2", "qwen3", "llama")
SDPA = "sdpa"


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory (one file, or the shards its index names)."""
    d = Path(path)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [d / "model.safetensors"] if (d / "model.safetensors").is_file() else []


def unsupported(path: str | Path, device: str = "cpu") -> str | None:
    """Why the native code cannot run the model in `path` on `device`; None when it can."""
    if not str(device).startswith("cpu"):
        return f"device {device} (the native code is the CPU's; a GPU keeps transformers' classes)"
    f = Path(path) / "config.json"
    if not f.is_file():
        return f"no config.json in {path}"
    try:
        c = json.loads(f.read_text())
        shape = ModelShape.from_hf_config(c)
    except (ValueError, ConfigError) as e:  # transformers' loader reports such a config its own way
        return f"config.json: {e}"
    family = c.get("model_type")
    if family not in FAMILIES:
        return f"model_type {family!r} (native: {', '.join(FAMILIES)})"
    if "text_config" in c or c.get("quantization_config"):
        return "a nested text_config or a quantization_config"
    if c.get("hidden_act", "silu") != "silu":
        return f"hidden_act {c.get('hidden_act')!r} (native: silu)"
    if c.get("mlp_bias") or (c.get("pretraining_tp") or 1) != 1:
        return "mlp_bias or pretraining_tp"
    if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or []):
        return "sliding-window layers"
    if shape.rope_type != "default":
        return f"RoPE type {shape.rope_type!r} (native: default)"
    if shape.num_moe_layers:
        return "mixture-of-experts layers"
    try:
        if not weight_files(path):
            return "no safetensors weights (model.safetensors or its index)"
    except (ValueError, KeyError) as e:  # an index that is not JSON, or without a weight_map
        return f"model.safetensors.index.json: {e!r}"
    return None


class NativeConfig:
    """config.json's keys as attributes (the ones callers read: vocab_size, max_position_embeddings,
    tie_word_embeddings, ...), its shape, and the attention the model calls."""

    def __init__(self, raw: dict[str, Any]):
        for k, v in raw.items():
            setattr(self, k, v)
        self.raw = dict(raw)  # after: a key of that name in config.json does not replace it
        self.shape = ModelShape.from_hf_config(raw)
        self.tie_word_embeddings = self.shape.tie_embeddings
        self.attention_dropout = float(raw.get("attention_dropout") or 0.0)
        self._attn_implementation = SDPA
        self.attention: Callable = sdpa_attention


class Output(dict):
    """transformers' ModelOutput as rollflow reads it: keys and attributes (logits, cache, last_hidden_state)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class KVCache:
    """Per layer, the keys and values seen so far ([b, Hkv, L, D] each), appended per forward (as DynamicCache)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.keys) <= layer:
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=-2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=-2)
        return self.keys[layer], self.values[layer]

    def reorder_cache(self, index: torch.Tensor) -> None:
        """Rows `index` of the batch (the engine's prefill of distinct prompts → every row)."""
        self.keys = [k.index_select(0, index.to(k.device)) for k in self.keys]
        self.values = [v.index_select(0, index.to(v.device)) for v in self.values]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, Hkv, L, D] → [b, Hkv·n_rep, L, D], each KV head repeated for its query heads."""
    if n_rep == 1:
        return x
    b, hkv, n, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, n, d).reshape(b, hkv * n_rep, n, d)


def sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """query [b, H, q, D], key/value [b, Hkv, kv, D], mask [b, 1, q, kv] bool or None → [b, q, H, D]."""
    n_rep, q_len = module.num_key_value_groups, query.shape[2]
    extra = {}
    if n_rep > 1:
        if attention_mask is None and key.shape[-1] <= 256:
            extra["enable_gqa"] = True
        elif q_len == 1:  # one token: the query's heads become the positions of their KV head
            query = query.reshape(query.shape[0], query.shape[1] // n_rep, n_rep, query.shape[-1])
        else:
            key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=q_len > 1 and attention_mask is None, **extra)
    return out.reshape(out.shape[0], -1, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def causal_mask(attention_mask: torch.Tensor | None, q_len: int, past: int) -> torch.Tensor | None:
    """[b, 1, q, kv] bool (True: attend) for query positions past … past+q−1 over kv = past+q keys, from a 2D
    padding mask [b, kv]; None where SDPA's `is_causal` (or no mask) is the same: no padding and q = 1 or q = kv."""
    kv = past + q_len
    pad = None if attention_mask is None else attention_mask[:, -kv:].bool()
    if (q_len == 1 or past == 0) and (pad is None or bool(pad.all())):
        return None
    dev = attention_mask.device if attention_mask is not None else None
    causal = torch.arange(kv, device=dev)[None, :] <= torch.arange(past, kv, device=dev)[:, None]  # [q, kv]
    mask = causal[None, None]
    return mask & pad[:, None, None, :] if pad is not None else mask


class Linear(nn.Linear):
    """nn.Linear without its random init: the weights come from the checkpoint (`load` builds the model on the meta
    device, where nn's init goes through torch._refs and imports torch._dynamo: ~1.2 s of CPU)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without its random init (as Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def inv_freq(shape: ModelShape) -> torch.Tensor:
    """[D/2] RoPE's inverse frequencies θ^(−2i/D), float32."""
    d = shape.head_dim  # on the CPU also while `load` builds the model on the meta device
    return 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device="cpu") / d))


class Rotary(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(shape), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [b, T, D] at the positions [b, T], in x's dtype."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: NativeConfig, layer: int):
        super().__init__()
        s = config.shape
        self.config, self.layer_idx, self.head_dim = config, layer, s.head_dim
        self.num_key_value_groups = s.num_heads // s.num_kv_heads
        self.scaling = s.head_dim ** -0.5
        self.is_causal = True
        self.q_proj = Linear(s.hidden_size, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        # Qwen2's output projection has no bias; Llama's and Qwen3's follow attention_bias
        self.o_proj = Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.qkv_bias and s.family != "qwen2")
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, **kwargs) -> torch.Tensor:
        heads = (*x.shape[:-1], -1, self.head_dim)
        q, k = self.q_proj(x).view(heads), self.k_proj(x).view(heads)  # [b, T, H(kv), D]
        if self.config.shape.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), self.v_proj(x).view(heads).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, T, D]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, _ = self.config.attention(self, q, k, v, mask, dropout=self.config.attention_dropout if self.training
                                       else 0.0, scaling=self.scaling, sliding_window=None, **kwargs)
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gate_proj = Linear(shape.hidden_size, shape.ffn_hidden_size, bias=False)
        self.up_proj = Linear(shape.hidden_size, shape.ffn_hidden_size, bias=False)
        self.down_proj = Linear(shape.ffn_hidden_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: NativeConfig, layer: int):
        super().__init__()
        s = config.shape
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, **kwargs) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, cache, **kwargs)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    """The decoder without its LM head (`model.model`, transformers' base model)."""

    def __init__(self, config: NativeConfig):
        super().__init__()
        s = config.shape
        self.config = config
        pad = config.raw.get("pad_token_id")
        # transformers' padding_idx: the pad token's embedding row gets no gradient
        self.embed_tokens = Embedding(s.vocab_size, s.hidden_size,
                                         pad if isinstance(pad, int) and 0 <= pad < s.vocab_size else None)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.norm_eps)
        self.rotary_emb = Rotary(s)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None, use_cache: bool = False,
                **kwargs) -> Output:
        h = self.embed_tokens(input_ids)  # [b, T, h]
        if use_cache and cache is None:
            cache = KVCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + h.shape[1], device=h.device)[None]
        # SDPA gets a causal ∧ padding mask; another attention (the packed training one) reads its own kwargs
        mask = causal_mask(attention_mask, h.shape[1], past) if self.config.attention is sdpa_attention \
            else attention_mask
        cos, sin = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, cache, **kwargs)
        return Output(last_hidden_state=self.norm(h), cache=cache if use_cache else None)


class NativeCausalLM(nn.Module):
    """A Llama-family causal LM with transformers' parameter names (`model.layers.0.self_attn.q_proj.weight`, …)."""

    base_model_prefix = "model"

    def __init__(self, config: NativeConfig):
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = Linear(config.shape.hidden_size, config.shape.vocab_size, bias=False)
        self.tie_weights()

    @property
    def base_model(self) -> Body:
        return self.model

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0, **kwargs) -> Output:
        """logits [b, T', V] of the positions `logits_to_keep` names (an int: the last ones, 0 = all; a 1-D
        tensor: those positions), and the cache when `use_cache`."""
        out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         use_cache=use_cache, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return Output(logits=self.lm_head(out.last_hidden_state[:, keep, :]), cache=out.cache)

    def set_attention(self, name: str, fn: Callable) -> None:
        """The attention every layer calls (transformers' AttentionInterface signature), by name."""
        self.config._attn_implementation, self.config.attention = name, fn

    def save_pretrained(self, path: str | Path) -> None:
        """config.json (the source's, with this model's dtype) and model.safetensors (a tied lm_head left out, as
        transformers writes it): a Hugging Face directory that transformers and SGLang load."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        dtype = next(self.parameters()).dtype
        raw = {**self.config.raw, "dtype": str(dtype).removeprefix("torch.")}
        raw.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        tied = self.config.tie_word_embeddings
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


class WeightsMismatch(ValueError):
    """The directory's weight names are not the model's (a checkpoint that needs transformers' key renames)."""


def load(path: str | Path, dtype: torch.dtype = torch.float32) -> NativeCausalLM:
    """The model in a Hugging Face directory (`unsupported(path)` is None), its weights cast to `dtype` (buffers
    such as RoPE's stay float32, as transformers keeps them). Names that do not match raise WeightsMismatch; RoPE
    inverse frequencies that older checkpoints saved (`*.rotary_emb.inv_freq`) are recomputed, as transformers
    does."""
    from safetensors.torch import load_file

    config = NativeConfig(json.loads((Path(path) / "config.json").read_text()))
    with torch.device("meta"):
        model = NativeCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        state.update(load_file(str(f)))
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    names = set(model.state_dict())
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing, unexpected = sorted(names - set(state) - tied), sorted(set(state) - names)
    if missing or unexpected:
        raise WeightsMismatch(f"the weights do not match a {config.shape.family} model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    if tied:
        state.pop("lm_head.weight", None)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    return model
