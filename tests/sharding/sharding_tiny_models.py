"""Tiny hybrid-MoE (shared expert, 16 experts), hybrid-dense and LLaMA configs, the steps of the sharding tests, and
their logits on one device: what every layout must reproduce.

All float32 and small enough that every layout compiles in seconds on a 2-core CPU."""

from __future__ import annotations

import jax
import numpy as np

from qwen_jax.config import ModelConfig, from_hf_dict
from qwen_jax.engine import step
from qwen_jax.layers.batch import Ragged, ragged
from sharding import mesh, rules

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


# REQUESTS: the 3 prompts and one padding request; a request holds at most MAX_BLOCKS blocks (12 tokens).
NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, MAX_BLOCKS, REQUESTS = 16, 4, 8, 3, 4
PROMPT_LENS = (7, 3, 5)
NUM_REAL = len(PROMPT_LENS)  # requests; the fourth is padding
PREFILL_TOKENS, DECODE_TOKENS = 16, 4  # 15 prompt tokens and 3 decode tokens, each padded


def tiny_config(name: str) -> ModelConfig:
    return from_hf_dict(TINY_CONFIGS[name])


def sequences(seed: int = 0) -> list[np.ndarray]:
    """Three prompts of different lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size=n).astype(np.int32) for n in PROMPT_LENS]


def step_batches() -> list[tuple[np.ndarray, Ragged]]:
    """(tokens [T], Ragged) of three steps: the three prompts prefilled in one ragged batch, then two decode steps
    of one random token each. Request r uses state slot 1 + r and KV blocks 1 + 3r, 2 + 3r, 3 + 3r; the fourth
    request and the tokens past the real ones are padding."""
    prompts = sequences()
    slots = [1 + r for r in range(len(prompts))]
    tables = [[1 + MAX_BLOCKS * r + b for b in range(MAX_BLOCKS)] for r in range(len(prompts))]
    tokens = np.zeros(PREFILL_TOKENS, np.int32)
    tokens[:sum(PROMPT_LENS)] = np.concatenate(prompts)
    steps = [(tokens, ragged([0] * len(prompts), PROMPT_LENS, slots, tables, PREFILL_TOKENS, REQUESTS, MAX_BLOCKS))]
    rng = np.random.default_rng(1)
    for n in range(2):
        tokens = np.zeros(DECODE_TOKENS, np.int32)
        tokens[:len(prompts)] = rng.integers(1, 256, len(prompts))
        starts = [length + n for length in PROMPT_LENS]
        steps.append((tokens, ragged(starts, [1] * len(prompts), slots, tables, DECODE_TOKENS, REQUESTS, MAX_BLOCKS)))
    return steps


def packed_steps() -> list[tuple[np.ndarray, np.ndarray, step.Layout]]:
    """step_batches as engine.step.forward's inputs: (last_tokens [REQUESTS], packed buffer, layout) per step. The
    second decode step reads its tokens from last_tokens (as the engine feeds a decode row the token the previous
    step sampled, still on the device), the other steps from the buffer; both decode steps have one layout."""
    packed = []
    for i, (tokens, batch) in enumerate(step_batches()):
        last_tokens = np.zeros(REQUESTS, np.int32)
        source = np.full(len(tokens), -1, np.int32)
        if i == 2:
            real = np.flatnonzero(batch.token_valid)
            last_tokens[:len(real)], source[real] = tokens[real], np.arange(len(real))
            tokens = np.zeros_like(tokens)
        buffer, layout = step.pack_inputs(tokens, batch, source)
        packed.append((last_tokens, buffer, layout))
    return packed


def single_device_logits(cfg: ModelConfig, params: dict) -> list[np.ndarray]:
    """The served step (engine/step.py's forward) over packed_steps on one device: each step's logits of the real
    requests."""
    one = mesh.make_mesh(1)
    params = rules.put_tree(params, rules.param_shardings(cfg, one))
    cache = rules.init_cache(cfg, one, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    logits = []
    for last_tokens, buffer, layout in packed_steps():
        last_tokens, buffer = jax.device_put((last_tokens, buffer), step.replicated(one))
        out, cache = step.forward(params, cache, last_tokens, buffer, layout=layout, cfg=cfg, mesh=one,
                                  kernels="reference")
        logits.append(np.asarray(out)[:NUM_REAL])
    return logits
