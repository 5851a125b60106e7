"""Full causal attention over a paged KV cache: projections, q/k norm, partial RoPE, GQA, output gate.

Reference math: gathers each sequence's pages into a dense context; pallas_kernels/paged_attention.py is its kernel
(layers/hot_ops.py switches). Never writes outside the block tables.
"""

import jax
import jax.numpy as jnp

from qwen_jax.layers.batch import Ragged
from qwen_jax.layers.mlp import dense, linear
from qwen_jax.layers.norms import rms_norm
from qwen_jax.layers.rope import apply_rope


def _projections(x: jax.Array, p: dict, names: tuple[str, ...], dense_op=dense) -> tuple[jax.Array, ...]:
    """[T, H] x each [H, heads, D] of p[names] -> [T, heads, D], float32 accumulation plus the bias where p
    has one (`<name>_bias`), rounded to x's dtype. One `dense` call: one launch for the one-row kernel."""
    outs = dense_op(x, tuple(p[n] for n in names))
    return tuple((out if f"{n}_bias" not in p else out + p[f"{n}_bias"].astype(jnp.float32)).astype(x.dtype)
                 for n, out in zip(names, outs))


def write_kv(cache: jax.Array, new: jax.Array, batch: Ragged) -> jax.Array:
    """Scatter new keys or values [T, kv_heads, D] into cache [blocks, block_size, kv_heads, D] at their tokens'
    positions in their requests' pages. Padding tokens go to block 0, which the allocator never hands out."""
    block_size = cache.shape[1]
    tables = batch.block_table[batch.token_request]  # [T, W]
    page = jnp.take_along_axis(tables, (batch.positions // block_size)[:, None], axis=1)[:, 0]
    page = jnp.where(batch.token_valid, page, 0)
    offset = jnp.where(batch.token_valid, batch.positions % block_size, 0)
    return cache.at[page, offset].set(new.astype(cache.dtype))


# Tokens per slice of the reference's dense gather: its temporaries are this many tokens x the table's keys.
ATTENTION_BLOCK_T = 64


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: Ragged, scale: float,
                    kv_head_start: jax.Array | int = 0, num_kv_heads: int | None = None,
                    max_query_len: int | None = None) -> jax.Array:
    """q: [T, heads, D], token t of request batch.token_request[t] at batch.positions[t]; each query sees its
    request's keys 0..its own position (and below the request's context_len). Padding tokens give 0.
    q's heads are split evenly over the cache's KV heads [kv_head_start, +num_kv_heads) (default: all of them; a
    device holding some query heads of a replicated cache reads only its own). max_query_len: a bound on every
    request's query_len the caller guarantees (a kernel's launch choice; the result is the same without it).
    Scores rounded to q's dtype, softmax in float32, probabilities rounded to q's dtype before multiplying V
    (as HF eager does). Gathers each token's pages into a dense context, ATTENTION_BLOCK_T tokens at a time."""
    tokens, heads, dim = q.shape
    kv_heads = num_kv_heads or k_cache.shape[2]
    block = min(ATTENTION_BLOCK_T, tokens)
    pad = (-tokens) % block

    def padded(x):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))

    tables = batch.block_table[batch.token_request]  # [T, W]
    context = jnp.where(batch.token_valid, batch.context_len[batch.token_request], 0)
    chunks = [padded(x).reshape(-1, block, *x.shape[1:]) for x in (q, batch.positions, context, tables)]

    def attend(args):
        q, positions, context, tables = args  # [block, ...]
        k = jax.lax.dynamic_slice_in_dim(k_cache[tables], kv_head_start, kv_heads, axis=3)  # [block, W, bs, kv, D]
        v = jax.lax.dynamic_slice_in_dim(v_cache[tables], kv_head_start, kv_heads, axis=3)
        k = k.reshape(block, -1, kv_heads, dim)  # [block, keys, kv_heads, D]
        v = v.reshape(block, -1, kv_heads, dim)
        qg = q.reshape(block, kv_heads, heads // kv_heads, dim)
        scores = jnp.einsum("tngd,tknd->tngk", qg, k, preferred_element_type=jnp.float32)
        scores = scores.astype(q.dtype).astype(jnp.float32) * scale  # HF eager rounds q @ k^T to q's dtype
        key_pos = jnp.arange(k.shape[1])
        visible = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] < context[:, None])  # [block, keys]
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(visible[:, None, None], probs, 0.0).astype(q.dtype)  # padding tokens see nothing
        out = jnp.einsum("tngk,tknd->tngd", probs, v, preferred_element_type=jnp.float32)
        return out.reshape(block, heads, dim).astype(q.dtype)

    out = jax.lax.map(attend, tuple(chunks))
    return out.reshape(-1, heads, dim)[:tokens]


def attention_layer(x: jax.Array, p: dict, cache: dict, batch: Ragged, cfg, inv_freq: jax.Array,
                    attend=paged_attention, dense_op=dense, max_query_len: int | None = None
                    ) -> tuple[jax.Array, dict]:
    """x: [T, H] -> ([T, H], updated {"k", "v"} pages).
    `attend`, `dense_op`: paged_attention and the projections' dense, or kernels with their contracts (layers/hot_ops.py
    picks). max_query_len: a bound on every request's tokens, if the caller knows one (paged_attention's)."""
    q, k, v, *gate = _projections(x, p, ("q", "k", "v", "gate") if cfg.attn_output_gate else ("q", "k", "v"),
                                  dense_op)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    q = apply_rope(q, batch.positions, inv_freq, cfg.rope_interleaved)
    k = apply_rope(k, batch.positions, inv_freq, cfg.rope_interleaved)
    k_cache = write_kv(cache["k"], k, batch)
    v_cache = write_kv(cache["v"], v, batch)
    out = attend(q, k_cache, v_cache, batch, cfg.head_dim ** -0.5, max_query_len=max_query_len)
    if cfg.attn_output_gate:
        # sigmoid in float32 and rounded once, as torch does
        out = out * jax.nn.sigmoid(gate[0].astype(jnp.float32)).astype(out.dtype)
    out = dense_op(out, p["o"], 2)
    if "o_bias" in p:
        out = out + p["o_bias"].astype(jnp.float32)
    return out.astype(x.dtype), {"k": k_cache, "v": v_cache}


__all__ = ["attention_layer", "paged_attention", "write_kv", "linear"]
