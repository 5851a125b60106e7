"""The hot ops of the layers as one bundle: the jnp references, or the Pallas kernels of pallas_kernels/ when
kernels="gpu". Layers receive their op from a bundle and never pick one; sharding/ops.py wraps a bundle for a mesh.

Each op has one contract, shared by its reference and its kernel; `batch` is the step's flat ragged batch
(qwen_jax.layers.batch.Ragged) and T its token count:
  attention(q [T, heads, D], k_cache, v_cache, batch, scale, kv_head_start=0, num_kv_heads=None) -> [T, heads, D]
                                                              (qwen_jax.layers.attention.paged_attention)
  delta_rule(q, k, v, a, b, A_log, dt_bias, ssm, batch) -> (out [T, nv, dv] in v's dtype, ssm)
                                                              (qwen_jax.layers.gated_deltanet.delta_rule)
  moe(x [T, H], p, top_k, renormalize, valid [T]) -> [T, H]    (qwen_jax.layers.mlp.sparse_moe)
  dense(x, w, contract=1) -> float32, x's last `contract` dims against w's first; w a tuple of weights -> a tuple
      (one x through several projections: one launch for the kernel)      (qwen_jax.layers.mlp.dense)
  norm(x, weight, eps, plus_one) -> x's dtype, the last axis RMS-normalised    (qwen_jax.layers.norms.rms_norm)
  conv(xs, caches, weights, batch) -> (outs, caches), a GDN layer's causal convs of q, k and v on their requests'
      state slots                                             (qwen_jax.layers.gated_deltanet.causal_convs)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from qwen_jax.config import KERNELS
from qwen_jax.layers.attention import paged_attention
from qwen_jax.layers.gated_deltanet import causal_convs, delta_rule
from qwen_jax.layers.mlp import dense, dense_impl, sparse_moe
from qwen_jax.layers.norms import rms_norm


@dataclasses.dataclass(frozen=True)
class Ops:
    attention: Callable
    delta_rule: Callable
    moe: Callable
    dense: Callable
    norm: Callable
    conv: Callable


def causal_convs_kernels(xs, caches, weights, batch):
    """causal_convs' contract on the GPU kernels (pallas_kernels/causal_conv.py: decode rows' state updated in place,
    prefill chunks in one launch) where jax-triton runs; the reference elsewhere."""
    from pallas_kernels.moe_gemm import triton_available

    if not triton_available():
        return causal_convs(xs, caches, weights, batch)
    from pallas_kernels.causal_conv import causal_convs as kernel  # imports triton: GPU machines and tests only

    return kernel(xs, caches, weights, batch)


def ops_for(kernels: str) -> Ops:
    """The one switch: "reference" (jnp) or "gpu" (the Pallas kernels where one exists)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "reference":
        return Ops(attention=paged_attention, delta_rule=delta_rule, moe=sparse_moe, dense=dense, norm=rms_norm,
                   conv=causal_convs)
    from pallas_kernels.gdn import delta_rule as delta_rule_kernel
    from pallas_kernels.paged_attention import paged_attention as attention_kernel
    from pallas_kernels.rms_norm import norm as norm_kernel

    return Ops(attention=attention_kernel, delta_rule=delta_rule_kernel,
               moe=functools.partial(sparse_moe, kernels="gpu"), dense=dense_impl("gpu"), norm=norm_kernel,
               conv=causal_convs_kernels)
