"""The Gated DeltaNet's depthwise causal conv + SiLU of q, k and v as native Triton launches (through jax-triton),
with its jnp references beside them (qwen_jax.layers.gated_deltanet.causal_conv, and causal_convs, the layers'
`conv` op on the state slots, whose roundings they repeat). Two kernels:

Prefill (`prefill_convs`): one program takes BLOCK_T tokens x BLOCK_C channels of one row: tap i reads the inputs
  i - (K - 1) tokens back (a shifted, contiguous tile: the K taps overlap in L1), from x or, before the row's first
  token, from the conv state (the K - 1 inputs before x); the taps are added in float32 in the reference's order
  without fused multiply-adds, rounded, then SiLU in float32 rounded once. The new state (the K - 1 inputs ending
  at each row's last real token) is a gather of three rows, left to XLA, as are the slots' gather and scatter.
  At a 4,096-token prefill XLA had run the three convs as two loop fusions of 71 + 67 us a layer (~1 TB/s).
Decode (`decode_convs`): one program per (row, channel block) convolves the row's one token with its slot's state
  rows and writes the shifted rows back in place: one launch where XLA ran 8-10 kernels (the slots' gathers, the
  convs, the scatters), 2-4 against 11-28 us of GPU time.

On an H200 (BENCH_H200.md, eighteenth session) both are bitwise the reference under the engine's exact-precision
compile. Prefill: 69 against 124 us for one 4,096-token prompt, 981 against 1,704 us for 64 x 1,024 (2.0-2.2 TB/s);
a 4,096-token prefill step's GPU time 62.5 -> 61.2-61.5 ms. Decode: a step's GPU time 3.50 -> 3.30 ms at B=1, 7.27
-> 6.95 at B=8, 21.43 -> 20.74 at B=64, and 150 fewer kernels a step. A Pallas version of the prefill loop
(gathered tiles) ran at 0.6-1.4 TB/s, no faster than XLA. On the CPU the tests run these kernels under Triton's
interpreter; the layers' `conv` op (qwen_jax/layers/ops.py) takes the reference wherever jax-triton cannot run.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from qwen_jax.layers.gated_deltanet import causal_conv as reference  # noqa: F401  (the jnp reference of this kernel)
from qwen_jax.layers.gated_deltanet import causal_convs as reference_convs  # noqa: F401  (the conv op's)
from qwen_jax.layers.gated_deltanet import conv_state, slot_states


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


def _three(arrays: list) -> list:
    """Pad a list of one to three per-input arrays to three: a missing input has no channel blocks, so its stand-in
    (the first input's array) is never read."""
    return arrays + [arrays[0]] * (3 - len(arrays))


def _check_counts(xs: tuple, others: tuple, weights: tuple, others_name: str) -> None:
    if not (len(xs) == len(others) == len(weights)) or not 1 <= len(xs) <= 3:
        raise ValueError(f"causal_conv: give one to three inputs with a {others_name[:-1]} and a weight each, got "
                         f"{len(xs)} inputs, {len(others)} {others_name}, {len(weights)} weights")


def _launcher(triton_call):
    if triton_call is not None:
        return triton_call
    import jax_triton  # here, not at the top: it refuses to import without a GPU

    return jax_triton.triton_call


def prefill_convs(xs: tuple[jax.Array, ...], states: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                  seq_lens: jax.Array, *, block_t: int = 64, block_c: int = 64, num_warps: int = 4,
                  triton_call=None) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """`reference` (x [B, S, C...], state [B, K-1, C...], weight [K, C...]) of each of up to three (x, state,
    weight), in one launch; returns ((out, new state), ...) as reference does. Tiles: 64 x 64 was the best or within
    3% of it among nine on an H200 at 1 x 4,096, 8 x 1,024 and 64 x 1,024 tokens. triton_call: the launcher,
    jax_triton.triton_call unless given (the tests give one that runs Triton's interpreter on the CPU)."""
    _check_counts(xs, states, weights, "states")
    kernel = weights[0].shape[0]
    batch, seq = xs[0].shape[:2]
    flat_x, flat_state, flat_w = [], [], []
    for x, state, w in zip(xs, states, weights, strict=True):
        if x.shape[:2] != (batch, seq) or state.shape != (batch, kernel - 1, *x.shape[2:]) or \
                w.shape != (kernel, *x.shape[2:]):
            raise ValueError(f"causal_conv: x {x.shape}, state {state.shape}, weight {w.shape} do not match")
        channels = math.prod(x.shape[2:])
        flat_x.append(x.reshape(batch, seq, channels))
        flat_state.append(state.astype(x.dtype).reshape(batch, kernel - 1, channels))
        flat_w.append(w.reshape(kernel, channels))
    channels = [x.shape[2] for x in flat_x] + [0] * (3 - len(xs))  # a missing input: no channel blocks
    outs = _launcher(triton_call)(
        *_three(flat_x), *_three(flat_state), *_three(flat_w), kernel=_conv_kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _three(flat_x)),
        grid=(batch, -(-seq // block_t), sum(-(-c // block_c) for c in channels)), num_warps=num_warps,
        num_stages=1, enable_fp_fusion=False, name="gdn_causal_conv", SEQ=seq, C0=channels[0], C1=channels[1],
        C2=channels[2], KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c)
    return tuple((out.reshape(x.shape), conv_state(x, state, seq_lens, kernel))
                 for out, x, state in zip(outs, xs, states))


@triton.jit
def _step_tile(x_ptr, cache_ptr, w_ptr, out_ptr, cache_out_ptr, slot, fresh, live, row, pid_c, CHANNELS: tl.constexpr,
               KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = c < CHANNELS
    state = cache_ptr + slot.to(tl.int64) * ((KERNEL - 1) * CHANNELS) + c
    x = tl.load(x_ptr + row * CHANNELS + c, mask=inside, other=0.0)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for i in tl.static_range(KERNEL):  # window: the state's K - 1 rows (zeros for a fresh row), then x
        if i < KERNEL - 1:
            tap = tl.where(fresh, 0.0, tl.load(state + i * CHANNELS, mask=inside, other=0.0).to(tl.float32))
        else:
            tap = x.to(tl.float32)
        acc = acc + tap.to(x.dtype).to(tl.float32) * tl.load(w_ptr + i * CHANNELS + c, mask=inside,
                                                             other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    conv = acc.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * CHANNELS + c, (conv * (1.0 / (1.0 + tl.exp(-conv)))).to(dtype), mask=inside)
    # the new state: the window shifted by the token (a padding row, seq_len 0, keeps it), in place: row i is
    # stored after rows i and i + 1 are loaded, and no later step reads a row below i + 1
    new = cache_out_ptr + slot.to(tl.int64) * ((KERNEL - 1) * CHANNELS) + c
    for i in tl.static_range(KERNEL - 1):
        kept = tl.where(fresh, 0.0, tl.load(state + i * CHANNELS, mask=inside, other=0.0).to(tl.float32))
        if i < KERNEL - 2:
            shifted = tl.where(fresh, 0.0, tl.load(state + (i + 1) * CHANNELS, mask=inside, other=0.0).to(tl.float32))
        else:
            shifted = x.to(tl.float32)
        tl.store(new + i * CHANNELS, tl.where(live, shifted, kept).to(cache_out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _step_kernel(x0_ptr, x1_ptr, x2_ptr, c0_ptr, c1_ptr, c2_ptr, w0_ptr, w1_ptr, w2_ptr, slots_ptr, fresh_ptr,
                 lens_ptr, o0_ptr, o1_ptr, o2_ptr, n0_ptr, n1_ptr, n2_ptr, C0: tl.constexpr, C1: tl.constexpr,
                 C2: tl.constexpr, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row, channel block over q, k, v) of a decode step: the conv of the row's one token and its state
    rows' update in place (n_i: the cache c_i's buffer)."""
    row, pid_c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    fresh = tl.load(fresh_ptr + row) != 0
    live = tl.load(lens_ptr + row) > 0
    B0: tl.constexpr = (C0 + BLOCK_C - 1) // BLOCK_C
    B1: tl.constexpr = (C1 + BLOCK_C - 1) // BLOCK_C
    if pid_c < B0:
        _step_tile(x0_ptr, c0_ptr, w0_ptr, o0_ptr, n0_ptr, slot, fresh, live, row, pid_c, C0, KERNEL, BLOCK_C)
    elif pid_c < B0 + B1:
        _step_tile(x1_ptr, c1_ptr, w1_ptr, o1_ptr, n1_ptr, slot, fresh, live, row, pid_c - B0, C1, KERNEL, BLOCK_C)
    else:
        _step_tile(x2_ptr, c2_ptr, w2_ptr, o2_ptr, n2_ptr, slot, fresh, live, row, pid_c - B0 - B1, C2, KERNEL,
                   BLOCK_C)


def decode_convs(xs: tuple[jax.Array, ...], caches: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                 slots: jax.Array, fresh: jax.Array, seq_lens: jax.Array, *, block_c: int = 256, num_warps: int = 4,
                 triton_call=None) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """`reference_convs` for a decode step (one token a row) in one launch, the caches' rows updated in place
    (donate them in the caller's jit to avoid a copy). Rows must name distinct slots, except padding rows (seq_len
    0), which may share a sink slot whose contents are garbage."""
    _check_counts(xs, caches, weights, "caches")
    kernel = weights[0].shape[0]
    batch = xs[0].shape[0]
    flat_x, flat_cache, flat_w = [], [], []
    for x, cache, w in zip(xs, caches, weights, strict=True):
        if x.shape[:2] != (batch, 1) or cache.shape[1:] != (kernel - 1, *x.shape[2:]) or \
                w.shape != (kernel, *x.shape[2:]) or cache.dtype != x.dtype:
            raise ValueError(f"causal_conv: x {x.shape} {x.dtype}, cache {cache.shape} {cache.dtype}, weight "
                             f"{w.shape} do not match a decode step")
        channels = math.prod(x.shape[2:])
        flat_x.append(x.reshape(batch, channels))
        flat_cache.append(cache.reshape(cache.shape[0], kernel - 1, channels))
        flat_w.append(w.reshape(kernel, channels))
    channels = [x.shape[1] for x in flat_x] + [0] * (3 - len(xs))  # a missing input: no channel blocks
    # a missing input's cache: a scratch row (aliased in place like the others, so not another input's cache)
    caches_in = flat_cache + [jnp.zeros((1, kernel - 1, 1), xs[0].dtype)] * (3 - len(xs))
    results = _launcher(triton_call)(
        *_three(flat_x), *caches_in, *_three(flat_w), slots.astype(jnp.int32), fresh.astype(jnp.int32),
        seq_lens.astype(jnp.int32), kernel=_step_kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _three(flat_x)) +
        tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches_in),
        input_output_aliases={3 + i: 3 + i for i in range(3)}, grid=(batch, sum(-(-c // block_c) for c in channels)),
        num_warps=num_warps, num_stages=1, enable_fp_fusion=False, name="gdn_causal_conv_step", C0=channels[0],
        C1=channels[1], C2=channels[2], KERNEL=kernel, BLOCK_C=block_c)
    outs, new = results[:3], results[3:]
    return (tuple(o.reshape(x.shape) for o, x in zip(outs, xs)),
            tuple(n.reshape(c.shape) for n, c in zip(new, caches)))


def causal_convs(xs: tuple[jax.Array, ...], caches: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                 slots: jax.Array, fresh: jax.Array, seq_lens: jax.Array, *, triton_call=None
                 ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The layers' `conv` op on these kernels (same contract as `reference_convs`): a decode step in one launch that
    updates the state rows in place; a prefill in one launch, its states gathered from and written to their slots
    around it."""
    if xs[0].shape[1] == 1:
        return decode_convs(xs, caches, weights, slots, fresh, seq_lens, triton_call=triton_call)
    states = tuple(slot_states(c, slots, fresh) for c in caches)
    results = prefill_convs(xs, states, weights, seq_lens, triton_call=triton_call)
    return (tuple(out for out, _ in results),
            tuple(c.at[slots].set(state.astype(c.dtype)) for c, (_, state) in zip(caches, results)))
