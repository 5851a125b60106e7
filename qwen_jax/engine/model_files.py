"""A model directory as the engine and its front read it, without touching a device: the path (or the built-in
default model), its config in the served dtype, the context length, the tokenizer and the EOS ids.

Host files only; the front process uses it to validate and tokenize, the engine core to build the model.
"""

from __future__ import annotations

import json
import os

from qwen_jax.config import ModelConfig, from_hf_dict
from qwen_jax.weights import open_checkpoint


def resolve_model(model: str | None) -> str:
    """A model directory (or llama2.c .bin); None means the small built-in default model."""
    if model is None:
        from qwen_jax.default_model import ensure_default_model

        return ensure_default_model()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path {model!r} does not exist (no model hub access: give a local directory)")
    return model


def _read_config(model_path: str) -> dict:
    path = os.path.join(model_path, "config.json") if os.path.isdir(model_path) else model_path
    with open(path) as f:
        return json.load(f)


def read_model_config(model_path: str, dtype: str = "auto") -> ModelConfig:
    """The config the engine serves: a model directory's config.json (or a llama2.c header), in `dtype`."""
    config_dict = _read_config(model_path) if os.path.isdir(model_path) else open_checkpoint(model_path)[0]
    cfg = from_hf_dict(config_dict)
    return cfg if dtype == "auto" else cfg.with_dtype(dtype)


def resolve_max_model_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    """The engine argument, or the model's max_position_embeddings capped at 8192."""
    return int(max_model_len or min(cfg.max_position_embeddings, 8192))


def load_tokenizer(model_path: str):
    """The HF tokenizer of a model directory, or None when it ships none (then only token ids are served)."""
    if os.path.isdir(model_path) and any(os.path.exists(os.path.join(model_path, f))
                                         for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    return None


def eos_ids(model_path: str, cfg: ModelConfig, tokenizer) -> list[int]:
    ids = set(cfg.eos_token_ids)
    gen = os.path.join(model_path, "generation_config.json") if os.path.isdir(model_path) else ""
    if gen and os.path.exists(gen):
        with open(gen) as f:
            value = json.load(f).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else (value or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
