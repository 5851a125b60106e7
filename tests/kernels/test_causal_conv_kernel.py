"""The GDN causal conv kernel (interpret mode on CPU) against its jnp reference (the layer's causal_conv): prompts
longer and shorter than the conv, ragged seq_lens, a state in another dtype, token and channel blocks that do not
divide the prompt; the layers' conv op that runs the kernel for prompts only; and its lowering to one Triton call
for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_kernels.causal_conv as cc
from pallas_kernels.causal_conv import causal_conv, conv, reference


def normal(seed: int, shape: tuple, dtype=jnp.bfloat16) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def inputs(seed: int, batch: int, seq: int, channels: tuple, dtype=jnp.bfloat16, state_dtype=None, kernel: int = 4):
    x = normal(seed, (batch, seq, *channels), dtype)
    state = normal(seed + 1, (batch, kernel - 1, *channels), state_dtype or dtype)
    weight = normal(seed + 2, (kernel, *channels), dtype)
    seq_lens = jnp.asarray(np.random.default_rng(seed + 3).integers(0, seq + 1, batch), jnp.int32)
    return x, state, weight, seq_lens


@pytest.mark.parametrize("batch,seq,channels,dtype,state_dtype,block_t,block_c", [
    (1, 200, (4, 32), jnp.bfloat16, None, 64, 256),       # tokens past the last block, channels under one block
    (3, 5, (2, 16), jnp.bfloat16, jnp.float32, 4, 16),    # blocks of 4 tokens: taps cross into the state and back
    (2, 2, (48,), jnp.bfloat16, None, 16, 32),            # shorter than the conv; 48 channels in blocks of 16
    (2, 70, (3, 16), jnp.float32, None, 32, 64),
])
def test_matches_reference(batch, seq, channels, dtype, state_dtype, block_t, block_c):
    args = inputs(batch * seq, batch, seq, channels, dtype, state_dtype)
    (out, new_state), (want, want_state) = causal_conv(*args, block_t=block_t, block_c=block_c), reference(*args)
    assert out.shape == want.shape and out.dtype == want.dtype and new_state.dtype == want_state.dtype
    np.testing.assert_array_equal(np.asarray(new_state, np.float32), np.asarray(want_state, np.float32))
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    else:  # the same roundings; an FMA may move a sum across a bf16 rounding boundary
        diff = np.abs(np.asarray(out, np.float32) - np.asarray(want, np.float32))
        assert np.mean(diff == 0) > 0.99 and np.max(diff) < 0.05


def test_conv_op_runs_the_kernel_for_prompts_only(monkeypatch):
    calls = []
    monkeypatch.setattr(cc, "causal_conv", lambda x, *a, **kw: calls.append(x.shape) or causal_conv(x, *a, **kw))
    for seq in (1, 6):
        args = inputs(seq, 2, seq, (2, 16))
        np.testing.assert_array_equal(np.asarray(conv(*args)[0], np.float32), np.asarray(reference(*args)[0],
                                                                                         np.float32))
    assert calls == [(2, 6, 2, 16)]


def test_refuses_mismatched_shapes():
    x, state, weight, seq_lens = inputs(0, 2, 8, (32,))
    with pytest.raises(ValueError, match="causal_conv: x"):
        causal_conv(x, state[:, :2], weight, seq_lens)
    with pytest.raises(ValueError, match="causal_conv: x"):
        causal_conv(x[..., :24], state[..., :24], weight[..., :24], seq_lens)  # 24 channels: not a multiple of 16


def test_lowers_to_one_triton_call_for_cuda():
    fn = jax.jit(lambda *args: causal_conv(*args, interpret=False))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        jax.ShapeDtypeStruct((1, 4096, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 3, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32)).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert 'name = "causal_conv"' in text and "grid_x = 32 : i32" in text and "grid_y = 128 : i32" in text
