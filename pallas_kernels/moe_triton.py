"""The MoE grouped GEMM's sorted layout (above moe_gemm.FEW_TOKENS tokens) as native Triton kernels launched through
jax-triton (`jax_triton.triton_call`), on moe_gemm's plan (pairs sorted by expert, each expert's group padded to
whole blocks of block_m rows), which `plan` here forms as a counting sort in four small launches (18 us at 4,096
tokens on an H200, against 70 us for moe_gemm.plan's ~25 XLA kernels around a radix argsort; same result).
moe_gemm.routed_experts picks these on a GPU with jax-triton (the `cuda` extra); jax_triton is imported only when
they launch, since it refuses to import without a GPU. On the CPU the tests run the same kernels under Triton's
interpreter (tests/kernels/test_moe_triton.py); scripts/check_moe_triton_gpu.py runs them natively.

Why a second source for the sorted GEMMs: the Pallas-Triton version of the same blocks ran 1.13-1.74x slower on an H200
(172 against 266 TFLOP/s at 4,096 tokens, 286 against 426 at 16,384; qwen_jax/bench/kernels.py). Besides Triton's own
code for the dot loop, each kernel here does what XLA did around the Pallas pair:
  1. gate_up gathers each row's token from x itself (no [rows, H] copy of x in HBM), then SwiGLU as moe_gemm;
  2. down multiplies by the routing weight with the reference's bf16 roundings and stores each row at its pair's
     row of out [T*k, H] (no gather of the sorted rows back);
and one XLA fusion sums a token's k rows in float32. Rounding is the reference's (moe_gemm's docstring). A block
with few live rows (a group's last) can run a shorter tile (tail_m), bitwise the same result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.tiling import tile_size

# ---- the plan as a stable counting sort: moe_gemm.plan's result, from four small launches instead of ~25 XLA
# kernels around a radix argsort (70 us at 4,096 tokens on an H200)
PLAN_CHUNK = 256  # pairs a program of the histogram and place launches takes


@triton.jit
def _local_experts(ids_ptr, first_expert_ptr, pairs, NUM_PAIRS: tl.constexpr, NUM_LOCAL: tl.constexpr):
    """Each pair's local expert, -1 for pairs past the end and for experts held elsewhere."""
    inside = pairs < NUM_PAIRS
    expert = tl.load(ids_ptr + pairs, mask=inside, other=0) - tl.load(first_expert_ptr)
    return tl.where(inside & (expert >= 0) & (expert < NUM_LOCAL), expert, -1)


@triton.jit
def _histogram_kernel(ids_ptr, first_expert_ptr, hist_ptr, NUM_PAIRS: tl.constexpr, NUM_LOCAL: tl.constexpr,
                      EXPERTS: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """hist[chunk, e]: how many of the chunk's pairs expert e got (SUB pairs at a time: a [SUB, EXPERTS]
    comparison)."""
    experts = tl.arange(0, EXPERTS)
    hist = tl.zeros((EXPERTS,), tl.int32)
    for first in range(0, CHUNK, SUB):
        pairs = tl.program_id(0) * CHUNK + first + tl.arange(0, SUB)
        expert = _local_experts(ids_ptr, first_expert_ptr, pairs, NUM_PAIRS, NUM_LOCAL)
        hist += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + tl.program_id(0) * NUM_LOCAL + experts, hist, mask=experts < NUM_LOCAL)


@triton.jit
def _scan_kernel(hist_ptr, chunk_start_ptr, counts_ptr, NUM_CHUNKS: tl.constexpr, NUM_LOCAL: tl.constexpr,
                 ROWS: tl.constexpr, COLS: tl.constexpr):
    """For COLS experts: chunk_start[chunk, e] = pairs of e in the chunks before (exclusive prefix sum down the
    chunks), counts[e] = all of e's pairs."""
    experts = tl.program_id(0) * COLS + tl.arange(0, COLS)
    total = tl.zeros((COLS,), tl.int32)
    for first in range(0, NUM_CHUNKS, ROWS):
        chunks = first + tl.arange(0, ROWS)
        at = chunks[:, None] * NUM_LOCAL + experts[None, :]
        mask = (chunks < NUM_CHUNKS)[:, None] & (experts < NUM_LOCAL)[None, :]
        hist = tl.load(hist_ptr + at, mask=mask, other=0)
        tl.store(chunk_start_ptr + at, total[None, :] + tl.cumsum(hist, 0) - hist, mask=mask)
        total += tl.sum(hist, axis=0)
    tl.store(counts_ptr + experts, total, mask=experts < NUM_LOCAL)


@triton.jit
def _groups_kernel(counts_ptr, group_start_ptr, block_expert_ptr, num_blocks_ptr, pair_of_row_ptr,
                   NUM_PAIRS: tl.constexpr, NUM_LOCAL: tl.constexpr, NUM_BLOCKS_MAX: tl.constexpr,
                   BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr, GROUPS: tl.constexpr):
    """Each program forms every group's padded start from the counts (a 256-long cumsum), then writes the expert
    of BLOCKS row blocks and NUM_PAIRS into the padding rows of GROUPS groups; the first program also writes the
    group starts and how many blocks are in use. Rows past the blocks in use are left unwritten: no kernel reads
    them."""
    pid = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    counts = tl.load(counts_ptr + experts, mask=experts < NUM_LOCAL, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    group_start = padded_end - padded
    if pid == 0:
        tl.store(group_start_ptr + experts, group_start, mask=experts < NUM_LOCAL)
        tl.store(num_blocks_ptr, tl.sum(padded) // BLOCK_M)
    # the group holding each block: how many groups end at or before its start (as moe_gemm.plan)
    blocks = pid * BLOCKS + tl.arange(0, BLOCKS)
    ends_before = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + blocks, tl.minimum(ends_before, NUM_LOCAL - 1), mask=blocks < NUM_BLOCKS_MAX)
    # padding rows: group_start + count .. padded_end of this program's groups
    groups = pid * GROUPS + tl.arange(0, GROUPS)
    mine = groups[:, None] == experts[None, :]
    pad_start = tl.sum(tl.where(mine, group_start + counts, 0), axis=1)
    pad_end = tl.sum(tl.where(mine, padded_end, 0), axis=1)
    rows = pad_start[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(pair_of_row_ptr + rows, tl.full(rows.shape, NUM_PAIRS, tl.int32),
             mask=(groups < NUM_LOCAL)[:, None] & (rows < pad_end[:, None]))


@triton.jit
def _place_kernel(ids_ptr, first_expert_ptr, group_start_ptr, chunk_start_ptr, pair_of_row_in_ptr,
                  row_of_pair_ptr, pair_of_row_ptr, NUM_PAIRS: tl.constexpr, NUM_LOCAL: tl.constexpr,
                  NUM_ROWS: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Each pair's row: its group's start + the pairs of its expert in earlier chunks + those earlier in this
    chunk (so pairs keep their order within a group, as a stable sort). row_of_pair[pair] = row (NUM_ROWS for
    experts held elsewhere), pair_of_row[row] = pair (pair_of_row_in: the same buffer, padding written)."""
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    expert = _local_experts(ids_ptr, first_expert_ptr, pairs, NUM_PAIRS, NUM_LOCAL)
    local = expert >= 0
    earlier = tl.zeros((CHUNK,), tl.int32)
    for first in range(0, CHUNK, SUB):  # SUB earlier-candidates at a time: a [CHUNK, SUB] comparison
        other = tl.program_id(0) * CHUNK + first + tl.arange(0, SUB)
        # no range check here (it cost the launch 15%): only earlier pairs count, so none past the end, and an
        # expert held elsewhere never equals a local one (places of pairs held elsewhere are not used)
        other_expert = tl.load(ids_ptr + other, mask=other < NUM_PAIRS, other=0) - tl.load(first_expert_ptr)
        same = (other_expert[None, :] == expert[:, None]) & (other[None, :] < pairs[:, None])
        earlier += tl.sum(same.to(tl.int32), axis=1)
    at = tl.where(local, expert, 0)
    row = (tl.load(group_start_ptr + at, mask=local, other=0)
           + tl.load(chunk_start_ptr + tl.program_id(0) * NUM_LOCAL + at, mask=local, other=0) + earlier)
    tl.store(row_of_pair_ptr + pairs, tl.where(local, row, NUM_ROWS), mask=pairs < NUM_PAIRS)
    tl.store(pair_of_row_ptr + row, pairs, mask=local)


def plan(ids: jax.Array, num_local: int, first_expert: jax.Array | int, block_m: int, triton_call
         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """moe_gemm.plan as a stable counting sort in four launches: per-chunk histograms, their prefix sums down the
    chunks, the groups (padded starts, each block's expert, padding rows), each pair's place. Same result, except
    that pair_of_row is left unwritten past the blocks in use (moe_gemm.plan fills it with T*k)."""
    num_pairs = ids.size
    num_blocks_max = -(-num_pairs // block_m) + min(num_local, num_pairs)
    num_rows = num_blocks_max * block_m
    num_chunks = -(-num_pairs // PLAN_CHUNK)
    experts = max(16, triton.next_power_of_2(num_local))
    ids = ids.reshape(-1).astype(jnp.int32)
    first_expert = jnp.asarray(first_expert, jnp.int32).reshape(1)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    common = dict(num_warps=4, num_stages=1, NUM_LOCAL=num_local)
    sub = min(32, PLAN_CHUNK)  # pairs compared at a time in a chunk
    hist = triton_call(ids, first_expert, kernel=_histogram_kernel, out_shape=i32(num_chunks, num_local),
                       grid=(num_chunks,), name="moe_plan_histogram", NUM_PAIRS=num_pairs, EXPERTS=experts,
                       CHUNK=PLAN_CHUNK, SUB=sub, **common)
    chunk_start, counts = triton_call(
        hist, kernel=_scan_kernel, out_shape=(i32(num_chunks, num_local), i32(num_local)),
        grid=(-(-num_local // 16),), name="moe_plan_scan", NUM_CHUNKS=num_chunks, ROWS=128, COLS=16, **common)
    blocks, groups = 32, 8
    group_start, block_expert, num_blocks, pair_of_row = triton_call(
        counts, kernel=_groups_kernel, out_shape=(i32(num_local), i32(num_blocks_max), i32(1), i32(num_rows)),
        grid=(max(-(-num_blocks_max // blocks), -(-num_local // groups)),), name="moe_plan_groups",
        NUM_PAIRS=num_pairs, NUM_BLOCKS_MAX=num_blocks_max, BLOCK_M=block_m, EXPERTS=experts, BLOCKS=blocks,
        GROUPS=groups, **common)
    row_of_pair, pair_of_row = triton_call(
        ids, first_expert, group_start, chunk_start, pair_of_row, kernel=_place_kernel,
        out_shape=(i32(num_pairs), i32(num_rows)), grid=(num_chunks,), input_output_aliases={4: 1},
        name="moe_plan_place", NUM_PAIRS=num_pairs, NUM_ROWS=num_rows, CHUNK=PLAN_CHUNK, SUB=sub, **common)
    return pair_of_row, row_of_pair, block_expert, num_blocks


# ---- the grouped GEMMs -----------------------------------------------------------------------------------------
# A group's live rows come first, so its last block is often mostly padding (at 4,096 tokens an expert averages 128
# pairs: about half the experts spill a few rows into a second 128-row block). A block with at most TAIL_M live rows
# runs a TAIL_M-row tile instead: one code path per tile height in each kernel, picked per block at run time.
@triton.jit
def _block(pair_of_row_ptr, block_expert_ptr, pid_m, NUM_PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
           TAIL_M: tl.constexpr):
    """Row block pid_m of the plan: its expert, its first row, and whether its live rows fit a TAIL_M-row tile."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    first_row = pid_m * BLOCK_M
    short = False
    if TAIL_M < BLOCK_M:
        pair = tl.load(pair_of_row_ptr + first_row + tl.arange(0, BLOCK_M))
        short = tl.sum((pair < NUM_PAIRS).to(tl.int32)) <= TAIL_M
    return expert, first_row, short


@triton.jit
def _rows(pair_of_row_ptr, first_row, NUM_PAIRS: tl.constexpr, ROWS: tl.constexpr):
    """ROWS rows from first_row, the pair each holds and whether it holds one (padding rows hold NUM_PAIRS)."""
    rows = first_row + tl.arange(0, ROWS)
    pair = tl.load(pair_of_row_ptr + rows)
    return rows, pair, pair < NUM_PAIRS


@triton.jit
def _gate_up_tile(x_ptr, pair_of_row_ptr, w_gate_ptr, w_up_ptr, h_ptr, expert, first_row, pid_n,
                  NUM_PAIRS: tl.constexpr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, pair, live = _rows(pair_of_row_ptr, first_row, NUM_PAIRS, ROWS)
    token = tl.where(live, pair // TOP_K, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptrs = x_ptr + token[:, None] * HIDDEN + ks[None, :]
    w_offsets = expert * (HIDDEN * INTER) + ks[:, None] * INTER + cols[None, :]
    gate_ptrs = w_gate_ptr + w_offsets
    up_ptrs = w_up_ptr + w_offsets
    gate = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for _ in range(0, HIDDEN // BLOCK_K):
        x = tl.load(x_ptrs, mask=live[:, None], other=0.0)
        gate = tl.dot(x, tl.load(gate_ptrs), gate)
        up = tl.dot(x, tl.load(up_ptrs), up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * INTER
        up_ptrs += BLOCK_K * INTER
    dtype = h_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    gate = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = (gate * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * INTER + cols[None, :], h)


@triton.jit
def _gate_up_kernel(x_ptr, pair_of_row_ptr, block_expert_ptr, num_blocks_ptr, w_gate_ptr, w_up_ptr, h_ptr,
                    NUM_PAIRS: tl.constexpr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                    BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block m, column block n), flattened n-fastest: h[rows, cols] = SwiGLU(x[tokens] @ w_gate[e],
    x[tokens] @ w_up[e]). Blocks past the ones in use return at once (their rows are never read); a short block
    writes only its first TAIL_M rows (the down kernel reads no more of it)."""
    pid = tl.program_id(0)
    pid_m = pid // (INTER // BLOCK_N)
    pid_n = pid % (INTER // BLOCK_N)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert, first_row, short = _block(pair_of_row_ptr, block_expert_ptr, pid_m, NUM_PAIRS, BLOCK_M, TAIL_M)
    if short:
        _gate_up_tile(x_ptr, pair_of_row_ptr, w_gate_ptr, w_up_ptr, h_ptr, expert, first_row, pid_n, NUM_PAIRS,
                      TOP_K, HIDDEN, INTER, TAIL_M, BLOCK_N, BLOCK_K)
    else:
        _gate_up_tile(x_ptr, pair_of_row_ptr, w_gate_ptr, w_up_ptr, h_ptr, expert, first_row, pid_n, NUM_PAIRS,
                      TOP_K, HIDDEN, INTER, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _down_tile(h_ptr, pair_of_row_ptr, weights_ptr, w_down_ptr, out_ptr, expert, first_row, pid_n,
               NUM_PAIRS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, pair, live = _rows(pair_of_row_ptr, first_row, NUM_PAIRS, ROWS)
    ks = tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * INTER + ks[None, :]
    w_ptrs = w_down_ptr + expert * (INTER * HIDDEN) + ks[:, None] * HIDDEN + cols[None, :]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for _ in range(0, INTER // BLOCK_K):
        acc = tl.dot(tl.load(h_ptrs), tl.load(w_ptrs), acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * HIDDEN
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=live, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    pair = tl.where(live, pair, 0).to(tl.int64)
    tl.store(out_ptr + pair[:, None] * HIDDEN + cols[None, :], out, mask=live[:, None])


@triton.jit
def _down_kernel(h_ptr, pair_of_row_ptr, block_expert_ptr, num_blocks_ptr, weights_ptr, w_down_ptr, out_ptr,
                 NUM_PAIRS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                 TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block m, column block n): out[pair] = round(round(h[rows] @ w_down[e]) * weight[pair]), stored
    at each live row's pair (padding rows store nothing); short blocks as in the gate_up kernel."""
    pid = tl.program_id(0)
    pid_m = pid // (HIDDEN // BLOCK_N)
    pid_n = pid % (HIDDEN // BLOCK_N)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert, first_row, short = _block(pair_of_row_ptr, block_expert_ptr, pid_m, NUM_PAIRS, BLOCK_M, TAIL_M)
    if short:
        _down_tile(h_ptr, pair_of_row_ptr, weights_ptr, w_down_ptr, out_ptr, expert, first_row, pid_n, NUM_PAIRS,
                   HIDDEN, INTER, TAIL_M, BLOCK_N, BLOCK_K)
    else:
        _down_tile(h_ptr, pair_of_row_ptr, weights_ptr, w_down_ptr, out_ptr, expert, first_row, pid_n, NUM_PAIRS,
                   HIDDEN, INTER, BLOCK_M, BLOCK_N, BLOCK_K)


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, first_expert: jax.Array | int = 0, *, block_m: int = 128,
                   tail_m: int | None = None, block_n: int = 128, block_k: int = 64, num_warps: int = 8,
                   num_stages: int = 3, down: tuple[int, int, int, int] | None = None, triton_call=None
                   ) -> jax.Array:
    """Same contract as moe_gemm.routed_experts (qwen_jax.layers.mlp.routed_experts_f32). (block_n, block_k,
    num_warps, num_stages) are gate_up's; `down` gives the down kernel's own, else it takes gate_up's. block_m is
    both kernels' (the plan's); tail_m (< block_m, None: off) the height of the tile a block with at most that many
    live rows runs instead. triton_call: the launcher, jax_triton.triton_call unless given (the tests give one that
    runs Triton's interpreter on the CPU)."""
    num_tokens, top_k = ids.shape
    num_local, hidden, inter = w_gate.shape
    num_pairs = num_tokens * top_k
    down_n, down_k, down_warps, down_stages = down or (block_n, block_k, num_warps, num_stages)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"moe_triton: block_m {block_m} is not a power of two >= 16")
    tail_m = tail_m or block_m
    if tail_m < 16 or tail_m & (tail_m - 1) or tail_m > block_m:
        raise ValueError(f"moe_triton: tail_m {tail_m} is not a power of two in [16, block_m {block_m}]")
    # each tile: the largest power of two up to the one asked that divides its dimension
    block_n, block_k = tile_size(inter, block_n), tile_size(hidden, block_k)
    down_n, down_k = tile_size(hidden, down_n), tile_size(inter, down_k)
    if triton_call is None:
        import jax_triton  # here, not at the top: it refuses to import without a GPU

        triton_call = jax_triton.triton_call
    pair_of_row, row_of_pair, block_expert, num_blocks = plan(ids, num_local, first_expert, block_m, triton_call)
    num_blocks_max = block_expert.shape[0]
    h = triton_call(
        x, pair_of_row, block_expert, num_blocks, w_gate, w_up, kernel=_gate_up_kernel,
        out_shape=jax.ShapeDtypeStruct((num_blocks_max * block_m, inter), x.dtype),
        grid=(num_blocks_max * (inter // block_n),), num_warps=num_warps, num_stages=num_stages,
        name="moe_triton_gate_up", NUM_PAIRS=num_pairs, TOP_K=top_k, HIDDEN=hidden, INTER=inter,
        BLOCK_M=block_m, TAIL_M=tail_m, BLOCK_N=block_n, BLOCK_K=block_k)
    out = triton_call(
        h, pair_of_row, block_expert, num_blocks, weights.reshape(-1).astype(x.dtype), w_down, kernel=_down_kernel,
        out_shape=jax.ShapeDtypeStruct((num_pairs, hidden), x.dtype),
        grid=(num_blocks_max * (hidden // down_n),), num_warps=down_warps, num_stages=down_stages,
        name="moe_triton_down", NUM_PAIRS=num_pairs, HIDDEN=hidden, INTER=inter, BLOCK_M=block_m,
        TAIL_M=tail_m, BLOCK_N=down_n, BLOCK_K=down_k)
    # Rows of pairs routed to experts held elsewhere were never written.
    local = row_of_pair < num_blocks_max * block_m
    return jnp.where(local[:, None], out.astype(jnp.float32), 0.0).reshape(num_tokens, top_k, hidden).sum(axis=1)
