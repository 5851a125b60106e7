"""The Gated DeltaNet's depthwise causal conv + SiLU at prefill, q, k and v in one native Triton launch (through
jax-triton), with its jnp reference beside it (qwen_jax.layers.gated_deltanet.causal_conv, whose roundings it
repeats).

Why: at a 4,096-token prefill XLA ran the three convs as two loop fusions of 71 + 67 us a layer on an H200 (~1 TB/s;
BENCH_H200.md, seventeenth session), about 4 ms of the step over 30 layers: the largest part of it not yet a kernel.
One program takes BLOCK_T tokens x BLOCK_C channels of one row: tap i reads the inputs i - (K - 1) tokens back (a
shifted, contiguous tile: the K taps overlap in L1), from x or, before the row's first token, from the conv state
(the K - 1 inputs before x); the taps are added in float32 in the reference's order without fused multiply-adds,
rounded, then SiLU in float32 rounded once. The new state (the K - 1 inputs ending at each row's last real token) is
a gather of three rows, left to XLA. The channel blocks of q, k and v share one grid.

On an H200 (BENCH_H200.md, eighteenth session) it is bitwise the reference under the engine's exact-precision
compile and 1.7-1.8x faster than XLA's fusions: 68 against 123 us for one 4,096-token prompt, 980 against 1,705 us
for 64 x 1,024 (2.0-2.2 TB/s of its reads and writes); a 4,096-token prefill step's GPU time falls by 1.1-1.4 ms
(2%). A Pallas version of the same loop (gathered tiles) ran at 0.6-1.4 TB/s, no faster than XLA. On the CPU the
tests run this kernel under Triton's interpreter; the layers' `conv` op (qwen_jax/layers/ops.py) takes the reference
for one-token decode rows and wherever jax-triton cannot run.
"""

from __future__ import annotations

import math

import jax
import triton
import triton.language as tl

from qwen_jax.layers.gated_deltanet import causal_conv as reference  # noqa: F401  (the jnp reference of this kernel)
from qwen_jax.layers.gated_deltanet import causal_convs as reference_convs  # noqa: F401  (of causal_convs)
from qwen_jax.layers.gated_deltanet import conv_state


@triton.jit
def _conv_tile(x_ptr, state_ptr, w_ptr, out_ptr, row, pid_t, pid_c, SEQ: tl.constexpr, CHANNELS: tl.constexpr,
               KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    live_c = (c < CHANNELS)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(KERNEL):  # tap i of token t reads input t + i - (K - 1): x from 0 on, the state before
        src = t + i - (KERNEL - 1)
        from_x = tl.load(x_ptr + (row * SEQ + src)[:, None].to(tl.int64) * CHANNELS + c[None, :],
                         mask=((src >= 0) & (src < SEQ))[:, None] & live_c, other=0.0)
        from_state = tl.load(state_ptr + (row * (KERNEL - 1) + src + KERNEL - 1)[:, None].to(tl.int64) * CHANNELS
                             + c[None, :], mask=(src < 0)[:, None] & live_c, other=0.0)
        window = tl.where((src >= 0)[:, None], from_x, from_state).to(tl.float32)
        acc = acc + window * tl.load(w_ptr + i * CHANNELS + c, mask=c < CHANNELS, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    conv = acc.to(dtype).to(tl.float32)  # rounded, then SiLU in float32, rounded once
    out = (conv * (1.0 / (1.0 + tl.exp(-conv)))).to(dtype)
    tl.store(out_ptr + (row * SEQ + t)[:, None].to(tl.int64) * CHANNELS + c[None, :], out,
             mask=(t < SEQ)[:, None] & live_c)


@triton.jit
def _conv_kernel(x0_ptr, x1_ptr, x2_ptr, s0_ptr, s1_ptr, s2_ptr, w0_ptr, w1_ptr, w2_ptr, o0_ptr, o1_ptr, o2_ptr,
                 SEQ: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, KERNEL: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row, token block, channel block): channel blocks [0, B0) are input 0's, the next B1 input 1's, the
    rest input 2's (Bi = ceil(Ci / BLOCK_C))."""
    row, pid_t, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    B0: tl.constexpr = (C0 + BLOCK_C - 1) // BLOCK_C
    B1: tl.constexpr = (C1 + BLOCK_C - 1) // BLOCK_C
    if pid_c < B0:
        _conv_tile(x0_ptr, s0_ptr, w0_ptr, o0_ptr, row, pid_t, pid_c, SEQ, C0, KERNEL, BLOCK_T, BLOCK_C)
    elif pid_c < B0 + B1:
        _conv_tile(x1_ptr, s1_ptr, w1_ptr, o1_ptr, row, pid_t, pid_c - B0, SEQ, C1, KERNEL, BLOCK_T, BLOCK_C)
    else:
        _conv_tile(x2_ptr, s2_ptr, w2_ptr, o2_ptr, row, pid_t, pid_c - B0 - B1, SEQ, C2, KERNEL, BLOCK_T, BLOCK_C)


def causal_convs(xs: tuple[jax.Array, ...], states: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                 seq_lens: jax.Array, *, block_t: int = 64, block_c: int = 64, num_warps: int = 4,
                 triton_call=None) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """`reference` (x [B, S, C...], state [B, K-1, C...], weight [K, C...]) of each of up to three (x, state,
    weight), in one launch; returns ((out, new state), ...) as reference does. Tiles: 64 x 64 was the best or within
    3% of it among nine on an H200 at 1 x 4,096, 8 x 1,024 and 64 x 1,024 tokens. triton_call: the launcher,
    jax_triton.triton_call unless given (the tests give one that runs Triton's interpreter on the CPU)."""
    if not (len(xs) == len(states) == len(weights)) or not 1 <= len(xs) <= 3:
        raise ValueError(f"causal_convs: give one to three inputs with a state and a weight each, got {len(xs)} "
                         f"inputs, {len(states)} states, {len(weights)} weights")
    kernel = weights[0].shape[0]
    batch, seq = xs[0].shape[:2]
    flat_x, flat_state, flat_w = [], [], []
    for x, state, w in zip(xs, states, weights, strict=True):
        if x.shape[:2] != (batch, seq) or state.shape != (batch, kernel - 1, *x.shape[2:]) or \
                w.shape != (kernel, *x.shape[2:]):
            raise ValueError(f"causal_convs: x {x.shape}, state {state.shape}, weight {w.shape} do not match")
        channels = math.prod(x.shape[2:])
        flat_x.append(x.reshape(batch, seq, channels))
        flat_state.append(state.astype(x.dtype).reshape(batch, kernel - 1, channels))
        flat_w.append(w.reshape(kernel, channels))
    channels = [x.shape[2] for x in flat_x] + [0] * (3 - len(xs))  # a missing input: no channel blocks
    pad = lambda arrays: arrays + [arrays[0]] * (3 - len(arrays))  # noqa: E731  (never read)
    if triton_call is None:
        import jax_triton  # here, not at the top: it refuses to import without a GPU

        triton_call = jax_triton.triton_call
    outs = triton_call(
        *pad(flat_x), *pad(flat_state), *pad(flat_w), kernel=_conv_kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pad(flat_x)),
        grid=(batch, -(-seq // block_t), sum(-(-c // block_c) for c in channels)), num_warps=num_warps,
        num_stages=1, enable_fp_fusion=False, name="gdn_causal_conv", SEQ=seq, C0=channels[0], C1=channels[1],
        C2=channels[2], KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c)
    return tuple((out.reshape(x.shape), conv_state(x, state, seq_lens, kernel))
                 for out, x, state in zip(outs, xs, states))

