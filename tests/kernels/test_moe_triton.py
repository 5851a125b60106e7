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


def make_inputs(*args):
    return make_bf16_inputs(*args, dtype=jnp.float32)  # the interpreter computes bf16 dots wrongly


@pytest.fixture(scope="module")
def moe_triton():
    """The module, its kernels decorated in interpreter mode (tests/conftest.py sets TRITON_INTERPRET=1 before
    anything imports triton)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pallas_kernels import moe_triton as module

    return module


def interpreted_call(*args, kernel, out_shape, grid, num_warps, num_stages, name, **metaparams):
    """jax_triton.triton_call's contract on the CPU: array arguments, then freshly allocated outputs, as pointers;
    outputs poisoned with NaN first, so a row the kernel should have written and did not shows."""
    del num_warps, num_stages, name
    inputs = [torch.from_numpy(np.array(a)) for a in args]
    out = torch.full(out_shape.shape, float("nan"), dtype=torch.from_numpy(np.zeros((), out_shape.dtype)).dtype)
    kernel[grid](*inputs, out, **metaparams)
    return jnp.asarray(out.numpy())


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
    assert rel_err(got, moe_gemm.reference(*inputs)) < 1e-5


def test_all_tokens_to_one_expert(moe_triton):
    x, weights, _, wg, wu, wd = make_inputs(4, 20, 8, 64, 32, 2)
    ids = jnp.tile(jnp.array([[5, 2]], jnp.int32), (20, 1))  # experts 5 and 2 get 20 rows each, six get none
    got = run(moe_triton, x, weights, ids, wg, wu, wd, block_m=16, block_n=32, block_k=32)
    assert rel_err(got, moe_gemm.reference(x, weights, ids, wg, wu, wd)) < 1e-5


def test_experts_held_elsewhere_add_nothing(moe_triton):
    """A device holding experts 4..7 returns only their share (the unwritten rows of the others, poisoned with
    NaN, are masked); the two shares sum to the whole."""
    x, weights, ids, wg, wu, wd = make_inputs(5, 9, 8, 64, 32, 3)
    halves = [run(moe_triton, x, weights, ids, wg[s:s + 4], wu[s:s + 4], wd[s:s + 4], first_expert=s, block_m=16,
                  block_n=32, block_k=32) for s in (0, 4)]
    assert np.isfinite(np.asarray(halves[1])).all()
    assert rel_err(halves[1], moe_gemm.reference(x, weights, ids, wg[4:], wu[4:], wd[4:], 4)) < 1e-5
    assert rel_err(halves[0] + halves[1], moe_gemm.reference(x, weights, ids, wg, wu, wd)) < 1e-5


def test_bad_block_m_is_refused(moe_triton):
    inputs = make_inputs(6, 4, 4, 64, 32, 2)
    with pytest.raises(ValueError, match="block_m"):
        run(moe_triton, *inputs, block_m=24)


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
    assert not moe_gemm.triton_available()  # the CPU: moe_gemm.routed_experts keeps to the Pallas kernels
