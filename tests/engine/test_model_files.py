"""What the engine reads from a model directory before it starts compiling: the ids that end a sequence come from
the tokenizer's JSON files, the ids the tokenizer itself would give, without loading it; the sampling defaults come
from generation_config.json as vLLM's --generation-config reads them."""

import json

import pytest
from transformers import AutoTokenizer

from qwen_jax.engine.model_files import sampling_defaults, tokenizer_eos_id


def test_the_eos_id_read_from_the_json_files_is_the_tokenizers(shared_data, tmp_path):
    qwen = str(shared_data / "qwen3_5_tokenizer")
    assert tokenizer_eos_id(qwen) == AutoTokenizer.from_pretrained(qwen).eos_token_id
    # an eos token only tokenizer.json's added tokens name (no added_tokens_decoder in the config)
    with open(f"{qwen}/tokenizer_config.json") as f:
        config = json.load(f)
    config.pop("added_tokens_decoder")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text(open(f"{qwen}/tokenizer.json").read())
    assert tokenizer_eos_id(str(tmp_path)) == tokenizer_eos_id(qwen)


def test_files_that_do_not_say_give_no_eos_id(tmp_path):
    assert tokenizer_eos_id(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    assert tokenizer_eos_id(str(tmp_path)) is None


def test_sampling_defaults_follow_the_generation_config_as_vllm_reads_it(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    (model / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2],
        "max_new_tokens": 100, "min_p": None}))
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert sampling_defaults(str(model)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    assert sampling_defaults(str(model), "vllm") == {}
    assert sampling_defaults(str(model), str(other)) == {"repetition_penalty": 1.1}
    assert sampling_defaults(str(model), "auto", {"temperature": 0.0}) == {
        "temperature": 0.0, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    assert sampling_defaults(str(model), "vllm", {"top_k": 5}) == {"top_k": 5}
    assert sampling_defaults(str(tmp_path)) == {}  # auto, and the model has no generation_config.json
    with pytest.raises(ValueError, match="no generation_config.json there"):
        sampling_defaults(str(model), str(tmp_path))
    with pytest.raises(ValueError, match="must be a dict of temperature"):
        sampling_defaults(str(model), "auto", {"do_sample": False})
