"""The scalar math both Gated DeltaNet launches (gdn_decode, gdn_prefill) compute alike, written once: the L2
normalisation's epsilon and a softplus every Pallas backend lowers. Must hold nothing but that shared math.
"""

import jax.numpy as jnp

L2_EPS = 1e-6  # as qwen_jax.layers.gated_deltanet.l2_normalize


def softplus(x):
    """log(1 + e^x), stable for large |x|, from ops every Pallas backend lowers."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))
