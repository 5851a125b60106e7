"""The Gated DeltaNet op's kernels (pallas_kernels/gdn.py: the decode kernel and the chunked prefill kernels;
Pallas, interpret mode on CPU) on mixed ragged batches against the jnp reference: decode rows beside prefill chunks
that start mid-sequence or fresh, one- and two-token prompts, a request of exactly one chunk, partial last chunks,
requests in a shuffled order at any offset, padding tokens (NaN) and padding requests, non-contiguous slots; GQA key
heads, dk != dv, several value blocks; plus their lowering to Triton for CUDA. Never needs a GPU. (Decode-only
batches and the NaN poison of unwritten outputs in interpret mode: tests/kernels/test_gdn_decode.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_batches import check_against_reference, device_batch, make_inputs, poison, run_kernel, shuffled_batch
from jax import export

from pallas_kernels.gdn import delta_rule
from pallas_kernels.gdn_prefill import default_tiles, work_items
from qwen_jax.layers.batch import ragged
from qwen_jax.layers.gated_deltanet import chunk_items

# (lens, starts, slots): a request mid-sequence over three chunks of 16 and a partial one, a decode row, a fresh
# prompt with a partial chunk, a one-token prompt, a two-token chunk mid-sequence, exactly one chunk of 16, a fresh
# prompt of two chunks and a token
MIXED = ([37, 1, 21, 1, 2, 16, 33], [20, 7, 0, 0, 5, 3, 0], [2, 5, 9, 3, 7, 11, 14])


@pytest.mark.parametrize("nk, nv, dk, dv, chunk_size, block_v, case, tokens, requests, slots", [
    (2, 4, 16, 32, 16, 16, MIXED, 128, 10, 16),   # two value blocks; dk != dv; three padding requests
    (1, 4, 32, 16, 64, 16, ([150, 1, 64, 3], [0, 9, 64, 0], [4, 1, 6, 2]), 224, 6, 8),  # chunks of 64 (two
    (2, 2, 32, 32, 32, 32, ([70, 1, 1, 5], [0, 3, 0, 40], [3, 8, 5, 6]), 80, 4, 9),    # sub-blocks); key head x4
])
def test_mixed_ragged_batch_matches_reference(nk, nv, dk, dv, chunk_size, block_v, case, tokens, requests, slots):
    for seed in range(2):  # another layout and other inputs each time
        batch = shuffled_batch(*case, tokens, requests, seed)
        inputs = make_inputs(seed, tokens, nk, nv, dk, dv, slots)
        check_against_reference(inputs, batch, chunk_size=chunk_size, block_v=block_v, decode_block_v=16)


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_mixed_ragged_batch_matches_reference_with_bfloat16_inputs(chunk_size):
    """The model feeds bf16 q/k/v/a/b: bf16 dot operands and T, float32 state and accumulation."""
    batch = shuffled_batch([70, 1, 5, 48], [0, 12, 0, 30], [3, 1, 4, 6], 136, 5, seed=3)
    inputs = make_inputs(7, 136, 2, 4, 16, 32, 8, jnp.bfloat16)
    check_against_reference(inputs, batch, chunk_size=chunk_size, block_v=16)


def test_a_request_gives_the_same_bits_wherever_it_sits():
    """A prompt's 37 tokens give the same outputs and state, bit for bit, alone in a 37-token batch or at another
    offset amid other requests and NaN padding tokens: its chunks start at its first token, and nothing else is
    read."""
    lens, starts, slots = [37, 5, 1, 20], [4, 0, 9, 0], [3, 1, 6, 5]
    wide = shuffled_batch(lens, starts, slots, 96, 6, seed=1)
    r = int(np.flatnonzero(np.asarray(wide.state_slot) == 3)[0])
    first = int(wide.query_start[r])
    assert first > 0  # not where it sits alone
    wide_inputs = poison(make_inputs(3, 96, 2, 4, 16, 16, 8), wide)
    narrow = ragged([4], [37], [3], [[0]], 37, 1, 1)
    narrow_inputs = dict(wide_inputs, **{name: wide_inputs[name][first:first + 37] for name in "qkvab"})
    options = dict(chunk_size=16, block_v=16, decode_block_v=16)
    wide_o, wide_ssm = map(np.asarray, run_kernel(wide_inputs, wide, **options))
    narrow_o, narrow_ssm = map(np.asarray, run_kernel(narrow_inputs, narrow, **options))
    np.testing.assert_array_equal(wide_o[first:first + 37], narrow_o)
    np.testing.assert_array_equal(wide_ssm[3], narrow_ssm[3])


def test_work_items_are_the_reference_chunks_of_requests_of_two_or_more_tokens():
    """The prepare launch's work items: the reference's chunks (chunk_items) of every request but one-token and
    padding ones, in its order, then padding items; the static count has room for every batch of T tokens and R
    requests."""
    for lens, tokens, requests in [(MIXED[0], 128, 10), ([2] * 8, 24, 9), ([16, 16, 1], 40, 4)]:
        batch = device_batch(shuffled_batch(lens, [0] * len(lens), list(range(1, len(lens) + 1)), tokens,
                                            requests, seed=2))
        first, end = map(np.asarray, jax.jit(work_items, static_argnums=(1, 2))(batch, 16, tokens))
        request, at, _ = map(np.asarray, jax.jit(chunk_items, static_argnums=1)(batch, 16))
        real = (at[:, 0] < tokens) & (np.asarray(batch.query_len)[request] >= 2)
        live = first < end
        assert len(first) == tokens // 16 + min(requests, tokens // 2) and live.sum() == real.sum()
        np.testing.assert_array_equal(first[live], at[real, 0])
        np.testing.assert_array_equal(end[live], (batch.query_start + batch.query_len)[request[real]])
        assert not first[~live].any() and not end[~live].any()


def test_prefill_rejects_tiles_triton_cannot_use():
    """Compiled for the GPU (interpret=False; checked before anything lowers), tiles under 16 are refused;
    interpreted, only the chunk must be a power of two (the engine's tiny test models have 8-wide heads)."""
    batch = device_batch(ragged([0], [8], [1], [[0]], 8, 1, 1))
    inputs = make_inputs(0, 8, 1, 2, 16, 16, 2)
    with pytest.raises(ValueError, match="block_v 8"):
        delta_rule(**inputs, batch=batch, chunk_size=16, block_v=8, decode_block_v=16, interpret=False)
    with pytest.raises(ValueError, match="chunk_size 24"):
        delta_rule(**inputs, batch=batch, chunk_size=24)


@pytest.mark.parametrize("case, requests", [(([150], [0], [2]), 1), (([150, 1, 37], [0, 4, 9], [2, 1, 4]), 3)])
def test_default_tiles_by_request_slots(case, requests):
    """Without tiles given: chunks of 32, with 32 value columns for a batch of one request slot (twice the
    recurrence programs) and 64 for several (default_tiles); both match the reference across chunk boundaries."""
    assert default_tiles(requests, 128) == dict(chunk_size=32, block_v=32 if requests == 1 else 64, num_stages=3)
    batch = shuffled_batch(*case, 192, requests, seed=4)
    check_against_reference(make_inputs(9, 192, 1, 2, 16, 32, 5), batch, state_rtol=1e-4)


def _lowered_for_cuda(tokens: int, requests: int, **options) -> str:
    """delta_rule lowered (not compiled) for CUDA on this CPU machine at the 35B-A3B shapes (nk 16, nv 32,
    dk = dv = 128, bf16), ssm (65 slots) donated: its StableHLO text."""
    s = jax.ShapeDtypeStruct
    nk, nv, dk, dv = 16, 32, 128, 128
    args = (s((tokens, nk, dk), jnp.bfloat16), s((tokens, nk, dk), jnp.bfloat16), s((tokens, nv, dv), jnp.bfloat16),
            s((tokens, nv), jnp.bfloat16), s((tokens, nv), jnp.bfloat16), s((nv,), jnp.float32),
            s((nv,), jnp.float32), s((65, nv, dk, dv), jnp.float32))
    batch = jax.tree.map(lambda x: s(x.shape, x.dtype), ragged([0], [tokens], [1], [[0]], tokens, requests, 1))
    fn = jax.jit(lambda *x: delta_rule(*x, **options, interpret=False), donate_argnums=7)
    return export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args, batch).mlir_module()


def _aliases(operands: tuple[int, int]) -> str:
    return ("output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [0], operand_index = "
            f"{operands[0]}, operand_tuple_indices = []>, #stablehlo.output_operand_alias<output_tuple_indices = [1], "
            f"operand_index = {operands[1]}, operand_tuple_indices = []>]")


def test_given_tiles_reach_the_triton_calls_for_cuda():
    """4,096 tokens of 64 request slots, tiles given: the decode launch over (request, head, value block of 64), the
    chunk preparation over (work item, head) in chunks of 64 (4,096 / 64 + 64 items), the recurrence over (value
    block, head, request) on 64 columns, the prefill launches on 8 warps; out and ssm go through the decode and
    recurrence launches in place."""
    text = _lowered_for_cuda(4096, 64, chunk_size=64, block_v=64, num_warps=8)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 3
    assert "grid_x = 64 : i32, grid_y = 32 : i32, grid_z = 2 : i32" in text  # decode
    assert "grid_x = 128 : i32, grid_y = 32 : i32, grid_z = 1 : i32" in text  # prepare
    assert "grid_x = 2 : i32, grid_y = 32 : i32, grid_z = 64 : i32" in text  # recurrence
    assert text.count("num_warps = 8 : i32") == 2 and text.count("num_warps = 4 : i32") == 1
    assert _aliases((11, 12)) in text and _aliases((10, 11)) in text


def test_one_request_slot_lowers_with_32_value_columns_and_chunks_of_32():
    text = _lowered_for_cuda(2048, 1)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 3
    assert "grid_x = 65 : i32, grid_y = 32 : i32, grid_z = 1 : i32" in text  # 2,048 / 32 + 1 items
    assert "grid_x = 4 : i32, grid_y = 32 : i32, grid_z = 1 : i32" in text  # 128 / 32 value blocks
