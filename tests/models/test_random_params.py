"""random_params: the `dummy` weights' distributions, and per-leaf stds by name (what kernel_parity's
--embed-scale / --residual-scale use to keep a full-size random model from amplifying rounding)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest

from qwen_jax.config import parse_config
from qwen_jax.default_model import TEXT_CONFIG
from qwen_jax.models.decoder import random_params

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kernel_parity.py"
HYBRID = dict(TEXT_CONFIG, vocab_size=512, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


def _leaves(params) -> dict[str, list[np.ndarray]]:
    """Leaves grouped by their name (the last key of their path)."""
    out: dict[str, list[np.ndarray]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        out.setdefault(str(path[-1].key), []).append(np.asarray(leaf, np.float32))
    return out


def _kernel_parity():
    spec = importlib.util.spec_from_file_location("kernel_parity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_named_leaves_get_their_own_std_and_the_rest_keep_scale():
    cfg = parse_config(HYBRID)
    leaves = _leaves(random_params(cfg, seed=3, scale=0.02, scales={"embed": 1.0, "o": 0.002, "w_down": 0.005}))
    std = {name: float(np.concatenate([a.ravel() for a in arrays]).std()) for name, arrays in leaves.items()}
    assert std["embed"] == pytest.approx(1.0, rel=0.05)
    assert std["o"] == pytest.approx(0.002, rel=0.05)
    assert std["w_down"] == pytest.approx(0.005, rel=0.05)
    for name in ("lm_head", "q", "out", "shared_down", "w_gate", "router"):
        assert std[name] == pytest.approx(0.02, rel=0.05), name
    # norms keep their identity value whatever the scales
    for name in ("input_norm", "post_norm", "final_norm"):
        assert all(np.all(a == (0.0 if cfg.norm_plus_one else 1.0)) for a in leaves[name]), name


def test_scales_of_a_name_the_model_lacks_are_an_error():
    with pytest.raises(ValueError, match="shared_down"):
        random_params(parse_config(LLAMA), scales={"shared_down": 0.002})


def test_residual_scales_name_only_the_models_own_residual_writers():
    residual_scales = _kernel_parity().residual_scales
    hybrid = residual_scales(parse_config(HYBRID), 1.0, 0.002)
    assert hybrid == {"embed": 1.0, "o": 0.002, "out": 0.002, "w_down": 0.002, "shared_down": 0.002}
    assert residual_scales(parse_config(LLAMA), None, 0.003) == {"o": 0.003, "w_down": 0.003}
    assert residual_scales(parse_config(LLAMA), None, None) == {}
    random_params(parse_config(LLAMA), scales=residual_scales(parse_config(LLAMA), 1.0, 0.003))  # all names exist


def test_set_leaves_fills_only_the_named_leaves():
    params = random_params(parse_config(HYBRID), seed=1)
    changed = _kernel_parity().set_leaves(params, "dt_bias", -4.0)
    before, after = _leaves(params), _leaves(changed)
    assert all(np.all(a == -4.0) for a in after["dt_bias"]) and len(after["dt_bias"]) == len(before["dt_bias"])
    for name in before.keys() - {"dt_bias"}:
        assert all(np.array_equal(a, b) for a, b in zip(before[name], after[name])), name
