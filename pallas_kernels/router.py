"""MoE routing in one launch: softmax over the experts in float32, the top k, renormalised, as a Pallas kernel with
the contract of its jnp reference (the model's own, qwen_jax.layers.mlp.route_logits).

Why: XLA runs the same math as four kernels a layer (softmax, a sort of the 256 probabilities for top_k, a slice, the
renormalisation), about 8 us of GPU time and four launches at one token, 40 layers a step; a decode step of a few
sequences waits on launches. Here one program takes a block of tokens, forms the
softmax as jax.nn.softmax does, and picks the k largest probabilities one at a time (largest first, the lowest expert
id among equals: lax.top_k's order), so the ids are the reference's and the weights agree to float32 rounding.
Same Triton lowering as the other Pallas kernels here, so it runs on the CPU in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _kernel(logits_ref, weights_ref, ids_ref, *, block_t: int, experts: int, top_k: int, renormalize: bool):
    """Program t: tokens t * block_t .. + block_t - 1 (rows past the last token repeat it and store nothing). The
    default of one token on one warp ran fastest at 1-4,096 tokens on an H200 (2-6 us; 16 tokens on 4 warps: 9-13
    us, XLA 7-40 us; qwen_jax/bench/kernels.py)."""
    num_tokens, num_experts = logits_ref.shape
    row = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    clipped = jnp.minimum(row, num_tokens - 1)[:, None]
    expert = jnp.arange(experts, dtype=jnp.int32)[None, :]  # padded to a power of two: padding has probability 0
    logits = logits_ref[clipped, jnp.minimum(expert, num_experts - 1)].astype(jnp.float32)
    logits = jnp.where(expert < num_experts, logits, -jnp.inf)
    unnormalized = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    probs = unnormalized / jnp.sum(unnormalized, axis=1, keepdims=True)
    slot = jnp.arange(pl.next_power_of_2(top_k), dtype=jnp.int32)[None, :]
    weights = jnp.zeros((block_t, slot.shape[1]), jnp.float32)
    ids = jnp.zeros((block_t, slot.shape[1]), jnp.int32)
    for j in range(top_k):
        best = jnp.max(probs, axis=1, keepdims=True)
        # the lowest id holding the largest probability (a NaN row picks the last expert rather than none)
        pick = jnp.minimum(jnp.min(jnp.where(probs == best, expert, experts), axis=1, keepdims=True),
                           num_experts - 1)
        weights = jnp.where(slot == j, best, weights)
        ids = jnp.where(slot == j, pick, ids)
        probs = jnp.where(expert == pick, -1.0, probs)  # probabilities are >= 0: never picked again
    if renormalize:
        weights = weights / jnp.sum(jnp.where(slot < top_k, weights, 0.0), axis=1, keepdims=True)
    mask = (row[:, None] < num_tokens) & (slot < top_k)
    pltriton.store(weights_ref.at[row[:, None], slot], weights.astype(weights_ref.dtype), mask=mask)
    pltriton.store(ids_ref.at[row[:, None], slot], ids, mask=mask)


def route_logits(logits: jax.Array, top_k: int, renormalize: bool, *, block_t: int = 1, num_warps: int = 1,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The reference's contract: logits [T, E] (x's dtype) -> (weights [T, k] in that dtype, ids [T, k] int32)."""
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"router: top_k {top_k} is not in 1..{num_experts} (the experts)")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    return pl.pallas_call(
        functools.partial(_kernel, block_t=block_t, experts=max(16, pl.next_power_of_2(num_experts)), top_k=top_k,
                          renormalize=renormalize),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, top_k), logits.dtype),
                   jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)),
        grid=(pl.cdiv(num_tokens, block_t),), interpret=interpret, compiler_params=params, name="moe_router")(logits)
