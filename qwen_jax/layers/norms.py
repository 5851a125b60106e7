"""RMSNorm variants (LLaMA's `w * x`, Qwen3.5's `(1 + w) * x`, the gated norm of Gated DeltaNet).

Variance is always computed in float32; the rounding order follows each HF reference exactly.
"""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool) -> jax.Array:
    """Normalise the last axis. plus_one: Qwen3.5 (scale by 1 + w in float32, then round); else LLaMA
    (round the normalised x, then scale by w in the input dtype)."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(dtype)
    return weight.astype(dtype) * normed.astype(dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gated DeltaNet output norm: w * norm(x), times silu(gate) in float32, rounded to x's dtype."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scaled = weight.astype(dtype) * normed.astype(dtype)
    return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)
