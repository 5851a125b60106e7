"""The GDN causal conv kernel (pallas_kernels/causal_conv.py) on the CPU: Triton's interpreter runs the kernel source
(launched by test_moe_triton's stand-in for jax_triton.triton_call, which poisons outputs with NaN) against the
reference (qwen_jax.layers.gated_deltanet.causal_conv): ragged rows, rows shorter than the conv's state, tokens and
channels that do not fill a tile, one to three inputs in one launch. Float32, as the other interpreted kernels.
tests/models/test_causal_conv.py covers the reference itself."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_triton import interpreted_call  # tests/kernels is on sys.path (pytest's prepend mode)

from qwen_jax.layers.gated_deltanet import causal_conv, causal_convs
from qwen_jax.layers.ops import ops_for


@pytest.fixture(scope="module")
def causal_conv_kernel():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it before anything imports triton
    from pallas_kernels import causal_conv as module

    return module


def make_inputs(seed, batch, seq, shapes, kernel=4):
    rng = np.random.default_rng(seed)
    normal = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    xs = tuple(normal((batch, seq) + s) for s in shapes)
    states = tuple(normal((batch, kernel - 1) + s) for s in shapes)
    weights = tuple(normal((kernel,) + s, 0.5) for s in shapes)
    return xs, states, weights


@pytest.mark.parametrize("seed,batch,seq,shapes,seq_lens,tiles", [
    (0, 3, 37, [(2, 8), (2, 8), (4, 8)], [37, 2, 20], dict(block_t=16, block_c=16)),  # GDN-like q, k, v
    (1, 2, 5, [(3, 6)], [5, 1], dict(block_t=4, block_c=8)),  # 18 channels: a partial channel block
    (2, 1, 64, [(16,), (24,)], [64], dict(block_t=32, block_c=16)),  # two inputs; tiles fill the tokens exactly
])
def test_kernel_matches_reference(causal_conv_kernel, seed, batch, seq, shapes, seq_lens, tiles):
    xs, states, weights = make_inputs(seed, batch, seq, shapes)
    lens = jnp.asarray(seq_lens, jnp.int32)
    got = causal_conv_kernel.prefill_convs(xs, states, weights, lens, triton_call=interpreted_call, **tiles)
    assert len(got) == len(xs)
    for (out, state), x, s0, w in zip(got, xs, states, weights):
        want_out, want_state = causal_conv(x, s0, w, lens)
        assert out.shape == x.shape and state.shape == s0.shape
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(state), np.asarray(want_state))


def test_mismatched_inputs_are_refused(causal_conv_kernel):
    xs, states, weights = make_inputs(3, 2, 8, [(4,), (4,)])
    with pytest.raises(ValueError, match="do not match"):
        causal_conv_kernel.prefill_convs(xs, (states[0], states[1][:, :2]), weights, jnp.array([8, 8]),
                                         triton_call=interpreted_call)
    with pytest.raises(ValueError, match="one to three"):
        causal_conv_kernel.prefill_convs(xs * 2, states * 2, weights * 2, jnp.array([8, 8]),
                                         triton_call=interpreted_call)


def make_step(seed, batch, shapes, num_slots, kernel=4):
    """A decode step: one token a row, each row on its own slot of caches [num_slots, K-1, ...]."""
    rng = np.random.default_rng(seed)
    normal = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    xs = tuple(normal((batch, 1) + s) for s in shapes)
    caches = tuple(normal((num_slots, kernel - 1) + s) for s in shapes)
    weights = tuple(normal((kernel,) + s, 0.5) for s in shapes)
    return xs, caches, weights


@pytest.mark.parametrize("shapes,tiles", [([(2, 8), (2, 8), (4, 8)], dict(block_c=16)),  # q, k, v
                                          ([(3, 6)], dict(block_c=8))])  # one input, a partial channel block
def test_decode_step_updates_the_slots_in_place(causal_conv_kernel, shapes, tiles):
    """Rows on slots out of order, a fresh row (reads zeros), a padding row (seq_len 0, keeps its state): outputs
    and every slot of the caches as the reference leaves them (untouched slots included)."""
    xs, caches, weights = make_step(5, 4, shapes, num_slots=7)
    slots = jnp.array([5, 2, 6, 0], jnp.int32)
    fresh = jnp.array([False, True, False, False])
    lens = jnp.array([1, 1, 1, 0], jnp.int32)
    got_outs, got_caches = causal_conv_kernel.decode_convs(xs, caches, weights, slots, fresh, lens,
                                                           triton_call=interpreted_call, **tiles)
    want_outs, want_caches = causal_convs(xs, caches, weights, slots, fresh, lens)
    for got, want in zip(got_outs + got_caches, want_outs + want_caches, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_prefill_op_writes_its_slots(causal_conv_kernel):
    """The op on a prefill: states gathered from the slots (zeros for fresh rows), written back after."""
    xs, _, weights = make_inputs(6, 2, 9, [(4,), (4,), (8,)])
    caches = make_step(7, 2, [(4,), (4,), (8,)], num_slots=4)[1]
    args = (xs, caches, weights, jnp.array([3, 1], jnp.int32), jnp.array([True, False]), jnp.array([9, 5]))
    got = causal_conv_kernel.causal_convs(*args, triton_call=interpreted_call)
    want = causal_convs(*args)
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_op_takes_the_reference_where_triton_cannot_run():
    """On the CPU (no jax-triton) the layers' `conv` op of kernels="gpu" is the reference itself."""
    xs, caches, weights = make_step(4, 2, [(4,), (4,), (8,)], num_slots=3)
    args = (xs, caches, weights, jnp.array([2, 0], jnp.int32), jnp.array([False, True]), jnp.array([1, 1]))
    got, want = ops_for("gpu").conv(*args), causal_convs(*args)
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
