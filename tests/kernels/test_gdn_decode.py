"""The fused Gated DeltaNet decode kernel (Pallas, interpret mode on CPU) against its jnp reference, plus its lowering
to Triton IR for CUDA; never needs a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental import pallas as pl

from pallas_kernels.gdn_decode import gdn_decode, reference, select

RTOL = 2e-6  # float32: max |kernel - reference| / max |reference|, per output
run_kernel = jax.jit(gdn_decode, static_argnames=("block_v", "interpret"), donate_argnames="state")


def make_inputs(seed: int, batch: int, nk: int, nv: int, dk: int, dv: int, num_slots: int, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    normal = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype)
    return dict(
        q=normal((batch, nk, dk), 2.0), k=normal((batch, nk, dk), 2.0), v=normal((batch, nv, dv)),
        a=normal((batch, nv), 2.0), b=normal((batch, nv), 2.0),
        A_log=normal(nv, 0.7).astype(jnp.float32), dt_bias=normal(nv).astype(jnp.float32),
        state=jnp.asarray(rng.standard_normal((num_slots, nv, dk, dv), np.float32)),
    )


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def check_against_reference(seed: int, batch: int, nk: int, nv: int, dk: int, dv: int, slots: list[int],
                            num_slots: int, block_v: int, dtype=jnp.float32, fresh: list[bool] | None = None) -> None:
    """Real rows name distinct nonzero slots; rows with slot 0 are padding sinking into slot 0 (never compared).
    Rows marked `fresh` start a sequence: both sides must read their slot as zeros."""
    inp = make_inputs(seed, batch, nk, nv, dk, dv, num_slots, dtype)
    state_before = np.asarray(inp["state"])
    state_slots = jnp.asarray(slots, jnp.int32)
    fresh = None if fresh is None else jnp.asarray(fresh)
    want_o, want_state = jax.jit(reference)(**inp, state_slots=state_slots, fresh=fresh)
    got_o, got_state = run_kernel(**inp, state_slots=state_slots, fresh=fresh, block_v=block_v)
    got_o, got_state, want_o, want_state = map(np.asarray, (got_o, got_state, want_o, want_state))

    real = [i for i, s in enumerate(slots) if s != 0]
    assert got_o.shape == (batch, nv, dv) and got_o.dtype == inp["v"].dtype  # float32 math, rounded once at the end
    assert np.isfinite(got_o).all()  # every element written, padding rows included
    # bf16 outputs: both round float32 values that differ by ~1e-7, so an element may land one bf16 ulp apart
    assert rel_err(got_o[real], want_o[real]) < (RTOL if dtype == jnp.float32 else 2.0 ** -8)
    addressed = [slots[i] for i in real]
    assert rel_err(got_state[addressed], want_state[addressed]) < RTOL
    untouched = [s for s in range(1, num_slots) if s not in addressed]
    np.testing.assert_array_equal(got_state[untouched], state_before[untouched])
    assert not np.allclose(got_state[addressed], state_before[addressed])  # the update did happen


def test_interpret_mode_leaves_unwritten_outputs_nan():
    """The poison the checks below rely on: an output element the kernel never writes reads back as NaN."""
    def write_first_half(o_ref):
        o_ref[pl.ds(0, 4)] = jnp.ones((4,), jnp.float32)

    o = pl.pallas_call(write_first_half, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)()
    np.testing.assert_array_equal(np.asarray(o[:4]), np.ones(4, np.float32))
    assert np.isnan(np.asarray(o[4:])).all()


@pytest.mark.parametrize(
    "batch, nk, nv, dk, dv, slots, num_slots, block_v",
    [
        (3, 2, 4, 16, 16, [5, 2, 3], 7, 8),          # slots out of order with gaps; two value blocks
        (5, 1, 4, 16, 32, [4, 0, 1, 0, 6], 8, 16),   # two padding rows share the sink slot 0; dk != dv
        (1, 2, 2, 16, 16, [3], 4, 16),               # one row, nk == nv, one value block
    ],
)
def test_gdn_decode_matches_reference(batch, nk, nv, dk, dv, slots, num_slots, block_v):
    for seed in range(2):  # fresh random inputs each check
        check_against_reference(seed, batch, nk, nv, dk, dv, slots, num_slots, block_v)


def test_gdn_decode_matches_reference_with_bfloat16_inputs():
    """The model feeds bf16 q/k/v/a/b; beta = sigmoid(b) is rounded to bf16 in both, as HF does."""
    check_against_reference(7, 3, 2, 4, 16, 16, [2, 6, 1], 7, 8, dtype=jnp.bfloat16)


def test_gdn_decode_starts_fresh_rows_from_a_zero_state():
    """A row that starts a sequence ignores whatever its slot held (the previous owner's state)."""
    check_against_reference(3, 3, 2, 4, 16, 16, [2, 6, 1], 7, 8, fresh=[True, False, True])
    inp = make_inputs(3, 3, 2, 4, 16, 16, 7)
    zeroed = inp["state"].at[jnp.array([2, 1])].set(0.0)
    slots = jnp.array([2, 6, 1], jnp.int32)
    fresh_o, _ = run_kernel(**inp, state_slots=slots, fresh=jnp.array([True, False, True]), block_v=8)
    want_o, _ = jax.jit(reference)(**dict(inp, state=zeroed), state_slots=slots)
    assert rel_err(fresh_o, want_o) < RTOL


def test_gdn_decode_rejects_mismatched_shapes():
    inp = make_inputs(0, 2, 2, 4, 16, 16, 3)
    with pytest.raises(ValueError, match="block_v"):
        gdn_decode(**inp, state_slots=jnp.array([1, 2], jnp.int32), block_v=12)


def test_select_switches_between_reference_and_kernel():
    assert select("reference") is reference and select("gpu") is gdn_decode


def test_gdn_decode_lowers_to_one_triton_call_for_cuda():
    """Lowered (not compiled) for CUDA on this CPU machine: the Pallas Triton backend accepts the kernel body at the
    35B-A3B decode shapes, as one Triton custom call that updates the state operand in place."""
    s = jax.ShapeDtypeStruct
    batch, nk, nv, dk, dv = 64, 16, 32, 128, 128
    args = (s((batch, nk, dk), jnp.bfloat16), s((batch, nk, dk), jnp.bfloat16), s((batch, nv, dv), jnp.bfloat16),
            s((batch, nv), jnp.bfloat16), s((batch, nv), jnp.bfloat16), s((nv,), jnp.float32), s((nv,), jnp.float32),
            s((batch + 1, nv, dk, dv), jnp.float32), s((batch,), jnp.int32))
    fn = jax.jit(lambda *x: gdn_decode(*x, block_v=32, num_warps=4, interpret=False), donate_argnums=7)
    exported = export.export(fn, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert "grid_x = 64 : i32, grid_y = 32 : i32, grid_z = 4 : i32" in text
    assert "num_warps = 4 : i32" in text
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [1], operand_index = 9" \
        in text
