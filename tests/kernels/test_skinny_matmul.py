"""The one-row Pallas matmul (interpret mode on CPU) against its jnp reference (the layers' dense): row counts up to
MAX_ROWS, split contractions, tiles that shrink to fit, the `dense` op of layers/hot_ops.py that runs it (and where that
leaves XLA's dots), shapes it refuses; plus its lowering to one Triton call for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_kernels.skinny_matmul as skinny
import qwen_jax.layers.hot_ops as ops
from pallas_kernels.skinny_matmul import MAX_ROWS, matmul, matmul_many
from pallas_kernels.tiling import split_contraction
from qwen_jax.layers.hot_ops import dense_kernel as dense
from qwen_jax.layers.mlp import dense as dense_reference


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def normal(seed: int, shape: tuple, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.bfloat16)


@pytest.mark.parametrize("rows,k,n,split_k", [
    (1, 256, 256, None),   # 2 column blocks of 128: the contraction splits 4 ways (every step of 64 its own slice)
    (3, 128, 64, 1),       # odd row count; 64 columns: the 128-column tile shrinks to 64
    (MAX_ROWS, 256, 192, 2),  # 192 columns: tiles of 64
    (5, 512, 48, 8),       # 48 columns: tiles of 16
])
def test_matches_reference(rows, k, n, split_k):
    x, w = normal(rows, (rows, k)), normal(k + n, (k, n), 0.05)
    got = matmul(x, w, split_k=split_k)
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    assert rel_err(got, dense_reference(x, w)) < 1e-5  # float32 sums of exact bf16 products: only the order differs


def test_split_contraction_reaches_the_program_target_in_whole_steps():
    assert split_contraction(8, 32) == 32 and split_contraction(64, 32) == 4 and split_contraction(256, 32) == 1
    assert split_contraction(2, 6) == 2  # 6 steps: a split of 4 would cut a step


def test_refuses_what_it_cannot_tile():
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS}"):
        matmul(jnp.ones((MAX_ROWS + 1, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="not a multiple of 16"):
        matmul(jnp.ones((1, 40), jnp.bfloat16), jnp.ones((40, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="split_k 4 does not divide the 2 steps"):
        matmul(jnp.ones((1, 128), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16), split_k=4)


@pytest.mark.parametrize("x_shape,w_shape,contract,kernel", [
    ((1, 1, 64), (64, 4, 16), 1, True),      # a decode step's q projection [B, S, H] x [H, heads, D]
    ((1, 1, 4, 16), (4, 16, 64), 2, True),   # its output projection [B, S, heads, D] x [heads, D, H]
    ((2, 1, 64), (64, 4, 16), 1, False),     # two rows through small weights: XLA's GEMM is as fast on an H200
    ((1, 64), (64, 1), 1, False),            # one output column alone: narrow weights only join a launch
    ((1, 32), (32, 64), 1, False),           # K below MIN_K (here 64): XLA's reduction is as fast
])
def test_dense_runs_the_kernel_for_one_row_only(x_shape, w_shape, contract, kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "MIN_K", 64)  # the real 512 at these small shapes
    monkeypatch.setattr(skinny, "matmul_many", lambda *a, **kw: calls.append(1) or matmul_many(*a, **kw))
    x, w = normal(1, x_shape), normal(2, w_shape, 0.1)
    got, want = dense(x, w, contract), dense_reference(x, w, contract)
    assert got.shape == want.shape and got.dtype == jnp.float32 and bool(calls) == kernel
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("rows,kernel", [(1, True), (2, True), (33, True), (64, True), (65, False)])
def test_dense_runs_the_kernel_for_a_few_rows_through_large_weights(rows, kernel, monkeypatch):
    """Up to MAX_ROWS rows take the kernel through several weights of MIN_MANY_ROWS_BYTES or more (here lowered to
    the test's 24 KB): a layer's large projections at a decode step of a few sequences; 33-64 rows run a 64-row
    tile. One weight, or weights under the threshold: the kernel at one row only."""
    calls = []
    monkeypatch.setattr(ops, "MIN_K", 64)
    monkeypatch.setattr(ops, "MIN_MANY_ROWS_BYTES", 64 * 192 * 2)
    monkeypatch.setattr(skinny, "matmul_many", lambda *a, **kw: calls.append(kw) or matmul_many(*a, **kw))
    x, ws = normal(rows, (rows, 64)), (normal(5, (64, 128), 0.1), normal(6, (64, 64), 0.1))
    got, want = dense(x, ws), dense_reference(x, ws)
    assert all(a.shape == b.shape and rel_err(a, b) < 1e-5 for a, b in zip(got, want))
    assert bool(calls) == kernel
    # under the threshold; one weight; one weight with a narrow one (which does not make several)
    for alone in ((normal(7, (64, 64), 0.1),), (normal(8, (64, 384), 0.1),),
                  (normal(8, (64, 384), 0.1), normal(9, (64, 1), 0.1))):
        calls.clear()
        dense(x, alone)
        assert bool(calls) == (rows == 1)


def test_dense_leaves_short_contractions_to_xla(monkeypatch):
    """At the real MIN_K: K 256 stays on XLA; the shared expert's down projection (K 512) and K 2,048 run the
    kernel."""
    calls = []
    monkeypatch.setattr(skinny, "matmul_many", lambda x, *a, **kw: calls.append(x.shape[1]) or matmul_many(x, *a, **kw))
    for k in (256, 512, 2048):
        x, w = normal(k, (1, k)), normal(k + 1, (k, 64), 0.05)
        assert rel_err(dense(x, w), dense_reference(x, w)) < 1e-5
    assert calls == [512, 2048]


def test_lowers_to_one_triton_call_for_cuda():
    """At the 35B-A3B GDN output projection (K 4,096, N 2,048): 16 column blocks x 16 slices = 256 programs."""
    s = jax.ShapeDtypeStruct
    fn = jax.jit(lambda x, w: matmul(x, w, interpret=False))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        s((1, 4096), jnp.bfloat16), s((4096, 2048), jnp.bfloat16)).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert 'name = "skinny_matmul"' in text and "grid_x = 16 : i32, grid_y = 16 : i32" in text


@pytest.mark.parametrize("rows,widths,split_k", [
    (1, (128, 256, 384), None),  # q/k/v/z-like: 6 column blocks of 128, the contraction split to reach 256 programs
    (3, (64, 192, 64), 2),       # tiles of 64 (the widths' gcd), three weights
    (1, (48, 16), 1),            # tiles of 16
    (1, (256, 32, 32), None),    # a GDN layer's v with b and a: the narrow ones one block of 32 columns each
    (1, (256, 512, 512, 1), None),  # router, shared gate / up and the 1-column shared gate: a masked 16-column block
    (5, (1, 64, 7), 2),          # narrow weights first and last, odd widths under 16, several rows
])
def test_many_weights_in_one_launch_match_each_reference(rows, widths, split_k):
    x = normal(rows, (rows, 256))
    ws = tuple(normal(10 + i, (256, n), 0.05) for i, n in enumerate(widths))
    got = matmul_many(x, ws, split_k=split_k)
    assert len(got) == len(ws)
    for out, w in zip(got, ws):
        assert out.shape == (rows, w.shape[1]) and out.dtype == jnp.float32
        assert rel_err(out, dense_reference(x, w)) < 1e-5


def test_many_weights_must_share_the_contraction():
    x = jnp.ones((1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="do not all contract x's 64 columns"):
        matmul_many(x, (jnp.ones((64, 64), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16)))


def test_dense_of_a_tuple_runs_one_launch(monkeypatch):
    """A GDN layer's projections at one row: q/k/v/z, the narrow b/a (16 columns, under one tile) and a 1-column
    weight (as the shared expert's gate) share one launch; each result equals the reference's. Two rows: XLA's
    GEMMs."""
    launches = []
    monkeypatch.setattr(ops, "MIN_K", 64)
    monkeypatch.setattr(skinny, "matmul_many", lambda x, ws, **kw: launches.append(len(ws)) or matmul_many(x, ws, **kw))
    x = normal(3, (1, 1, 64))
    shapes = [(64, 2, 16), (64, 2, 16), (64, 4, 16), (64, 4, 16), (64, 16), (64, 16), (64, 1)]
    ws = tuple(normal(20 + i, shape, 0.1) for i, shape in enumerate(shapes))
    got, want = dense(x, ws), dense_reference(x, ws)
    assert isinstance(got, tuple) and len(got) == len(ws)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == jnp.float32 and rel_err(a, b) < 1e-5
    assert launches == [7]
    launches.clear()
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(dense(normal(4, (2, 1, 64)), ws), dense_reference(
        normal(4, (2, 1, 64)), ws)))
    assert launches == []


def test_fused_launch_lowers_to_one_triton_call_for_cuda():
    """A 35B-A3B GDN layer's q/k/v/z/b/a (2,048 + 2,048 + 4,096 + 4,096 + 32 + 32 columns): 98 column blocks x 4
    slices."""
    s = jax.ShapeDtypeStruct
    fn = jax.jit(lambda x, *ws: matmul_many(x, ws, interpret=False))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        s((1, 2048), jnp.bfloat16), *(s((2048, n), jnp.bfloat16) for n in (2048, 2048, 4096, 4096, 32, 32))
    ).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert "grid_x = 98 : i32, grid_y = 4 : i32" in text
