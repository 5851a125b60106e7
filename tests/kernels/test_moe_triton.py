"""The native Triton MoE kernels (pallas_kernels/moe_triton.py) on the CPU: Triton's interpreter (TRITON_INTERPRET=1)
runs the same kernel source, launched by a stand-in for jax_triton.triton_call, against the jnp reference over ragged
routings (empty experts, one expert taking every token, experts held elsewhere, odd token counts, top_k 3). Float32
only: the interpreter computes bf16 dots wrongly (triton 3.6). Also: which layout moe_gemm picks at which size."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_moe_gemm import make_inputs as make_bf16_inputs  # tests/kernels is on sys.path (pytest's prepend mode)
from test_moe_gemm import rel_err

from pallas_kernels import moe_gemm
from pallas_kernels.tiling import triton_available
from qwen_jax.layers.mlp import routed_experts_f32 as reference


def make_inputs(*args):
    return make_bf16_inputs(*args, dtype=jnp.float32)  # the interpreter computes bf16 dots wrongly


@pytest.fixture(scope="module")
def moe_triton():
    """The module, its kernels decorated in interpreter mode (tests/conftest.py sets TRITON_INTERPRET=1 before
    anything imports triton)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pallas_kernels import moe_triton as module

    return module


POISON_INT = -7777  # what an int output holds where the kernel wrote nothing


def interpreted_call(*args, kernel, out_shape, grid, num_warps, num_stages, name, zeroed_outputs=(),
                     input_output_aliases=None, enable_fp_fusion=True, **metaparams):
    """jax_triton.triton_call's contract on the CPU: array arguments, then the outputs, as pointers; an output
    aliased to an input is that input's buffer, the others are fresh, zeroed if asked, else poisoned (NaN, or
    POISON_INT), so a row the kernel should have written and did not shows."""
    del num_warps, num_stages, name, enable_fp_fusion  # compile options: the interpreter has none
    inputs = [torch.from_numpy(np.array(a)) for a in args]
    aliased = {out: inputs[i] for i, out in (input_output_aliases or {}).items()}
    shapes = out_shape if isinstance(out_shape, (tuple, list)) else (out_shape,)
    outs = []
    for i, shape in enumerate(shapes):
        dtype = torch.from_numpy(np.zeros((), shape.dtype)).dtype
        fill = 0 if i in zeroed_outputs else float("nan") if dtype.is_floating_point else POISON_INT
        outs.append(aliased.get(i, torch.full(shape.shape, fill, dtype=dtype)))
    kernel[grid](*inputs, *outs, **metaparams)
    results = [jnp.asarray(out.numpy()) for out in outs]
    return results if isinstance(out_shape, (tuple, list)) else results[0]


def run(moe_triton, *inputs, first_expert=0, **tiles):
    return moe_triton.routed_experts(*inputs, first_expert, triton_call=interpreted_call, **tiles)


@pytest.mark.parametrize("seed,tokens,experts,hidden,inter,top_k,tiles", [
    (0, 1, 16, 64, 32, 4, dict(block_m=16, block_n=16, block_k=16)),  # 12 of 16 experts empty
    (1, 37, 8, 64, 32, 2, dict(block_m=16, block_n=32, block_k=32, down=(16, 16, 4, 3))),  # odd count
    (2, 40, 8, 128, 64, 2, dict(block_m=16, block_n=64, block_k=32)),  # several blocks per expert
    (3, 33, 4, 64, 48, 3, dict(block_m=32, block_n=32, block_k=64)),  # I 48: tiles fall back to 16; top_k 3
])
def test_kernels_match_reference(moe_triton, seed, tokens, experts, hidden, inter, top_k, tiles):
    inputs = make_inputs(seed, tokens, experts, hidden, inter, top_k)
    got = run(moe_triton, *inputs, **tiles)
    assert got.shape == (tokens, hidden) and got.dtype == jnp.float32
    assert rel_err(got, reference(*inputs)) < 1e-5


def test_all_tokens_to_one_expert(moe_triton):
    x, weights, _, wg, wu, wd = make_inputs(4, 20, 8, 64, 32, 2)
    ids = jnp.tile(jnp.array([[5, 2]], jnp.int32), (20, 1))  # experts 5 and 2 get 20 rows each, six get none
    got = run(moe_triton, x, weights, ids, wg, wu, wd, block_m=16, block_n=32, block_k=32)
    assert rel_err(got, reference(x, weights, ids, wg, wu, wd)) < 1e-5


def test_experts_held_elsewhere_add_nothing(moe_triton):
    """A device holding experts 4..7 returns only their share (the unwritten rows of the others, poisoned with
    NaN, are masked); the two shares sum to the whole."""
    x, weights, ids, wg, wu, wd = make_inputs(5, 9, 8, 64, 32, 3)
    halves = [run(moe_triton, x, weights, ids, wg[s:s + 4], wu[s:s + 4], wd[s:s + 4], first_expert=s, block_m=16,
                  block_n=32, block_k=32) for s in (0, 4)]
    assert np.isfinite(np.asarray(halves[1])).all()
    assert rel_err(halves[1], reference(x, weights, ids, wg[4:], wu[4:], wd[4:], 4)) < 1e-5
    assert rel_err(halves[0] + halves[1], reference(x, weights, ids, wg, wu, wd)) < 1e-5


@pytest.mark.parametrize("tail_m", [16, 32])
def test_short_blocks_run_the_tail_tile(moe_triton, tail_m):
    """block_m 32: expert 0's 40 rows fill one block and spill 8 into a short one, expert 1's 16 fit a short block
    exactly, expert 2's 24 do not, expert 3 gets none (tail_m 16). tail_m = block_m is the plain kernel."""
    x, weights, _, wg, wu, wd = make_inputs(14, 40, 4, 64, 32, 2)
    ids = jnp.asarray(np.stack([np.zeros(40, int), np.array([1] * 16 + [2] * 24)], axis=1), jnp.int32)
    got = run(moe_triton, x, weights, ids, wg, wu, wd, block_m=32, tail_m=tail_m, block_n=32, block_k=32)
    assert rel_err(got, reference(x, weights, ids, wg, wu, wd)) < 1e-5


def test_bad_tiles_are_refused(moe_triton):
    inputs = make_inputs(6, 4, 4, 64, 32, 2)
    with pytest.raises(ValueError, match="block_m"):
        run(moe_triton, *inputs, block_m=24)
    for tail_m in (24, 8, 64):
        with pytest.raises(ValueError, match="tail_m"):
            run(moe_triton, *inputs, block_m=32, tail_m=tail_m)
    with pytest.raises(ValueError, match="tail_m"):  # the Pallas sorted kernels have no short blocks
        moe_gemm.routed_experts(*inputs, few_tokens=False, block_m=32, tail_m=16)


@pytest.mark.parametrize("tokens,native,layout,block_m", [
    (1, True, "few", None), (moe_gemm.FEW_TOKENS, True, "few", None),
    (moe_gemm.FEW_TOKENS + 1, True, "triton", 16),  # memory-bound: 16-row blocks
    (1024, True, "triton", 64), (4096, True, "triton", 128),  # compute-bound: larger tiles
    (moe_gemm.FEW_TOKENS + 1, False, "pallas", 16), (4096, False, "pallas", 128),  # no jax-triton, or the CPU
])
def test_layout_by_size(tokens, native, layout, block_m):
    tiles = moe_gemm.resolve_tiles(tokens, tokens * 8, native)
    assert ("few" if tiles["few_tokens"] else "triton" if tiles["triton"] else "pallas") == layout
    assert tiles["block_m"] == block_m


def test_forced_layouts_take_their_own_defaults():
    assert moe_gemm.resolve_tiles(4096, 4096 * 8, True, triton=False)["triton"] is False
    few = moe_gemm.resolve_tiles(4096, 4096 * 8, True, few_tokens=True, block_n=32)
    assert few["few_tokens"] and few["block_n"] == 32 and not few["triton"]
    forced = moe_gemm.resolve_tiles(8, 64, True, triton=True)
    assert forced["triton"] and not forced["few_tokens"] and forced["block_m"] == 16


def test_native_triton_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="jax-triton"):
        moe_gemm.resolve_tiles(4096, 4096 * 8, False, triton=True)
    assert not triton_available()  # the CPU: moe_gemm.routed_experts keeps to the Pallas kernels


def assert_plan_is_the_reference(moe_triton, ids, num_local, first_expert, block_m):
    """The counting-sort plan is moe_gemm.plan's (a stable sort too), except for the rows past the blocks in use,
    which it leaves unwritten (no kernel reads them)."""
    want = [np.asarray(a) for a in moe_gemm.plan(ids, num_local, first_expert, block_m)]
    got = [np.asarray(a) for a in moe_triton.plan(ids, num_local, jnp.int32(first_expert), block_m,
                                                  interpreted_call)]
    assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want]
    used_rows = int(want[3][0]) * block_m
    np.testing.assert_array_equal(got[0][:used_rows], want[0][:used_rows])
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("seed,tokens,experts,top_k,block_m,first_expert,num_local,hot_expert", [
    (7, 1, 16, 4, 16, 0, 16, None),  # most experts empty
    (8, 37, 8, 2, 16, 0, 8, None),  # odd count, several blocks per expert
    (9, 300, 16, 3, 32, 0, 16, None),  # 900 pairs: several chunks of PLAN_CHUNK, ragged last chunk
    (10, 50, 8, 2, 16, 4, 4, None),  # experts 4..7 held here, the others elsewhere
    (11, 20, 8, 2, 128, 0, 8, 3),  # block_m above a group's size; expert 3 in every token's first slot
    (12, 400, 20, 8, 16, 0, 20, None),  # 20 experts: not a power of two
])
def test_plan_matches_reference_plan(moe_triton, seed, tokens, experts, top_k, block_m, first_expert, num_local,
                                     hot_expert):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    if hot_expert is not None:
        ids = ids.at[:, 0].set(hot_expert)
    assert_plan_is_the_reference(moe_triton, ids, num_local, first_expert, block_m)


def test_plan_over_more_chunks_than_one_scan_tile(moe_triton, monkeypatch):
    """More chunks than the scan takes at once (its ROWS): small chunks, so the interpreter stays quick."""
    monkeypatch.setattr(moe_triton, "PLAN_CHUNK", 16)
    rng = np.random.default_rng(13)
    ids = jnp.asarray(np.stack([rng.choice(16, 4, replace=False) for _ in range(530)]), jnp.int32)  # 133 chunks
    assert_plan_is_the_reference(moe_triton, ids, 16, 0, 16)
