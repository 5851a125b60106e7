"""Karpathy's trained stories260K (llama2.c .bin) through create_engine: greedy decoding must reproduce the golden
token ids of ../shared/data/tiny_llama/greedy_reference.json exactly.

Reads the shared data in place; a missing file fails the test rather than skipping it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from qwen_jax import create_engine

NATIVE_FLOAT32 = {"model_type": "tiny_llama", "torch_dtype": "float32", "vocab_size": 512, "hidden_size": 64,
                  "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
                  "rope_theta": 10000.0}


def _greedy(engine, prompt: list[int], max_steps: int) -> list[int]:
    """run.c's loop: the prompt after BOS is forced, then argmax until BOS (1) or max_steps positions."""
    out = list(prompt[1:])
    logits = engine.prefill(["story"], [np.asarray(prompt)])
    while True:
        token = int(np.argmax(np.asarray(logits[0])))
        out.append(token)
        if token == 1 or len(out) >= max_steps:
            break
        logits = engine.decode(["story"], np.asarray([token]))
    engine.remove(["story"])
    return out


@pytest.mark.parametrize("via", ["bin_file_without_config", "directory_with_native_config"])
def test_stories260k_greedy_matches_golden_tokens(via, shared_data):
    folder = shared_data / "tiny_llama"
    reference = json.loads((folder / "greedy_reference.json").read_text())
    if via == "bin_file_without_config":
        engine = create_engine(None, str(folder / "stories260K.bin"), device="cpu", max_num_seqs=1)
    else:
        engine = create_engine(NATIVE_FLOAT32, str(folder), device="cpu", max_num_seqs=1)
    assert engine.cfg.tie_word_embeddings and engine.cfg.rope_interleaved and engine.cfg.dtype == "float32"
    assert len(reference["cases"]) == 2
    for case in reference["cases"]:
        tokens = _greedy(engine, case["prompt_tokens"], case["max_steps"])
        assert tokens == case["sequence_after_bos"], f"prompt {case['prompt']!r} diverged"
