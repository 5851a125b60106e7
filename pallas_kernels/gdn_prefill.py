"""Gated DeltaNet prefill (the chunked WY-form delta rule of flash-linear-attention's `chunk_gated_delta_rule`) as
two Pallas kernels over a flat ragged batch: the requests of two or more tokens, each from its state slot. Only the
recurrence: it must never take over the projections, conv, gated norm or state slots' choice of the layer, never read
a token outside its request, and never touch a request of fewer than two tokens (pallas_kernels/gdn.py runs the op).

Per chunk of C tokens (g: log decays, cum: their running sum in the chunk, beta: write strengths, K L2-normed):
    A = strict_lower((beta K) K^T * exp(cum_i - cum_j)),  T = (I + A)^-1          (the WY system)
    w = T (beta exp(cum) K),  u = T (beta V),  v_new = u - w S
    out = (exp(cum) Q) S + causal(Q K^T * exp(cum_i - cum_j)) v_new
    S = exp(cum_last) S + (exp(cum_last - cum) K)^T v_new

The ragged layout: request r's tokens are [query_start[r], +query_len[r]) of the token axis, at any offset and in
any order; its chunks start at query_start[r], query_start[r] + C, ... (the last partial), so a chunk's C rows may
run into another request's tokens or past T, and every load and store of them is masked to the request.

Two launches: only the chain of chunks runs in order, everything that does not need the state runs once per chunk
in parallel before it.
1. `_prepare_kernel` (one program per work item x value head): a work item is one chunk of one request, listed
   request by request on the device (`work_items`: a few jnp ops), padded to a static count; padding items exit
   at once. Gates, norms, T, and what the recurrence needs from the chunk, to HBM: w, u (stored transposed), the
   keys decayed to the chunk's end (k_end), cum, and the outputs' intra-chunk scores causal(Q K^T * decays). They are
   stored at the chunk's token rows ([nv, T, ...]), masked to its request's tokens, so two requests' chunks never
   write the same row: T rows in all, where rows by work item would take C per item, and the static item count
   allows for a partial chunk per request (up to 16 times T at C = 32 with many two-token requests).
2. `_recurrence_kernel` (one program per value block x value head x request): the request's chunks in order with
   its float32 state in registers, held transposed ([block_v, dk]: every dot then has block_v rows); per chunk
   v_new = u - w S, the outputs (exp(cum) Q) S + scores v_new, then S's update. Neither the chunk states nor v_new
   leave the registers. The state is read from the request's slot (zeros if fresh) and written back in place.
Why: the chunk loop is the only part that cannot run in parallel, and on one long prompt it is all there is to wait
for (one program per value block and head: 128 at 35B-A3B shapes with 32 columns). Keeping the inverse, the gates,
the key norms and the scores out of it leaves four dots a chunk, two of them on the chain. The price is HBM
traffic: w, u, k_end (C x d each) and the scores (C x C) written in the dot operands' dtype and read back. (fla
splits in three, with the chunk states through HBM; on an H200 these two launches beat such a three-launch split at
every prompt count measured, 2,671 against 2,974 us at 64 x 1,024.)

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
with dots at HIGHEST precision (IEEE on GPU; within ~3e-7 of the reference on CPU); bf16 inputs use bf16 operands
for every dot except the inverse, which takes float32 operands at default precision (TF32 on GPU, float32 in
interpret mode). Storing w, k_end and the scores in bf16 rounds nothing the dots would not round anyway; u is the one
extra rounding (fla stores it in bf16 too): ~5e-3 relative on CPU at dk = dv = 128, within bf16 limits. Rows of a
chunk past its request's end are never read (masked loads give 0; beta, g and k are 0 there), so they never touch a
state, and the recurrence reads only the rows its request's prepare programs wrote.

Pallas' Triton lowering (as pallas_kernels/gdn_decode.py and paged_attention.py): whole-array refs indexed in the
kernel, masked loads and stores, power-of-two tiles of at least 16 for the dots; on the CPU the same source runs in
interpret mode.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gdn_math import L2_EPS, softplus

F32 = jnp.float32


def _dot(x: jax.Array, y: jax.Array, dtype, precision) -> jax.Array:
    return jnp.dot(x.astype(dtype), y.astype(dtype), precision=precision, preferred_element_type=F32)


def _load_normed(ref, tok, head, live) -> jax.Array:
    """Rows `tok` [C] of head `head` of q or k [T, heads, d], L2-normed in float32: [C, d], 0 where not live."""
    lanes = jnp.arange(ref.shape[-1], dtype=jnp.int32)[None, :]
    x = pltriton.load(ref.at[tok[:, None], head, lanes], mask=live[:, None], other=0.0).astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1) + L2_EPS)[:, None]


def _gates(a_ref, b_ref, a_log_ref, dt_bias_ref, h, tok, live) -> tuple[jax.Array, jax.Array]:
    """(g, beta) [C] float32 of value head h at tokens `tok`: both 0 where not live, which leaves the state
    untouched."""
    a = pltriton.load(a_ref.at[tok, h], mask=live, other=0.0).astype(F32)
    b = pltriton.load(b_ref.at[tok, h], mask=live, other=0.0)
    beta = jax.nn.sigmoid(b.astype(F32)).astype(b.dtype).astype(F32)  # rounded to b's dtype, as HF does
    g = -jnp.exp(a_log_ref[h].astype(F32)) * softplus(a + dt_bias_ref[h].astype(F32))
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
# inverse, 77 us for chunks of 32).
SUB_BLOCK = 32


def _prepare_kernel(first_ref, end_ref, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, w_ref, u_ref,
                    k_end_ref, cum_ref, scores_ref, *, repeat: int, chunk: int, dtype, precision):
    """One program: work item `i` (the chunk of tokens [first, first + C) of a request ending at `end`), value head
    `h` -> its token rows of w, k_end [nv, T, dk], the scores [nv, T, C] (in `dtype`) and cum [nv, T] (float32), its
    token columns of u^T [nv, dv, T]; rows at or past `end` are not stored. Padding items (first == end) do nothing.

    A chunk longer than SUB_BLOCK is solved by block forward substitution over its sub-blocks p (A_pq: the rows of
    sub-block p against the columns of q, T_p = (I + A_pp)^-1): w_p = T_p (x_p - sum_{q<p} A_pq w_q), and u alike.
    The same w and u as T of the whole chunk, without a [C, C] inverse whose doubling dots grow with C^3."""
    i, h = pl.program_id(0), pl.program_id(1)
    first, end = first_ref[i], end_ref[i]
    size = min(chunk, SUB_BLOCK)
    v_lanes = jnp.arange(v_ref.shape[-1], dtype=jnp.int32)
    k_lanes = jnp.arange(k_ref.shape[-1], dtype=jnp.int32)[None, :]

    @pl.when(first < end)
    def _():
        gates, offset = [], 0.0  # offset: cum at the end of the sub-blocks before
        for p in range(chunk // size):  # static: one or two sub-blocks; the gates first, for cum at the chunk's end
            tok = first + p * size + jnp.arange(size, dtype=jnp.int32)
            live = tok < end
            g, beta = _gates(a_ref, b_ref, a_log_ref, dt_bias_ref, h, tok, live)
            cum = offset + jnp.cumsum(g)
            offset = jnp.sum(jnp.where(jnp.arange(size) == size - 1, cum, 0.0))  # cum[-1]
            gates.append((tok, live, beta, cum))
        row = jnp.arange(size, dtype=jnp.int32)[:, None]
        col = jnp.arange(size, dtype=jnp.int32)[None, :]
        solved = []  # per sub-block before: k, cum, w, u (the dots' operands, kept in their dtype: fewer registers)
        for tok, live, beta, cum in gates:
            rows = live[:, None]  # the store mask of [size, ...] tiles at token rows `tok`
            k = _load_normed(k_ref, tok, h // repeat, live)  # [size, dk]
            decay = _decay(cum)
            decays_from = [jnp.exp(cum[:, None] - cum_q[None, :]) for _, cum_q, _, _ in solved]  # earlier sub-blocks
            # The outputs' intra-chunk scores, causal(Q K^T * decays), by blocks of columns, here rather than in the
            # recurrence, off its chain (64 x 1,024 tokens, H200: the recurrence 1.78 -> 1.27 ms). Formed before v is
            # loaded, q held in the dots' dtype (as _dot rounds it): 128 registers, against 168 with q in float32 beside
            # v (H100, 64 x 1,024: 1.35 against 1.41 ms) and 255 formed after the inverse (its loads hoisted; 2.3 ms).
            q = (_load_normed(q_ref, tok, h // repeat, live) * q_ref.shape[-1] ** -0.5).astype(dtype)
            for q_block in range(chunk // size):
                if q_block < len(solved):
                    scores = _dot(q, solved[q_block][0].T, dtype, precision) * decays_from[q_block]
                elif q_block == len(solved):
                    scores = _dot(q, k.T, dtype, precision) * decay
                else:  # causal: 0
                    scores = jnp.zeros((size, size), F32)
                columns = q_block * size + col
                pltriton.store(scores_ref.at[h, tok[:, None], columns], scores.astype(scores_ref.dtype), mask=rows)
            v = pltriton.load(v_ref.at[tok[:, None], h, v_lanes[None, :]], mask=rows, other=0.0)
            kb = k * beta[:, None]
            a = jnp.where(row > col, _dot(kb, k.T, dtype, precision) * decay, 0.0)
            k_end = (k * jnp.exp(offset - cum)[:, None]).astype(k_end_ref.dtype)
            pltriton.store(k_end_ref.at[h, tok[:, None], k_lanes], k_end, mask=rows)
            pltriton.store(cum_ref.at[h, tok], cum, mask=live)
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
            pltriton.store(w_ref.at[h, tok[:, None], k_lanes], w, mask=rows)
            # stored transposed: the recurrence reads u^T
            pltriton.store(u_ref.at[h, v_lanes[:, None], tok[None, :]], u.T, mask=live[None, :])
            solved.append((k, cum, w, u))


def _recurrence_kernel(start_ref, len_ref, slots_ref, fresh_ref, q_ref, w_ref, u_ref, k_end_ref, cum_ref,
                       scores_ref, out_in_ref, state_in_ref, o_ref, state_ref, *, repeat: int, chunk: int,
                       block_v: int, dtype, precision):
    """One program: request `r`, value head `h`, value columns [j * block_v, +block_v): the request's chunks in
    order, the state carried in registers from its slot (zeros if fresh) and written back there. Per chunk:
    v_new = u - w S, the chunk's outputs (exp(cum) Q) S + scores v_new, then S's update. A request of fewer than two
    tokens exits at once (decode rows are gdn_decode's; padding requests all name the sink slot).

    The state is held transposed, S^T [block_v, dk], and every product is formed transposed (v_new^T = u^T - S^T
    w^T, ...), so each dot has block_v rows, not the chunk's 32, and S^T and v_new^T are the dots' left operands,
    which may stay in registers (H200, 64 x 1,024 tokens: 1.32 -> 1.10 ms; 255 -> 221 registers; one 4,096-token
    prompt at 32 columns 176 -> 150 us). The same roundings; only the float32 sums run in another order. u comes
    stored transposed, so its tile needs no transpose per chunk (64 x 1,024: the launch 1,042 -> 947 us, the prepare
    launch's transposed store 1,345 -> 1,361)."""
    del out_in_ref, state_in_ref  # aliased to o_ref, state_ref (input_output_aliases): same buffers
    j, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = len_ref[r]

    @pl.when(length >= 2)
    def _():
        first, slot = start_ref[r], slots_ref[r]
        end = first + length
        cols = pl.ds(j * block_v, block_v)
        lanes = j * block_v + jnp.arange(block_v, dtype=jnp.int32)
        k_lanes = jnp.arange(w_ref.shape[-1], dtype=jnp.int32)[None, :]
        chunk_lanes = jnp.arange(chunk, dtype=jnp.int32)[None, :]

        def step(c, s_t):  # s_t: [block_v, dk] float32, S^T before chunk c
            tok = first + c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            live = tok < end
            rows = live[:, None]
            u_t = pltriton.load(u_ref.at[h, lanes[:, None], tok[None, :]], mask=live[None, :], other=0.0)
            w = pltriton.load(w_ref.at[h, tok[:, None], k_lanes], mask=rows, other=0.0)
            v_new_t = u_t.astype(F32) - _dot(s_t, w.T, dtype, precision)
            q = _load_normed(q_ref, tok, h // repeat, live) * q_ref.shape[-1] ** -0.5  # [C, dk]
            q_decayed = q * jnp.exp(pltriton.load(cum_ref.at[h, tok], mask=live, other=0.0))[:, None]
            scores = pltriton.load(scores_ref.at[h, tok[:, None], chunk_lanes], mask=rows, other=0.0)
            out_t = _dot(s_t, q_decayed.T, dtype, precision) + _dot(v_new_t, scores.T, dtype, precision)
            pltriton.store(o_ref.at[tok[:, None], h, lanes[None, :]], out_t.T.astype(o_ref.dtype), mask=rows)
            decay_all = jnp.exp(cum_ref[h, jnp.minimum(first + c * chunk + chunk, end) - 1])  # the chunk's last token
            k_end = pltriton.load(k_end_ref.at[h, tok[:, None], k_lanes], mask=rows, other=0.0)
            return s_t * decay_all + _dot(v_new_t, k_end, dtype, precision)

        s_t = jnp.where(fresh_ref[r] != 0, 0.0, state_ref[slot, h, :, cols]).T
        state_ref[slot, h, :, cols] = jax.lax.fori_loop(0, jax.lax.div(length + chunk - 1, chunk), step, s_t).T


def default_tiles(requests: int, dv: int) -> dict:
    """(chunk_size, block_v, num_stages) for a batch of `requests` request slots (static, so the number of prefill
    requests among them is not known here), from H200 runs at 35B-A3B shapes (GPU time of tile sweeps with
    qwen_jax/bench/kernels.py). Chunks of 32 and three pipeline stages (the chunk loop's loads a step ahead) everywhere.
    One prompt has only nv * dv / block_v recurrence programs on 132 SMs, so its chain of chunks is the critical
    path: 32 value columns, twice the programs of 64 (the recurrence alone at 4,096 tokens: 150 us, 64 columns 165;
    whole op with chunks of 64: 270 against 240); only a batch of one request slot is sure to hold at most one. From
    two prompts on the programs are enough and 64 columns halve the re-reads of w, k_end, q and the scores (the
    recurrence alone at 64 x 1,024: 1,098 us against 1,833 at 32 columns and 1,175 at 128 on 8 warps), and a lone
    prompt in a batch of several slots loses less at 64 (~10%) than many would at 32 (~65%)."""
    return dict(chunk_size=32, block_v=min(32 if requests == 1 else 64, dv), num_stages=3)


def work_items(batch, chunk: int, tokens: int) -> tuple[jax.Array, jax.Array]:
    """The prepare launch's work items: the chunks of `chunk` tokens of each request of two or more tokens, request
    by request, padded to T // chunk + min(R, T // 2) (no more can be: the requests' whole chunks fit in T, and each of
    at most min(R, T // 2) such requests adds at most one partial chunk). Returns (each chunk's first token, its
    request's end) [NC] int32; padding items have both 0. A few jnp ops of R and NC elements on the device."""
    query_start = jnp.asarray(batch.query_start).astype(jnp.int32)
    query_len = jnp.asarray(batch.query_len).astype(jnp.int32)
    requests = query_len.shape[0]
    lens = jnp.where(query_len >= 2, query_len, 0)
    count = (lens + chunk - 1) // chunk  # [R]
    ends = jnp.cumsum(count)
    item = jnp.arange(tokens // chunk + min(requests, tokens // 2), dtype=jnp.int32)
    # compare_all: one fused comparison, not a loop (XLA's loops wait on the host every iteration on GPU)
    request = jnp.minimum(jnp.searchsorted(ends, item, side="right", method="compare_all"), requests - 1)
    live = item < ends[-1]
    first = query_start[request] + (item - (ends - count)[request]) * chunk
    return jnp.where(live, first, 0), jnp.where(live, query_start[request] + lens[request], 0)


def launch_config(q: jax.Array, v: jax.Array, requests: int, *, chunk_size: int | None = None,
                  block_v: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                  interpret: bool | None = None) -> dict:
    """Both launches' options (chunk_size, block_v, num_stages, num_warps, interpret) for q [T, nk, dk], v [T, nv, dv]
    and `requests` request slots: `default_tiles` where not given, checked (Triton's dots take powers of two >= 16;
    interpreted, only the chunk's power of two matters); interpret None: on CPU only."""
    nk, dk = q.shape[1:]
    nv, dv = v.shape[1:]
    given = dict(chunk_size=chunk_size, block_v=block_v, num_stages=num_stages)
    tiles = default_tiles(requests, dv) | {name: value for name, value in given.items() if value is not None}
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    dims = (tiles["chunk_size"], dk, dv, tiles["block_v"]) if not interpret else (tiles["chunk_size"],)
    if nv % nk or dv % tiles["block_v"] or v.shape[0] != q.shape[0] or any(n < 16 or n & (n - 1) for n in dims):
        raise ValueError(f"gdn_prefill: q {q.shape}, v {v.shape}, chunk_size {tiles['chunk_size']}, "
                         f"block_v {tiles['block_v']}")
    return dict(tiles, num_warps=num_warps, interpret=interpret)


def prefill(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
            dt_bias: jax.Array, ssm: jax.Array, batch, out: jax.Array, *, chunk_size: int | None = None,
            block_v: int | None = None, num_warps: int = 4, num_stages: int | None = None,
            interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The delta rule of the batch's requests of two or more tokens: q, k [T, nk, dk] (after conv + SiLU, before the
    L2 norm); v [T, nv, dv]; a, b [T, nv] raw; A_log, dt_bias [nv]; ssm [slots, nv, dk, dv] float32; batch: a
    qwen_jax.layers.batch.Ragged (query_start, query_len, state_slot, fresh are read); out [T, nv, dv] in v's dtype.
    Returns (out with those requests' tokens written, ssm with their slots advanced), both in place (aliased): every
    other token of out and every other slot of ssm keep their bits. A fresh request reads its slot as zeros. Cost
    follows the requests' lengths: padding work items and short requests exit at once; a batch of one token
    launches nothing.
    chunk_size, dk, dv and block_v (the value columns of one recurrence program): powers of two, at least 16
    (Triton's smallest dot; interpreted, only chunk_size); num_warps and num_stages apply to both launches; None:
    `default_tiles` for this many request slots. interpret=None interprets on CPU only."""
    nk, dk = q.shape[1:]
    nv, dv = v.shape[1:]
    if ssm.shape[1:] != (nv, dk, dv) or ssm.dtype != F32 or out.shape != v.shape or out.dtype != v.dtype:
        raise ValueError(f"gdn_prefill: q {q.shape}, v {v.shape}, ssm {ssm.shape} {ssm.dtype}, out {out.shape} "
                         f"{out.dtype}")
    config = launch_config(q, v, batch.query_len.shape[0], chunk_size=chunk_size, block_v=block_v,
                           num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    block_v = config.pop("block_v")
    if q.shape[0] < 2:  # no request of two tokens fits: nothing to launch
        return out, ssm
    prepared = prepare_chunks(q, k, v, a, b, A_log, dt_bias, batch, **config)
    return recurrence(q, *prepared, ssm, batch, out, block_v=block_v, **config)


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
                   dt_bias: jax.Array, batch, **config) -> tuple[jax.Array, ...]:
    """Launch 1 (config: `launch_config`'s, without block_v), over (work item, value head): (w, u^T, k_end, cum, scores)
    at the token rows of every chunk of the requests of two or more tokens: [nv, T, ...] but u^T [nv, dv, T], in the
    orientation the recurrence adds it in; scores [nv, T, C] are each chunk's causal(Q K^T * decays) (q scaled), a
    row per token, a column per token of its chunk. All in q's dtype but cum (float32); rows of other tokens are
    not written."""
    tokens, nk, dk = k.shape
    nv, dv = v.shape[1:]
    chunk = config["chunk_size"]
    first, end = work_items(batch, chunk, tokens)
    rows_of = lambda width: jax.ShapeDtypeStruct((nv, tokens, width), q.dtype)  # noqa: E731
    out_shape = (rows_of(dk), jax.ShapeDtypeStruct((nv, dv, tokens), q.dtype), rows_of(dk),
                 jax.ShapeDtypeStruct((nv, tokens), F32), rows_of(chunk))
    return _launch(_prepare_kernel, (first.shape[0], nv), out_shape, "gdn_prefill_prepare", repeat=nv // nk,
                   dtype=q.dtype, **config)(first, end, q, k, v, a, b, A_log, dt_bias)


def recurrence(q: jax.Array, w: jax.Array, u: jax.Array, k_end: jax.Array, cum: jax.Array, scores: jax.Array,
               ssm: jax.Array, batch, out: jax.Array, *, block_v: int, **config) -> tuple[jax.Array, jax.Array]:
    """Launch 2, over (value block, value head, request): (out with the tokens of the requests of two or more
    written, ssm with their slots advanced), both in place of the operands."""
    nk = q.shape[1]
    nv, dv = u.shape[:2]
    index = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
    out_shape = (jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(ssm.shape, F32))
    return _launch(_recurrence_kernel, (dv // block_v, nv, batch.query_len.shape[0]), out_shape,
                   "gdn_prefill_recurrence", aliases={10: 0, 11: 1}, repeat=nv // nk, block_v=block_v, dtype=q.dtype,
                   **config)(index(batch.query_start), index(batch.query_len), index(batch.state_slot),
                             index(batch.fresh), q, w, u, k_end, cum, scores, out, ssm)
