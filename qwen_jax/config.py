"""ModelConfig: every size and switch of a supported decoder, read from an HF config.json or the native dict.

Nothing here may hard-code a model size; every number comes from the config being parsed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5", "qwen3", "qwen3_moe", "llama", "tiny_llama", "llama2c")

_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder-only LM. Layers are a sequence of token mixers (`layer_types`) each followed by an MLP or MoE."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    # Qwen3.5 norms scale by (1 + w) and round after scaling; LLaMA/Qwen3 by w after rounding.
    norm_plus_one: bool = False
    # Full attention.
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    qk_norm: bool = False
    attn_output_gate: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # e.g. llama3 frequency scaling, as sorted items
    rope_interleaved: bool = False  # Meta/llama2.c pairs (2i, 2i+1) instead of HF's rotate-half halves
    max_position_embeddings: int = 4096
    # Gated DeltaNet.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # MLP / MoE. A layer is MoE when num_experts > 0 and the layer is listed in moe_layers.
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # Qwen3.5's multi-token-prediction head (models/mtp.py): 0 or 1 extra full-attention layer.
    num_mtp_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, i: int) -> bool:
        return i in self.moe_layers

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0

    @property
    def mtp_is_moe(self) -> bool:
        """The MTP layer's MLP is the model's MoE block in a MoE model, its dense MLP otherwise."""
        return self.num_experts > 0

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def with_dtype(self, dtype: str) -> ModelConfig:
        return dataclasses.replace(self, dtype=_normalize_dtype(dtype))

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2] in float32, with llama3 scaling applied when configured."""
        dim = self.rotary_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
        scaling = dict(self.rope_scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "llama3":
            factor = scaling["factor"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
            inv_freq = np.where(medium, smoothed, scaled)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
        return inv_freq.astype(np.float32)


def _normalize_dtype(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (supported: bfloat16, float16, float32)")
    return _DTYPES[name]


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_settings(text: dict) -> tuple[float, float, tuple]:
    """(theta, partial_rotary_factor, scaling items) from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (older files)."""
    params = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or {})
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    merged = {**scaling, **{k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}}
    keep = ("rope_type", "type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    items = tuple(sorted((k, v) for k, v in merged.items() if k in keep))
    return float(theta), float(partial), items


# Text-only configs of the Qwen3.5 family name their model type with a suffix.
_MODEL_TYPE_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_5_text": "qwen3_5"}


def from_hf_dict(config: dict) -> ModelConfig:
    """Parse an HF config.json dict (multimodal wrappers keep the decoder under `text_config`)."""
    model_type = _MODEL_TYPE_ALIASES.get(config.get("model_type"), config.get("model_type"))
    if model_type in ("tiny_llama", "llama2c"):
        return from_native_dict(config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}: supported are {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    text = dict(config.get("text_config") or config)
    # Either spelling at either level: transformers 5 writes `dtype`, older versions `torch_dtype`, and a
    # ForConditionalGeneration saved by transformers 5 has it at the top level only.
    dtype = _normalize_dtype(text.get("dtype") or text.get("torch_dtype") or config.get("dtype")
                             or config.get("torch_dtype") or "bfloat16")
    num_layers = int(text["num_hidden_layers"])
    num_heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // num_heads)
    theta, partial, scaling = _rope_settings(text)
    tie = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    common = dict(
        model_type=model_type,
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_layers=num_layers,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        dtype=dtype,
        tie_word_embeddings=tie,
        num_heads=num_heads,
        num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        attention_bias=bool(text.get("attention_bias", False)),
        rope_theta=theta,
        partial_rotary_factor=partial,
        rope_scaling=scaling,
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        intermediate_size=int(text.get("intermediate_size") or 0),
        eos_token_ids=_eos_ids(text.get("eos_token_id", config.get("eos_token_id"))),
        bos_token_id=text.get("bos_token_id", config.get("bos_token_id")),
    )
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {text.get('hidden_act')!r} (only silu)")
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        layer_types = tuple(text.get("layer_types") or _interval_layer_types(num_layers, text))
        moe = model_type == "qwen3_5_moe"
        mlp_only = set(text.get("mlp_only_layers") or [])
        return ModelConfig(
            **common,
            layer_types=layer_types,
            norm_plus_one=True,
            qk_norm=True,
            attn_output_gate=bool(text.get("attn_output_gate", True)),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            num_experts=int(text.get("num_experts", 0)) if moe else 0,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0)) if moe else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0)) if moe else 0,
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0)) if moe else 0,
            norm_topk_prob=True,
            moe_layers=tuple(i for i in range(num_layers) if i not in mlp_only) if moe else (),
            num_mtp_layers=_num_mtp_layers(text),
        )
    layer_types = (FULL_ATTENTION,) * num_layers
    if model_type == "qwen3_moe":
        step = int(text.get("decoder_sparse_step", 1))
        mlp_only = set(text.get("mlp_only_layers") or [])
        return ModelConfig(
            **common,
            layer_types=layer_types,
            qk_norm=True,
            num_experts=int(text.get("num_experts") or text["num_local_experts"]),  # to_dict() writes the latter
            num_experts_per_tok=int(text["num_experts_per_tok"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            moe_layers=tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0),
        )
    return ModelConfig(**common, layer_types=layer_types, qk_norm=model_type == "qwen3")


def _num_mtp_layers(text: dict) -> int:
    """MTP layers of a Qwen3.5 text config (`mtp_num_hidden_layers`; Qwen3-Next spelled it
    `num_nextn_predict_layers`). Every released checkpoint has one; more, or a head with embeddings of its own,
    would need a layout no checkpoint shows, so they are refused rather than guessed."""
    count = int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers")) or 0)
    if count > 1:
        raise ValueError(f"mtp_num_hidden_layers {count} is not supported (only 0 or 1 MTP layer)")
    if count and text.get("mtp_use_dedicated_embeddings"):
        raise ValueError("mtp_use_dedicated_embeddings true is not supported (the MTP head shares the embedding)")
    return count


def _interval_layer_types(num_layers: int, text: dict) -> list[str]:
    interval = int(text.get("full_attention_interval", 4))
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]


def from_native_dict(config: dict) -> ModelConfig:
    """The engine-skeleton format: a LLaMA with interleaved RoPE pairs, float32 softmax and norm variance."""
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in config]
    if missing:
        raise ValueError(f"native config is missing {', '.join(missing)}")
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    return ModelConfig(
        model_type="tiny_llama",
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        num_layers=num_layers,
        layer_types=(FULL_ATTENTION,) * num_layers,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        dtype=_normalize_dtype(config.get("torch_dtype") or config.get("dtype") or "float16"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        rope_interleaved=True,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        intermediate_size=int(config["intermediate_size"]),
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
        bos_token_id=config.get("bos_token_id"),
    )


def parse_config(config: dict | ModelConfig) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    return from_hf_dict(config)


def load_config(path: str) -> ModelConfig:
    """Read `config.json` from a model directory (or the file itself)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(file) as f:
        return from_hf_dict(json.load(f))
