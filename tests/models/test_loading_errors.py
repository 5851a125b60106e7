"""create_engine and Engine must fail loudly and name the problem: missing or misshapen tensors, unknown
architectures, empty weight folders, a GPU that is not there, and request ids the engine does not know.

Each error is asserted on its message, not only its type.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_jax import create_engine
from qwen_jax.weights import WeightError


def _rewrite(ckpt, tmp_path, edit) -> str:
    state = load_file(ckpt.dirs["float32"] + "/model.safetensors")
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    ckpt = checkpoints("llama")
    path = _rewrite(ckpt, tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        create_engine(ckpt.config_for("float32"), path, device="cpu")


def test_wrong_shape_names_tensor_and_both_shapes(checkpoints, tmp_path):
    ckpt = checkpoints("llama")
    path = _rewrite(ckpt, tmp_path, lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(WeightError) as info:
        create_engine(ckpt.config_for("float32"), path, device="cpu")
    message = str(info.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message and "(16, 64)" in message
    assert "layers/0/mixer/k" in message and "(64, 2, 16)" in message


def test_unknown_architecture_is_named(checkpoints):
    ckpt = checkpoints("llama")
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*llama"):
        create_engine(dict(ckpt.config, model_type="gpt2"), ckpt.dirs["float32"], device="cpu")


def test_folder_without_weights_is_an_error(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightError, match="no weights in"):
        create_engine(checkpoints("llama").config_for("float32"), str(tmp_path), device="cpu")


def test_cuda_without_a_gpu_and_unknown_device_are_errors(checkpoints):
    ckpt = checkpoints("llama")
    with pytest.raises(RuntimeError, match="device='cuda' was requested but JAX has no GPU"):
        create_engine(ckpt.config_for("float32"), ckpt.dirs["float32"], device="cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu9'"):
        create_engine(ckpt.config_for("float32"), ckpt.dirs["float32"], device="tpu9")


def test_unknown_request_ids_are_named(checkpoints):
    ckpt = checkpoints("llama")
    engine = create_engine(ckpt.config_for("float32"), ckpt.dirs["float32"], device="cpu", max_num_seqs=2,
                           max_model_len=32)
    with pytest.raises(KeyError, match="unknown request id 'ghost'"):
        engine.decode(["ghost"], np.array([1]))
    with pytest.raises(KeyError, match="unknown request id 7"):
        engine.remove([7])
    with pytest.raises(ValueError, match="prompt of 33 tokens"):
        engine.prefill(["long"], [np.zeros(33, np.int32)])
    assert engine.requests == {} and engine.blocks.num_free == engine.blocks.num_usable
