"""The Gated DeltaNet's depthwise causal conv + SiLU of q, k and v on the ragged token axis, with each request's conv
state slot, as two native Triton launches (through jax-triton). Leaf module: no imports of the engine or its layers.

`causal_convs` has the contract of the layers' `conv` op, qwen_jax.layers.gated_deltanet.causal_convs (its jnp
reference), and repeats its roundings so as to equal it bitwise under the engine's exact-precision compile
(`xla_allow_excess_precision=False`; scripts/check_causal_conv_gpu.py checks that on a GPU): the taps are added in
float32 in the reference's order without fused multiply-adds, rounded, then SiLU in float32, rounded once. Two
launches, in this order:

Tokens (`_token_kernel`): one program takes BLOCK_T tokens x BLOCK_C channels of the token axis (a block may span
  several requests) and writes the outputs of prefill requests' tokens (requests of two or more tokens): tap j of
  the token i tokens into its request reads its request's input i + j - (K - 1), x (a shifted, contiguous tile: the
  taps overlap in L1) from 0 on, the request's state row before (zeros for a fresh request). Padding tokens get 0;
  decode tokens are left to the second launch.
Requests (`_request_kernel`): one program per (request, channel block), the caches updated in place. A decode
  request (one token) convolves its token with its slot's K - 1 state rows; every request then writes its slot's new
  state, the K - 1 inputs ending at its last token (x, or the old state for requests shorter than K - 1). It runs
  after the first launch has read the old states. Padding requests (no tokens) read and write nothing.

`verify_causal_convs` (the layers' `verify_conv` op) is the token launch alone: speculative verify rows are
requests of two or more tokens, and their slots stay unwritten until the layers' commit_verified.

The arithmetic and tiles (64 x 64 tokens x channels, 256 channels a request) are those measured on an H200 for the
row layout (`python -m qwen_jax.bench.kernels --only causal_conv`: about 2 TB/s for long prefills, 2-4 us a decode
step). On the CPU the tests run these kernels under Triton's interpreter; qwen_jax/layers/hot_ops.py
takes the reference where jax-triton cannot run.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import triton
import triton.language as tl


@triton.jit
def _silu(conv):
    return conv * (1.0 / (1.0 + tl.exp(-conv)))


@triton.jit
def _token_tile(x_ptr, cache_ptr, w_ptr, out_ptr, t, start, length, slot, fresh, valid, pid_c, TOKENS: tl.constexpr,
                CHANNELS: tl.constexpr, KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    live_c = (c < CHANNELS)[None, :]
    prefill = valid & (length >= 2)
    offset = t - start  # tokens before t in its request
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        back = offset + j - (KERNEL - 1)  # the input tap j reads, in its request: x from 0 on, the state before
        from_x = tl.load(x_ptr + (t + j - (KERNEL - 1))[:, None].to(tl.int64) * CHANNELS + c[None, :],
                         mask=(prefill & (back >= 0))[:, None] & live_c, other=0.0)
        from_state = tl.load(cache_ptr + (slot.to(tl.int64) * (KERNEL - 1) + offset + j)[:, None] * CHANNELS
                             + c[None, :], mask=(prefill & (back < 0) & ~fresh)[:, None] & live_c, other=0.0)
        window = tl.where((back >= 0)[:, None], from_x, from_state).to(tl.float32)
        acc = acc + window * tl.load(w_ptr + j * CHANNELS + c, mask=c < CHANNELS, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    out = tl.where(prefill[:, None], _silu(acc.to(dtype).to(tl.float32)), 0.0).to(dtype)  # rounded, SiLU, rounded
    decode = valid & (length == 1)
    tl.store(out_ptr + t[:, None].to(tl.int64) * CHANNELS + c[None, :], out,
             mask=((t < TOKENS) & ~decode)[:, None] & live_c)


@triton.jit
def _token_kernel(x0_ptr, x1_ptr, x2_ptr, c0_ptr, c1_ptr, c2_ptr, w0_ptr, w1_ptr, w2_ptr, token_request_ptr,
                  token_valid_ptr, query_start_ptr, query_len_ptr, slot_ptr, fresh_ptr, o0_ptr, o1_ptr, o2_ptr,
                  TOKENS: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, KERNEL: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (token block, channel block): channel blocks [0, B0) are input 0's, the next B1 input 1's, the rest
    input 2's (Bi = ceil(Ci / BLOCK_C))."""
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = t < TOKENS
    request = tl.load(token_request_ptr + t, mask=inside, other=0)
    valid = inside & (tl.load(token_valid_ptr + t, mask=inside, other=0) != 0)
    start = tl.load(query_start_ptr + request)
    length = tl.load(query_len_ptr + request)
    slot = tl.load(slot_ptr + request)
    fresh = tl.load(fresh_ptr + request) != 0
    B0: tl.constexpr = (C0 + BLOCK_C - 1) // BLOCK_C
    B1: tl.constexpr = (C1 + BLOCK_C - 1) // BLOCK_C
    if pid_c < B0:
        _token_tile(x0_ptr, c0_ptr, w0_ptr, o0_ptr, t, start, length, slot, fresh, valid, pid_c, TOKENS, C0, KERNEL,
                    BLOCK_T, BLOCK_C)
    elif pid_c < B0 + B1:
        _token_tile(x1_ptr, c1_ptr, w1_ptr, o1_ptr, t, start, length, slot, fresh, valid, pid_c - B0, TOKENS, C1,
                    KERNEL, BLOCK_T, BLOCK_C)
    else:
        _token_tile(x2_ptr, c2_ptr, w2_ptr, o2_ptr, t, start, length, slot, fresh, valid, pid_c - B0 - B1, TOKENS,
                    C2, KERNEL, BLOCK_T, BLOCK_C)


@triton.jit
def _request_tile(x_ptr, cache_ptr, w_ptr, out_ptr, start, length, slot, fresh, pid_c, CHANNELS: tl.constexpr,
                  KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = c < CHANNELS
    state = cache_ptr + slot.to(tl.int64) * ((KERNEL - 1) * CHANNELS) + c
    decode = inside & (length == 1)
    x = tl.load(x_ptr + start.to(tl.int64) * CHANNELS + c, mask=decode, other=0.0)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in tl.static_range(KERNEL):  # a decode token's window: the state's K - 1 rows (zeros when fresh), then x
        if j < KERNEL - 1:
            tap = tl.load(state + j * CHANNELS, mask=decode & ~fresh, other=0.0).to(tl.float32)
        else:
            tap = x.to(tl.float32)
        acc = acc + tap.to(x.dtype).to(tl.float32) * tl.load(w_ptr + j * CHANNELS + c, mask=decode,
                                                             other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + start.to(tl.int64) * CHANNELS + c, _silu(acc.to(dtype).to(tl.float32)).to(dtype), mask=decode)
    # the new state, in place: row i is input length + i of (state, tokens), stored after that row is loaded; later
    # rows load inputs above length + i > i, so none reads a row already stored
    live = inside & (length > 0)
    for i in tl.static_range(KERNEL - 1):
        src = length + i
        from_x = tl.load(x_ptr + (start + src - (KERNEL - 1)).to(tl.int64) * CHANNELS + c,
                         mask=live & (src >= KERNEL - 1), other=0.0)
        from_state = tl.load(state + src * CHANNELS, mask=live & (src < KERNEL - 1) & ~fresh, other=0.0)
        new = tl.where(src >= KERNEL - 1, from_x, from_state)
        tl.store(state + i * CHANNELS, new.to(cache_ptr.dtype.element_ty), mask=live)


@triton.jit
def _request_kernel(x0_ptr, x1_ptr, x2_ptr, w0_ptr, w1_ptr, w2_ptr, query_start_ptr, query_len_ptr, slot_ptr,
                    fresh_ptr, _o0, _o1, _o2, _c0, _c1, _c2, o0_ptr, o1_ptr, o2_ptr, c0_ptr, c1_ptr, c2_ptr,
                    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (request, channel block over q, k, v): a decode token's conv, and the request's state rows updated in
    place. o_i and c_i: the first launch's outputs and the caches, aliased (_o_i and _c_i, their input pointers,
    name the same buffers)."""
    request, pid_c = tl.program_id(0), tl.program_id(1)
    start = tl.load(query_start_ptr + request)
    length = tl.load(query_len_ptr + request)
    slot = tl.load(slot_ptr + request)
    fresh = tl.load(fresh_ptr + request) != 0
    B0: tl.constexpr = (C0 + BLOCK_C - 1) // BLOCK_C
    B1: tl.constexpr = (C1 + BLOCK_C - 1) // BLOCK_C
    if pid_c < B0:
        _request_tile(x0_ptr, c0_ptr, w0_ptr, o0_ptr, start, length, slot, fresh, pid_c, C0, KERNEL, BLOCK_C)
    elif pid_c < B0 + B1:
        _request_tile(x1_ptr, c1_ptr, w1_ptr, o1_ptr, start, length, slot, fresh, pid_c - B0, C1, KERNEL, BLOCK_C)
    else:
        _request_tile(x2_ptr, c2_ptr, w2_ptr, o2_ptr, start, length, slot, fresh, pid_c - B0 - B1, C2, KERNEL,
                      BLOCK_C)


def _launcher(triton_call):
    if triton_call is not None:
        return triton_call
    import jax_triton  # here, not at the top: it refuses to import without a GPU

    return jax_triton.triton_call


def _token_launch(triton_call, x3, flat_cache, missing, w3, meta, flat_x, xs, tokens, block_t, block_c, channels,
                  kernel, num_warps):
    """The token launch: every prefill request's outputs, 0 at padding tokens."""
    return _launcher(triton_call)(
        *x3, *flat_cache, *flat_cache[:1] * missing, *w3, *meta, kernel=_token_kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat_x) +
        (jax.ShapeDtypeStruct((1, 1), xs[0].dtype),) * missing,
        grid=(-(-tokens // block_t), sum(-(-c // block_c) for c in channels)), num_warps=num_warps, num_stages=1,
        enable_fp_fusion=False, name="gdn_causal_conv", TOKENS=tokens, C0=channels[0], C1=channels[1],
        C2=channels[2], KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c)


def _flattened(xs, caches, weights, batch):
    """The launches' operands, checked: x [T, C], caches [slots, K-1, C], weights [K, C] of each input, padded to
    three with stand-ins, the channel counts (0 for a stand-in: it has no channel blocks, so no program touches it)
    and the batch's int32 fields."""
    if not (len(xs) == len(caches) == len(weights)) or not 1 <= len(xs) <= 3:
        raise ValueError(f"causal_conv: give one to three inputs with a cache and a weight each, got {len(xs)} "
                         f"inputs, {len(caches)} caches, {len(weights)} weights")
    kernel, tokens = weights[0].shape[0], xs[0].shape[0]
    flat_x, flat_cache, flat_w = [], [], []
    for x, cache, w in zip(xs, caches, weights, strict=True):
        if x.shape[0] != tokens or cache.shape[1:] != (kernel - 1, *x.shape[1:]) or \
                w.shape != (kernel, *x.shape[1:]) or cache.dtype != x.dtype:
            raise ValueError(f"causal_conv: x {x.shape} {x.dtype}, cache {cache.shape} {cache.dtype}, weight "
                             f"{w.shape} do not match")
        channels = math.prod(x.shape[1:])
        flat_x.append(x.reshape(tokens, channels))
        flat_cache.append(cache.reshape(cache.shape[0], kernel - 1, channels))
        flat_w.append(w.reshape(kernel, channels))
    missing = 3 - len(xs)
    channels = [x.shape[1] for x in flat_x] + [0] * missing
    x3, w3 = flat_x + flat_x[:1] * missing, flat_w + flat_w[:1] * missing
    meta = [jnp.asarray(a, jnp.int32) for a in (batch.token_request, batch.token_valid, batch.query_start,
                                                batch.query_len, batch.state_slot, batch.fresh)]
    return flat_x, flat_cache, x3, w3, channels, meta


def verify_causal_convs(xs: tuple[jax.Array, ...], caches: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                        batch: Any, *, block_t: int | None = None, block_c: int = 64, num_warps: int = 4,
                        triton_call=None) -> tuple[jax.Array, ...]:
    """The layers' `verify_conv` op (qwen_jax.layers.gated_deltanet.verify_causal_convs): the outputs of speculative
    verify rows (requests of two or more tokens, or padding requests), no cache written. The token launch alone,
    which computes every request of two or more tokens as `causal_convs` does; padding tokens' outputs are 0.
    Arguments as `causal_convs`', but block_t (None) fits the step: verify steps are a few tokens, which a 64-token
    tile would mostly mask."""
    flat_x, flat_cache, x3, w3, channels, meta = _flattened(xs, caches, weights, batch)
    kernel, tokens, missing = weights[0].shape[0], xs[0].shape[0], 3 - len(xs)
    if tokens == 1:  # no row of two tokens fits: all padding
        return tuple(jnp.zeros(x.shape, x.dtype) for x in xs)
    block_t = block_t or min(64, triton.next_power_of_2(tokens))
    outs = _token_launch(triton_call, x3, flat_cache, missing, w3, meta, flat_x, xs, tokens, block_t, block_c,
                         channels, kernel, num_warps)
    return tuple(o.reshape(x.shape) for o, x in zip(outs, xs))


def causal_convs(xs: tuple[jax.Array, ...], caches: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                 batch: Any, *, block_t: int = 64, block_c: int = 64, request_block_c: int = 256,
                 num_warps: int = 4, triton_call=None) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The layers' `conv` op: the causal conv + SiLU of each of one to three x [T, C...] with its requests' state
    slots in caches [slots, K-1, C...] (x's dtype), weights [K, C...]. `batch`: the step's
    qwen_jax.layers.batch.Ragged (token_request, token_valid, query_start, query_len, state_slot, fresh are read).
    Returns (outs [T, C...], caches with each request's slot advanced by its tokens) as the reference does; padding
    tokens' outputs are 0 (the reference's are garbage). The caches are updated in place: donate them in the caller's
    jit to avoid a copy. Requests must name distinct slots; padding requests (no tokens) touch no slot.
    Tiles: block_t x block_c tokens x channels for prefill tokens, request_block_c channels a request.
    triton_call: the launcher, jax_triton.triton_call unless given (the tests give one that runs Triton's
    interpreter on the CPU)."""
    flat_x, flat_cache, x3, w3, channels, meta = _flattened(xs, caches, weights, batch)
    kernel, tokens, requests, missing = weights[0].shape[0], xs[0].shape[0], batch.query_len.shape[0], 3 - len(xs)
    if tokens == 1:  # a one-token step holds no prefill: its token (if any) is the request launch's
        outs = tuple(jnp.zeros(x.shape, x.dtype) for x in flat_x) + (jnp.zeros((1, 1), xs[0].dtype),) * missing
    else:
        outs = _token_launch(triton_call, x3, flat_cache, missing, w3, meta, flat_x, xs, tokens, block_t, block_c,
                             channels, kernel, num_warps)
    # outs and caches aliased in place; a missing input's cache is a scratch row of its own
    caches_in = flat_cache + [jnp.zeros((1, kernel - 1, 1), xs[0].dtype) for _ in range(missing)]
    results = _launcher(triton_call)(
        *x3, *w3, *meta[2:], *outs, *caches_in, kernel=_request_kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*outs, *caches_in)),
        input_output_aliases={10 + i: i for i in range(6)},
        grid=(requests, sum(-(-c // request_block_c) for c in channels)), num_warps=num_warps, num_stages=1,
        enable_fp_fusion=False, name="gdn_causal_conv_requests", C0=channels[0], C1=channels[1], C2=channels[2],
        KERNEL=kernel, BLOCK_C=request_block_c)
    return (tuple(o.reshape(x.shape) for o, x in zip(results[:3], xs)),
            tuple(n.reshape(c.shape) for n, c in zip(results[3:], caches)))
