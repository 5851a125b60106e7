"""Tiny hybrid-MoE (shared expert, 16 experts), hybrid-dense and LLaMA configs and prompts for the sharding tests.

All float32 and small enough that every layout compiles in seconds on a 2-core CPU; nothing here touches devices."""

from __future__ import annotations

import numpy as np

from qwen_jax.config import ModelConfig, from_hf_dict
from qwen_jax.models import decoder

_HYBRID = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "dtype": "float32",
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}
TINY_CONFIGS: dict[str, dict] = {
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": {
        **_HYBRID, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32}},
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {**_HYBRID, "intermediate_size": 128}},
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 128, "rms_norm_eps": 1e-5,
              "torch_dtype": "float32", "rope_theta": 10000.0},
}


NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, MAX_BLOCKS, BATCH = 16, 4, 8, 3, 4


def tiny_config(name: str) -> ModelConfig:
    return from_hf_dict(TINY_CONFIGS[name])


def sequences(seed: int = 0) -> list[np.ndarray]:
    """Three prompts of different lengths; a fourth batch row is padding."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size=n) for n in (7, 3, 5)]


def step_batches(data_parallel: int) -> list[dict]:
    """Prefill of three prompts (lengths 7, 3, 5; row 3 is padding), then two decode steps. Block tables and
    state slots are replica-local: row r of a replica with `rows` rows uses slot 1 + r and blocks 1 + 3r.."""
    rows = BATCH // data_parallel
    prompts = sequences()
    tokens = np.zeros((BATCH, max(len(p) for p in prompts)), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    lens = np.array([len(p) for p in prompts] + [0])
    local = np.arange(BATCH) % rows
    tables = np.where(lens[:, None] > 0, 1 + local[:, None] * MAX_BLOCKS + np.arange(MAX_BLOCKS), 0)
    slots = np.where(lens > 0, 1 + local, 0)
    batches = [decoder.make_batch(tokens, np.zeros(BATCH), lens, slots, tables)]
    rng = np.random.default_rng(1)
    positions, new = lens.copy(), (lens > 0).astype(np.int32)
    for _ in range(2):
        batches.append(decoder.make_batch(rng.integers(1, 256, (BATCH, 1)), positions, new, slots, tables))
        positions = positions + new
    return batches
