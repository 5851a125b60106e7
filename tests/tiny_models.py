"""Tiny float32 checkpoints in HF layout for the CPU tests, built from transformers' own modules: a hybrid
Qwen3.5-MoE (with the default model's tokenizer), the same with an MTP head that drafts often right, and a LLaMA.

Plain functions of a target directory (the fixtures of tests/engine and tests/bench call them once per session);
never downloads anything.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import transformers

from qwen_jax.default_model import ensure_default_model

HYBRID_VOCAB = 517  # the default model's tokenizer: 512 BPE tokens + 5 added
LLAMA_VOCAB = 128
EOS = 514  # <|im_end|> of the default tokenizer (generation_config also lists 512, <|endoftext|>)
EOS_PROMPT = [17, 301, 45, 99, 230, 8, 61]  # the hybrid model's greedy continuation of this is (a, b, EOS, ...)
EOS_STEP = 2


def _peaked(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Larger embedding and head weights than HF's init, so next-token distributions have clear winners (greedy
    comparisons across batch shapes are then robust) while temperature sampling still varies."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.startswith("lm_head"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.float().eval()


@torch.no_grad()
def _make_eos_follow(model: torch.nn.Module, prompt: list[int], step: int) -> None:
    """Swap the head rows of EOS and of the greedy token at `step` after `prompt`: greedy decoding of the prompt then
    emits EOS there (the earlier steps keep their argmax, since both swapped logits were below it)."""
    ids = torch.tensor([prompt])
    greedy = model.generate(ids, max_new_tokens=step + 1, do_sample=False)[0, len(prompt):].tolist()
    token = greedy[step]
    if token in greedy[:step] or {EOS, 512} & set(greedy):
        raise AssertionError(f"pick another EOS_PROMPT: greedy continuation {greedy}")
    head = model.lm_head.weight
    head[[EOS, token]] = head[[token, EOS]]


def build_hybrid(directory: Path) -> torch.nn.Module:
    """Two layers (Gated DeltaNet, then gated attention), 4 experts top-2 with a shared expert, float32."""
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=HYBRID_VOCAB, hidden_size=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, max_position_embeddings=256,
        initializer_range=0.1, eos_token_id=EOS, attn_implementation="eager")
    torch.manual_seed(0)
    model = _peaked(transformers.Qwen3_5MoeForCausalLM(config), seed=1)
    _make_eos_follow(model, EOS_PROMPT, EOS_STEP)
    model.save_pretrained(directory)
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "qwen3_5_moe"  # the engine reads text-only configs under the family name
    cfg_path.write_text(json.dumps(cfg))
    default = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(os.path.join(default, name), directory / name)
    return model


def build_llama(directory: Path) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.1, eos_token_id=1,
        bos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = _peaked(transformers.LlamaForCausalLM(config), seed=2)
    model.save_pretrained(directory)
    return model


def add_copy_mtp_head(source: str | Path, directory: Path) -> str:
    """A copy of the hybrid checkpoint `source` in `directory` with an MTP head (config mtp_num_hidden_layers 1,
    mtp.* tensors) built to draft often right: its fc passes the main model's hidden state through and its layer
    adds nothing (output projections zero), so it drafts the main model's last prediction again, which this tiny
    model's repetitive greedy output often is."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    state = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    attention = config["layer_types"].index("full_attention")
    prefix = f"model.layers.{attention}."
    head = {"mtp.layers.0." + k[len(prefix):]: torch.zeros_like(v) if "o_proj" in k or "down_proj" in k else v.clone()
            for k, v in state.items() if k.startswith(prefix)}
    hidden = config["hidden_size"]
    head["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)  # [embedding, hidden]
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{name}.weight"] = torch.zeros(hidden)  # (1 + w) norms: the identity scale
    save_file({**state, **head}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1)))
    return str(directory)
