"""Gated DeltaNet prefill (the chunked WY-form delta rule of flash-linear-attention's `chunk_gated_delta_rule`) as two
Pallas kernels, with its plain-jnp `reference` beside it. Only the recurrence: it must never take over the
projections, conv, gated norm or state slots of the layer, and never read a token past a row's seq_len.

Per chunk of C tokens (g: log decays, cum: their running sum in the chunk, beta: write strengths, K L2-normed):
    A = strict_lower((beta K) K^T * exp(cum_i - cum_j)),  T = (I + A)^-1          (the WY system)
    w = T (beta exp(cum) K),  u = T (beta V),  v_new = u - w S
    out = (exp(cum) Q) S + causal(Q K^T * exp(cum_i - cum_j)) v_new
    S = exp(cum_last) S + (exp(cum_last - cum) K)^T v_new

Two launches. `_wy_kernel` (one program per row x value head x chunk, all independent) builds A and its inverse T
and writes T [C, C] per chunk to HBM. `_scan_kernel` (one program per row x value head x block of value columns)
walks the row's chunks in order with its [dk, block_v] float32 state in registers, recomputes the cheap per-token
terms (norms, gates, decays) and does everything that needs the state. Why split: the inverse is the largest block of
work per chunk and does not depend on the state, so it runs fully parallel once per (head, chunk) instead of inside
the sequential loop of every value block (which would also redo it dv / block_v times). The price is T's round trip
through HBM: C values per token and head, written once and read by each value block (64 x 2 B in bf16, a quarter of
the float32 output's 512 B per token and head at dv = 128).

The inverse: unit-lower-triangular, by block doubling on the whole [C, C] tile. With X_s the inverse of the
block-diagonal part of I + A in blocks of s, and N_s the part of A in the blocks of 2s but not of s (the lower-left
quarter of each 2s block), X_2s = X_s - X_s N_s X_s exactly (N_s X_s N_s = 0). X_1 = I, X_2 = I - N_1 take no dot;
then log2(C) - 1 steps of two [C, C] dots each (10 tensor-core dots at C = 64, no solve, no slicing of values). It is
the recursive block inversion fla's solve_tril does at 16 -> 32 -> 64 with explicit tiles, done here with masks:
every intermediate is a block of the true inverse or M21 M11^-1 (|A| <= 1 because beta <= 1, |k_i . k_j| <= 1 and
decays <= 1), so nothing grows beyond the answer itself, unlike a product of (I + L^(2^i)) factors whose powers of
L can reach binomial(C, C/2) before cancelling. Its rounding error is that of one matrix product per level.

Numerics: float32 state, gates, decays and accumulation. Dot operands are in the model's dtype (q's): float32 inputs
use float32 operands at HIGHEST precision everywhere (IEEE on GPU; within ~3e-7 of `reference` on CPU); bf16
inputs use bf16 operands for every dot except the inverse, which takes float32 operands at default precision (TF32
on GPU, float32 in interpret mode), and store T in bf16, as fla does (~5e-3 relative on CPU at dk = dv = 128,
within bf16 limits). Padding tokens (past seq_len) are never read; their outputs are exactly 0.

Pallas' Triton lowering (as pallas_kernels/gdn_decode.py and paged_attention.py): whole-array refs indexed in the
kernel, masked loads and stores, power-of-two tiles of at least 16 for the dots; on the CPU the same source runs in
interpret mode.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gdn_decode import L2_EPS, _softplus
from qwen_jax.layers.gated_deltanet import delta_rule

F32 = jnp.float32


def reference(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
              dt_bias: jax.Array, state: jax.Array, seq_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layer's delta rule (qwen_jax.layers.gated_deltanet.delta_rule) on states given per row: q, k
    [B, S, nk, dk] after conv + SiLU, before the L2 norm; v [B, S, nv, dv]; a, b [B, S, nv] raw; A_log, dt_bias
    [nv]; state [B, nv, dk, dv] float32; seq_lens [B] (tokens past them are padding). Returns (out [B, S, nv, dv]
    float32, final state [B, nv, dk, dv] float32)."""
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    return delta_rule(q, k, v, a, b, A_log, dt_bias, state, rows, jnp.zeros(q.shape[0], bool), seq_lens)


def _dot(x: jax.Array, y: jax.Array, dtype, precision) -> jax.Array:
    return jnp.dot(x.astype(dtype), y.astype(dtype), precision=precision, preferred_element_type=F32)


def _load_normed(ref, r, tok, head, live) -> jax.Array:
    """Rows `tok` [C] of head `head` of q or k [B, S, heads, d], L2-normed in float32: [C, d], 0 at padding."""
    lanes = jnp.arange(ref.shape[-1], dtype=jnp.int32)[None, :]
    x = pltriton.load(ref.at[r, tok[:, None], head, lanes], mask=live[:, None], other=0.0).astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1) + L2_EPS)[:, None]


def _gates(a_ref, b_ref, a_log_ref, dt_bias_ref, r, h, tok, live) -> tuple[jax.Array, jax.Array]:
    """(g, beta) [C] float32 of value head h at tokens `tok`: both 0 at padding, which leaves the state untouched."""
    a = pltriton.load(a_ref.at[r, tok, h], mask=live, other=0.0).astype(F32)
    b = pltriton.load(b_ref.at[r, tok, h], mask=live, other=0.0)
    beta = jax.nn.sigmoid(b.astype(F32)).astype(b.dtype).astype(F32)  # rounded to b's dtype, as HF does
    g = -jnp.exp(a_log_ref[h].astype(F32)) * _softplus(a + dt_bias_ref[h].astype(F32))
    return jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)


def _decay(cum: jax.Array) -> jax.Array:
    """[C, C]: exp(cum_i - cum_j) on and below the diagonal (<= 1: g <= 0), 0 above (never exp of a positive)."""
    row = jnp.arange(cum.shape[0], dtype=jnp.int32)[:, None]
    col = jnp.arange(cum.shape[0], dtype=jnp.int32)[None, :]
    causal = row >= col
    return jnp.where(causal, jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)


def _unit_lower_inverse(strict: jax.Array, precision) -> jax.Array:
    """(I + strict)^-1 for a strictly lower-triangular [C, C] float32 tile, C a power of two, by block doubling
    (module docstring): X_2 = I - N_1, then X_2s = X_s - X_s (N_s X_s) for s = 2, 4, ..., C / 2."""
    size = strict.shape[0]
    row = jnp.arange(size, dtype=jnp.int32)[:, None]
    col = jnp.arange(size, dtype=jnp.int32)[None, :]
    block = lambda s: jax.lax.div(row, s) == jax.lax.div(col, s)  # (i, j) in one diagonal block of s
    coupling = lambda s: jnp.where(block(2 * s) & ~block(s), strict, 0.0)  # N_s
    inverse = jnp.where(row == col, 1.0, 0.0) - coupling(1)
    s = 2
    while s < size:
        inverse = inverse - _dot(inverse, _dot(coupling(s), inverse, F32, precision), F32, precision)
        s *= 2
    return inverse


def _wy_kernel(seq_lens_ref, k_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, t_ref, *, repeat: int, chunk: int,
               dtype, precision):
    """One program: chunk `c` of row `r`, value head `h`: T = (I + A)^-1 into t [B, nv, chunks * C, C].
    Chunks past the row's seq_len do nothing (their T is never read)."""
    c, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len = seq_lens_ref[r]

    @pl.when(c * chunk < seq_len)
    def _():
        tok = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        live = tok < seq_len
        k = _load_normed(k_ref, r, tok, h // repeat, live)  # [C, dk]
        g, beta = _gates(a_ref, b_ref, a_log_ref, dt_bias_ref, r, h, tok, live)
        decay = _decay(jnp.cumsum(g))
        row = jnp.arange(chunk, dtype=jnp.int32)[:, None]
        col = jnp.arange(chunk, dtype=jnp.int32)[None, :]
        system = jnp.where(row > col, _dot(k * beta[:, None], k.T, dtype, precision) * decay, 0.0)
        t_ref[r, h, pl.ds(c * chunk, chunk), :] = _unit_lower_inverse(system, precision).astype(t_ref.dtype)


def _scan_kernel(seq_lens_ref, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, t_ref, state_in_ref, o_ref,
                 state_ref, *, repeat: int, chunk: int, block_v: int, dtype, precision):
    """One program: row `r`, value head `h`, value columns [j * block_v, +block_v): the row's chunks in order, the
    [dk, block_v] float32 state carried in registers; then zeros into the outputs of the padding chunks."""
    del state_in_ref  # aliased to state_ref (input_output_aliases): same buffer
    j, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len, seq = seq_lens_ref[r], q_ref.shape[1]
    dk = q_ref.shape[-1]
    cols = j * block_v + jnp.arange(block_v, dtype=jnp.int32)
    index = jnp.arange(chunk, dtype=jnp.int32)
    num_live = jax.lax.div(seq_len + chunk - 1, chunk)

    def out_at(tok):
        return o_ref.at[r, tok[:, None], h, cols[None, :]]

    def step(c, s):  # s: [dk, block_v] float32, the state before chunk c
        tok = c * chunk + index
        live = tok < seq_len
        q = _load_normed(q_ref, r, tok, h // repeat, live) * dk ** -0.5  # [C, dk]
        k = _load_normed(k_ref, r, tok, h // repeat, live)
        v = pltriton.load(v_ref.at[r, tok[:, None], h, cols[None, :]], mask=live[:, None], other=0.0)  # [C, block_v]
        g, beta = _gates(a_ref, b_ref, a_log_ref, dt_bias_ref, r, h, tok, live)
        cum = jnp.cumsum(g)
        last = jnp.sum(jnp.where(index == chunk - 1, cum, 0.0))  # cum[-1]
        t = t_ref[r, h, pl.ds(c * chunk, chunk), :]  # [C, C]
        w = _dot(t, k * (beta * jnp.exp(cum))[:, None], dtype, precision)  # [C, dk]
        u = _dot(t, v.astype(F32) * beta[:, None], dtype, precision)  # [C, block_v]
        v_new = u - _dot(w, s, dtype, precision)
        attention = _dot(q, k.T, dtype, precision) * _decay(cum)  # causal: _decay is 0 above the diagonal
        out = _dot(q * jnp.exp(cum)[:, None], s, dtype, precision) + _dot(attention, v_new, dtype, precision)
        pltriton.store(out_at(tok), jnp.where(live[:, None], out, 0.0), mask=(tok < seq)[:, None])
        k_to_end = k * jnp.exp(last - cum)[:, None]  # each key decayed to the end of the chunk
        return s * jnp.exp(last) + _dot(k_to_end.T, v_new, dtype, precision)

    s = jax.lax.fori_loop(0, num_live, step, state_ref[r, h, :, pl.ds(j * block_v, block_v)])
    state_ref[r, h, :, pl.ds(j * block_v, block_v)] = s

    def zero_fill(c, carry):
        tok = c * chunk + index
        pltriton.store(out_at(tok), jnp.zeros((chunk, block_v), F32), mask=(tok < seq)[:, None])
        return carry

    jax.lax.fori_loop(num_live, jax.lax.div(seq + chunk - 1, chunk), zero_fill, 0)


def gdn_prefill(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
                dt_bias: jax.Array, state: jax.Array, seq_lens: jax.Array, *, chunk_size: int = 32,
                block_v: int | None = None, num_warps: int = 4, num_stages: int = 2, interpret: bool | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Same contract as `reference`; outputs at padding tokens are exactly 0. The state is updated in place (donate
    it in the caller's jit to avoid a copy). Cost follows each row's seq_len: chunks past it are skipped.
    chunk_size, dk and block_v: powers of two, at least 16 (Triton's smallest dot; interpreted, only chunk_size);
    num_warps and num_stages apply to both launches; block_v None: min(64, dv). The defaults (chunk 32, 64 value
    columns, 4 warps, 2 stages) were the fastest of pallas_kernels/bench.py on an H200 at 35B-A3B shapes for every
    case (1 x 4,096, 8 / 64 x 1,024, ragged): chunks of 32 halve the [C, C] work of the inverse and of the
    intra-chunk attention, which outweighs their twice as many sequential steps. interpret=None interprets on CPU
    only."""
    batch, seq, nk, dk = q.shape
    nv, dv = v.shape[2:]
    block_v = block_v or min(64, dv)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    tiles = (chunk_size, dk, block_v) if not interpret else (chunk_size,)  # Triton's dots need >= 16
    if nv % nk or dv % block_v or k.shape != q.shape or v.shape[:2] != (batch, seq) \
            or state.shape != (batch, nv, dk, dv) or state.dtype != F32 \
            or any(n < 16 or n & (n - 1) for n in tiles):
        raise ValueError(f"gdn_prefill: q {q.shape}, v {v.shape}, state {state.shape} {state.dtype}, "
                         f"chunk_size {chunk_size}, block_v {block_v}")
    config = dict(chunk_size=chunk_size, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    t = wy_inverse(k, a, b, A_log, dt_bias, seq_lens, num_values=nv, dtype=q.dtype, **config)
    return chunked_scan(q, k, v, a, b, A_log, dt_bias, t, state, seq_lens, block_v=block_v, **config)


def _launch_config(chunk_size: int, num_warps: int, num_stages: int, interpret: bool, dtype, num_kv: int,
                   num_values: int) -> tuple[dict, object]:
    compiler_params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    precision = jax.lax.Precision.HIGHEST if dtype == F32 else None  # float32: IEEE dots on GPU, not TF32
    return dict(repeat=num_values // num_kv, chunk=chunk_size, dtype=dtype, precision=precision), compiler_params


def wy_inverse(k: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array, dt_bias: jax.Array, seq_lens: jax.Array,
               *, num_values: int, dtype, chunk_size: int, num_warps: int, num_stages: int, interpret: bool
               ) -> jax.Array:
    """First launch: T = (I + A)^-1 of every live chunk, [B, nv, chunks * C, C] in `dtype` (the dot operands')."""
    batch, seq, nk, _ = k.shape
    config, compiler_params = _launch_config(chunk_size, num_warps, num_stages, interpret, dtype, nk, num_values)
    num_chunks = -(-seq // chunk_size)
    return pl.pallas_call(
        functools.partial(_wy_kernel, **config),
        out_shape=jax.ShapeDtypeStruct((batch, num_values, num_chunks * chunk_size, chunk_size), dtype),
        grid=(num_chunks, num_values, batch),
        interpret=interpret,
        compiler_params=compiler_params,
        name="gdn_prefill_wy",
    )(jnp.minimum(seq_lens.astype(jnp.int32), seq), k, a, b, A_log, dt_bias)


def chunked_scan(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
                 dt_bias: jax.Array, t: jax.Array, state: jax.Array, seq_lens: jax.Array, *, block_v: int,
                 chunk_size: int, num_warps: int, num_stages: int, interpret: bool
                 ) -> tuple[jax.Array, jax.Array]:
    """Second launch: each row's chunks in order given `wy_inverse`'s T; returns (out, final state)."""
    batch, seq, nk, _ = q.shape
    nv, dv = v.shape[2:]
    config, compiler_params = _launch_config(chunk_size, num_warps, num_stages, interpret, q.dtype, nk, nv)
    return pl.pallas_call(
        functools.partial(_scan_kernel, **config, block_v=block_v),
        out_shape=(jax.ShapeDtypeStruct((batch, seq, nv, dv), F32), jax.ShapeDtypeStruct(state.shape, F32)),
        grid=(dv // block_v, nv, batch),
        input_output_aliases={9: 1},
        interpret=interpret,
        compiler_params=compiler_params,
        name="gdn_prefill_scan",
    )(jnp.minimum(seq_lens.astype(jnp.int32), seq), q, k, v, a, b, A_log, dt_bias, t, state)


def select(kernels: str) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The one switch: "reference" (jnp, the default everywhere) or "gpu" (the Pallas kernels)."""
    return {"reference": reference, "gpu": gdn_prefill}[kernels]
