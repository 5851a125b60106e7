"""The MoE grouped GEMM's sorted layout (above moe_gemm.FEW_TOKENS tokens) as native Triton kernels launched through
jax-triton (`jax_triton.triton_call`), on moe_gemm's plan (`moe_gemm.plan`: pairs sorted by expert, each expert's
group padded to whole blocks of block_m rows). moe_gemm.routed_experts picks these on a GPU with jax-triton (the
`cuda` extra); jax_triton is imported only when they launch, since it refuses to import without a GPU. On the CPU
the tests run the same kernels under Triton's interpreter (tests/kernels/test_moe_triton.py).

Why a second source for the sorted GEMMs: the Pallas-Triton version of the same blocks ran 1.13-1.74x slower on
an H200 (172 against 266 TFLOP/s at 4,096 tokens, 286 against 426 at 16,384; BENCH_H200.md). Besides Triton's own
code for the dot loop, each kernel here does what XLA did around the Pallas pair:
  1. gate_up gathers each row's token from x itself (no [rows, H] copy of x in HBM), then SwiGLU as moe_gemm;
  2. down multiplies by the routing weight with the reference's bf16 roundings and stores each row at its pair's
     row of out [T*k, H] (no gather of the sorted rows back);
and one XLA fusion sums a token's k rows in float32. Rounding is the reference's (moe_gemm's docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import moe_gemm


@triton.jit
def _row_block(pair_of_row_ptr, block_expert_ptr, pid_m, NUM_PAIRS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block pid_m of the plan: its expert, its rows, the pair each row holds and whether it holds one (padding
    rows hold NUM_PAIRS)."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_of_row_ptr + rows)
    return expert, rows, pair, pair < NUM_PAIRS


@triton.jit
def _gate_up_kernel(x_ptr, pair_of_row_ptr, block_expert_ptr, num_blocks_ptr, w_gate_ptr, w_up_ptr, h_ptr,
                    NUM_PAIRS: tl.constexpr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block m, column block n), flattened n-fastest: h[rows, cols] = SwiGLU(x[tokens] @ w_gate[e],
    x[tokens] @ w_up[e]). Blocks past the ones in use return at once (their rows are never read)."""
    pid = tl.program_id(0)
    pid_m = pid // (INTER // BLOCK_N)
    pid_n = pid % (INTER // BLOCK_N)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert, rows, pair, live = _row_block(pair_of_row_ptr, block_expert_ptr, pid_m, NUM_PAIRS, BLOCK_M)
    token = tl.where(live, pair // TOP_K, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptrs = x_ptr + token[:, None] * HIDDEN + ks[None, :]
    w_offsets = expert * (HIDDEN * INTER) + ks[:, None] * INTER + cols[None, :]
    gate_ptrs = w_gate_ptr + w_offsets
    up_ptrs = w_up_ptr + w_offsets
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
def _down_kernel(h_ptr, pair_of_row_ptr, block_expert_ptr, num_blocks_ptr, weights_ptr, w_down_ptr, out_ptr,
                 NUM_PAIRS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block m, column block n): out[pair] = round(round(h[rows] @ w_down[e]) * weight[pair]), stored
    at each live row's pair (padding rows store nothing)."""
    pid = tl.program_id(0)
    pid_m = pid // (HIDDEN // BLOCK_N)
    pid_n = pid % (HIDDEN // BLOCK_N)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert, rows, pair, live = _row_block(pair_of_row_ptr, block_expert_ptr, pid_m, NUM_PAIRS, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * INTER + ks[None, :]
    w_ptrs = w_down_ptr + expert * (INTER * HIDDEN) + ks[:, None] * HIDDEN + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, INTER // BLOCK_K):
        acc = tl.dot(tl.load(h_ptrs), tl.load(w_ptrs), acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * HIDDEN
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=live, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    pair = tl.where(live, pair, 0).to(tl.int64)
    tl.store(out_ptr + pair[:, None] * HIDDEN + cols[None, :], out, mask=live[:, None])


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, first_expert: jax.Array | int = 0, *, block_m: int = 128,
                   block_n: int = 128, block_k: int = 64, num_warps: int = 8, num_stages: int = 3,
                   down: tuple[int, int, int, int] | None = None, triton_call=None) -> jax.Array:
    """Same contract as moe_gemm.reference. (block_n, block_k, num_warps, num_stages) are gate_up's; `down` gives
    the down kernel's own, else it takes gate_up's. block_m is both kernels' (the plan's). triton_call: the
    launcher, jax_triton.triton_call unless given (the tests give one that runs Triton's interpreter on the CPU)."""
    num_tokens, top_k = ids.shape
    num_local, hidden, inter = w_gate.shape
    num_pairs = num_tokens * top_k
    down_n, down_k, down_warps, down_stages = down or (block_n, block_k, num_warps, num_stages)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"moe_triton: block_m {block_m} is not a power of two >= 16")
    # each tile: the largest power of two up to the one asked that divides its dimension
    block_n, block_k = moe_gemm._tile(inter, block_n), moe_gemm._tile(hidden, block_k)
    down_n, down_k = moe_gemm._tile(hidden, down_n), moe_gemm._tile(inter, down_k)
    if triton_call is None:
        import jax_triton  # here, not at the top: it refuses to import without a GPU

        triton_call = jax_triton.triton_call
    pair_of_row, row_of_pair, block_expert, num_blocks = moe_gemm.plan(ids, num_local, first_expert, block_m)
    num_blocks_max = block_expert.shape[0]
    h = triton_call(
        x, pair_of_row, block_expert, num_blocks, w_gate, w_up, kernel=_gate_up_kernel,
        out_shape=jax.ShapeDtypeStruct((num_blocks_max * block_m, inter), x.dtype),
        grid=(num_blocks_max * (inter // block_n),), num_warps=num_warps, num_stages=num_stages,
        name="moe_triton_gate_up", NUM_PAIRS=num_pairs, TOP_K=top_k, HIDDEN=hidden, INTER=inter,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    out = triton_call(
        h, pair_of_row, block_expert, num_blocks, weights.reshape(-1).astype(x.dtype), w_down, kernel=_down_kernel,
        out_shape=jax.ShapeDtypeStruct((num_pairs, hidden), x.dtype),
        grid=(num_blocks_max * (hidden // down_n),), num_warps=down_warps, num_stages=down_stages,
        name="moe_triton_down", NUM_PAIRS=num_pairs, HIDDEN=hidden, INTER=inter, BLOCK_M=block_m,
        BLOCK_N=down_n, BLOCK_K=down_k)
    # Rows of pairs routed to experts held elsewhere were never written.
    local = row_of_pair < num_blocks_max * block_m
    return jnp.where(local[:, None], out.astype(jnp.float32), 0.0).reshape(num_tokens, top_k, hidden).sum(axis=1)
