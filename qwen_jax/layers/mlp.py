"""SwiGLU MLP and the sparse mixture of experts (softmax top-k routing, optional shared expert), in plain jnp.

Reference math (the grouped GEMM is `jax.lax.ragged_dot`): it never picks a kernel; layers/hot_ops.py passes kernels in.
"""

import jax
import jax.numpy as jnp


def dense(x: jax.Array, w: jax.Array | tuple[jax.Array, ...], contract: int = 1):
    """x's last `contract` dims against w's first ones, float32 accumulation and result: the layers' projections
    (their `dense` op; pallas_kernels/skinny_matmul.py is its kernel for one row). A tuple of weights (projections
    of the same x) gives a tuple of results, which a kernel may compute in one launch."""
    if isinstance(w, tuple):
        return tuple(dense(x, wi, contract) for wi in w)
    return jnp.tensordot(x, w, contract, preferred_element_type=jnp.float32)


def linear(x: jax.Array, w: jax.Array, dense_op=dense) -> jax.Array:
    """x @ w with float32 accumulation, rounded to x's dtype (what a torch bf16 Linear does)."""
    return dense_op(x, w).astype(x.dtype)


def linears(x: jax.Array, ws: tuple[jax.Array, ...], dense_op=dense) -> tuple[jax.Array, ...]:
    """`linear` of each weight in ws, through one `dense` call (one launch for the one-row kernel)."""
    return tuple(y.astype(x.dtype) for y in dense_op(x, tuple(ws)))


def silu(x: jax.Array) -> jax.Array:
    """SiLU in float32, rounded once to x's dtype (as torch does for bf16; x * sigmoid(x) in bf16 rounds twice)."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, dense_op=dense) -> jax.Array:
    gate, up = linears(x, (w_gate, w_up), dense_op)
    return linear(silu(gate) * up, w_down, dense_op)


def route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool, dense_op=dense
          ) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts in float32, keep the top k, optionally renormalise.
    Returns (weights [T, k] in x's dtype, expert ids [T, k] int32)."""
    return route_logits(linear(x, router, dense_op), top_k, renormalize)


def route_logits(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """`route` from the router's logits (in x's dtype)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(logits.dtype), ids.astype(jnp.int32)


def routed_experts_f32(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                       w_down: jax.Array, first_expert: jax.Array | int = 0) -> jax.Array:
    """x: [T, H]; weights, ids: [T, k]; w_gate/w_up: [E_local, H, I]; w_down: [E_local, I, H] -> float32 [T, H].
    The weights hold experts first_expert .. first_expert + E_local - 1; (token, expert) pairs routed elsewhere are
    dropped, so a device holding a slice of the experts (or of their I columns) returns its partial sum.
    Sorts the kept pairs by expert and runs each expert's rows as one group."""
    num_tokens, top_k = ids.shape
    num_local = w_gate.shape[0]
    flat_ids = ids.reshape(-1) - first_expert
    # Pairs of other experts sort after every local group; no group covers them, so ragged_dot leaves them zero.
    flat_ids = jnp.where((flat_ids >= 0) & (flat_ids < num_local), flat_ids, num_local)
    order = jnp.argsort(flat_ids)
    rows = x[order // top_k]
    group_sizes = jnp.bincount(flat_ids, length=num_local).astype(jnp.int32)

    def gdot(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)

    hidden = silu(gdot(rows, w_gate)) * gdot(rows, w_up)
    out = gdot(hidden, w_down) * weights.reshape(-1)[order][:, None]
    # Undo the sort and add the k expert outputs of each token in float32.
    unsorted = jnp.zeros_like(out, dtype=jnp.float32).at[order].set(out.astype(jnp.float32))
    return unsorted.reshape(num_tokens, top_k, -1).sum(axis=1)


def drop_padding(ids: jax.Array, valid: jax.Array | None) -> jax.Array:
    """Routing ids [T, k] with the pairs of padding tokens sent to expert -1, which no device holds: every routed
    experts op drops them, so padding tokens read no expert's weights."""
    return ids if valid is None else jnp.where(valid[:, None], ids, -1)


def sparse_moe(x: jax.Array, p: dict, top_k: int, renormalize: bool, valid: jax.Array | None = None,
               dense_op=dense, route_op=route_logits, experts_op=routed_experts_f32) -> jax.Array:
    """Routed experts plus, when present, a shared expert scaled by sigmoid(x @ shared_expert_gate).
    valid [T]: the real tokens (None: all); padding tokens go to no expert. dense_op, route_op, experts_op: the
    projections, the routing from logits and the routed experts (these references, or kernels with their
    contracts: layers/hot_ops.py picks)."""
    shared = "shared_gate" in p
    names = ("router", "shared_gate", "shared_up", "shared_expert_gate") if shared else ("router",)
    logits, *shared_in = linears(x, tuple(p[n] for n in names), dense_op)  # the projections of x: one launch
    weights, ids = route_op(logits, top_k, renormalize)
    ids = drop_padding(ids, valid)
    out = experts_op(x, weights, ids, p["w_gate"], p["w_up"], p["w_down"]).astype(x.dtype)
    if shared:
        gate, up, expert_gate = shared_in
        shared_out = linear(silu(gate) * up, p["shared_down"], dense_op)
        out = out + jax.nn.sigmoid(expert_gate.astype(jnp.float32)).astype(x.dtype) * shared_out
    return out
