"""The hot ops of the layers as one bundle, and the ONE place that chooses between a kernel of pallas_kernels/ and
its jnp reference here in qwen_jax/layers/: by backend and by shape. Layers receive their ops and never pick one.

kernels="reference" gives the references everywhere; "auto" is "gpu" on a GPU backend, "reference" elsewhere.
kernels="gpu" gives the kernels, except where one was measured no faster than XLA (the shape rules below: the
one-row projection and norm kernels), where jax-triton is missing (the native Triton conv), or where the ops run
under XLA's partitioner (`partitioned`: it cannot split a Pallas call; sharding/partitioned_ops.py splits the others
per device itself).

Each op has one contract, shared by its reference and its kernel; `batch` is the step's flat ragged batch
(qwen_jax.layers.batch.Ragged) and T its token count:
  attention(q [T, heads, D], k_cache, v_cache, batch, scale, kv_head_start=0, num_kv_heads=None) -> [T, heads, D]
                                                              (qwen_jax.layers.attention.paged_attention)
  delta_rule(q, k, v, a, b, A_log, dt_bias, ssm, batch) -> (out [T, nv, dv] in v's dtype, ssm)
                                                              (qwen_jax.layers.gated_deltanet.delta_rule)
  moe(x [T, H], p, top_k, renormalize, valid [T]) -> [T, H]    (qwen_jax.layers.mlp.sparse_moe)
  experts(x [T, H], weights [T, k], ids [T, k], w_gate, w_up, w_down, first_expert=0) -> float32 [T, H], the routed
      experts of moe alone, on the experts first_expert.. that the weights hold (qwen_jax.layers.mlp.routed_experts_f32)
  dense(x, w, contract=1) -> float32, x's last `contract` dims against w's first; w a tuple of weights -> a tuple
      (one x through several projections: one launch for the kernel)      (qwen_jax.layers.mlp.dense)
  norm(x, weight, eps, plus_one) -> x's dtype, the last axis RMS-normalised    (qwen_jax.layers.norms.rms_norm)
  conv(xs, caches, weights, batch) -> (outs, caches), a GDN layer's causal convs of q, k and v on their requests'
      state slots                                             (qwen_jax.layers.gated_deltanet.causal_convs)
  verify_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm, batch, draft_len) -> (out, states [T, nv, dk, dv] float32),
      speculative verify rows of draft_len + 1 tokens, ssm only read  (qwen_jax.layers.gated_deltanet.verify_delta_rule)
  verify_conv(xs, caches, weights, batch) -> outs, the convs of verify rows, caches only read
                                                              (qwen_jax.layers.gated_deltanet.verify_causal_convs)
  commit_verified(cache, pending, batch, num_accepted [R]) -> cache, one GDN layer's slots {"ssm", "conv_q",
      "conv_k", "conv_v"} set to each verify row's state after its accepted tokens (the kernel: one launch, in place)
                                                              (qwen_jax.layers.gated_deltanet.commit_verified)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import gdn, moe_gemm, paged_attention, rms_norm, router, skinny_matmul
from pallas_kernels.tiling import triton_available
from qwen_jax.layers.attention import paged_attention as attention_reference
from qwen_jax.layers.gated_deltanet import (
    causal_convs,
    commit_verified,
    delta_rule,
    verify_causal_convs,
    verify_delta_rule,
)
from qwen_jax.layers.mlp import dense, drop_padding, linears, routed_experts_f32, sparse_moe
from qwen_jax.layers.norms import rms_norm as norm_reference

KERNELS = ("auto", "gpu", "reference")  # the engine's `kernels` argument


def resolve_kernels(kernels: str) -> str:
    """"gpu" or "reference": the choice `kernels` names, "auto" being "gpu" on a GPU backend."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "auto":
        return "gpu" if jax.default_backend() == "gpu" else "reference"
    return kernels


@dataclasses.dataclass(frozen=True)
class Ops:
    attention: Callable
    delta_rule: Callable
    moe: Callable
    experts: Callable
    dense: Callable
    norm: Callable
    conv: Callable
    verify_delta_rule: Callable
    verify_conv: Callable
    commit_verified: Callable


# Below this contraction XLA's one-row reduction is as fast as the one-row kernel. The shared expert's down
# projection (K 512) took 2 us in XLA alone and 3 us in the kernel, but inside the model XLA ran it as a multiply
# writing a float32 [512, 2048] product and a reduce of it (5 us, two kernels): through the kernel a B=1 step took
# 0.1 ms less GPU time.
MIN_K = 512

# From two rows on XLA emits a GEMM, but for several weights of one x it first concatenates them on every call (its
# dot merger): at 8-64 rows one launch over a layer's projections of 38-51 MB beat it (the GDN's q/k/v/z/b/a: 26-38
# against 16-25 us; attention's q/k/v/gate: 15-23 against 11-16 us), while XLA won on single weights, 2-50 MB (one
# 50 MB weight: 13-14 against 15-19 us) (H200, `python -m qwen_jax.bench.kernels --only skinny_matmul`).
MIN_MANY_ROWS_BYTES = 32 * 2**20


def dense_kernel(x: jax.Array, w: jax.Array | tuple[jax.Array, ...], contract: int = 1):
    """The `dense` op on the one-row kernel (pallas_kernels/skinny_matmul.py) where it pays: K >= MIN_K, K a multiple
    of 16, and one row, or up to its MAX_ROWS rows through several weights of MIN_MANY_ROWS_BYTES or more. The
    weights whose widths are multiples of 16 share one launch, joined by those under 16 columns (the shared expert's
    1-column gate: in XLA a launch of its own); a lone narrow weight and every other shape take the reference."""
    ws = w if isinstance(w, tuple) else (w,)
    lead = x.shape[:x.ndim - contract]
    rows, k = math.prod(lead), math.prod(x.shape[x.ndim - contract:])
    widths = [math.prod(wi.shape[contract:]) for wi in ws]
    wide = [i for i, n in enumerate(widths) if n % 16 == 0]
    fused = [i for i, n in enumerate(widths) if n % 16 == 0 or n < 16] if wide else []  # narrow ones only join
    weight_bytes = sum(k * widths[i] * ws[i].dtype.itemsize for i in wide)
    few_rows_pay = len(wide) > 1 and weight_bytes >= MIN_MANY_ROWS_BYTES
    if rows > skinny_matmul.MAX_ROWS or k < MIN_K or k % 16 or not fused or rows > 1 and not few_rows_pay:
        return dense(x, w, contract)
    outs = dict(zip(fused, skinny_matmul.matmul_many(
        x.reshape(rows, k), tuple(ws[i].reshape(k, widths[i]) for i in fused), **skinny_matmul.row_tiles(rows))))
    out = tuple(outs[i].reshape(*lead, *wi.shape[contract:]) if i in outs else dense(x, wi, contract)
                for i, wi in enumerate(ws))
    return out if isinstance(w, tuple) else out[0]


def moe_kernel(x: jax.Array, p: dict, top_k: int, renormalize: bool, valid: jax.Array | None = None, *,
               dense_op=dense) -> jax.Array:
    """The `moe` op on the kernels. Up to moe_gemm.FEW_TOKENS tokens, with a shared expert as wide as the routed
    ones, the shared expert runs inside the routed experts' two launches (moe_gemm.few_token_moe) and only the
    router and the shared expert's 1-column gate go through `dense`; elsewhere sparse_moe over the kernels."""
    shared = ("shared_gate", "shared_up", "shared_down")
    tokens = math.prod(x.shape[:-1])
    fits = all(n in p for n in shared) and p["shared_gate"].shape == p["w_gate"].shape[1:] == p["shared_up"].shape \
        and p["shared_down"].shape == p["w_down"].shape[1:]
    if tokens > moe_gemm.FEW_TOKENS or not fits:
        return sparse_moe(x, p, top_k, renormalize, valid, dense_op=dense_op, route_op=router.route_logits,
                          experts_op=moe_gemm.routed_experts)
    logits, expert_gate = linears(x, (p["router"], p["shared_expert_gate"]), dense_op)
    weights, ids = router.route_logits(logits, top_k, renormalize)
    scale = jax.nn.sigmoid(expert_gate.astype(jnp.float32)).astype(x.dtype).reshape(tokens)
    return moe_gemm.few_token_moe(x, weights, drop_padding(ids, valid), p["w_gate"], p["w_up"], p["w_down"],
                                  tuple(p[n] for n in shared), scale)


def norm_kernel(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool) -> jax.Array:
    """The `norm` op on the one-row kernel (pallas_kernels/rms_norm.py) for one row, where XLA takes two kernels;
    from two rows on XLA's one fused kernel (the reference)."""
    if math.prod(x.shape[:-1]) == 1:
        return rms_norm.rms_norm(x, weight, eps, plus_one)
    return norm_reference(x, weight, eps, plus_one)


def conv_kernel(xs, caches, weights, batch):
    """The `conv` op on the native Triton kernels (pallas_kernels/causal_conv.py: decode rows' state updated in
    place, prefill chunks in one launch) where jax-triton launches; the reference elsewhere."""
    if not triton_available():
        return causal_convs(xs, caches, weights, batch)
    from pallas_kernels import causal_conv  # imports triton, which only GPU machines and the tests install

    return causal_conv.causal_convs(xs, caches, weights, batch)


def verify_conv_kernel(xs, caches, weights, batch):
    """The `verify_conv` op on the native Triton token launch (pallas_kernels/causal_conv.py) where jax-triton
    launches; the reference elsewhere."""
    if not triton_available():
        return verify_causal_convs(xs, caches, weights, batch)
    from pallas_kernels import causal_conv  # imports triton, which only GPU machines and the tests install

    return causal_conv.verify_causal_convs(xs, caches, weights, batch)


def ops_for(kernels: str, partitioned: bool = False) -> Ops:
    """The one switch: "reference" (the jnp ops), "gpu" (the kernels, by the rules in this module's docstring) or
    "auto". partitioned: the ops run under XLA's partitioner over a mesh's model axes, so dense, norm and conv stay
    XLA's."""
    if resolve_kernels(kernels) == "reference":
        return Ops(attention=attention_reference, delta_rule=delta_rule, moe=sparse_moe, experts=routed_experts_f32,
                   dense=dense, norm=norm_reference, conv=causal_convs, verify_delta_rule=verify_delta_rule,
                   verify_conv=verify_causal_convs, commit_verified=commit_verified)
    dense_op = dense if partitioned else dense_kernel
    return Ops(attention=paged_attention.paged_attention, delta_rule=gdn.delta_rule,
               moe=functools.partial(moe_kernel, dense_op=dense_op),
               experts=moe_gemm.routed_experts, dense=dense_op,
               norm=norm_reference if partitioned else norm_kernel,
               conv=causal_convs if partitioned else conv_kernel, verify_delta_rule=gdn.verify_delta_rule,
               verify_conv=verify_causal_convs if partitioned else verify_conv_kernel,
               commit_verified=gdn.commit_verified)
