"""Causal attention over the paged KV cache (decode and chunked prefill) as a flash-attention Pallas kernel, with the
jnp `reference` beside it. It only reads the cache: it must never write it, nor read a key past a row's context or
past the last query of its tile.

Same contract as the reference (qwen_jax.layers.attention.paged_attention), without its dense [B, T] gather or its
[B, kv, group, S, T] scores: one program takes `block_q` queries x the query heads of one KV head as the rows of its
tiles (decode: one query, the heads padded to 16 rows), walks that KV head's pages `block_k` keys at a time up to
min(context_len, its last query position + 1) and keeps a float32 running max, sum and accumulator (online softmax).
The cost follows the real context, not the block-table width. Blocks every row sees whole skip the causal mask; only
the last ones are masked. When (queries / block_q) x kv_heads x rows is too few programs to fill the GPU (decode at
small batch), the keys are also split over `num_splits` programs and one XLA fusion merges their partial softmaxes
(flash-decoding).

Numerics: float32 scores, softmax and accumulation; probabilities rounded to V's dtype for P @ V; the output rounded
to q's dtype. The reference rounds its scores to q's dtype first (as HF eager does), so bf16 results differ from it by
bf16 rounding. A query that sees no key (context_len 0) gives exactly 0, as there.

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

from qwen_jax.layers.attention import paged_attention as reference  # noqa: F401  (the jnp reference of this kernel)

MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite "minus infinity": no inf - inf = NaN in the updates
LOG2_E = math.log2(math.e)
TARGET_PROGRAMS = 264  # two per SM of an H100/H200 (132 SMs): below this, the keys are split
MIN_SPLIT_KEYS = 256  # a split covers at least this many keys of the table's width


def _kernel(context_lens_ref, tables_ref, positions_ref, kv_head_start_ref, q_ref, k_ref, v_ref, *out_refs,
            scale_log2: float, block_size: int, block_q: int, heads_p: int, group: int, block_k: int, num_splits: int,
            split_keys: int):
    """One program: queries [qb * block_q, +block_q) of sequence `b` x the query heads of KV head `h` (row i: query
    i // heads_p, head i % heads_p of the group), keys [split * split_keys, +split_keys) of what those rows see.
    KV head h of q's heads is the cache's head kv_head_start + h.
    Refs are whole arrays: context_lens [B]; tables [B, W] int32; positions [B, S]; kv_head_start [1];
    q [B, S, heads, D];
    k, v [num_blocks * block_size, kv, D] (the pages, flattened). Out: o [B, S, heads, D] in q's dtype, or with
    num_splits > 1 the unnormalised float32 partials acc [splits, B, S, heads, D], max and sum [splits, B, S, heads]
    (log2 domain)."""
    j, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, heads, dim = q_ref.shape[1:]
    kv_head = kv_head_start_ref[0] + h
    width = tables_ref.shape[1]
    num_q_blocks = -(-seq // block_q)
    if num_splits == 1:
        qb, split = j, 0
    else:
        qb, split = jax.lax.div(j, num_splits), jax.lax.rem(j, num_splits)
    qb = num_q_blocks - 1 - qb  # the longest (latest) query blocks first: less tail under the causal imbalance

    row = jnp.arange(block_q * heads_p, dtype=jnp.int32)
    query = qb * block_q + jax.lax.div(row, heads_p)  # [rows]
    g = jax.lax.rem(row, heads_p)
    real = (query < seq) & (g < group)  # padding rows: past the queries, or past the group
    head = jnp.where(g < group, h * group + g, heads)  # out of range on padding rows (masked, so never touched)
    pos = positions_ref[b, jnp.minimum(query, seq - 1)]  # [rows]; a padding row copies a real row's position
    lanes = jnp.arange(dim, dtype=jnp.int32)[None, :]  # [1, D]
    q_at = (b, query[:, None], head[:, None], lanes)
    q = pltriton.load(q_ref.at[q_at], mask=real[:, None], other=0.0)  # [rows, D]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # float32: no TF32

    start = split * split_keys
    end = jnp.minimum(jnp.minimum(context_lens_ref[b], jnp.max(pos) + 1), start + split_keys)
    full_end = jnp.minimum(end, jnp.min(pos) + 1)  # keys before this are seen by every row
    num_full = jax.lax.div(jnp.maximum(full_end - start, 0), block_k)
    num_steps = jax.lax.div(jnp.maximum(end - start, 0) + (block_k - 1), block_k)

    def step(i, carry, masked: bool):
        acc, m, denom = carry  # [rows, D], [rows], [rows] float32: running P @ V, max, sum
        key = start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k] key positions
        page = tables_ref[b, jnp.minimum(jax.lax.div(key, block_size), width - 1)]  # [block_k] page ids
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

    if num_splits == 1:
        o_ref, = out_refs
        out = (acc / jnp.where(denom > 0.0, denom, 1.0)[:, None]).astype(o_ref.dtype)
        pltriton.store(o_ref.at[q_at], out, mask=real[:, None])
    else:
        acc_ref, m_ref, denom_ref = out_refs
        pltriton.store(acc_ref.at[(split,) + q_at], acc, mask=real[:, None])
        pltriton.store(m_ref.at[split, b, query, head], m, mask=real)
        pltriton.store(denom_ref.at[split, b, query, head], denom, mask=real)


def auto_splits(programs: int, table_keys: int) -> int:
    """Key splits per program: enough programs for the GPU, each split at least MIN_SPLIT_KEYS keys of the table."""
    return max(1, min(TARGET_PROGRAMS // programs, -(-table_keys // MIN_SPLIT_KEYS)))


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                    context_lens: jax.Array, block_tables: jax.Array, scale: float,
                    kv_head_start: jax.Array | int = 0, num_kv_heads: int | None = None, *, block_m: int | None = None,
                    block_k: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, interpret: bool | None = None) -> jax.Array:
    """Same contract as `reference`: q [B, S, heads, D] at `positions` [B, S]; k_cache, v_cache
    [num_blocks, block_size, kv_heads, D]; context_lens [B]; block_tables [B, W] int32 -> [B, S, heads, D]; q's heads
    split evenly over the cache's KV heads [kv_head_start, +num_kv_heads) (default: all).
    Tiles: about `block_m` rows (queries x query heads of one KV head; decode takes one query) by `block_k` keys;
    num_splits: key splits (None: from the grid size). None elsewhere: the best of pallas_kernels/bench.py on an H200
    at 35B-A3B shapes (decode 4 warps, 2 stages; prefill 128 rows, 8 warps, 3 stages), with 64 keys a step (32 for
    float32 D = 256 tiles, whose pipeline buffers would not fit in shared memory). interpret=None interprets on CPU
    only. D, block_m and block_k must be powers of two, block_k at least 16 (Triton's smallest dot)."""
    batch, seq, heads, dim = q.shape
    num_blocks, block_size, cache_kv_heads, _ = k_cache.shape
    kv_heads = num_kv_heads or cache_kv_heads
    group = heads // kv_heads
    wide = q.dtype.itemsize > 2  # float32 tiles: twice the registers and shared memory
    block_m = block_m or 128
    block_k = block_k or max(16, min(64, 32768 // (dim * q.dtype.itemsize)))
    num_warps = num_warps or (4 if seq == 1 else 8)
    num_stages = num_stages or (2 if seq == 1 or wide else 3)
    if heads % kv_heads or kv_heads > cache_kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[3] != dim \
            or block_k < 16 or dim & (dim - 1) or block_k & (block_k - 1) or block_m & (block_m - 1):
        raise ValueError(f"paged_attention: q {q.shape}, cache {k_cache.shape}, block_m {block_m}, block_k {block_k}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"

    heads_p = pl.next_power_of_2(group)  # a KV head's query heads, padded to a power of two
    block_q = 1 if seq == 1 else min(max(block_m // heads_p, 1), pl.next_power_of_2(seq))
    heads_p = max(heads_p, 16 // block_q)  # a tile has at least 16 rows
    num_q_blocks = -(-seq // block_q)
    if num_splits is None:
        num_splits = auto_splits(num_q_blocks * kv_heads * batch, block_tables.shape[1] * block_size)
    split_keys = -(-block_tables.shape[1] * block_size // (num_splits * block_k)) * block_k

    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits,) + q.shape, jnp.float32),
                     jax.ShapeDtypeStruct((num_splits,) + q.shape[:3], jnp.float32),
                     jax.ShapeDtypeStruct((num_splits,) + q.shape[:3], jnp.float32))
    kernel = functools.partial(_kernel, scale_log2=scale * LOG2_E, block_size=block_size, block_q=block_q,
                               heads_p=heads_p, group=group, block_k=block_k, num_splits=num_splits,
                               split_keys=split_keys)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_q_blocks * num_splits, kv_heads, batch),
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="paged_attention",
    )(context_lens.astype(jnp.int32), block_tables.astype(jnp.int32), positions.astype(jnp.int32),
      jnp.asarray(kv_head_start, jnp.int32).reshape(1), q,
      k_cache.reshape(num_blocks * block_size, cache_kv_heads, dim),
      v_cache.reshape(num_blocks * block_size, cache_kv_heads, dim))
    if num_splits == 1:
        return out
    acc, m, denom = out  # merge the splits' partial softmaxes
    weight = jnp.exp2(m - jnp.max(m, axis=0))
    total = jnp.sum(weight * denom, axis=0)
    return (jnp.sum(weight[..., None] * acc, axis=0) / jnp.where(total > 0.0, total, 1.0)[..., None]).astype(q.dtype)
