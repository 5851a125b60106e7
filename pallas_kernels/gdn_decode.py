"""Fused Gated DeltaNet decode step (one token per row) as a Pallas kernel, with its plain-jnp `reference` beside it.
Only the recurrence: it must never take over the projections, conv, gated norm or padding masks of the layer."""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qwen_jax.layers.gated_deltanet import delta_rule

L2_EPS = 1e-6  # as layers.gated_deltanet.l2_normalize


def reference(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
              dt_bias: jax.Array, state: jax.Array, state_slots: jax.Array, fresh: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array]:
    """q, k: [B, nk, dk] (after conv + SiLU, before the L2 norm); v: [B, nv, dv]; a, b: [B, nv] raw;
    A_log, dt_bias: [nv]; state: [slots, nv, dk, dv] float32; state_slots: [B] int32; fresh: [B] bool, rows that
    start a sequence (their slot is read as zeros). Returns (o [B, nv, dv] in v's dtype, state with rows `state_slots`
    advanced by one token): the layer's delta rule (qwen_jax.layers.gated_deltanet.delta_rule) on one token a row."""
    rows = q.shape[0]
    fresh = jnp.zeros(rows, bool) if fresh is None else fresh
    one = lambda t: t[:, None]  # noqa: E731  [B, ...] -> [B, 1, ...]: one token per row
    out, state = delta_rule(one(q), one(k), one(v), one(a), one(b), A_log, dt_bias, state, state_slots, fresh,
                            jnp.ones(rows, jnp.int32))
    return out[:, 0], state


def _softplus(x):  # stable log(1 + e^x) from ops every Pallas backend lowers
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _kernel(slots_ref, fresh_ref, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, state_in_ref, o_ref,
            state_ref, *, repeat: int, block_v: int):
    """One program: row `r`, value head `h`, value columns [j * block_v, (j + 1) * block_v) of the [dk, dv] state.
    Every ref is the whole array (no BlockSpecs), indexed here, so the state row comes from the slot index."""
    del state_in_ref  # aliased to state_ref (input_output_aliases): same buffer
    r, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[r]
    cols = pl.ds(j * block_v, block_v)
    dk = q_ref.shape[-1]

    q = q_ref[r, h // repeat, :].astype(jnp.float32)  # [dk]
    k = k_ref[r, h // repeat, :].astype(jnp.float32)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * dk ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    v = v_ref[r, h, cols].astype(jnp.float32)  # [block_v]
    b = b_ref[r, h]
    beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(b.dtype).astype(jnp.float32)
    dt = _softplus(a_ref[r, h].astype(jnp.float32) + dt_bias_ref[h].astype(jnp.float32))
    decay = jnp.exp(-jnp.exp(a_log_ref[h].astype(jnp.float32)) * dt)

    s = state_ref[slot, h, :, cols]  # [dk, block_v] float32; a fresh row starts from zeros (never read as such)
    s = jnp.where(fresh_ref[r] != 0, 0.0, s) * decay
    delta = (v - jnp.sum(s * k[:, None], axis=0)) * beta  # [block_v]
    s = s + k[:, None] * delta[None, :]
    state_ref[slot, h, :, cols] = s
    o_ref[r, h, cols] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)


def gdn_decode(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
               dt_bias: jax.Array, state: jax.Array, state_slots: jax.Array, fresh: jax.Array | None = None, *,
               block_v: int | None = None, num_warps: int = 4, num_stages: int = 1, interpret: bool | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Same contract as `reference`; the state is updated in place (donate it in the caller's jit to avoid a copy).
    Rows must name distinct slots, except padding rows, which may all share a sink slot (its contents are garbage).
    One program per (row, value head, block of `block_v` value columns); interpret=None interprets on CPU only.
    On GPU this lowers through the Pallas Triton backend: dk and block_v must be powers of two. block_v None:
    min(64, dv); in the 35B-A3B decode step on an H200, 64 columns took 74 us a layer at B=64 (3.6 TB/s of state
    traffic) against 84 us with 32, and 18.1 against 18.7 us at B=16 (BENCH_H200.md)."""
    batch, nk, dk = q.shape
    nv, dv = v.shape[1:]
    block_v = block_v or min(64, dv)
    if nv % nk or dv % block_v or state.shape[1:] != (nv, dk, dv) or state.dtype != jnp.float32:
        raise ValueError(f"gdn_decode: q {q.shape}, v {v.shape}, state {state.shape} {state.dtype}, block_v {block_v}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton  # GPU only; Mosaic GPU is the default otherwise

        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    call = pl.pallas_call(
        functools.partial(_kernel, repeat=nv // nk, block_v=block_v),
        out_shape=(jax.ShapeDtypeStruct((batch, nv, dv), v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)),
        grid=(batch, nv, dv // block_v),
        input_output_aliases={9: 1},
        interpret=interpret,
        compiler_params=compiler_params,
        name="gdn_decode",
    )
    fresh = jnp.zeros(batch, jnp.int32) if fresh is None else fresh.astype(jnp.int32)
    return call(state_slots.astype(jnp.int32), fresh, q, k, v, a, b, A_log, dt_bias, state)


def select(kernels: str) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The one switch: "reference" (jnp, the default everywhere) or "gpu" (the Pallas kernel)."""
    return {"reference": reference, "gpu": gdn_decode}[kernels]
