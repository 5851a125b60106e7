"""Fixtures for model tests: tiny random HF models of every architecture (built and saved once per session) and
a per-request HF reference with its own cache (the shared data's folder: the `shared_data` fixture of
tests/conftest.py). Never downloads anything."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256, initializer_range=0.08, attn_implementation="eager")
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)

# name -> (HF config class, HF model class, config kwargs). Tiny, but every feature the engine implements is on:
# hybrid layer types, GQA, partial RoPE, output gate, MoE with more experts than top-k, a shared expert, dense
# layers inside a MoE model, tied embeddings, attention bias, llama3 frequency scaling.
ARCHS = {
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, dict(
        _COMMON, **_GDN, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=48)),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, dict(
        _COMMON, **_GDN, num_hidden_layers=3, intermediate_size=96,
        layer_types=["linear_attention", "linear_attention", "full_attention"])),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        _COMMON, num_hidden_layers=2, intermediate_size=96, tie_word_embeddings=True)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        _COMMON, num_hidden_layers=2, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, mlp_only_layers=[0])),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        _COMMON, num_hidden_layers=2, intermediate_size=96, attention_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
}


def rel_err(ours, ref) -> float:
    """max|a - b| / max|b| in float32."""
    a = np.asarray(ours, np.float32)
    b = np.asarray(ref, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def build_hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A float32 HF model with random weights; norms, GDN gates and biases are perturbed off their init values."""
    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # confident routers: a 1-ulp bf16 difference must not flip top-k
                p.mul_(8.0)
    return model


class HFReference:
    """Runs an HF model one request at a time with its own cache, like the engine's named requests."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.caches: dict = {}

    @torch.no_grad()
    def prefill(self, rid, tokens: np.ndarray) -> torch.Tensor:
        out = self.model(torch.as_tensor(tokens, dtype=torch.long)[None], use_cache=True)
        self.caches[rid] = out.past_key_values
        return out.logits[0, -1].float()

    @torch.no_grad()
    def decode(self, rid, token: int) -> torch.Tensor:
        out = self.model(torch.tensor([[token]]), past_key_values=self.caches[rid], use_cache=True)
        self.caches[rid] = out.past_key_values
        return out.logits[0, -1].float()

    def remove(self, rid) -> None:
        del self.caches[rid]


class Checkpoint:
    """One saved tiny model: the HF module (float32 and bfloat16 copies), its config dict and save dirs."""

    def __init__(self, arch: str, root: Path):
        self.arch = arch
        self.model = build_hf_model(arch)
        self.config = self.model.config.to_dict()
        self.dirs = {"float32": str(root / f"{arch}_float32"), "bfloat16": str(root / f"{arch}_bfloat16")}
        self.model.save_pretrained(self.dirs["float32"])
        copy.deepcopy(self.model).to(torch.bfloat16).save_pretrained(self.dirs["bfloat16"])
        # Reloaded rather than cast: `.to(bfloat16)` would also round the RoPE inv_freq buffer, which a real bf16
        # HF model keeps in float32.
        bf16 = ARCHS[arch][1].from_pretrained(self.dirs["bfloat16"], dtype=torch.bfloat16, attn_implementation="eager")
        self.models = {"float32": self.model, "bfloat16": bf16.eval()}

    def config_for(self, dtype: str) -> dict:
        return dict(self.config, dtype=dtype)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> Checkpoint, built lazily and once per session."""
    root = tmp_path_factory.mktemp("hf_checkpoints")
    made: dict[str, Checkpoint] = {}

    def get(arch: str) -> Checkpoint:
        if arch not in made:
            made[arch] = Checkpoint(arch, root)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def hf_reference():
    """The HFReference class (fixtures rather than imports: conftest modules are not importable by name)."""
    return HFReference


@pytest.fixture(scope="session", name="rel_err")
def rel_err_fixture():
    return rel_err


