"""What the core reads from a model directory before it starts compiling: the ids that end a sequence come from
the tokenizer's JSON files, the ids the tokenizer itself would give, without loading it."""

import json

from transformers import AutoTokenizer

from qwen_jax.engine.model_files import tokenizer_eos_id


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
