"""Gated DeltaNet: the chunked (WY) prefill scan must equal the token-by-token recurrence it replaces.

Pure layer math in float32; never goes through the engine or HF.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.layers.gated_deltanet import CHUNK_SIZE, chunked_delta_rule, l2_normalize


def _inputs(batch: int, seq: int, heads: int = 3, dk: int = 16, dv: int = 8, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = l2_normalize(jax.random.normal(keys[0], (batch, seq, heads, dk))) * dk ** -0.5
    k = l2_normalize(jax.random.normal(keys[1], (batch, seq, heads, dk)))
    v = jax.random.normal(keys[2], (batch, seq, heads, dv))
    g = -jax.random.uniform(keys[3], (batch, seq, heads), minval=0.01, maxval=0.5)  # log decay <= 0
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, seq, heads)))
    state = jax.random.normal(keys[5], (batch, heads, dk, dv)) * 0.1
    return q, k, v, g, beta, state


def recurrent_step(q, k, v, g, beta, state):
    """The recurrence itself, one token. q, k: [B, Hv, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dk, Dv]
    (all float32)."""
    state = state * jnp.exp(g)[..., None, None]
    predicted = jnp.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", state, q), state


SEQ = 2 * CHUNK_SIZE + 37  # two full chunks and a padded partial one
_chunked = jax.jit(chunked_delta_rule)


@jax.jit
def _recurrence(q, k, v, g, beta, state):
    def step(s, xs):
        out, s = recurrent_step(*xs, s)
        return s, out

    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (q, k, v, g, beta))
    final, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), final


def test_chunked_delta_rule_equals_step_by_step_recurrence_across_chunks():
    seq = SEQ
    q, k, v, g, beta, state = _inputs(batch=2, seq=seq)
    out, final, boundaries = _chunked(q, k, v, g, beta, state)
    ref_out, ref_final = _recurrence(q, k, v, g, beta, state)
    assert out.shape == ref_out.shape == (2, seq, 3, 8)
    scale = float(jnp.abs(ref_out).max())
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5 * scale, rtol=0)
    np.testing.assert_allclose(np.asarray(final), np.asarray(ref_final), atol=2e-5 * float(jnp.abs(ref_final).max()))
    # The state after the first chunk is what the recurrence holds after CHUNK_SIZE tokens.
    _, after_one_chunk = _recurrence(*(t[:, :CHUNK_SIZE] for t in (q, k, v, g, beta)), state)
    np.testing.assert_allclose(np.asarray(boundaries[:, 0]), np.asarray(after_one_chunk), atol=2e-5)


def test_tokens_with_zero_beta_and_gate_leave_the_state_untouched():
    """Padding tokens (beta = 0, g = 0) after two full chunks: the final state is the state at the chunk boundary."""
    q, k, v, g, beta, state = _inputs(batch=2, seq=SEQ, seed=1)
    beta = beta.at[:, 2 * CHUNK_SIZE:].set(0.0)
    g = g.at[:, 2 * CHUNK_SIZE:].set(0.0)
    _, final, boundaries = _chunked(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(final), np.asarray(boundaries[:, 1]), atol=1e-6)
    assert float(jnp.abs(final - state).max()) > 0.1  # the real tokens did change it
