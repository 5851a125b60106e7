"""Fused Gated DeltaNet decode step as a Pallas kernel: the one-token requests of a flat ragged batch, each advancing
its state slot in place; and its speculative verify form, rows of k + 1 tokens, each token's state written out and
the slots only read. Only the recurrence: it must never take over the projections, conv, gated norm or padding
masks of the layer, nor touch a request of another length than its own (pallas_kernels/gdn.py runs the ops)."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gdn_math import L2_EPS, softplus
from pallas_kernels.tiling import pallas_backend


def _token_step(s, t, h, cols, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, repeat: int):
    """Token t's step of value head h on the state columns `cols`, s [dk, block_v] float32 -> (new s, output
    [block_v] float32). The one token math of both kernels here: a verify row's states are bitwise a decode's."""
    dk = q_ref.shape[-1]
    q = q_ref[t, h // repeat, :].astype(jnp.float32)  # [dk]
    k = k_ref[t, h // repeat, :].astype(jnp.float32)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * dk ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    v = v_ref[t, h, cols].astype(jnp.float32)  # [block_v]
    b = b_ref[t, h]
    beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(b.dtype).astype(jnp.float32)
    dt = softplus(a_ref[t, h].astype(jnp.float32) + dt_bias_ref[h].astype(jnp.float32))
    decay = jnp.exp(-jnp.exp(a_log_ref[h].astype(jnp.float32)) * dt)
    s = s * decay
    delta = (v - jnp.sum(s * k[:, None], axis=0)) * beta  # [block_v]
    s = s + k[:, None] * delta[None, :]
    return s, jnp.sum(s * q[:, None], axis=0)


def _kernel(start_ref, len_ref, slots_ref, fresh_ref, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref,
            out_in_ref, state_in_ref, o_ref, state_ref, *, repeat: int, block_v: int):
    """One program: request `r`, value head `h`, value columns [j * block_v, (j + 1) * block_v) of the [dk, dv] state.
    Every ref is the whole array (no BlockSpecs), indexed here, so the token comes from the request's query_start and
    the state row from its slot. Any request but a one-token one exits before reading its slot: padding requests all
    name the sink slot, and prefill requests belong to the prefill kernel."""
    del out_in_ref, state_in_ref  # aliased to o_ref, state_ref (input_output_aliases): same buffers
    r, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(len_ref[r] == 1)
    def _():
        t, slot = start_ref[r], slots_ref[r]
        cols = pl.ds(j * block_v, block_v)
        s = state_ref[slot, h, :, cols]  # [dk, block_v] float32; a fresh request starts from zeros
        s, out = _token_step(jnp.where(fresh_ref[r] != 0, 0.0, s), t, h, cols, q_ref, k_ref, v_ref, a_ref, b_ref,
                             a_log_ref, dt_bias_ref, repeat)
        state_ref[slot, h, :, cols] = s
        o_ref[t, h, cols] = out.astype(o_ref.dtype)


def _verify_kernel(start_ref, len_ref, slots_ref, fresh_ref, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref,
                   dt_bias_ref, ssm_ref, out_in_ref, o_ref, states_ref, *, repeat: int, block_v: int, row_len: int):
    """One program: request `r`, value head `h`, value columns [j * block_v, (j + 1) * block_v). A verify row (of
    exactly row_len tokens) reads its slot's state block once, then for each token in turn advances it in registers
    and writes the token's output and state; its slot is never written. Padding requests read nothing. The tokens
    are a loop, not unrolled: each step then compiles as a decode program's does (unrolled, XLA:CPU fused the
    interpreted steps into one another and the states drifted from decode's by an ulp)."""
    del out_in_ref  # aliased to o_ref: same buffer
    r, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(len_ref[r] == row_len)
    def _():
        start, cols = start_ref[r], pl.ds(j * block_v, block_v)
        s = jnp.where(fresh_ref[r] != 0, 0.0, ssm_ref[slots_ref[r], h, :, cols])  # [dk, block_v] float32

        def token(i, s):
            s, out = _token_step(s, start + i, h, cols, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref,
                                 repeat)
            states_ref[start + i, h, :, cols] = s
            o_ref[start + i, h, cols] = out.astype(o_ref.dtype)
            return s

        jax.lax.fori_loop(0, row_len, token, s)


FEW_REQUESTS = 4  # up to this many requests a launch has too few programs of 64 columns to keep the GPU busy


def default_tiles(dv: int, requests: int, verify_rows: bool = False) -> tuple[int, int]:
    """(block_v, num_warps) for a launch over `requests` request slots. Up to FEW_REQUESTS: 16 columns and one warp,
    four times the programs (H200, 35B-A3B shapes: one request's decode 2.6 us a layer against 3.2 us with 64 and
    four warps, a k = 2 verify 5.6 against 7.0 us). Beyond: min(64, dv) columns (the decode step at 64 rows, in the
    model: 74 us a layer against 84 us with 32), four warps for decode, two for verify (42 against 47 us at 16 rows,
    161 against 170 us at 64)."""
    if requests <= FEW_REQUESTS:
        return min(16, dv), 1
    return min(64, dv), 2 if verify_rows else 4


def decode(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
           dt_bias: jax.Array, ssm: jax.Array, batch, out: jax.Array, *, block_v: int | None = None,
           num_warps: int | None = None, num_stages: int = 1, interpret: bool | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """The delta rule of the batch's one-token requests: q, k [T, nk, dk] (after conv + SiLU, before the L2 norm);
    v [T, nv, dv]; a, b [T, nv] raw; A_log, dt_bias [nv]; ssm [slots, nv, dk, dv] float32; batch: a
    qwen_jax.layers.batch.Ragged (query_start, query_len, state_slot, fresh are read); out [T, nv, dv] in v's dtype.
    Returns (out with each one-token request's token written, ssm with its slot advanced), both in place (aliased):
    every other token of out and every other slot of ssm keep their bits. A fresh request reads its slot as zeros.
    One program per (request, value head, block of `block_v` value columns; None: `default_tiles`, as num_warps);
    interpret=None interprets on CPU only. On GPU this lowers through the Pallas Triton backend: dk and block_v must
    be powers of two."""
    requests = batch.query_len.shape[0]
    nk, dk = q.shape[1:]
    nv, dv = v.shape[1:]
    tiles = default_tiles(dv, requests)
    block_v, num_warps = block_v or tiles[0], num_warps or tiles[1]
    if nv % nk or dv % block_v or ssm.shape[1:] != (nv, dk, dv) or ssm.dtype != jnp.float32 \
            or out.shape != v.shape or out.dtype != v.dtype:
        raise ValueError(f"gdn_decode: q {q.shape}, v {v.shape}, ssm {ssm.shape} {ssm.dtype}, out {out.shape} "
                         f"{out.dtype}, block_v {block_v}")
    call = pl.pallas_call(
        functools.partial(_kernel, repeat=nv // nk, block_v=block_v),
        out_shape=(jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(ssm.shape, ssm.dtype)),
        grid=(requests, nv, dv // block_v),
        input_output_aliases={11: 0, 12: 1},
        **pallas_backend(interpret, num_warps, num_stages),
        name="gdn_decode",
    )
    return call(*_request_fields(batch), q, k, v, a, b, A_log, dt_bias, out, ssm)


def verify(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
           dt_bias: jax.Array, ssm: jax.Array, batch, draft_len: int, out: jax.Array, *, block_v: int | None = None,
           num_warps: int | None = None, num_stages: int = 1, interpret: bool | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """The delta rule of speculative verify rows, requests of exactly draft_len + 1 tokens (static); the inputs,
    batch and out as `decode`'s. Returns (out with each verify row's tokens written in place, every other token
    keeping its bits; states [T, nv, dk, dv] float32, the row's state after each of its tokens, undefined elsewhere).
    ssm is only read: slot batch.state_slot of each verify row (zeros when fresh). Each token's math is decode's, so
    out and states are bitwise those of draft_len + 1 decode launches. Traffic: the state read once, draft_len + 1
    states written. Grid, block_v, interpret and the Triton lowering as `decode`'s."""
    nk, dk = q.shape[1:]
    nv, dv = v.shape[1:]
    tiles = default_tiles(dv, batch.query_len.shape[0], verify_rows=True)
    block_v, num_warps = block_v or tiles[0], num_warps or tiles[1]
    if draft_len < 1 or nv % nk or dv % block_v or ssm.shape[1:] != (nv, dk, dv) or ssm.dtype != jnp.float32 \
            or out.shape != v.shape or out.dtype != v.dtype:
        raise ValueError(f"gdn_decode.verify: draft_len {draft_len}, q {q.shape}, v {v.shape}, ssm {ssm.shape} "
                         f"{ssm.dtype}, out {out.shape} {out.dtype}, block_v {block_v}")
    tokens = q.shape[0]
    call = pl.pallas_call(
        functools.partial(_verify_kernel, repeat=nv // nk, block_v=block_v, row_len=draft_len + 1),
        out_shape=(jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct((tokens, nv, dk, dv),
                                                                                    jnp.float32)),
        grid=(batch.query_len.shape[0], nv, dv // block_v),
        input_output_aliases={12: 0},
        **pallas_backend(interpret, num_warps, num_stages),
        name="gdn_verify",
    )
    return call(*_request_fields(batch), q, k, v, a, b, A_log, dt_bias, ssm, out)


def _request_fields(batch) -> tuple[jax.Array, ...]:
    """The batch fields both kernels read, as int32: query_start, query_len, state_slot, fresh."""
    return tuple(jnp.asarray(x).astype(jnp.int32) for x in (batch.query_start, batch.query_len, batch.state_slot,
                                                             batch.fresh))
