"""The Gated DeltaNet's depthwise causal conv + SiLU over a prompt as one Pallas kernel, with its jnp reference
beside it (qwen_jax.layers.gated_deltanet.causal_conv, whose roundings it repeats).

Why: XLA runs the reference's four shifted windows of x (the first rows reading the conv state) as a loop fusion
at 1.0-1.3 TB/s on an H200 (the select between state and x per element keeps it from vectorizing); before the
windows were split out it was a copy of x plus the conv, 0.55 TB/s. A 4,096-token prompt of 35B-A3B spent ~140 us
of each GDN layer there (BENCH_H200.md). Here a program takes a block of tokens and channels and reads each tap's
rows straight from x, or from the state for the rows before the prompt. The new conv state (K-1 rows per sequence)
stays the reference's gather. Same Triton lowering as the other Pallas kernels here, so it runs on the CPU in
interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qwen_jax.layers.gated_deltanet import causal_conv as reference
from qwen_jax.layers.gated_deltanet import conv_state_after


def _kernel(x_ref, state_ref, w_ref, out_ref, *, block_t: int, block_c: int):
    """Program (c, t, b): channels block c, tokens block t of row b (neighbouring programs share tokens: whole rows of
    x stream together). Tap i of token s reads input s + i - (K-1): x from 0 on, the state (its rows 0..K-2)
    before, which only the first token block reaches (block_t >= K-1); the others read x alone."""
    c, t, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, kernel = x_ref.shape[1], w_ref.shape[0]
    tok = t * block_t + jnp.arange(block_t, dtype=jnp.int32)[:, None]
    col = c * block_c + jnp.arange(block_c, dtype=jnp.int32)[None, :]

    def conv(first_block: bool):
        acc = jnp.zeros((block_t, block_c), jnp.float32)
        for i in range(kernel):
            src = tok + i - (kernel - 1)
            tap = x_ref[b, jnp.clip(src, 0, seq - 1), col]  # rows past the end repeat the last: never stored
            if first_block:
                from_state = state_ref[b, jnp.clip(src + kernel - 1, 0, kernel - 2), col]
                tap = jnp.where(src < 0, from_state.astype(x_ref.dtype), tap)
            acc = acc + tap.astype(jnp.float32) * w_ref[i, pl.ds(c * block_c, block_c)].astype(jnp.float32)[None, :]
        dtype = out_ref.dtype
        out = jax.nn.silu(acc.astype(dtype).astype(jnp.float32)).astype(dtype)  # HF rounds the conv, then SiLU
        pltriton.store(out_ref.at[b, tok, col], out, mask=tok < seq)

    pl.when(t == 0)(lambda: conv(True))
    pl.when(t > 0)(lambda: conv(False))


def causal_conv(x: jax.Array, state: jax.Array, weight: jax.Array, seq_lens: jax.Array, *, block_t: int = 32,
                block_c: int = 128, num_warps: int = 4, interpret: bool | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Same contract as `reference`: x [B, S, C...], state [B, K-1, C...], weight [K, C...] -> (out, new state).
    The channels (C... flattened) must be a multiple of 16; block_c shrinks to divide them."""
    batch, seq = x.shape[:2]
    kernel = weight.shape[0]
    channels = math.prod(x.shape[2:])
    if state.shape != (batch, kernel - 1, *x.shape[2:]) or weight.shape[1:] != x.shape[2:] or channels % 16 \
            or block_t < kernel - 1:
        raise ValueError(f"causal_conv: x {x.shape}, state {state.shape}, weight {weight.shape}, block_t {block_t}")
    block_c = math.gcd(block_c, channels)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_kernel, block_t=block_t, block_c=block_c),
        out_shape=jax.ShapeDtypeStruct((batch, seq, channels), x.dtype),
        grid=(channels // block_c, pl.cdiv(seq, block_t), batch), interpret=interpret, compiler_params=params,
        name="causal_conv")(x.reshape(batch, seq, channels), state.reshape(batch, kernel - 1, channels),
                            weight.reshape(kernel, channels))
    return out.reshape(x.shape), conv_state_after(x, state, seq_lens, kernel)


def conv(x: jax.Array, state: jax.Array, weight: jax.Array, seq_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layers' `conv` op on this kernel for prompts (S > 1); a decode step (S = 1) keeps XLA's small fusion."""
    if x.shape[1] == 1 or math.prod(x.shape[2:]) % 16:
        return reference(x, state, weight, seq_lens)
    return causal_conv(x, state, weight, seq_lens)
