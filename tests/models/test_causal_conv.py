"""The GDN causal conv op (qwen_jax.layers.gated_deltanet.causal_convs, on a ragged batch) forms each tap's window
from the state's rows and x's separately; it must equal the conv over one concatenation of state and x, token by
token, with the same bf16 roundings, for requests shorter and longer than the conv (0 tokens to the width)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax.layers.batch import ragged
from qwen_jax.layers.gated_deltanet import causal_convs

EXACT = {"xla_allow_excess_precision": False}  # the engine's programs keep every bf16 rounding (engine/step.py)


def concatenated(x, state, weight, seq_lens):
    """The conv written plainly: full = state then x; out[t] = SiLU(round(sum_i full[t + i] w[i])); the new state is
    the K-1 inputs of full ending at each row's seq_len."""
    kernel, seq = weight.shape[0], x.shape[1]
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    w = weight.astype(jnp.float32)
    out = sum(full[:, i:i + seq].astype(jnp.float32) * w[i] for i in range(kernel))
    out = jax.nn.silu(out.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)
    at = seq_lens[:, None] + jnp.arange(kernel - 1)[None, :]
    return out, jnp.take_along_axis(full, at.reshape(at.shape + (1,) * (x.ndim - 2)), axis=1)


@pytest.mark.parametrize("seq", [1, 2, 3, 4, 37])
@pytest.mark.parametrize("kernel,state_dtype", [(2, jnp.bfloat16), (4, jnp.bfloat16), (4, jnp.float32)])
def test_windows_equal_the_concatenated_conv(seq, kernel, state_dtype):
    rng = np.random.default_rng(seq * kernel)
    batch = seq + 1  # seq_lens 0 .. seq, one row each
    x = jnp.asarray(rng.standard_normal((batch, seq, 2, 8)), jnp.bfloat16)
    state = jnp.asarray(rng.standard_normal((batch, kernel - 1, 2, 8)), state_dtype)
    weight = jnp.asarray(rng.standard_normal((kernel, 2, 8)), jnp.bfloat16)
    seq_lens = jnp.arange(batch, dtype=jnp.int32)
    want_out, want_state = jax.jit(concatenated, compiler_options=EXACT)(x, state, weight, seq_lens)
    # request b: the first seq_lens[b] tokens of row b, past the start of its sequence (its state is read), slot b+1
    lens = list(range(batch))
    flat = jnp.concatenate([x[b, :n] for b, n in enumerate(lens)])
    requests = ragged([kernel] * batch, lens, list(range(1, batch + 1)), [[]] * batch, flat.shape[0], batch, 1)
    cache = jnp.concatenate([jnp.zeros_like(state[:1]), state]).astype(x.dtype)  # slot 0: the sink
    (out,), (new_cache,) = jax.jit(causal_convs, compiler_options=EXACT)((flat,), (cache,), (weight,), requests)
    assert out.dtype == want_out.dtype and new_cache.dtype == want_state.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(
        jnp.concatenate([want_out[b, :n] for b, n in enumerate(lens)]), np.float32))
    np.testing.assert_array_equal(np.asarray(new_cache[1:], np.float32), np.asarray(want_state, np.float32))
