"""MoE grouped GEMM (routed experts) as Pallas kernels; the jnp reference they match is
qwen_jax.layers.mlp.routed_experts_f32 (ragged_dot). Two layouts:

Few tokens (decode, at most FEW_TOKENS): expert-major, no sort. One program per (expert, column block) reads the
  (token, expert) pairs itself, exits at once if its expert got none, and otherwise runs all the tokens through the
  expert's weights as one [tokens padded to 16+, H] tile, keeping only the routed rows. With fewer pairs than
  local experts (up to 31 tokens at 256 experts, top 8), the programs go per pair instead, each taking its pair's
  expert unless an earlier pair has it: at one token, 8 x 8 programs for gate_up instead of 256 x 8, nearly all
  of which would start only to exit. Still under 256 programs (one or two tokens), gate_up splits its contraction
  into slices whose float32 partial sums one XLA fusion adds before SwiGLU. The two kernels:
  1. gate_up: x @ w_gate[e], x @ w_up[e] and SwiGLU, each routed row stored at its pair's row of h [T*k, I];
  2. down:    h's rows of the expert's pairs @ w_down[e], times the routing weight, stored at the pair's row;
  and one XLA fusion sums a token's k rows in float32. Two launches and a sum: the sort, bincount and scatters of a
  plan cost more than the weight traffic at one token (8 experts, 50 MB). `few_token_moe` also runs a shared
  expert as wide as the routed ones, as one more program row of both launches over every token (rows T*k + t),
  instead of its own few-row GEMMs and their fusions.
Many tokens (prefill): the (token, expert) pairs are sorted by expert and each expert's group is padded to a
  multiple of `block_m` rows, so every block of rows belongs to one expert (the layout of vLLM's fused_moe), then
  the same two GEMMs run one program per (row block, column block), and XLA scales each pair by its routing weight
  and sums a token's k pairs in float32.
Both read only the experts that received tokens, where XLA's ragged_dot streams every expert's weights. On a GPU
with jax-triton, the sorted layout runs as the native Triton kernels of pallas_kernels/moe_triton.py instead (same
plan, faster at every sorted size); the Pallas sorted kernels serve the CPU and GPUs without jax-triton.

Pallas' Triton lowering (as pallas_kernels/gdn_decode.py): the same source runs on the CPU in interpret mode, so
CI tests the kernel itself, not only its reference. Rounding follows the reference: float32 accumulation, each
GEMM's result rounded to the model dtype, SiLU in float32 rounded once, bf16 products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tiling import split_contraction, tile_size, triton_available

# On a GPU the sorted layout runs as native Triton kernels (pallas_kernels/moe_triton.py), which beat this module's
# Pallas-Triton kernels on an H200 at every sorted size: 13% at 128-256 tokens, 1.5x at 4,096 (266 vs 172 TFLOP/s) and
# 16,384 (426 vs 286 TFLOP/s; qwen_jax/bench/kernels.py). The Pallas ones stay for the CPU (interpret mode, so CI runs
# the engine's kernels) and where jax-triton is missing. Tiles by pairs (token x expert), from the same sweeps:
# (max pairs, block_m, block_n, block_k, num_warps, num_stages, down's (block_n, block_k, num_warps, num_stages),
# tail_m: the tile height of a block with at most that many live rows, moe_triton's short blocks; None: off).
TRITON_TILES = [(2048, 16, 128, 64, 4, 3, (256, 64, 8, 3), None),  # memory-bound: a few rows per expert
                (8192, 64, 128, 64, 4, 3, (128, 64, 4, 3), None),
                (None, 128, 128, 64, 8, 4, (256, 64, 8, 4), 64)]  # compute-bound
PALLAS_SORTED_MAX_PAIRS = 2048  # up to here 16-row blocks, above it 128 x 128 tiles on 8 warps


FEW_TOKENS = 64  # up to this many tokens, the expert-major kernels (every program scans all pairs; tiles of T rows)
# The few-token kernels' tiles by tokens, from H200 sweeps of each kernel's GPU time (profiler) at 35B-A3B's expert
# shapes: (max tokens, block_n, block_k, num_warps, num_stages, split_k (None: split_contraction), down's (block_n,
# block_k, num_warps, num_stages) or None: gate_up's).
FEW_TOKEN_TILES = [(1, 64, 64, 4, 4, None, None),
                   (4, 128, 64, 8, 4, 1, (128, 64, 2, 3)),  # a verify row's 2-4 tokens: 3 tokens 41.8 vs 44.6 us
                   (FEW_TOKENS, 64, 64, 4, 4, None, None)]


def few_token_tiles(num_tokens: int) -> dict:
    """few_token_experts' (and few_token_moe's) tiles at this many tokens (FEW_TOKEN_TILES; past FEW_TOKENS, where
    a caller forces the few-token layout, its last row's)."""
    _, bn, bk, warps, stages, split_k, down = next(t for t in FEW_TOKEN_TILES
                                                   if min(num_tokens, FEW_TOKENS) <= t[0])
    return dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split_k, down=down)


def default_tiles(num_tokens: int, num_pairs: int, native: bool = False) -> dict:
    """Layout and tiles by size, from the H200 sweeps of qwen_jax/bench/kernels.py: the expert-major
    Pallas kernels up to FEW_TOKENS tokens; above, the sorted layout, as native Triton kernels when `native`."""
    if num_tokens <= FEW_TOKENS:
        return dict(few_tokens=True, triton=False, block_m=None, tail_m=None, **few_token_tiles(num_tokens))
    if native:
        _, bm, bn, bk, warps, stages, down, tail = next(t for t in TRITON_TILES if t[0] is None or num_pairs <= t[0])
        return dict(few_tokens=False, triton=True, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                    num_stages=stages, down=down, tail_m=tail)
    if num_pairs <= PALLAS_SORTED_MAX_PAIRS:
        return dict(few_tokens=False, triton=False, block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3,
                    down=None, tail_m=None)
    return dict(few_tokens=False, triton=False, block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                down=None, tail_m=None)


def resolve_tiles(num_tokens: int, num_pairs: int, native: bool = False, **given) -> dict:
    """default_tiles with the given (not None) values put in; forcing a layout (few_tokens, triton) takes that
    layout's defaults at this size. `native`: whether the native Triton kernels may run (triton_available())."""
    if given.get("triton") and not native:
        raise ValueError("moe_gemm: triton=True needs a GPU and jax-triton (the cuda extra)")
    tokens = num_tokens
    if given.get("few_tokens") is not None:
        tokens = min(num_tokens, FEW_TOKENS) if given["few_tokens"] else max(num_tokens, FEW_TOKENS + 1)
    if given.get("triton"):
        tokens = max(num_tokens, FEW_TOKENS + 1)
    tiles = default_tiles(tokens, num_pairs, native and given.get("triton") is not False)
    return tiles | {k: v for k, v in given.items() if v is not None}


def plan(ids: jax.Array, num_local: int, first_expert: jax.Array | int, block_m: int
         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sort the pairs of ids [T, k] by (local) expert into padded groups of whole blocks.

    Returns (pair_of_row [P]: the flat pair index held by each row, T*k on padding rows;
             row_of_pair [T*k]: where each pair sits, P for pairs of experts held elsewhere;
             block_expert [NB]: each block's expert; num_blocks [1]: how many blocks are in use).
    NB covers the worst case: one partial block per non-empty expert plus the full ones."""
    num_pairs = ids.size
    num_blocks_max = -(-num_pairs // block_m) + min(num_local, num_pairs)
    rows = num_blocks_max * block_m
    expert = ids.reshape(-1) - first_expert
    local = (expert >= 0) & (expert < num_local)
    expert = jnp.where(local, expert, num_local)  # sorts after every local group
    counts = jnp.bincount(expert, length=num_local + 1)[:num_local]
    padded = -(-counts // block_m) * block_m
    padded_end = jnp.cumsum(padded)
    group_start = padded_end - padded
    order = jnp.argsort(expert, stable=True)
    sorted_expert = expert[order]
    first_of_expert = jnp.cumsum(counts) - counts  # unpadded start of each group in `order`
    safe = jnp.minimum(sorted_expert, num_local - 1)
    row = group_start[safe] + jnp.arange(num_pairs) - first_of_expert[safe]
    row = jnp.where(sorted_expert < num_local, row, rows)
    row_of_pair = jnp.zeros(num_pairs, jnp.int32).at[order].set(row.astype(jnp.int32))
    pair_of_row = jnp.full(rows, num_pairs, jnp.int32).at[row].set(order.astype(jnp.int32), mode="drop")
    block_start = jnp.arange(num_blocks_max) * block_m
    # The group holding each block: how many groups end at or before its start (searchsorted's answer, written
    # out because jnp.searchsorted fails inside shard_map on jax 0.10).
    ends_before = jnp.sum(padded_end[None, :] <= block_start[:, None], axis=1)
    block_expert = jnp.minimum(ends_before, num_local - 1)
    num_blocks = (padded_end[-1] // block_m).reshape(1)
    return pair_of_row, row_of_pair, block_expert.astype(jnp.int32), num_blocks.astype(jnp.int32)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)  # tensor cores, float32 accumulation


def _silu_f32(x):
    return x / (1.0 + jnp.exp(-x))


def _expert_block_kernel(block_expert_ref, num_blocks_ref, rows_ref, *refs, epilogue, block_m: int, block_n: int,
                         block_k: int):
    """One program: row block `b` (all one expert's rows) times column block `n` of each weight in `refs` (all but
    the last, the output), float32 accumulation over the contraction in steps of block_k; `epilogue` turns the
    accumulators into the output tile. Blocks past the ones in use are skipped (their rows are never read)."""
    *w_refs, out_ref = refs
    b, n = pl.program_id(0), pl.program_id(1)

    @pl.when(b < num_blocks_ref[0])
    def _():
        e = block_expert_ref[b]
        m_rows = pl.ds(pl.multiple_of(b * block_m, block_m), block_m)
        cols = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)

        def body(i, accs):
            ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            x = rows_ref[m_rows, ks]
            return tuple(acc + _dot(x, w_ref[e, ks, cols]) for acc, w_ref in zip(accs, w_refs, strict=True))

        zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in w_refs)
        accs = jax.lax.fori_loop(0, rows_ref.shape[1] // block_k, body, zeros)
        out_ref[m_rows, cols] = epilogue(*accs, dtype=out_ref.dtype)


def _swiglu(gate, up, *, dtype):
    """Each GEMM rounded to the model dtype, SiLU in float32 rounded once, then the rounded product."""
    gate = _silu_f32(gate.astype(dtype).astype(jnp.float32)).astype(dtype)
    return (gate.astype(jnp.float32) * up.astype(dtype).astype(jnp.float32)).astype(dtype)


def _rounded(acc, *, dtype):
    return acc.astype(dtype)


# ---- few tokens: expert-major, no sort ---------------------------------------------------------------------------


def _program_expert(first_expert_ref, ids_ref, num_local: int, by_pair: bool, p):
    """(local expert index, whether it has work) of program p (program_id 0). By expert: program e takes local
    expert e (work: decided by its routed rows). By pair (fewer pairs than local experts, so the grid covers only
    routed experts instead of every expert, most of whose programs would start only to find no pair): program p
    takes the expert of flat pair p = t * k + j, and works only if that expert is local and no earlier pair chose
    it."""
    if not by_pair:
        return p, True
    num_tokens, top_k = ids_ref.shape
    flat = jnp.arange(pl.next_power_of_2(num_tokens * top_k), dtype=jnp.int32)
    earlier = flat < p
    ids = pltriton.load(ids_ref.at[jnp.where(earlier, flat // top_k, 0), jnp.where(earlier, flat % top_k, 0)],
                        mask=earlier, other=-1)
    mine = ids_ref[jax.lax.div(p, top_k), jax.lax.rem(p, top_k)]
    local = mine - first_expert_ref[0]
    first_time = jnp.max(jnp.where(ids == mine, 1, 0)) == 0
    return jnp.clip(local, 0, num_local - 1), first_time & (local >= 0) & (local < num_local)


def _pairs_of_expert(first_expert_ref, ids_ref, weights_ref, rows: int, local_expert):
    """The pairs routed to local expert `local_expert` (offset by first_expert): per token row of the tile
    (rows >= T), whether it chose the expert, the flat index t * k + j of that pair, and its routing weight
    (float32; a token picks an expert at most once, so the masked sum is exact)."""
    num_tokens, top_k = ids_ref.shape
    expert = first_expert_ref[0] + local_expert
    token = jnp.arange(rows, dtype=jnp.int32)
    slot = jnp.arange(pl.next_power_of_2(top_k), dtype=jnp.int32)
    at = (jnp.minimum(token, num_tokens - 1)[:, None], jnp.minimum(slot, top_k - 1)[None, :])
    valid = (token[:, None] < num_tokens) & (slot[None, :] < top_k)
    hit = (pltriton.load(ids_ref.at[at], mask=valid, other=-1) == expert) & valid
    routed = jnp.max(hit.astype(jnp.int32), axis=1) > 0
    pair = token * top_k + jnp.sum(jnp.where(hit, slot[None, :], 0), axis=1)
    weight = jnp.sum(jnp.where(hit, weights_ref[at].astype(jnp.float32), 0.0), axis=1)
    return routed, pair, weight


def _shared_rows(num_tokens: int, top_k: int, rows: int):
    """The shared expert's rows of the tile: every token routed to it, at rows T*k + t of h and out."""
    token = jnp.arange(rows, dtype=jnp.int32)
    return token < num_tokens, num_tokens * top_k + token


def _few_gate_up_tile(x_ref, gate_at, up_at, out_refs, routed, pair, n, s, *, rows: int, block_n: int,
                      block_k: int, split_k: int):
    """SwiGLU(x @ w_gate, x @ w_up) for column block n (contraction slice s), every token a row; the routed rows go
    to their pairs' rows of h. gate_at / up_at (ks, cols): the weight's tile."""
    num_tokens = x_ref.shape[0]
    steps = x_ref.shape[1] // block_k // split_k
    token = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), num_tokens - 1)[:, None]  # padding rows repeat
    cols = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)

    def body(i, accs):
        k0 = pl.multiple_of((s * steps + i) * block_k, block_k)
        x = x_ref[token, k0 + jnp.arange(block_k, dtype=jnp.int32)[None, :]]
        ks = pl.ds(k0, block_k)
        return accs[0] + _dot(x, gate_at(ks, cols)), accs[1] + _dot(x, up_at(ks, cols))

    zeros = jnp.zeros((rows, block_n), jnp.float32)
    gate, up = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
    col = n * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
    if split_k == 1:
        (h_ref,) = out_refs
        pltriton.store(h_ref.at[pair[:, None], col], _swiglu(gate, up, dtype=h_ref.dtype), mask=routed[:, None])
    else:
        for part_ref, acc in zip(out_refs, (gate, up), strict=True):
            pltriton.store(part_ref.at[s, pair[:, None], col], acc, mask=routed[:, None])


def _few_gate_up_kernel(first_expert_ref, ids_ref, weights_ref, x_ref, w_gate_ref, w_up_ref, *refs, rows: int,
                        block_n: int, block_k: int, by_pair: bool, split_k: int, shared: bool):
    """Program (e, n, s): SwiGLU(x @ w_gate[e], x @ w_up[e]) for columns block n, every token a row; the rows of
    tokens routed to e go to their pairs' rows of h [T*k, I]. Experts without pairs read nothing. With split_k > 1,
    program s runs the s-th slice of the contraction and stores float32 gate and up partial sums at [s, pair]
    instead ([split_k, T*k, I] each), which one XLA fusion adds up and passes through SwiGLU. With `shared`, the
    last program row runs the shared expert (refs: its gate and up weights first) for every token, at h rows
    T*k + t."""
    if shared:
        shared_gate_ref, shared_up_ref, *out_refs = refs
    else:
        out_refs = refs
    # program ids are read here, outside the branches (interpret mode substitutes them only at the top level)
    p, n, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile = functools.partial(_few_gate_up_tile, x_ref, out_refs=out_refs, n=n, s=s, rows=rows, block_n=block_n,
                             block_k=block_k, split_k=split_k)
    routed_programs = pl.num_programs(0) - 1 if shared else pl.num_programs(0)

    @pl.when(p < routed_programs)
    def _():
        e, active = _program_expert(first_expert_ref, ids_ref, w_gate_ref.shape[0], by_pair, p)
        routed, pair, _ = _pairs_of_expert(first_expert_ref, ids_ref, weights_ref, rows, e)
        pl.when(active & (jnp.max(routed.astype(jnp.int32)) > 0))(lambda: tile(
            lambda ks, cols: w_gate_ref[e, ks, cols], lambda ks, cols: w_up_ref[e, ks, cols], routed=routed,
            pair=pair))

    if shared:
        routed, pair = _shared_rows(*ids_ref.shape, rows)
        pl.when(p == routed_programs)(lambda: tile(
            lambda ks, cols: shared_gate_ref[ks, cols], lambda ks, cols: shared_up_ref[ks, cols], routed=routed,
            pair=pair))


def _few_down_tile(h_ref, down_at, out_ref, routed, pair, weight, n, *, rows: int, block_n: int, block_k: int):
    """For the routed rows: (h row @ w_down) rounded, times the weight, rounded, stored at the pair's row of out
    (columns block n). down_at (ks, cols): the weight's tile."""
    cols = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)

    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        h = pltriton.load(h_ref.at[pair[:, None], k0 + jnp.arange(block_k, dtype=jnp.int32)[None, :]],
                          mask=routed[:, None], other=0.0)
        return acc + _dot(h, down_at(pl.ds(k0, block_k), cols))

    acc = jax.lax.fori_loop(0, h_ref.shape[1] // block_k, body, jnp.zeros((rows, block_n), jnp.float32))
    dtype = out_ref.dtype
    out = (acc.astype(dtype).astype(jnp.float32) * weight.astype(dtype).astype(jnp.float32)[:, None]).astype(dtype)
    col = n * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
    pltriton.store(out_ref.at[pair[:, None], col], out, mask=routed[:, None])


def _few_down_kernel(first_expert_ref, ids_ref, weights_ref, h_ref, w_down_ref, *refs, rows: int, block_n: int,
                     block_k: int, by_pair: bool, shared: bool):
    """Program (e, n): for the pairs routed to e, (h row @ w_down[e]) rounded, times the routing weight, rounded,
    stored at the pair's row of out [T*k, H] (columns block n). With `shared`, the last program row runs the shared
    expert (refs: its down weight and its per-token scale [T] first) on h rows T*k + t, stored at the same rows."""
    if shared:
        shared_down_ref, shared_scale_ref, out_ref = refs
    else:
        (out_ref,) = refs
    p, n = pl.program_id(0), pl.program_id(1)  # outside the branches, as in the gate_up kernel
    tile = functools.partial(_few_down_tile, h_ref, out_ref=out_ref, n=n, rows=rows, block_n=block_n,
                             block_k=block_k)
    routed_programs = pl.num_programs(0) - 1 if shared else pl.num_programs(0)

    @pl.when(p < routed_programs)
    def _():
        e, active = _program_expert(first_expert_ref, ids_ref, w_down_ref.shape[0], by_pair, p)
        routed, pair, weight = _pairs_of_expert(first_expert_ref, ids_ref, weights_ref, rows, e)
        pl.when(active & (jnp.max(routed.astype(jnp.int32)) > 0))(lambda: tile(
            lambda ks, cols: w_down_ref[e, ks, cols], routed=routed, pair=pair, weight=weight))

    if shared:
        num_tokens, top_k = ids_ref.shape
        routed, pair = _shared_rows(num_tokens, top_k, rows)
        token = jnp.arange(rows, dtype=jnp.int32)
        scale = pltriton.load(shared_scale_ref.at[jnp.minimum(token, num_tokens - 1)], mask=routed, other=0.0)
        pl.when(p == routed_programs)(lambda: tile(
            lambda ks, cols: shared_down_ref[ks, cols], routed=routed, pair=pair, weight=scale))


def few_token_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                      w_down: jax.Array, first_expert: jax.Array | int = 0, *, block_n: int | None = None,
                      block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                      split_k: int | None = None, down: tuple[int, int, int, int] | None = None,
                      interpret: bool | None = None) -> jax.Array:
    """`routed_experts` for a few tokens: the expert-major kernels above (same contract, no sort). (block_n,
    block_k, num_warps, num_stages) are gate_up's; `down` gives the down kernel's own, else it takes gate_up's.
    split_k: slices of gate_up's contraction (split_contraction where the tiles leave it None). None tiles:
    few_token_tiles at this many tokens."""
    tiles = dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages, split_k=split_k,
                 down=down)
    out = _few_token_pairs(x, weights, ids, w_gate, w_up, w_down, first_expert, None, tiles, interpret)
    return _routed_sum(out, ids, first_expert, w_gate.shape[0])


def few_token_moe(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                  w_down: jax.Array, shared: tuple[jax.Array, jax.Array, jax.Array], shared_scale: jax.Array, *,
                  block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, split_k: int | None = None,
                  down: tuple[int, int, int, int] | None = None, interpret: bool | None = None) -> jax.Array:
    """A MoE block's experts for a few tokens, the shared expert run as one more program row of the same two
    launches: routed_experts(...) rounded to x's dtype + shared_scale [T] * shared expert(x), each product rounded
    as the reference (qwen_jax.layers.mlp.sparse_moe) rounds it -> [T, H] in x's dtype. shared: the shared
    expert's (gate [H, I], up [H, I], down [I, H]), I the routed experts' width. Why: the shared expert's own
    few-row GEMMs and their fusions took ~6 us a layer for its 6 MB; here it adds its bytes' time (a k = 2 verify
    round at one row, 41 such layers: 0.26 ms less GPU time on an H200). All experts are local (first expert 0).
    Tiles as few_token_experts."""
    tiles = dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages, split_k=split_k,
                 down=down)
    out = _few_token_pairs(x, weights, ids, w_gate, w_up, w_down, 0, (*shared, shared_scale), tiles, interpret)
    pairs = ids.size
    return _routed_sum(out[:pairs], ids, 0, w_gate.shape[0]).astype(x.dtype) + out[pairs:]


def _routed_sum(out: jax.Array, ids: jax.Array, first_expert, num_local: int) -> jax.Array:
    """Each token's k pair rows [T*k, H] added in float32 -> [T, H]; rows of pairs routed to experts held
    elsewhere were never written and add nothing."""
    num_tokens, top_k = ids.shape
    expert = ids.reshape(-1) - first_expert
    local = (expert >= 0) & (expert < num_local)
    return jnp.where(local[:, None], out.astype(jnp.float32), 0.0).reshape(num_tokens, top_k, -1).sum(axis=1)


def _few_token_pairs(x, weights, ids, w_gate, w_up, w_down, first_expert, shared, given: dict, interpret
                     ) -> jax.Array:
    """The two few-token launches -> out [T*k (+ T with `shared`: (gate, up, down, scale)), H] in x's dtype: each
    pair's (and each token's shared) expert output times its weight, at its row; rows of pairs routed elsewhere
    unwritten. `given` tiles that are None take few_token_tiles'."""
    num_tokens, top_k = ids.shape
    tiles = few_token_tiles(num_tokens) | {k: v for k, v in given.items() if v is not None}
    block_n, block_k, num_warps, num_stages = (tiles[k] for k in ("block_n", "block_k", "num_warps", "num_stages"))
    split_k, down = tiles["split_k"], tiles["down"]
    num_local, hidden, inter = w_gate.shape
    rows = max(16, pl.next_power_of_2(num_tokens))  # a dot tile has at least 16 rows
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if shared is not None and (shared[0].shape != (hidden, inter) or shared[1].shape != (hidden, inter)
                               or shared[2].shape != (inter, hidden) or shared[3].shape != (num_tokens,)):
        raise ValueError(f"moe_gemm: the shared expert {[a.shape for a in shared]} is not [H, I], [H, I], [I, H] "
                         f"and scale [T] with the routed experts' H {hidden}, I {inter}, T {num_tokens}")
    routing = (jnp.asarray(first_expert, jnp.int32).reshape(1), ids.astype(jnp.int32), weights)
    pairs = num_tokens * top_k
    out_rows = pairs + (num_tokens if shared is not None else 0)
    extra = 1 if shared is not None else 0  # the shared expert's program row

    by_pair = pairs < num_local  # a program per pair (its expert's first) rather than one per local expert
    programs = pairs if by_pair else num_local
    bn, bk = tile_size(inter, block_n), tile_size(hidden, block_k)
    split_k = split_contraction((programs + extra) * (inter // bn), hidden // bk, split_k)
    h_shapes = (jax.ShapeDtypeStruct((out_rows, inter), x.dtype),) if split_k == 1 else \
        (jax.ShapeDtypeStruct((split_k, out_rows, inter), jnp.float32),) * 2  # gate, up partial sums
    gate_up = _call(functools.partial(_few_gate_up_kernel, rows=rows, block_n=bn, block_k=bk, by_pair=by_pair,
                                      split_k=split_k, shared=shared is not None),
                    h_shapes, (programs + extra, inter // bn, split_k), interpret, num_warps, num_stages,
                    "moe_few_gate_up")
    h = gate_up(*routing, x, w_gate, w_up, *(shared[:2] if shared is not None else ()))
    # Rows of pairs not routed here hold garbage; the down kernel never reads them.
    h = h[0] if split_k == 1 else _swiglu(h[0].sum(axis=0), h[1].sum(axis=0), dtype=x.dtype)

    down_n, down_k, down_warps, down_stages = down or (block_n, block_k, num_warps, num_stages)
    bn, bk = tile_size(hidden, down_n), tile_size(inter, down_k)
    down_call = _call(functools.partial(_few_down_kernel, rows=rows, block_n=bn, block_k=bk, by_pair=by_pair,
                                        shared=shared is not None),
                      jax.ShapeDtypeStruct((out_rows, hidden), x.dtype), (programs + extra, hidden // bn),
                      interpret, down_warps, down_stages, "moe_few_down")
    return down_call(*routing, h, w_down, *((shared[2], shared[3].astype(x.dtype)) if shared is not None else ()))


def _call(kernel, out_shape, grid, interpret, num_warps, num_stages, name):
    compiler_params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret,
                          compiler_params=compiler_params, name=name)


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, first_expert: jax.Array | int = 0, *, few_tokens: bool | None = None,
                   triton: bool | None = None, block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   down: tuple[int, int, int, int] | None = None, tail_m: int | None = None,
                   split_k: int | None = None, interpret: bool | None = None) -> jax.Array:
    """Same contract as the reference (qwen_jax.layers.mlp.routed_experts_f32): x [T, H]; weights, ids [T, k];
    w_gate/w_up [E_local, H, I]; w_down [E_local, I, H] holding experts first_expert..; returns float32 [T, H]
    (pairs routed to experts held elsewhere add nothing). few_tokens: the expert-major kernels, else the sorted
    blocks of block_m rows; triton: the sorted blocks as native Triton kernels (GPU only; tail_m: their
    short-block tile height); `down`: the down kernel's own tiles (few-token or native Triton); split_k: the
    few-token gate_up's contraction slices; None here and in the tiles: `default_tiles`. interpret=None interprets
    on CPU only."""
    num_tokens, top_k = ids.shape
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    tiles = resolve_tiles(num_tokens, num_tokens * top_k, not interpret and triton_available(),
                          few_tokens=few_tokens, triton=triton, block_m=block_m, block_n=block_n, block_k=block_k,
                          num_warps=num_warps, num_stages=num_stages, down=down, tail_m=tail_m, split_k=split_k)
    if tiles.pop("few_tokens"):
        for key in ("block_m", "triton", "tail_m"):
            tiles.pop(key)
        return few_token_experts(x, weights, ids, w_gate, w_up, w_down, first_expert, interpret=interpret, **tiles)
    if tiles.pop("split_k", None) is not None:
        raise ValueError("moe_gemm: split_k applies to the few-token kernels only")
    if tiles.pop("triton"):
        from pallas_kernels import moe_triton  # GPU only

        return moe_triton.routed_experts(x, weights, ids, w_gate, w_up, w_down, first_expert, **tiles)
    if tiles.pop("tail_m") is not None:
        raise ValueError("moe_gemm: tail_m applies to the native Triton kernels only")
    if tiles.pop("down") is not None:
        raise ValueError("moe_gemm: down applies to the few-token and native Triton kernels only")
    block_m, block_n, block_k = tiles["block_m"], tiles["block_n"], tiles["block_k"]
    num_warps, num_stages = tiles["num_warps"], tiles["num_stages"]
    num_local, hidden, inter = w_gate.shape
    num_pairs = num_tokens * top_k
    pair_of_row, row_of_pair, block_expert, num_blocks = plan(ids, num_local, first_expert, block_m)
    num_blocks_max = block_expert.shape[0]
    rows = x[jnp.minimum(pair_of_row, num_pairs - 1) // top_k]  # padding rows copy a real row: finite, unused

    bn, bk = tile_size(inter, block_n), tile_size(hidden, block_k)
    gate_up = _call(functools.partial(_expert_block_kernel, epilogue=_swiglu, block_m=block_m, block_n=bn,
                                      block_k=bk),
                    jax.ShapeDtypeStruct((rows.shape[0], inter), x.dtype), (num_blocks_max, inter // bn),
                    interpret, num_warps, num_stages, "moe_gate_up")
    hidden_rows = gate_up(block_expert, num_blocks, rows, w_gate, w_up)

    bn, bk = tile_size(hidden, block_n), tile_size(inter, block_k)
    down = _call(functools.partial(_expert_block_kernel, epilogue=_rounded, block_m=block_m, block_n=bn,
                                   block_k=bk),
                 jax.ShapeDtypeStruct((rows.shape[0], hidden), x.dtype), (num_blocks_max, hidden // bn),
                 interpret, num_warps, num_stages, "moe_down")
    out_rows = down(block_expert, num_blocks, hidden_rows, w_down)

    # Rows of unused blocks are never written: read only the rows that hold a local pair.
    local = row_of_pair < rows.shape[0]
    per_pair = out_rows[jnp.where(local, row_of_pair, 0)] * weights.reshape(-1)[:, None]  # bf16 product
    per_pair = jnp.where(local[:, None], per_pair.astype(jnp.float32), 0.0)
    return per_pair.reshape(num_tokens, top_k, hidden).sum(axis=1)
