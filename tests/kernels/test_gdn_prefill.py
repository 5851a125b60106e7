"""The Gated DeltaNet chunked-prefill kernels (Pallas, interpret mode on CPU) against their jnp reference: ragged
seq_lens (0, 1, one chunk exactly, several chunks, a partial last chunk), GQA key-head repeats, dk != dv, several
value blocks, nonzero initial states, NaN in every padding token; plus their lowering to Triton for CUDA. Never needs
a GPU. (The NaN poison of unwritten outputs in interpret mode: tests/kernels/test_gdn_decode.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.gdn_prefill import default_tiles, gdn_prefill, reference, select

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}  # max |kernel - reference| / max |reference|; bf16: the kernel's dot
# operands are bf16, the reference computes in float32 from the same (bf16) inputs
run_kernel = jax.jit(gdn_prefill, static_argnames=("chunk_size", "block_v"))
_jitted_reference = jax.jit(reference)


def run_reference(**inputs):
    """The reference in float32 throughout: on a GPU, XLA's default would take float32 dots as TF32 (~5e-4 off),
    where the kernel's float32 dots are IEEE; on the CPU this changes nothing."""
    with jax.default_matmul_precision("highest"):
        return _jitted_reference(**inputs)


def make_inputs(seed: int, batch: int, seq: int, nk: int, nv: int, dk: int, dv: int, seq_lens: list[int],
                dtype=jnp.float32) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype)
    return dict(
        q=normal((batch, seq, nk, dk), 2.0), k=normal((batch, seq, nk, dk), 2.0), v=normal((batch, seq, nv, dv)),
        a=normal((batch, seq, nv)), b=normal((batch, seq, nv), 2.0),
        A_log=normal(nv, 0.7).astype(jnp.float32) - 1.0, dt_bias=normal(nv).astype(jnp.float32),
        state=jnp.asarray(rng.standard_normal((batch, nv, dk, dv), np.float32)),
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
    )


def poison_padding(inputs: dict) -> dict:
    """NaN in q, k, v, a, b at every token past its row's seq_len: one read of them would show in the results."""
    seq = inputs["q"].shape[1]
    padding = np.arange(seq)[None, :] >= np.asarray(inputs["seq_lens"])[:, None]  # [B, S]
    poison = lambda x: jnp.where(padding.reshape(padding.shape + (1,) * (x.ndim - 2)), jnp.nan, x)
    return dict(inputs, **{name: poison(inputs[name]) for name in ("q", "k", "v", "a", "b")})


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def check_against_reference(inputs: dict, chunk_size: int, block_v: int) -> None:
    """The kernel on NaN-poisoned padding against the reference on finite padding: real outputs and every row's
    final state match, padding outputs are exactly 0, rows without tokens keep their state bit for bit."""
    want_o, want_state = map(np.asarray, run_reference(**inputs))
    got_o, got_state = map(np.asarray, run_kernel(**poison_padding(inputs), chunk_size=chunk_size, block_v=block_v))
    seq_lens = np.asarray(inputs["seq_lens"])
    real = np.arange(got_o.shape[1])[None, :] < seq_lens[:, None]  # [B, S]

    assert got_o.shape == want_o.shape and got_o.dtype == inputs["v"].dtype and got_state.dtype == np.float32
    assert np.isfinite(got_o).all() and np.isfinite(got_state).all()  # every output written, no padding read
    assert rel_err(got_o[real], want_o[real]) < RTOL[inputs["q"].dtype.type]
    assert not got_o[~real].any()
    assert rel_err(got_state, want_state) < RTOL[inputs["q"].dtype.type]
    state_before = np.asarray(inputs["state"])
    np.testing.assert_array_equal(got_state[seq_lens == 0], state_before[seq_lens == 0])
    assert not np.allclose(got_state[seq_lens > 0], state_before[seq_lens > 0])  # the update did happen


@pytest.mark.parametrize("batch, seq, nk, nv, dk, dv, seq_lens, chunk_size, block_v", [
    (3, 70, 2, 4, 16, 32, [70, 0, 33], 16, 16),           # 5 chunks, a row without tokens; 2 value blocks; dk != dv
    (5, 40, 1, 4, 32, 16, [1, 32, 40, 0, 17], 32, 16),    # odd batch; 1 token, exactly one chunk; key head x4
    (2, 150, 2, 2, 32, 32, [150, 64], 64, 32),            # chunk 64 (two sub-blocks, scores across them): three
])                                                        # chunks (the last partial), exactly one
def test_gdn_prefill_matches_reference(batch, seq, nk, nv, dk, dv, seq_lens, chunk_size, block_v):
    for seed in range(2):  # fresh random inputs each check
        check_against_reference(make_inputs(seed, batch, seq, nk, nv, dk, dv, seq_lens), chunk_size, block_v)


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_gdn_prefill_matches_reference_with_bfloat16_inputs(chunk_size):
    """The model feeds bf16 q/k/v/a/b: bf16 dot operands and T, float32 state and accumulation."""
    inputs = make_inputs(7, 3, 70, 2, 4, 16, 32, [70, 5, 48], jnp.bfloat16)
    check_against_reference(inputs, chunk_size=chunk_size, block_v=16)


def test_padding_tokens_never_change_the_state():
    """A row's 37 tokens give the same outputs and state, bit for bit, whether the batch is 37 tokens wide or 96
    with 59 NaN padding tokens after them."""
    wide = make_inputs(3, 2, 96, 2, 4, 16, 16, [37, 96])
    narrow = dict(wide, seq_lens=wide["seq_lens"][:1], state=wide["state"][:1],
                  **{name: wide[name][:1, :37] for name in ("q", "k", "v", "a", "b")})
    narrow_o, narrow_state = run_kernel(**narrow, chunk_size=16, block_v=16)
    wide_o, wide_state = run_kernel(**poison_padding(wide), chunk_size=16, block_v=16)
    np.testing.assert_array_equal(np.asarray(wide_o[0, :37]), np.asarray(narrow_o[0]))
    np.testing.assert_array_equal(np.asarray(wide_state[0]), np.asarray(narrow_state[0]))


def test_gdn_prefill_rejects_tiles_triton_cannot_use():
    """Compiled for the GPU (interpret=False; checked before anything lowers), tiles under 16 are refused;
    interpreted, only the chunk must be a power of two (the engine's tiny test models have 8-wide heads)."""
    inputs = make_inputs(0, 1, 8, 1, 2, 16, 16, [8])
    with pytest.raises(ValueError, match="block_v 8"):
        gdn_prefill(**inputs, chunk_size=16, block_v=8, interpret=False)
    with pytest.raises(ValueError, match="chunk_size 24"):
        gdn_prefill(**inputs, chunk_size=24)


def test_select_switches_between_reference_and_kernel():
    assert select("reference") is reference and select("gpu") is gdn_prefill


def _lowered_for_cuda(batch: int, seq: int, **options) -> str:
    """gdn_prefill lowered (not compiled) for CUDA on this CPU machine at the 35B-A3B shapes (nk 16, nv 32,
    dk = dv = 128, bf16), the state donated: its StableHLO text."""
    s = jax.ShapeDtypeStruct
    nk, nv, dk, dv = 16, 32, 128, 128
    args = (s((batch, seq, nk, dk), jnp.bfloat16), s((batch, seq, nk, dk), jnp.bfloat16),
            s((batch, seq, nv, dv), jnp.bfloat16), s((batch, seq, nv), jnp.bfloat16), s((batch, seq, nv), jnp.bfloat16),
            s((nv,), jnp.float32), s((nv,), jnp.float32), s((batch, nv, dk, dv), jnp.float32), s((batch,), jnp.int32))
    fn = jax.jit(lambda *x: gdn_prefill(*x, **options, interpret=False), donate_argnums=7)
    return export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()


def test_given_tiles_reach_both_triton_calls_for_cuda():
    """64 x 1,024 tokens, tiles given: the chunk preparation over (chunk, head, row) in chunks of 64, the
    recurrence over (value block, head, row) on 64 columns, both on 8 warps; the state (operand 7) updated in
    place."""
    text = _lowered_for_cuda(64, 1024, chunk_size=64, block_v=64, num_warps=8)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2
    assert "grid_x = 16 : i32, grid_y = 32 : i32, grid_z = 64 : i32" in text  # 1,024 / 64 chunks
    assert "grid_x = 2 : i32, grid_y = 32 : i32, grid_z = 64 : i32" in text  # 128 / 64 value blocks
    assert text.count("num_warps = 8 : i32") == 2
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [1], operand_index = 7" \
        in text


def test_several_prompts_lower_to_two_triton_calls_for_cuda():
    """At the defaults for 64 prompts: the preparation over (chunk, head, row) in chunks of 32, then one launch
    over (value block, head, row) that runs the recurrence, writes the outputs and updates the state (operand 7)
    in place."""
    text = _lowered_for_cuda(64, 1024)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2
    assert "grid_x = 32 : i32, grid_y = 32 : i32, grid_z = 64 : i32" in text  # 1,024 / 32 chunks
    assert "grid_x = 2 : i32, grid_y = 32 : i32, grid_z = 64 : i32" in text  # 128 / 64 value blocks
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [1], operand_index = 7" \
        in text


@pytest.mark.parametrize("batch, seq_lens", [(1, [150]), (2, [150, 37])])
def test_default_tiles_by_prompt_count(batch, seq_lens):
    """Without tiles given: chunks of 32, with 32 value columns for one prompt (twice the recurrence programs) and 64
    for several (default_tiles); both match the reference across chunk boundaries."""
    assert default_tiles(batch, 128) == dict(chunk_size=32, block_v=32 if batch == 1 else 64, num_stages=3)
    inputs = make_inputs(9, batch, 150, 1, 2, 16, 32, seq_lens)
    got_o, got_state = map(np.asarray, jax.jit(gdn_prefill)(**poison_padding(inputs)))
    want_o, want_state = map(np.asarray, run_reference(**inputs))
    real = np.arange(150)[None, :] < np.asarray(seq_lens)[:, None]
    assert rel_err(got_o[real], want_o[real]) < 1e-4 and rel_err(got_state, want_state) < 1e-4


def test_one_prompt_lowers_with_32_value_columns():
    text = _lowered_for_cuda(1, 2048)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2
    assert "grid_x = 64 : i32, grid_y = 32 : i32, grid_z = 1 : i32" in text  # 2,048 / 32 chunks
    assert "grid_x = 4 : i32, grid_y = 32 : i32, grid_z = 1 : i32" in text  # 128 / 32 value blocks
