"""The built-in default model: a real HF Qwen3.5-MoE directory that the real loader and AutoTokenizer accept.

Builds into per-session temporary directories only; never touches ~/.cache.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from safetensors import safe_open

from qwen_jax.config import load_config
from qwen_jax.default_model import CHAT_TEMPLATE, ensure_default_model
from qwen_jax.models.decoder import param_shapes
from qwen_jax.weights import load_params, open_checkpoint


def test_config_is_the_real_qwen3_5_moe_layout(default_model_dir):
    with open(os.path.join(default_model_dir, "config.json")) as f:
        config = json.load(f)
    text = config["text_config"]
    assert config["model_type"] == "qwen3_5_moe"
    assert set(text["layer_types"]) == {"linear_attention", "full_attention"} and len(text["layer_types"]) == 4
    assert (text["num_experts"], text["num_experts_per_tok"]) == (8, 2)
    assert text["shared_expert_intermediate_size"] > 0
    cfg = load_config(default_model_dir)
    assert cfg.moe_layers == (0, 1, 2, 3) and cfg.is_hybrid and cfg.attn_output_gate


def test_safetensors_use_hf_names_and_the_real_loader_reads_them(default_model_dir):
    with safe_open(os.path.join(default_model_dir, "model.safetensors"), "np") as f:
        names = set(f.keys())
        cfg = load_config(default_model_dir)
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        gate_up = f.get_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj")
        down = f.get_tensor("model.language_model.layers.0.mlp.experts.down_proj")
    assert gate_up.shape == (e, 2 * i, h) and down.shape == (e, h, i)
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in names)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in names
    config, source = open_checkpoint(default_model_dir)
    params = load_params(cfg, source)
    got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    want = jax.tree.map(lambda s: (s.shape, s.dtype), param_shapes(cfg))
    assert got == want
    assert float(np.abs(np.asarray(params["layers"][0]["mlp"]["w_gate"], np.float32)).max()) > 0


def test_build_is_cached_and_deterministic(default_model_dir, tmp_path):
    again = ensure_default_model(os.path.dirname(default_model_dir))
    assert again == default_model_dir
    other = ensure_default_model(str(tmp_path))
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        with open(os.path.join(default_model_dir, name), "rb") as a, open(os.path.join(other, name), "rb") as b:
            assert a.read() == b.read(), name
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging directory left behind


def test_tokenizer_loads_offline_with_qwen_special_tokens(default_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids == list(range(ids[0], ids[0] + 5))
    assert load_config(default_model_dir).vocab_size == len(tok) == ids[-1] + 1
    with open(os.path.join(default_model_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [ids[2], ids[0]]
    text = "Hello, café 東京! 12 + 30 = 42"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user\n") == [ids[1], *tok.encode("user\n")]
    assert 256 < len(tok) <= 1024


def test_chat_template_honours_enable_thinking(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    default = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert off == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                  "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on.endswith("<|im_start|>assistant\n<think>\n") and default == on
    assert tokenizer.chat_template == CHAT_TEMPLATE
