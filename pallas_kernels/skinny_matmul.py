"""x @ w for one row (a decode step of one sequence), or a few rows through a layer's large projections, as a Pallas
kernel: float32 accumulation, float32 out, the contract of the layers' `dense` op (qwen_jax.layers.mlp.dense, its jnp
reference; qwen_jax/layers/hot_ops.py decides at which shapes this kernel runs instead).

Why: XLA rewrites a one-row dot into a reduction fusion, which streams an 8-16 MB projection weight at 0.7-1.5 TB/s on
an H200; from two rows on it emits a GEMM, as fast as this kernel except through a layer's 38-51 MB of projections. In a
35B-A3B decode step of one sequence those fusions took ~5 of the 8.4 ms of GPU time (the step profiled on an H200).
The kernel streams the weight: each program takes a block of columns (and, where that leaves too few programs to keep
every SM streaming, one slice of the contraction), runs the rows as one [16-64, K] tile through the tensor cores, and
stores float32 partial sums [slices, M, N] that XLA adds up (a sum it fuses into whatever follows). Several weights of
one x (a layer's q/k/v/z projections) run side by side as one launch: one 50 MB stream (17.5 us, 2.9 TB/s, on an H200
with each call on other weights, as in the model) instead of four 8-16 MB ones and four partial sums. Same Triton
lowering as pallas_kernels/moe_gemm.py's few-token kernels, so the same source runs on the CPU in interpret mode.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tiling import split_contraction, tile_size

MAX_ROWS = 64  # rows run as one tile of 16, 32 or 64 (the next power of two)


def _kernel(x_ref, *refs, rows: int, block_k: int, steps: int, bounds: tuple[int, ...], tiles: tuple[int, ...],
            widths: tuple[int, ...]):
    """Program (n, s): every row of x through column block n of the weights side by side, over contraction slice s
    -> out[s, :, block n's columns]. Weight i holds column blocks bounds[i] .. bounds[i + 1] - 1, each tiles[i]
    columns wide (a narrow weight such as the GDN's 32-column b and a is one block of its own width; one under 16
    columns, such as the shared expert's 1-column gate, one block of 16 whose columns past its width read nothing
    and store nothing); a program reads only its own weight (one branch per weight, none when there is one)."""
    *w_refs, out_ref = refs
    n, s = pl.program_id(0), pl.program_id(1)
    num_rows = x_ref.shape[0]
    row = jnp.arange(rows, dtype=jnp.int32)
    clipped = jnp.minimum(row, num_rows - 1)[:, None]  # padding rows repeat the last row: finite, never stored

    def run(w_ref, start, tile, width, first_col):
        cols = pl.ds(pl.multiple_of((n - start) * tile, tile), tile)
        col = jnp.arange(tile, dtype=jnp.int32)[None, :]

        def body(i, acc):
            k0 = pl.multiple_of((s * steps + i) * block_k, block_k)
            x = x_ref[clipped, k0 + jnp.arange(block_k, dtype=jnp.int32)[None, :]]
            if width < tile:
                w = pltriton.load(w_ref.at[k0 + jnp.arange(block_k, dtype=jnp.int32)[:, None],
                                           jnp.minimum(col, width - 1)], mask=col < width, other=0.0)
            else:
                w = w_ref[pl.ds(k0, block_k), cols]
            return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, tile), jnp.float32))
        mask = (row < num_rows)[:, None] & (col < width)
        pltriton.store(out_ref.at[s, row[:, None], first_col + (n - start) * tile + col], acc, mask=mask)

    first_cols = tuple(itertools.accumulate(widths, initial=0))
    if len(w_refs) == 1:
        run(w_refs[0], 0, tiles[0], widths[0], 0)
        return
    for w_ref, start, end, tile, width, first_col in zip(w_refs, bounds, bounds[1:], tiles, widths, first_cols):
        pl.when((n >= start) & (n < end))(functools.partial(run, w_ref, start, tile, width, first_col))


def matmul(x: jax.Array, w: jax.Array, **tiles) -> jax.Array:
    """x [M <= MAX_ROWS, K] @ w [K, N] (K, N multiples of 16) -> float32 [M, N]: matmul_many of one weight."""
    return matmul_many(x, (w,), **tiles)[0]


def matmul_many(x: jax.Array, ws: tuple[jax.Array, ...], *, block_n: int = 128, block_k: int = 64,
                split_k: int | None = None, num_warps: int = 8, num_stages: int = 4,
                interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """x @ w (float32) for each w of ws (each [K, N_i]) as one kernel over their columns side by side: one launch
    and one stream of all the weights instead of one per weight (a layer's q/k/v/z projections: four 4-16 MB
    weights, each too small to reach full bandwidth alone). block_k shrinks to divide K, and each weight's column
    tile is block_n shrunk to divide its width (a 32-column weight is one block of 32: contiguous loads that Triton
    pipelines; widths of 16 or more must be multiples of 16, one under 16 is one masked block of 16); split_k: slices of
    the contraction (None: tiling.split_contraction over all the column blocks). Default tiles: the fastest or tied at
    every 35B-A3B projection shape of one row (H200, qwen_jax/bench/kernels.py). interpret=None interprets on CPU
    only."""
    (num_rows, k), widths = x.shape, [w.shape[1] for w in ws]
    if not 0 < num_rows <= MAX_ROWS:
        raise ValueError(f"skinny_matmul: x has {num_rows} rows; the kernel takes 1 to {MAX_ROWS}")
    if any(w.shape[0] != k for w in ws):
        raise ValueError(f"skinny_matmul: weights {[w.shape for w in ws]} do not all contract x's {k} columns")
    tiles, block_k = tuple(16 if n < 16 else tile_size(n, block_n) for n in widths), tile_size(k, block_k)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    bounds = tuple(itertools.accumulate((-(-n // t) for n, t in zip(widths, tiles)), initial=0))
    steps = k // block_k
    split = split_contraction(bounds[-1], steps, split_k)
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    parts = pl.pallas_call(
        functools.partial(_kernel, rows=max(16, pl.next_power_of_2(num_rows)), block_k=block_k,
                          steps=steps // split, bounds=bounds, tiles=tiles, widths=tuple(widths)),
        out_shape=jax.ShapeDtypeStruct((split, num_rows, sum(widths)), jnp.float32),
        grid=(bounds[-1], split), interpret=interpret, compiler_params=params, name="skinny_matmul")(x, *ws)
    out = parts.sum(axis=0) if split > 1 else parts[0]
    ends = tuple(itertools.accumulate(widths, initial=0))
    return tuple(out[:, a:b] for a, b in zip(ends, ends[1:]))


def row_tiles(rows: int) -> dict:
    """matmul_many's tiles for `rows` rows: the defaults up to 16, 64-column tiles past (the best of an H200 sweep
    at 2-64 rows; GDN projections at 32 rows 19 against 21 us, attention's at 64 rows 15 against 18)."""
    return {} if rows <= 16 else dict(block_n=64)
