"""x @ w for one row (a decode step of one sequence) as a Pallas kernel, with the plain-jnp `reference` beside it:
float32 accumulation, float32 out, as jnp.matmul(x, w, preferred_element_type=float32).

Why: XLA rewrites a one-row dot into a reduction fusion, which streams an 8-16 MB projection weight at 0.7-1.5
TB/s on an H200; from two rows on it emits a GEMM, as fast as this kernel or faster. In a 35B-A3B decode step of
one sequence those fusions took ~5 of the 8.4 ms of GPU time (BENCH_H200.md). The kernel streams the weight: each
program takes a block of columns (and, where that leaves too few programs to keep every SM streaming, one slice of
the contraction), runs the rows as one [16, K] tile through the tensor cores, and stores float32 partial sums
[slices, M, N] that XLA adds up (a sum it fuses into whatever follows). Same Triton lowering as
pallas_kernels/moe_gemm.py's few-token kernels, so the same source runs on the CPU in interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.moe_gemm import _tile, split_contraction
from qwen_jax.layers.mlp import dense as dense_reference

MAX_ROWS = 16  # one tensor-core tile of rows


def reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] -> float32 [M, N]."""
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def _kernel(x_ref, w_ref, out_ref, *, rows: int, block_n: int, block_k: int, steps: int):
    """Program (n, s): every row of x through column block n of w over contraction slice s -> out[s, :, block n]."""
    n, s = pl.program_id(0), pl.program_id(1)
    num_rows = x_ref.shape[0]
    row = jnp.arange(rows, dtype=jnp.int32)
    clipped = jnp.minimum(row, num_rows - 1)[:, None]  # padding rows repeat the last row: finite, never stored
    cols = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)

    def body(i, acc):
        k0 = pl.multiple_of((s * steps + i) * block_k, block_k)
        x = x_ref[clipped, k0 + jnp.arange(block_k, dtype=jnp.int32)[None, :]]
        return acc + jnp.dot(x, w_ref[pl.ds(k0, block_k), cols], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, block_n), jnp.float32))
    col = n * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
    pltriton.store(out_ref.at[s, row[:, None], col], acc, mask=(row < num_rows)[:, None])


def matmul(x: jax.Array, w: jax.Array, *, block_n: int = 128, block_k: int = 64, split_k: int | None = None,
           num_warps: int = 8, num_stages: int = 4, interpret: bool | None = None) -> jax.Array:
    """Same contract as `reference` for x [M <= MAX_ROWS, K], w [K, N] (K, N multiples of 16). Tiles shrink to
    divide K and N; split_k: slices of the contraction (None: moe_gemm.split_contraction). Default tiles: the
    fastest or tied at every 35B-A3B projection shape of one row (H200, BENCH_H200.md). interpret=None interprets
    on CPU only."""
    (num_rows, k), n = x.shape, w.shape[1]
    if not 0 < num_rows <= MAX_ROWS:
        raise ValueError(f"skinny_matmul: x has {num_rows} rows; the kernel takes 1 to {MAX_ROWS}")
    block_n, block_k = _tile(n, block_n), _tile(k, block_k)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    steps = k // block_k
    split = split_contraction(n // block_n, steps, split_k)
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    parts = pl.pallas_call(
        functools.partial(_kernel, rows=max(16, pl.next_power_of_2(num_rows)), block_n=block_n, block_k=block_k,
                          steps=steps // split),
        out_shape=jax.ShapeDtypeStruct((split, num_rows, n), jnp.float32), grid=(n // block_n, split),
        interpret=interpret, compiler_params=params, name="skinny_matmul")(x, w)
    return parts.sum(axis=0) if split > 1 else parts[0]


MIN_K = 1024  # below, XLA's one-row reduction is as fast: [512, 2048] took 2 us in XLA, 3 us in the kernel


def dense(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """The layers' `dense` op (qwen_jax.layers.mlp.dense: x's last `contract` dims against w's first) on this
    kernel where it pays, one row, K >= MIN_K, K and N multiples of 16; elsewhere the reference (XLA)."""
    lead, out = x.shape[:x.ndim - contract], w.shape[contract:]
    rows, k, n = math.prod(lead), math.prod(x.shape[x.ndim - contract:]), math.prod(out)
    if rows != 1 or k < MIN_K or k % 16 or n % 16:
        return dense_reference(x, w, contract)
    return matmul(x.reshape(rows, k), w.reshape(k, n)).reshape(*lead, *out)
