"""The one-program-a-row RMSNorm (interpret mode on CPU) against its jnp reference (the model's rms_norm): both
weightings (Qwen3.5's float32 1 + w, LLaMA's w in the input dtype), a hidden size that is not a power of two, the
layers' norm op (layers/hot_ops.py) that runs it for one row only; plus its lowering to one Triton call for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_kernels.rms_norm as rms
from pallas_kernels.rms_norm import rms_norm
from qwen_jax.layers.hot_ops import norm_kernel as norm
from qwen_jax.layers.norms import rms_norm as reference


def normal(seed: int, shape: tuple, dtype=jnp.bfloat16, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


@pytest.mark.parametrize("shape,plus_one,dtype", [
    ((1, 1, 2048), True, jnp.bfloat16),   # 35B-A3B decode of one sequence
    ((3, 2, 2560), False, jnp.bfloat16),  # Qwen3.5-4B's hidden size (not a power of two), LLaMA weighting
    ((5, 96), True, jnp.float32),
])
def test_matches_reference(shape, plus_one, dtype):
    x, w = normal(1, shape, dtype, 3.0), normal(2, shape[-1:], dtype, 0.1)
    got, want = rms_norm(x, w, 1e-6, plus_one), reference(x, w, 1e-6, plus_one)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    else:  # the same bf16 roundings: equal except where float32 sums in another order cross a rounding boundary
        diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
        assert np.mean(diff == 0) > 0.99 and np.max(diff / np.maximum(np.abs(np.asarray(want, np.float32)),
                                                                      1e-3)) < 1e-2


def test_norm_op_runs_the_kernel_for_one_row_only(monkeypatch):
    calls = []
    monkeypatch.setattr(rms, "rms_norm", lambda x, *a, **kw: calls.append(x.shape) or rms_norm(x, *a, **kw))
    w = normal(3, (64,), scale=0.1)
    for shape in ((1, 1, 64), (2, 1, 64), (1, 4, 64)):
        x = normal(4, shape)
        np.testing.assert_allclose(np.asarray(norm(x, w, 1e-6, True), np.float32),
                                   np.asarray(reference(x, w, 1e-6, True), np.float32), rtol=1e-2, atol=1e-2)
    assert calls == [(1, 1, 64)]


def test_refuses_a_weight_of_another_size():
    with pytest.raises(ValueError, match="does not match the hidden size 64"):
        rms_norm(jnp.ones((1, 64), jnp.bfloat16), jnp.ones((32,), jnp.bfloat16), 1e-6, True)


def test_lowers_to_one_triton_call_for_cuda():
    fn = jax.jit(lambda x, w: rms_norm(x, w, 1e-6, True, interpret=False))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        jax.ShapeDtypeStruct((1, 1, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048,), jnp.bfloat16)).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert 'name = "rms_norm"' in text and "grid_x = 1 : i32" in text
