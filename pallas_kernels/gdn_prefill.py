"""Gated DeltaNet prefill (the chunked WY-form delta rule of flash-linear-attention's `chunk_gated_delta_rule`) as
two Pallas kernels, with its plain-jnp `reference` beside it. Only the recurrence: it must never take over the
projections, conv, gated norm or state slots of the layer, and never read a token past a row's seq_len.

Per chunk of C tokens (g: log decays, cum: their running sum in the chunk, beta: write strengths, K L2-normed):
    A = strict_lower((beta K) K^T * exp(cum_i - cum_j)),  T = (I + A)^-1          (the WY system)
    w = T (beta exp(cum) K),  u = T (beta V),  v_new = u - w S
    out = (exp(cum) Q) S + causal(Q K^T * exp(cum_i - cum_j)) v_new
    S = exp(cum_last) S + (exp(cum_last - cum) K)^T v_new

Two launches: only the chain of chunks runs in order, everything that does not need the state runs once per chunk
in parallel before it.
1. `_prepare_kernel` (one program per chunk x value head x row): gates, norms, T, and what the recurrence needs
   from the chunk, to HBM: w, u (stored transposed), the keys decayed to the chunk's end (k_end), cum, and the
   outputs' intra-chunk scores causal(Q K^T * decays).
2. `_recurrence_kernel` (one program per row x value head x block of value columns): the row's chunks in order with
   its float32 state in registers, held transposed ([block_v, dk]: every dot then has block_v rows); per chunk
   v_new = u - w S, the outputs (exp(cum) Q) S + scores v_new, then S's update. Neither the chunk states nor v_new
   leave the registers.
Why: the chunk loop is the only part that cannot run in parallel, and on one long prompt it is all there is to wait
for (one program per value block and head: 128 at 35B-A3B shapes with 32 columns). Keeping the inverse, the gates,
the key norms and the scores out of it leaves four dots a chunk, two of them on the chain. The price is HBM
traffic: w, u, k_end (C x d each) and the scores (C x C) written in the dot operands' dtype and read back. (fla
splits in three, with the chunk states through HBM; so did this module up to its sixteenth session: BENCH_H200.md.)

The inverse: unit-lower-triangular, by block doubling on the [C, C] tile of a chunk of up to SUB_BLOCK tokens; a
longer chunk solves its sub-blocks in order by forward substitution (`_prepare_kernel`). With X_s the inverse of the
block-diagonal part of I + A in blocks of s, and N_s the part of A in the blocks of 2s but not of s (the lower-left
quarter of each 2s block), X_2s = X_s - X_s N_s X_s exactly (N_s X_s N_s = 0). X_1 = I, X_2 = I - N_1 take no dot;
then log2(C) - 1 steps of two [C, C] dots each (8 tensor-core dots at C = 32, no solve, no slicing of values). It is
the recursive block inversion fla's solve_tril does at 16 -> 32 -> 64 with explicit tiles, done here with masks:
every intermediate is a block of the true inverse or M21 M11^-1 (|A| <= 1 because beta <= 1, |k_i . k_j| <= 1 and
decays <= 1), so nothing grows beyond the answer itself, unlike a product of (I + L^(2^i)) factors whose powers of
L can reach binomial(C, C/2) before cancelling. Its rounding error is that of one matrix product per level.

Numerics: float32 state, gates, decays and accumulation. Dot operands are in the model's dtype (q's), and so are the
intermediates stored between launches (w, u, k_end, the scores): float32 inputs use float32 everywhere,
with dots at HIGHEST precision (IEEE on GPU; within ~3e-7 of `reference` on CPU); bf16 inputs use bf16 operands for
every dot except the inverse, which takes float32 operands at default precision (TF32 on GPU, float32 in interpret
mode). Storing w, k_end and the scores in bf16 rounds nothing the dots would not round anyway; u is the one
extra rounding (fla stores it in bf16 too): ~5e-3 relative on CPU at dk = dv = 128, within bf16 limits. Padding
tokens (past seq_len) are never read; their outputs are exactly 0, and their rows of w, u and k_end are 0 (beta and
k are 0 there), so they never touch a state.

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
    in v's dtype, final state [B, nv, dk, dv] float32)."""
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


# The prepare launch solves the WY system in sub-blocks of this many tokens, so a chunk of 64 (only when asked for:
# the defaults are chunks of 32) as two (H200, one 4,096-token prompt, the launch alone: 131 us with one 64-wide
# inverse, 77 us for chunks of 32; BENCH_H200.md, thirteenth session).
SUB_BLOCK = 32


def _prepare_kernel(seq_lens_ref, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, w_ref, u_ref,
                    k_end_ref, cum_ref, scores_ref, *, repeat: int, chunk: int, dtype, precision):
    """One program: chunk `c` of row `r`, value head `h` -> its rows of w, k_end [B, nv, chunks * C, dk], its
    columns of u^T [B, nv, dv, chunks * C], the scores [B, nv, chunks * C, C] (in `dtype`) and cum [B, nv, chunks * C]
    (float32).
    Chunks past the row's seq_len do nothing (nothing reads them).

    A chunk longer than SUB_BLOCK is solved by block forward substitution over its sub-blocks p (A_pq: the rows of
    sub-block p against the columns of q, T_p = (I + A_pp)^-1): w_p = T_p (x_p - sum_{q<p} A_pq w_q), and u alike.
    The same w and u as T of the whole chunk, without a [C, C] inverse whose doubling dots grow with C^3."""
    c, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len = seq_lens_ref[r]
    size = min(chunk, SUB_BLOCK)
    lanes = jnp.arange(v_ref.shape[-1], dtype=jnp.int32)[None, :]

    @pl.when(c * chunk < seq_len)
    def _():
        gates, offset = [], 0.0  # offset: cum at the end of the sub-blocks before
        for p in range(chunk // size):  # static: one or two sub-blocks; the gates first, for cum at the chunk's end
            tok = c * chunk + p * size + jnp.arange(size, dtype=jnp.int32)
            g, beta = _gates(a_ref, b_ref, a_log_ref, dt_bias_ref, r, h, tok, tok < seq_len)
            cum = offset + jnp.cumsum(g)
            offset = jnp.sum(jnp.where(jnp.arange(size) == size - 1, cum, 0.0))  # cum[-1]
            gates.append((c * chunk + p * size, tok, beta, cum))
        row = jnp.arange(size, dtype=jnp.int32)[:, None]
        col = jnp.arange(size, dtype=jnp.int32)[None, :]
        solved = []  # per sub-block before: k, cum, w, u (the dots' operands, kept in their dtype: fewer registers)
        for start, tok, beta, cum in gates:
            live = tok < seq_len
            rows = pl.ds(start, size)
            k = _load_normed(k_ref, r, tok, h // repeat, live)  # [size, dk]
            decay = _decay(cum)
            decays_from = [jnp.exp(cum[:, None] - cum_q[None, :]) for _, cum_q, _, _ in solved]  # earlier sub-blocks
            # The outputs' intra-chunk scores, causal(Q K^T * decays), by blocks of columns, here rather than in the
            # recurrence, off its chain (64 x 1,024 tokens, H200: the recurrence 1.78 -> 1.27 ms). Formed before v is
            # loaded, q held in the dots' dtype (as _dot rounds it): 128 registers, against 168 with q in float32 beside
            # v (H100, 64 x 1,024: 1.35 against 1.41 ms) and 255 formed after the inverse (its loads hoisted; 2.3 ms).
            q = (_load_normed(q_ref, r, tok, h // repeat, live) * q_ref.shape[-1] ** -0.5).astype(dtype)
            for q_block in range(chunk // size):
                if q_block < len(solved):
                    scores = _dot(q, solved[q_block][0].T, dtype, precision) * decays_from[q_block]
                elif q_block == len(solved):
                    scores = _dot(q, k.T, dtype, precision) * decay
                else:  # causal: 0
                    scores = jnp.zeros((size, size), F32)
                scores_ref[r, h, rows, pl.ds(q_block * size, size)] = scores.astype(scores_ref.dtype)
            v = pltriton.load(v_ref.at[r, tok[:, None], h, lanes], mask=live[:, None], other=0.0)
            kb = k * beta[:, None]
            a = jnp.where(row > col, _dot(kb, k.T, dtype, precision) * decay, 0.0)
            k_end_ref[r, h, rows, :] = (k * jnp.exp(offset - cum)[:, None]).astype(k_end_ref.dtype)
            cum_ref[r, h, rows] = cum
            x, y = k * (beta * jnp.exp(cum))[:, None], v.astype(F32) * beta[:, None]
            for (k_q, _, w_q, u_q), decay_q in zip(solved, decays_from):  # each of their tokens precedes these
                a_pq = _dot(kb, k_q.T, dtype, precision) * decay_q
                x, y = x - _dot(a_pq, w_q, dtype, precision), y - _dot(a_pq, u_q, dtype, precision)
            # Everything but the inverse is formed first, and x, y held in the dots' operand type (as _dot would
            # round them): over the inverse's dependent dots only they and the system stay live, not k, v in float32.
            # Chunks of 32 on an H200: 137 -> 125 registers, four programs a multiprocessor instead of three (chunks
            # of 64 stay at ~254 registers, two programs).
            k, x, y = k.astype(dtype), x.astype(dtype), y.astype(dtype)
            t = _unit_lower_inverse(a, precision)
            w = _dot(t, x, dtype, precision).astype(w_ref.dtype)
            u = _dot(t, y, dtype, precision).astype(u_ref.dtype)
            w_ref[r, h, rows, :] = w
            u_ref[r, h, :, rows] = u.T  # stored transposed: the recurrence reads u^T
            solved.append((k, cum, w, u))


def _recurrence_kernel(seq_lens_ref, q_ref, w_ref, u_ref, k_end_ref, cum_ref, scores_ref, state_in_ref, o_ref,
                       state_ref, *, repeat: int, chunk: int, block_v: int, dtype, precision):
    """One program: row `r`, value head `h`, value columns [j * block_v, +block_v): the row's live chunks in order,
    the state carried in registers. Per chunk: v_new = u - w S, the chunk's outputs (exp(cum) Q) S + scores v_new,
    then S's update; the final state in place. Chunks past seq_len get 0 outputs.

    The state is held transposed, S^T [block_v, dk], and every product is formed transposed (v_new^T = u^T - S^T
    w^T, ...), so each dot has block_v rows, not the chunk's 32, and S^T and v_new^T are the dots' left operands,
    which may stay in registers (H200, 64 x 1,024 tokens: 1.32 -> 1.10 ms; 255 -> 221 registers; one 4,096-token
    prompt at 32 columns 176 -> 150 us). The same roundings; only the float32 sums run in another order. u comes
    stored transposed, so its tile needs no transpose per chunk (64 x 1,024: the launch 1,042 -> 947 us, the prepare
    launch's transposed store 1,345 -> 1,361)."""
    del state_in_ref  # aliased to state_ref (input_output_aliases): same buffer
    j, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len, seq = seq_lens_ref[r], o_ref.shape[1]
    cols = pl.ds(j * block_v, block_v)
    lanes = j * block_v + jnp.arange(block_v, dtype=jnp.int32)[None, :]

    def out_at(c):
        tok = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        return tok, o_ref.at[r, tok[:, None], h, lanes], (tok < seq)[:, None]

    def step(c, s_t):  # s_t: [block_v, dk] float32, S^T before chunk c
        rows = pl.ds(c * chunk, chunk)
        tok, at, in_bounds = out_at(c)
        v_new_t = u_ref[r, h, cols, rows].astype(F32) - _dot(s_t, w_ref[r, h, rows, :].T, dtype, precision)
        q = _load_normed(q_ref, r, tok, h // repeat, tok < seq_len) * q_ref.shape[-1] ** -0.5  # [C, dk]
        q_decayed = q * jnp.exp(cum_ref[r, h, rows])[:, None]
        out_t = _dot(s_t, q_decayed.T, dtype, precision) + _dot(v_new_t, scores_ref[r, h, rows, :].T, dtype, precision)
        pltriton.store(at, out_t.T.astype(o_ref.dtype), mask=in_bounds)  # 0 at padding: q and the scores are 0 there
        decay_all = jnp.exp(cum_ref[r, h, c * chunk + chunk - 1])
        return s_t * decay_all + _dot(v_new_t, k_end_ref[r, h, rows, :], dtype, precision)

    def zeros(c, carry):  # chunks past the row's seq_len
        _, at, in_bounds = out_at(c)
        pltriton.store(at, jnp.zeros((chunk, block_v), o_ref.dtype), mask=in_bounds)
        return carry

    num_live = jax.lax.div(seq_len + chunk - 1, chunk)
    state_ref[r, h, :, cols] = jax.lax.fori_loop(0, num_live, step, state_ref[r, h, :, cols].T).T
    jax.lax.fori_loop(num_live, pl.cdiv(seq, chunk), zeros, 0)


def default_tiles(rows: int, dv: int) -> dict:
    """(chunk_size, block_v, num_stages) by the number of prompts, from H200 runs at 35B-A3B shapes (GPU time,
    BENCH_H200.md, sixteenth and seventeenth sessions). Chunks of 32 and three pipeline stages (the chunk loop's
    loads a step ahead) everywhere. One prompt has only nv * dv / block_v recurrence programs on 132 SMs, so its chain
    of chunks is the critical path: 32 value columns, twice the programs of 64 (the recurrence alone at 4,096 tokens:
    150 us, 64 columns 165; whole op with chunks of 64: 270 against 240). From two prompts on the programs are
    enough and 64 columns halve the re-reads of w, k_end, q and the scores (the recurrence alone at 64 x 1,024:
    1,098 us against 1,833 at 32 columns and 1,175 at 128 on 8 warps)."""
    return dict(chunk_size=32, block_v=min(32 if rows == 1 else 64, dv), num_stages=3)


def gdn_prefill(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
                dt_bias: jax.Array, state: jax.Array, seq_lens: jax.Array, *, chunk_size: int | None = None,
                block_v: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Same contract as `reference`; outputs at padding tokens are exactly 0. The state is updated in place (donate
    it in the caller's jit to avoid a copy). Cost follows each row's seq_len: chunks past it are skipped.
    chunk_size, dk, dv and block_v (the value columns of one recurrence program): powers of two, at least 16
    (Triton's smallest dot; interpreted, only chunk_size); num_warps and num_stages apply to both launches; None:
    `default_tiles` for this many rows. interpret=None interprets on CPU only."""
    batch, seq, nk, dk = q.shape
    nv, dv = v.shape[2:]
    given = dict(chunk_size=chunk_size, block_v=block_v, num_stages=num_stages)
    tiles = default_tiles(batch, dv) | {name: value for name, value in given.items() if value is not None}
    chunk_size, block_v, num_stages = tiles["chunk_size"], tiles["block_v"], tiles["num_stages"]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    dims = (chunk_size, dk, dv, block_v) if not interpret else (chunk_size,)  # Triton's dots need >= 16
    if nv % nk or dv % block_v or k.shape != q.shape or v.shape[:2] != (batch, seq) \
            or state.shape != (batch, nv, dk, dv) or state.dtype != F32 \
            or any(n < 16 or n & (n - 1) for n in dims):
        raise ValueError(f"gdn_prefill: q {q.shape}, v {v.shape}, state {state.shape} {state.dtype}, "
                         f"chunk_size {chunk_size}, block_v {block_v}")
    config = dict(chunk_size=chunk_size, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    seq_lens = jnp.minimum(seq_lens.astype(jnp.int32), seq)
    w, u, k_end, cum, scores = prepare_chunks(q, k, v, a, b, A_log, dt_bias, seq_lens, **config)
    return recurrence(q, w, u, k_end, cum, scores, state, seq_lens, block_v=block_v, out_dtype=v.dtype, **config)


def _launch(kernel, grid: tuple, out_shape, name: str, *, chunk_size: int, num_warps: int, num_stages: int,
            interpret: bool, dtype, aliases: dict | None = None, **static):
    """pallas_call of kernel(**static, chunk=, dtype=, precision=) over `grid`: float32 operands get IEEE dots."""
    precision = jax.lax.Precision.HIGHEST if dtype == F32 else None  # float32: IEEE dots on GPU, not TF32
    return pl.pallas_call(
        functools.partial(kernel, **static, chunk=chunk_size, dtype=dtype, precision=precision),
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases or {},
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name,
    )


def prepare_chunks(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
                   dt_bias: jax.Array, seq_lens: jax.Array, **config) -> tuple[jax.Array, ...]:
    """Launch 1 (seq_lens already clamped to the width): (w, u^T, k_end, cum, scores) of every live chunk, rows of
    [B, nv, chunks * C, ...] but u^T [B, nv, dv, chunks * C], in the orientation the recurrence adds it in; scores
    [.., C] are the chunk's causal(Q K^T * decays), q scaled. All in q's dtype but cum (float32)."""
    batch, seq, nk, dk = k.shape
    nv, dv = v.shape[2:]
    chunk = config["chunk_size"]
    padded = -(-seq // chunk) * chunk
    rows_of = lambda width: jax.ShapeDtypeStruct((batch, nv, padded, width), q.dtype)
    u_t = jax.ShapeDtypeStruct((batch, nv, dv, padded), q.dtype)
    out_shape = (rows_of(dk), u_t, rows_of(dk), jax.ShapeDtypeStruct((batch, nv, padded), F32), rows_of(chunk))
    grid = (padded // chunk, nv, batch)
    return _launch(_prepare_kernel, grid, out_shape, "gdn_prefill_prepare", repeat=nv // nk, dtype=q.dtype,
                   **config)(seq_lens, q, k, v, a, b, A_log, dt_bias)


def recurrence(q: jax.Array, w: jax.Array, u: jax.Array, k_end: jax.Array, cum: jax.Array, scores: jax.Array,
               state: jax.Array, seq_lens: jax.Array, *, block_v: int, out_dtype, **config
               ) -> tuple[jax.Array, jax.Array]:
    """Launch 2: (outputs [B, S, nv, dv] in `out_dtype`, the final state in place of `state`)."""
    batch, seq, nk, _ = q.shape
    _, nv, dv, _ = u.shape
    out_shape = (jax.ShapeDtypeStruct((batch, seq, nv, dv), out_dtype), jax.ShapeDtypeStruct(state.shape, F32))
    return _launch(_recurrence_kernel, (dv // block_v, nv, batch), out_shape, "gdn_prefill_recurrence",
                   aliases={7: 1}, repeat=nv // nk, block_v=block_v, dtype=q.dtype, **config)(
        seq_lens, q, w, u, k_end, cum, scores, state)


def select(kernels: str) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The one switch: "reference" (jnp, the default everywhere) or "gpu" (the Pallas kernels)."""
    return {"reference": reference, "gpu": gdn_prefill}[kernels]
