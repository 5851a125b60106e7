"""Causal attention of a flat ragged token batch over the paged KV cache, as flash-attention Pallas kernels: one
launch for the one-token (decode) requests, one for the longer (prefill) ones. They only read the cache: they must
never write it, nor read a key past a request's context or past the last query of a tile.

Same contract as the jnp reference (qwen_jax.layers.attention.paged_attention), without its dense gather of every
token's pages: a program takes `block_q` queries of one request x the query heads of one KV head as the rows of its
tiles, walks that KV head's pages `block_k` keys at a time up to min(context_len, its last query position + 1) and
keeps a float32 running max, sum and accumulator (online softmax). The cost follows the real context, not the
block-table width. Blocks every row sees whole skip the causal mask; only the last ones are masked.
- Decode: grid (key splits, KV heads, requests), one query a program (its heads padded to 16 rows); a program whose
  request is not a one-token request exits at once. When KV heads x requests is too few programs to fill the GPU,
  the keys are split over `num_splits` programs and one XLA fusion merges their partial softmaxes (flash-decoding).
  With `max_query_len` (speculative verify rows: every request has at most that many tokens) the decode launch takes
  every request, all its queries in one program, and there is no prefill launch: a few queries over a long context
  are a decode's work, which the prefill launch (no key splits: one program a KV head) would run on two SMs.
- Prefill: grid (work slots, KV heads). A work list built on the device with a few small XLA ops names each slot's
  (request, query tile): the tiles of every request of two or more tokens, a request's latest (longest) tile first,
  so the tail of the launch is short tiles; the slots past the last tile do nothing. Its size is a static bound on
  the tiles (T / block_q + the most prefill requests T tokens hold), not queries x requests.

Numerics: float32 scores, softmax and accumulation; probabilities rounded to V's dtype for P @ V; the output rounded
to q's dtype. The reference rounds its scores to q's dtype first (as HF eager does), so bf16 results differ from it by
bf16 rounding. A query that sees no key gives exactly 0, as there, and so does a padding token.

Pallas' Triton lowering (as pallas_kernels/gdn_decode.py): whole-array refs indexed in the kernel with index arrays
(q and o in place, pages through the block table key by key), masked loads and stores for ragged edges, power-of-two
tiles of at least 16 rows for the tensor-core dots; on the CPU the same source runs in interpret mode.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite "minus infinity": no inf - inf = NaN in the updates
LOG2_E = math.log2(math.e)
TARGET_PROGRAMS = 264  # two per SM of an H100/H200 (132 SMs): below this, the decode keys are split
MIN_SPLIT_KEYS = 256  # a split covers at least this many keys of the table's width


def _attend(r, first, split, h, query_start_ref, query_len_ref, context_len_ref, tables_ref, positions_ref,
            kv_head_start_ref, q_ref, k_ref, v_ref, *, scale_log2: float, block_size: int, block_q: int, heads_p: int,
            group: int, block_k: int, split_keys: int) -> tuple:
    """Queries [first, first + block_q) of request r (those below its query_len) x the query heads of KV head h (row i:
    query i // heads_p, head i % heads_p of the group) against keys [split * split_keys, +split_keys) of what those
    rows see. KV head h of q's heads is the cache's head kv_head_start + h.
    Refs are whole arrays: query_start, query_len, context_len [R]; tables [R, W]; positions [T]; kv_head_start [1];
    q [T, heads, D]; k, v [num_blocks * block_size, kv, D] (the pages, flattened).
    Returns the unnormalised float32 acc [rows, D], max and sum [rows] (log2 domain), and the rows' (token, head,
    real) for the stores (padding rows: masked)."""
    tokens, heads, dim = q_ref.shape
    kv_head = kv_head_start_ref[0] + h
    width = tables_ref.shape[1]
    query_len = query_len_ref[r]

    row = jnp.arange(block_q * heads_p, dtype=jnp.int32)
    query = first + jax.lax.div(row, heads_p)  # [rows] query index within the request
    g = jax.lax.rem(row, heads_p)
    real = (query < query_len) & (g < group)  # padding rows: past the request's queries, or past the group
    head = jnp.where(g < group, h * group + g, heads)  # out of range on padding rows (masked, so never touched)
    # a padding row reads a real row's position (clamped in range whatever the request) ...
    pos = positions_ref[jnp.clip(query_start_ref[r] + jnp.minimum(query, query_len - 1), 0, tokens - 1)]  # [rows]
    # ... but its q and o index is out of range: masked, and no masked lane aliases a real one (interpret mode's
    # masked store writes every lane back)
    token = jnp.where(query < query_len, query_start_ref[r] + query, tokens)
    lanes = jnp.arange(dim, dtype=jnp.int32)[None, :]  # [1, D]
    q = pltriton.load(q_ref.at[token[:, None], head[:, None], lanes], mask=real[:, None], other=0.0)  # [rows, D]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # float32: no TF32

    start = split * split_keys
    end = jnp.minimum(jnp.minimum(context_len_ref[r], jnp.max(pos) + 1), start + split_keys)
    full_end = jnp.minimum(end, jnp.min(pos) + 1)  # keys before this are seen by every row
    num_full = jax.lax.div(jnp.maximum(full_end - start, 0), block_k)
    num_steps = jax.lax.div(jnp.maximum(end - start, 0) + (block_k - 1), block_k)

    def step(i, carry, masked: bool):
        acc, m, denom = carry  # [rows, D], [rows], [rows] float32: running P @ V, max, sum
        key = start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k] key positions
        page = tables_ref[r, jnp.minimum(jax.lax.div(key, block_size), width - 1)]  # [block_k] page ids
        at = ((page * block_size + jax.lax.rem(key, block_size))[:, None], kv_head, lanes)  # -> [block_k, D]
        if masked:
            live = key < end
            k = pltriton.load(k_ref.at[at], mask=live[:, None], other=0.0)  # nothing past `end` is read
            v = pltriton.load(v_ref.at[at], mask=live[:, None], other=0.0)
        else:
            k, v = k_ref[at], v_ref[at]
        s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale_log2  # [rows, block_k]
        if masked:
            visible = live[None, :] & (key[None, :] <= pos[:, None])
            s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(visible, p, 0.0)  # a row that has seen nothing yet keeps denom = 0
        alpha = jnp.exp2(m - m_new)
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, alpha * denom + jnp.sum(p, axis=1)

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full(pos.shape, MASKED, jnp.float32),
             jnp.zeros(pos.shape, jnp.float32))
    carry = jax.lax.fori_loop(0, num_full, functools.partial(step, masked=False), carry)
    acc, m, denom = jax.lax.fori_loop(num_full, num_steps, functools.partial(step, masked=True), carry)
    return acc, m, denom, token, head, real


def _normalised(acc, denom, dtype):
    return (acc / jnp.where(denom > 0.0, denom, 1.0)[:, None]).astype(dtype)


def _decode_kernel(query_start_ref, query_len_ref, context_len_ref, tables_ref, positions_ref, kv_head_start_ref,
                   q_ref, k_ref, v_ref, *out_refs, num_splits: int, block_q: int, bounded: bool, heads_p: int,
                   **tile):
    """One program: split j of the keys of request r's queries x the query heads of KV head h (see _attend): its one
    query, or with `bounded` (every request at most block_q tokens) all its queries. Out: with one split,
    o [T, heads, D] in q's dtype, aliased to an input (the prefill launch's output or zeros: only this request's
    tokens are written); with more, the float32 partials acc [splits, R * block_q, heads, D], max and sum
    [splits, R * block_q, heads] of the request's rows r * block_q + query (the other rows are left unwritten)."""
    j, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    refs = (query_start_ref, query_len_ref, context_len_ref, tables_ref, positions_ref, kv_head_start_ref, q_ref,
            k_ref, v_ref)
    query_len = query_len_ref[r]

    @pl.when((query_len > 0) if bounded else (query_len == 1))  # padding (and prefill) requests: nothing here
    def _():
        acc, m, denom, token, head, real = _attend(r, 0, j, h, *refs, block_q=block_q, heads_p=heads_p, **tile)
        lanes = jnp.arange(acc.shape[1], dtype=jnp.int32)[None, :]
        if num_splits == 1:
            _, o_ref = out_refs  # the aliased input and the output: one buffer
            pltriton.store(o_ref.at[token[:, None], head[:, None], lanes], _normalised(acc, denom, o_ref.dtype),
                           mask=real[:, None])
        else:
            acc_ref, m_ref, denom_ref = out_refs
            row = r * block_q + jax.lax.div(jnp.arange(acc.shape[0], dtype=jnp.int32), heads_p)
            pltriton.store(acc_ref.at[j, row[:, None], head[:, None], lanes], acc, mask=real[:, None])
            pltriton.store(m_ref.at[j, row, head], m, mask=real)
            pltriton.store(denom_ref.at[j, row, head], denom, mask=real)


def _prefill_kernel(work_ref, token_valid_ref, *refs, block_q: int, heads_p: int, group: int, **tile):
    """One program: work slot w x KV head h. work [2, slots]: the slot's request and first query (a slot past the
    last tile: a first query past every request's, so it attends nothing); token_valid [T] int32; then _attend's
    refs. Out: o [T, heads, D] in q's dtype; the slot's tile rows, and zeros on the padding tokens among
    [w * block_q, +block_q), so the slots together write every padding token (the decode launch writes the one-token
    requests' rows after)."""
    *refs, o_ref = refs
    query_len_ref = refs[1]
    w, h = pl.program_id(0), pl.program_id(1)
    r, first = work_ref[0, w], work_ref[1, w]
    tokens, _, dim = o_ref.shape
    lanes = jnp.arange(dim, dtype=jnp.int32)[None, :]

    @pl.when(first < query_len_ref[r])
    def _():
        acc, _, denom, token, head, real = _attend(r, first, 0, h, *refs, block_q=block_q, heads_p=heads_p,
                                                   group=group, **tile)
        pltriton.store(o_ref.at[token[:, None], head[:, None], lanes], _normalised(acc, denom, o_ref.dtype),
                       mask=real[:, None])

    row = jnp.arange(block_q * heads_p, dtype=jnp.int32)
    token = w * block_q + jax.lax.div(row, heads_p)
    g = jax.lax.rem(row, heads_p)
    padding = (token < tokens) & (g < group) & (token_valid_ref[jnp.minimum(token, tokens - 1)] == 0)
    token = jnp.where(padding, token, tokens)  # masked rows out of range, as in _attend
    pltriton.store(o_ref.at[token[:, None], (h * group + g)[:, None], lanes],
                   jnp.zeros((row.shape[0], dim), o_ref.dtype), mask=padding[:, None])


def auto_splits(programs: int, table_keys: int) -> int:
    """Key splits per program: enough programs for the GPU, each split at least MIN_SPLIT_KEYS keys of the table."""
    return max(1, min(TARGET_PROGRAMS // programs, -(-table_keys // MIN_SPLIT_KEYS)))


def prefill_work(query_len: jax.Array, tokens: int, block_q: int) -> jax.Array:
    """[2, slots] int32 (request, first query) of every block_q-query tile of the requests of two or more tokens,
    request by request, each request's latest tile first; then (0, tokens) on the slots left (no query). slots =
    prefill_slots(tokens, R, block_q), a bound on the tiles T tokens hold."""
    requests = query_len.shape[0]
    tiles = jnp.where(query_len >= 2, -(-query_len // block_q), 0)  # [R]
    ends = jnp.cumsum(tiles)  # [R] the slot past each request's tiles
    slot = jnp.arange(prefill_slots(tokens, requests, block_q), dtype=jnp.int32)
    # searchsorted(ends, slot, "right") as one compare-and-sum fusion (the default binary search is a loop)
    request = jnp.sum(ends[None, :] <= slot[:, None], axis=1, dtype=jnp.int32)
    live = request < requests
    request = jnp.minimum(request, requests - 1)
    first = jnp.where(live, (ends[request] - 1 - slot) * block_q, tokens)
    return jnp.stack([jnp.where(live, request, 0), first]).astype(jnp.int32)


def prefill_slots(tokens: int, requests: int, block_q: int) -> int:
    """Work slots of the prefill launch: at least every tile of P requests of two or more tokens among T tokens,
    sum ceil(len / block_q) <= (T + P (block_q - 1)) / block_q with P <= min(R, T // 2); and at least T / block_q,
    so that the slots cover every token for the zero fill of padding tokens."""
    most = min(requests, tokens // 2)
    return max((tokens + most * (block_q - 1)) // block_q, -(-tokens // block_q))


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch, scale: float,
                    kv_head_start: jax.Array | int = 0, num_kv_heads: int | None = None,
                    max_query_len: int | None = None, *, block_m: int | None = None,
                    block_k: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, interpret: bool | None = None) -> jax.Array:
    """Same contract as the reference: q [T, heads, D], token t of request batch.token_request[t] at
    batch.positions[t] (batch: a qwen_jax.layers.batch.Ragged; positions, token_valid, query_start, query_len,
    context_len and block_table are read); k_cache, v_cache [num_blocks, block_size, kv_heads, D] -> [T, heads, D],
    padding tokens 0. q's heads split evenly over the cache's KV heads [kv_head_start, +num_kv_heads) (default: all).
    max_query_len: a static bound on every request's query_len that the caller guarantees (speculative verify rows:
    draft_len + 1), or None; with it every request takes the decode launch. Tiles: prefill about `block_m` rows
    (queries x query heads of one KV head), decode one request's queries; `block_k` keys a step. num_splits: decode
    key splits (None: from the grid size). num_warps, num_stages: both launches (None: each its own). None
    elsewhere: the best of qwen_jax/bench/kernels.py on an H200 at 35B-A3B shapes (decode 4 warps, 2 stages; prefill
    128 rows, 8 warps, 3 stages), with 64 keys a step (32 for float32 D = 256 tiles, whose pipeline buffers would not
    fit in shared memory). interpret=None interprets on CPU only. D, block_m and block_k must be
    powers of two, block_k at least 16 (Triton's smallest dot)."""
    tokens, heads, dim = q.shape
    num_blocks, block_size, cache_kv_heads, _ = k_cache.shape
    requests, width = batch.block_table.shape
    kv_heads = num_kv_heads or cache_kv_heads
    group = heads // kv_heads
    wide = q.dtype.itemsize > 2  # float32 tiles: twice the registers and shared memory
    block_m = block_m or 128
    block_k = block_k or max(16, min(64, 32768 // (dim * q.dtype.itemsize)))
    if heads % kv_heads or kv_heads > cache_kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[3] != dim \
            or block_k < 16 or dim & (dim - 1) or block_k & (block_k - 1) or block_m & (block_m - 1):
        raise ValueError(f"paged_attention: q {q.shape}, cache {k_cache.shape}, block_m {block_m}, block_k {block_k}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"

    def params(warps: int, stages: int):
        return None if interpret else pltriton.CompilerParams(num_warps=num_warps or warps,
                                                              num_stages=num_stages or stages)

    index = lambda x: jnp.asarray(x).astype(jnp.int32)
    query_len = index(batch.query_len)
    refs = (index(batch.query_start), query_len, index(batch.context_len), index(batch.block_table),
            index(batch.positions), jnp.asarray(kv_head_start, jnp.int32).reshape(1), q,
            k_cache.reshape(num_blocks * block_size, cache_kv_heads, dim),
            v_cache.reshape(num_blocks * block_size, cache_kv_heads, dim))
    table_keys = width * block_size
    tile = dict(scale_log2=scale * LOG2_E, block_size=block_size, group=group, block_k=block_k)

    heads_p = pl.next_power_of_2(group)  # a KV head's query heads, padded to a power of two
    block_q = min(max(block_m // heads_p, 1), pl.next_power_of_2(tokens))
    heads_p = max(heads_p, 16 // block_q)  # a tile has at least 16 rows
    slots = prefill_slots(tokens, requests, block_q)
    # Prefill first: its tiles and its zero fill of the padding tokens write every row but the one-token requests'
    # (no zeros pass over the output); the decode launch then writes those rows in place (aliased), or its merged
    # key splits are scattered in. No select over all T rows.
    if tokens == 1 or max_query_len is not None:  # no request for a prefill launch
        out = jnp.zeros(q.shape, q.dtype)
    else:
        out = pl.pallas_call(
            functools.partial(_prefill_kernel, block_q=block_q, heads_p=heads_p, split_keys=table_keys, **tile),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            grid=(slots, kv_heads),
            interpret=interpret,
            compiler_params=params(8, 2 if wide else 3),
            name="paged_attention_prefill",
        )(prefill_work(query_len, tokens, block_q), index(batch.token_valid), *refs)

    if num_splits is None:
        num_splits = auto_splits(kv_heads * requests, table_keys)
    split_keys = -(-table_keys // (num_splits * block_k)) * block_k
    decode_q = pl.next_power_of_2(max_query_len or 1)  # a decode program's queries (all of its request's)
    decode = functools.partial(pl.pallas_call, functools.partial(
        _decode_kernel, num_splits=num_splits, block_q=decode_q, bounded=max_query_len is not None,
        heads_p=max(pl.next_power_of_2(group), 16 // decode_q), split_keys=split_keys, **tile),
        grid=(num_splits, kv_heads, requests), interpret=interpret, compiler_params=params(4, 2),
        name="paged_attention_decode")
    if num_splits == 1:
        return decode(out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), input_output_aliases={len(refs): 0})(*refs, out)
    rows = requests * decode_q
    acc, m, denom = decode(out_shape=(jax.ShapeDtypeStruct((num_splits, rows, heads, dim), jnp.float32),
                                      jax.ShapeDtypeStruct((num_splits, rows, heads), jnp.float32),
                                      jax.ShapeDtypeStruct((num_splits, rows, heads), jnp.float32)))(*refs)
    weight = jnp.exp2(m - jnp.max(m, axis=0))  # merge the splits' partial softmaxes
    total = jnp.sum(weight * denom, axis=0)
    merged = jnp.sum(weight[..., None] * acc, axis=0) / jnp.where(total > 0.0, total, 1.0)[..., None]
    # row r * decode_q + i is query i of request r: its token, or dropped (past the request's queries, or a request
    # of the prefill launch)
    query = jnp.arange(decode_q, dtype=jnp.int32)[None, :]
    taken = (query_len[:, None] > query) & ((query_len[:, None] == 1) | (max_query_len is not None))
    token = jnp.where(taken, index(batch.query_start)[:, None] + query, tokens).reshape(rows)
    return out.at[token].set(merged.astype(q.dtype), mode="drop")
