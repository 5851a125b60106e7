"""The GDN causal conv kernels (pallas_kernels/causal_conv.py) on the CPU: Triton's interpreter runs the kernel source
(launched by test_moe_triton's stand-in for jax_triton.triton_call, which poisons outputs with NaN, so a token no
launch wrote shows) against the layers' `conv` op reference (qwen_jax.layers.gated_deltanet.causal_convs) on ragged
batches: decode rows and prefill chunks mixed, chunks starting mid-sequence, fresh requests with garbage in their
slot, requests shorter than the conv's state, one-token prompts, requests shuffled on the token axis between padding
tokens, padding requests, slots out of order with untouched ones between.

Float32 only: the interpreter rounds bf16 differently (triton 3.6). The new states (copies) are bitwise the
reference's; the outputs agree to float32 rounding, since XLA:CPU contracts the reference's multiply-adds and its
exp is not numpy's. scripts/check_causal_conv_gpu.py holds both bitwise on a GPU, bf16 included.
tests/models/test_causal_conv.py covers the reference's conv itself."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_triton import interpreted_call  # tests/kernels is on sys.path (pytest's prepend mode)

from qwen_jax.layers.batch import Ragged, ragged
from qwen_jax.layers.gated_deltanet import causal_convs, verify_causal_convs
from qwen_jax.layers.hot_ops import ops_for

EXACT = {"xla_allow_excess_precision": False}  # as the engine compiles
reference = jax.jit(causal_convs, compiler_options=EXACT)

QKV = [(2, 8), (2, 8), (4, 8)]  # GDN-like q, k, v: (heads, head dim)
# (start position, new tokens) of each request: decode rows, a one-token prompt, chunks mid-sequence, a fresh
# prompt, chunks and a prompt shorter than the conv's state (K - 1 = 3), a chunk of exactly K - 1 tokens
MIXED = [(9, 1), (3, 1), (0, 1), (12, 23), (0, 17), (5, 2), (0, 2), (7, 3), (1, 1), (40, 6)]


@pytest.fixture(scope="module")
def causal_conv_kernel():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it before anything imports triton
    from pallas_kernels import causal_conv as module

    return module


def shuffled_batch(rng, requests, num_tokens, num_requests) -> Ragged:
    """A Ragged of `requests` ((start position, new tokens, slot) each) at random request indices among
    `num_requests` (the others padding requests), laid out on the token axis in another random order, with padding
    tokens before, between and after them."""
    count, total = len(requests), sum(n for _, n, _ in requests)
    index = rng.permutation(num_requests)[:count]
    gaps = rng.multinomial(num_tokens - total, np.full(count + 1, 1 / (count + 1)))
    query_start, at = np.zeros(count, np.int32), 0
    for gap, i in zip(gaps, rng.permutation(count)):
        query_start[i], at = at + gap, at + gap + requests[i][1]
    starts, lens, slots = zip(*requests, strict=True)
    return ragged(starts, lens, slots, [[]] * count, num_tokens, num_requests, 1, query_start, index)


def make_case(seed, requests, shapes, num_tokens, num_requests, kernel=4):
    """Inputs, caches of 2 * len(requests) + 1 slots (random: fresh requests' slots hold garbage), weights, and a
    shuffled batch whose requests take distinct random slots from 1 (slot 0 is the padding requests' sink)."""
    rng = np.random.default_rng(seed)
    normal = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    num_slots = 2 * len(requests) + 1
    slots = rng.permutation(np.arange(1, num_slots))[:len(requests)]
    batch = shuffled_batch(rng, [(s, n, int(slot)) for (s, n), slot in zip(requests, slots)], num_tokens,
                           num_requests)
    xs = tuple(normal((num_tokens,) + s) for s in shapes)
    caches = tuple(normal((num_slots, kernel - 1) + s) for s in shapes)
    weights = tuple(normal((kernel,) + s, 0.5) for s in shapes)
    return xs, caches, weights, batch


@pytest.mark.parametrize("seed,requests,shapes,tokens,num_requests,kernel,tiles", [
    (0, MIXED, QKV, 100, 14, 4, dict(block_t=16, block_c=16, request_block_c=16)),  # a partial token block
    (1, MIXED, QKV, 100, 14, 4, {}),  # the default tiles: a token block spans every request
    (2, MIXED[:6], [(3, 6)], 64, 8, 4, dict(block_t=8, block_c=8, request_block_c=8)),  # 18 channels: partial blocks
    (3, MIXED, [(16,), (24,)], 90, 12, 2, dict(block_t=32, block_c=16, request_block_c=16)),  # two inputs, K = 2
    (4, [(5, 1), (0, 1), (17, 1), (2, 1), (30, 1), (1, 1)], QKV, 8, 8, 4, dict(request_block_c=16)),  # decode step
    (5, [(0, 40), (64, 33), (3, 2)], QKV, 80, 4, 4, dict(block_t=16, block_c=16)),  # prefill only
])
def test_kernels_match_the_reference(causal_conv_kernel, seed, requests, shapes, tokens, num_requests, kernel, tiles):
    """Outputs of the real tokens as the reference's, 0 on padding tokens; every cache slot as the reference leaves
    it: the requests' advanced, the others (the sink and unused slots) untouched."""
    xs, caches, weights, batch = make_case(seed, requests, shapes, tokens, num_requests, kernel)
    got_outs, got_caches = causal_conv_kernel.causal_convs(xs, caches, weights, batch, triton_call=interpreted_call,
                                                           **tiles)
    want_outs, want_caches = reference(xs, caches, weights, batch)
    valid = batch.token_valid
    for got, want, x in zip(got_outs, want_outs, xs, strict=True):
        assert got.shape == x.shape and got.dtype == x.dtype
        got = np.asarray(got)
        np.testing.assert_allclose(got[valid], np.asarray(want)[valid], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[~valid], 0.0)
    untouched = np.setdiff1d(np.arange(caches[0].shape[0]), batch.state_slot[batch.query_len > 0])
    for got, want, cache in zip(got_caches, want_caches, caches, strict=True):
        assert got.shape == cache.shape and got.dtype == cache.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(cache)[untouched])


def test_mismatched_inputs_are_refused(causal_conv_kernel):
    xs, caches, weights, batch = make_case(6, MIXED[:3], [(4,), (4,)], 8, 4)
    with pytest.raises(ValueError, match="do not match"):
        causal_conv_kernel.causal_convs(xs, (caches[0], caches[1][:, :2]), weights, batch,
                                        triton_call=interpreted_call)
    with pytest.raises(ValueError, match="do not match"):
        causal_conv_kernel.causal_convs(xs, (caches[0], caches[1].astype(jnp.bfloat16)), weights, batch,
                                        triton_call=interpreted_call)
    with pytest.raises(ValueError, match="one to three"):
        causal_conv_kernel.causal_convs(xs * 2, caches * 2, weights * 2, batch, triton_call=interpreted_call)


def test_op_takes_the_reference_where_triton_cannot_run():
    """On the CPU (no jax-triton) the layers' `conv` op of kernels="gpu" is the reference itself."""
    args = make_case(7, MIXED, QKV, 64, 12)
    got, want = jax.jit(ops_for("gpu").conv, compiler_options=EXACT)(*args), reference(*args)
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("draft_len, block_t", [(1, 8), (3, 8), (3, None)])
def test_verify_kernel_matches_the_reference(causal_conv_kernel, draft_len, block_t):
    """Speculative verify rows (draft_len + 1 tokens each: mid-sequence, fresh, starting inside the conv's state):
    the token launch's outputs as the reference's (verify_causal_convs), 0 on padding tokens, no cache returned.
    block_t None: the step's own (one tile of 32 tokens here)."""
    requests = [(9, draft_len + 1), (0, draft_len + 1), (1, draft_len + 1), (30, draft_len + 1)]
    xs, caches, weights, batch = make_case(8 + draft_len, requests, QKV, 4 * draft_len + 9, 6)
    got = causal_conv_kernel.verify_causal_convs(xs, caches, weights, batch, triton_call=interpreted_call,
                                                 block_t=block_t, block_c=8)
    want = jax.jit(verify_causal_convs, compiler_options=EXACT)(xs, caches, weights, batch)
    valid = batch.token_valid
    assert len(got) == 3
    for g, w, x in zip(got, want, xs, strict=True):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g)[valid], np.asarray(w)[valid], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(g)[~valid], 0.0)
