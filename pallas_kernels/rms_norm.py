"""RMSNorm of a few rows as one Pallas kernel, repeating the roundings of its jnp reference (the model's own,
qwen_jax.layers.norms.rms_norm).

Why: for a single row (a decode step of one sequence) XLA splits the norm into two kernels, the sum of squares and then
the scaling, twice a layer; a step of one sequence waits on kernel launches, not on the GPU
(profiled on an H200). Here one program normalises one row. From two rows on XLA emits one fused kernel
itself, so the layers' norm op (qwen_jax/layers/hot_ops.py) runs this kernel for one row only. Same Triton lowering as
the other Pallas kernels here, so it runs on the CPU in interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _kernel(x_ref, w_ref, out_ref, *, eps: float, plus_one: bool, block_h: int):
    """Program r: row r of x, its hidden size padded to a power of two (padding reads the last column, counts zero
    and stores nothing)."""
    hidden = x_ref.shape[1]
    row = jnp.full((1, 1), pl.program_id(0), jnp.int32)
    col = jnp.arange(block_h, dtype=jnp.int32)[None, :]
    clipped = jnp.minimum(col, hidden - 1)
    x32 = jnp.where(col < hidden, x_ref[row, clipped].astype(jnp.float32), 0.0)
    normed = x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=1, keepdims=True) / hidden + eps)
    w = w_ref[clipped]
    if plus_one:  # Qwen3.5: scale by 1 + w in float32, then round
        out = (normed * (1.0 + w.astype(jnp.float32))).astype(out_ref.dtype)
    else:  # LLaMA: round the normalised row, then scale by w in the input dtype
        out = w.astype(out_ref.dtype) * normed.astype(out_ref.dtype)
    pltriton.store(out_ref.at[row, col], out, mask=col < hidden)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool, *, num_warps: int = 4,
             interpret: bool | None = None) -> jax.Array:
    """The reference's contract (the last axis of x normalised, in x's dtype), one program per row."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight {weight.shape} does not match the hidden size {hidden}")
    rows = math.prod(x.shape[:-1])
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, plus_one=plus_one, block_h=pl.next_power_of_2(hidden)),
        out_shape=jax.ShapeDtypeStruct((rows, hidden), x.dtype), grid=(rows,), interpret=interpret,
        compiler_params=params, name="rms_norm")(x.reshape(rows, hidden), weight)
    return out.reshape(x.shape)
