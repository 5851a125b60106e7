"""Rotary position embedding on the first `rotary_dim` features of each head.

Two pairings: HF's rotate-half (feature i with i + d/2) and Meta's interleaved (2i with 2i + 1).
"""

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, interleaved: bool) -> jax.Array:
    """x: [..., S, heads, head_dim]; positions: [..., S]; inv_freq: [rotary_dim // 2] float32."""
    rotary_dim = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., S, rotary_dim // 2]
    cos = jnp.cos(freqs)[..., None, :]
    sin = jnp.sin(freqs)[..., None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        # Meta/llama2.c pairs, computed in float32 as those references do.
        pairs = rot.astype(jnp.float32).reshape(*rot.shape[:-1], rotary_dim // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
        rot = out.reshape(rot.shape).astype(x.dtype)
    else:
        # HF rounds cos/sin to the activation dtype before rotating.
        cos = jnp.concatenate([cos, cos], axis=-1).astype(x.dtype)
        sin = jnp.concatenate([sin, sin], axis=-1).astype(x.dtype)
        half = rotary_dim // 2
        rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
        rot = rot * cos + rotated * sin
    return jnp.concatenate([rot, rest], axis=-1) if rest.shape[-1] else rot
