"""AsyncLLM knows max_model_len, the EOS ids and the config before start(), with the values the engine computes.

Nothing is loaded or compiled here: only the checkpoint's config and tokenizer are read."""

from __future__ import annotations

import pytest

from qwen_jax.llm import AsyncLLM


def test_async_llm_limits_known_before_start(hybrid_dir, kit):
    default = AsyncLLM.from_engine_args(hybrid_dir)
    assert not default.is_ready()  # no core process yet
    assert default.max_model_len == 256  # max_position_embeddings, under the 8192 cap
    assert default.eos_token_ids == [512, kit.EOS]  # config and generation_config
    assert default.config.vocab_size == kit.HYBRID_VOCAB
    assert AsyncLLM.from_engine_args(hybrid_dir, max_model_len=48).max_model_len == 48


def test_hf_overrides_go_over_the_config_and_a_broken_one_is_named(hybrid_dir):
    """vLLM's hf_overrides: entries put over config.json's before anything reads it (the core reads it the same)."""
    overridden = AsyncLLM.from_engine_args(hybrid_dir, hf_overrides={"max_position_embeddings": 96})
    assert overridden.config.max_position_embeddings == 96 and overridden.max_model_len == 96
    with pytest.raises(ValueError, match="hf_overrides .* make an invalid config"):
        AsyncLLM.from_engine_args(hybrid_dir, hf_overrides={"num_hidden_layers": "many"})


def test_a_model_directory_without_a_config_is_an_error_naming_it(tmp_path):
    from qwen_jax import LLM, ModelNotFound

    for build in (LLM, AsyncLLM.from_engine_args):
        with pytest.raises(ModelNotFound, match=f"^{tmp_path} has no config.json"):
            build(str(tmp_path))
