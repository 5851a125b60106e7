"""The fused Gated DeltaNet decode kernel (Pallas, interpret mode on CPU) on decode batches against the jnp reference:
through the op (pallas_kernels/gdn.py) with slots out of order, padding requests sinking into slot 0, fresh rows;
alone, it leaves every other request's tokens and slots untouched; plus its lowering to Triton IR for CUDA. Never
needs a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_batches import (
    check_against_reference,
    device_batch,
    make_inputs,
    poison,
    rel_err,
    run_reference,
    shuffled_batch,
)
from jax.experimental import pallas as pl
from support import cuda_mlir

from pallas_kernels.gdn import delta_rule
from pallas_kernels.gdn_decode import decode
from qwen_jax.layers.batch import ragged

RTOL = 2e-6  # float32 decode rows: one token's float32 math in another order


def test_interpret_mode_leaves_unwritten_outputs_nan():
    """The poison the checks below rely on: an output element the kernel never writes reads back as NaN."""
    def write_first_half(o_ref):
        o_ref[pl.ds(0, 4)] = jnp.ones((4,), jnp.float32)

    o = pl.pallas_call(write_first_half, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)()
    np.testing.assert_array_equal(np.asarray(o[:4]), np.ones(4, np.float32))
    assert np.isnan(np.asarray(o[4:])).all()


@pytest.mark.parametrize("nk, nv, dk, dv, slots, starts, tokens, requests, block_v", [
    (2, 4, 16, 16, [5, 2, 3], [9, 4, 0], 6, 5, 8),             # slots out of order with gaps; two value blocks;
    (1, 4, 16, 32, [4, 1, 6, 7, 3], [3, 0, 0, 12, 1], 10, 8, 16),  # padding requests; fresh rows; dk != dv
    (2, 2, 16, 16, [3], [5], 2, 1, 16),                        # one row, nk == nv, one value block
])
def test_decode_batch_matches_reference(nk, nv, dk, dv, slots, starts, tokens, requests, block_v):
    for seed in range(2):  # another layout and other inputs each time
        batch = shuffled_batch([1] * len(slots), starts, slots, tokens, requests, seed)
        inputs = make_inputs(seed, tokens, nk, nv, dk, dv, 8)
        check_against_reference(inputs, batch, state_rtol=RTOL, decode_block_v=block_v, chunk_size=16, block_v=dv)


def test_decode_batch_matches_reference_with_bfloat16_inputs():
    """The model feeds bf16 q/k/v/a/b; beta = sigmoid(b) is rounded to bf16 in both, as HF does; the state stays
    float32 throughout."""
    batch = shuffled_batch([1] * 3, [2, 0, 7], [2, 6, 1], 6, 4, seed=5)
    check_against_reference(make_inputs(7, 6, 2, 4, 16, 16, 7, jnp.bfloat16), batch, state_rtol=RTOL,
                            decode_block_v=8, chunk_size=16, block_v=16)


def test_a_one_token_batch_runs_the_decode_launch_alone():
    """No request of two tokens fits in a batch of one token: the prefill launches are left out."""
    batch = ragged([5], [1], [3], [[0]], 1, 1, 1)
    inputs = make_inputs(2, 1, 2, 4, 16, 16, 5)
    check_against_reference(inputs, batch, state_rtol=RTOL, decode_block_v=16)
    text = str(jax.make_jaxpr(lambda x: delta_rule(**x, batch=device_batch(batch)))(inputs))
    assert text.count("pallas_call") == 1 and "gdn_decode" in text


def test_decode_kernel_leaves_every_other_request_alone():
    """The decode launch alone on a mixed batch: its one-token requests' outputs and slots match the reference; the
    prefill requests' tokens and slots, padding tokens and the sink slot keep their bits."""
    batch = shuffled_batch([1, 9, 1, 3, 1], [4, 0, 0, 7, 2], [6, 2, 3, 5, 1], 20, 7, seed=6)
    inputs = make_inputs(1, 20, 2, 4, 16, 16, 8)
    with jax.default_matmul_precision("highest"):
        want_o, want_ssm = map(np.asarray, run_reference(inputs, device_batch(batch)))
    sentinel = jnp.full((20, 4, 16), 7.0, jnp.float32)
    poisoned = poison(inputs, batch)
    got_o, got_ssm = map(np.asarray, jax.jit(decode, static_argnames="block_v")(
        **poisoned, batch=device_batch(batch), out=sentinel, block_v=8))
    one = np.asarray(batch.query_len) == 1
    tokens = np.asarray(batch.query_start)[one]
    slots = np.asarray(batch.state_slot)[one]
    assert rel_err(got_o[tokens], want_o[tokens]) < RTOL and rel_err(got_ssm[slots], want_ssm[slots]) < RTOL
    others = np.setdiff1d(np.arange(20), tokens)
    np.testing.assert_array_equal(got_o[others], np.asarray(sentinel)[others])
    rest = np.setdiff1d(np.arange(8), slots)  # the prefill requests' slots (one NaN: fresh), the sink, unused ones
    np.testing.assert_array_equal(got_ssm[rest], np.asarray(poisoned["ssm"])[rest])


def test_decode_rejects_mismatched_shapes():
    inputs = make_inputs(0, 2, 2, 4, 16, 16, 3)
    batch = device_batch(ragged([3, 5], [1, 1], [1, 2], [[0], [0]], 2, 2, 1))
    with pytest.raises(ValueError, match="block_v"):
        decode(**inputs, batch=batch, out=jnp.zeros((2, 4, 16)), block_v=12)


def test_decode_lowers_to_one_triton_call_for_cuda():
    """Lowered (not compiled) for CUDA on this CPU machine: the Pallas Triton backend accepts the kernel body at the
    35B-A3B decode shapes, as one Triton call over (request, value head, value block) that updates out and ssm
    (operands 11 and 12) in place."""
    s = jax.ShapeDtypeStruct
    rows, nk, nv, dk, dv = 64, 16, 32, 128, 128
    args = (s((rows, nk, dk), jnp.bfloat16), s((rows, nk, dk), jnp.bfloat16), s((rows, nv, dv), jnp.bfloat16),
            s((rows, nv), jnp.bfloat16), s((rows, nv), jnp.bfloat16), s((nv,), jnp.float32), s((nv,), jnp.float32),
            s((rows + 1, nv, dk, dv), jnp.float32))
    batch = jax.tree.map(lambda x: s(x.shape, x.dtype), ragged([5] * rows, [1] * rows, list(range(1, rows + 1)),
                                                               [[0]] * rows, rows, rows, 1))
    fn = jax.jit(lambda *x: decode(*x, out=jnp.zeros((rows, nv, dv), jnp.bfloat16), block_v=32, num_warps=4,
                                   interpret=False), donate_argnums=7)
    text = cuda_mlir(fn, *args, batch)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert "grid_x = 64 : i32, grid_y = 32 : i32, grid_z = 4 : i32" in text
    assert "num_warps = 4 : i32" in text
    assert ("output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [0], operand_index = 11, "
            "operand_tuple_indices = []>, #stablehlo.output_operand_alias<output_tuple_indices = [1], "
            "operand_index = 12") in text
