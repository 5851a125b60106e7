"""Gated DeltaNet (Qwen3.5 linear attention): causal conv1d with a rolling state, L2-normed q/k, decay gates and
the delta-rule recurrence on a float32 state, as a chunked (WY-form) scan for prefill and one step for decode.

Reference math for pallas_kernels/gdn_*; state slots are read and written only at the rows `batch` names.
"""

import jax
import jax.numpy as jnp

from qwen_jax.layers.mlp import dense, linear, linears
from qwen_jax.layers.norms import gated_rms_norm

CHUNK_SIZE = 64


def causal_conv(x: jax.Array, state: jax.Array, weight: jax.Array, seq_lens: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv + SiLU. x: [B, S, C...]; state: [B, K-1, C...] (the K-1 inputs before x);
    weight: [K, C...]. Returns (out [B, S, C...], new state = the K-1 inputs ending at each row's last valid token).

    Over the inputs `full` = state then x, tap i of token t reads full[t + i]. Each tap's window is formed on its
    own (the state's rows, then x's): from one shared `full`, XLA made a copy of x (0.55 TB/s on an H200) where
    the windows fuse into the conv's one loop over x (1.0-1.3 TB/s; BENCH_H200.md, twelfth session)."""
    kernel, seq = weight.shape[0], x.shape[1]
    state = state.astype(x.dtype)

    def window(i):  # full[:, i:i + seq]
        parts = state[:, i:min(i + seq, kernel - 1)], x[:, :max(0, i + seq - (kernel - 1))]
        return jnp.concatenate([p for p in parts if p.shape[1]], axis=1)

    w = weight.astype(jnp.float32)
    out = sum(window(i).astype(jnp.float32) * w[i] for i in range(kernel))
    out = jax.nn.silu(out.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)  # HF rounds the conv, then SiLU
    return out, conv_state(x, state, seq_lens, kernel)


def conv_state(x: jax.Array, state: jax.Array, seq_lens: jax.Array, kernel: int) -> jax.Array:
    """The conv's new state: the K-1 inputs of `full` (state then x) ending at each row's seq_len, from x or (rows
    shorter than K-1) from the state. x: [B, S, C...]; state: [B, K-1, C...] -> [B, K-1, C...] in x's dtype."""
    seq, state = x.shape[1], state.astype(x.dtype)
    at = seq_lens[:, None] + jnp.arange(kernel - 1)[None, :]  # [B, K-1] positions in full
    at = at.reshape(at.shape + (1,) * (x.ndim - 2))
    from_x = jnp.take_along_axis(x, jnp.clip(at - (kernel - 1), 0, seq - 1), axis=1)
    from_state = jnp.take_along_axis(state, jnp.clip(at, 0, kernel - 2), axis=1)
    return jnp.where(at >= kernel - 1, from_x, from_state)


def causal_convs(xs: tuple[jax.Array, ...], caches: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                 slots: jax.Array, fresh: jax.Array, seq_lens: jax.Array
                 ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The layer's `conv` op: `causal_conv` of each x with its state slots. xs: [B, S, C...]; caches: [slots, K-1,
    C...] (rows `slots` read, zeros for `fresh` rows, and written back); weights: [K, C...]. Returns (outs, caches
    with rows `slots` advanced by their seq_lens). pallas_kernels/causal_conv.py is its kernel: q, k and v in one
    launch, a decode step's state rows updated in place."""
    outs, new_caches = [], []
    for x, cache, w in zip(xs, caches, weights, strict=True):
        out, state = causal_conv(x, slot_states(cache, slots, fresh), w, seq_lens)
        outs.append(out)
        new_caches.append(cache.at[slots].set(state.astype(cache.dtype)))
    return tuple(outs), tuple(new_caches)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrent_step(q, k, v, g, beta, state):
    """One token. q, k: [B, Hv, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dk, Dv] (all float32)."""
    state = state * jnp.exp(g)[..., None, None]
    predicted = jnp.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", state, q), state


def chunked_delta_rule(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """Whole prompt chunks at a time (WY form). q, k: [B, S, Hv, Dk]; v: [B, S, Hv, Dv]; g, beta: [B, S, Hv];
    state: [B, Hv, Dk, Dv]. All float32; tokens with beta = 0 and g = 0 leave the state untouched.
    Returns (out [B, S, Hv, Dv], final state, chunk-boundary states [B, S // chunk, Hv, Dk, Dv])."""
    batch, seq, heads, _ = k.shape
    pad = (-seq) % chunk_size
    if pad:
        q, k, v = (jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (q, k, v))
        g, beta = (jnp.pad(t, ((0, 0), (0, pad), (0, 0))) for t in (g, beta))
    n = (seq + pad) // chunk_size

    def chunks(t):  # [B, S, H, ...] -> [B, H, N, C, ...]
        t = t.reshape(batch, n, chunk_size, heads, *t.shape[3:])
        return jnp.moveaxis(t, 3, 1)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    strict = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool), -1)
    system = jnp.where(strict, jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k) * decay, 0.0)
    system = system + jnp.eye(chunk_size, dtype=system.dtype)
    # Both right-hand sides in one solve. Two independent solves run concurrently on XLA:CPU's intra-op pool, and
    # jaxlib's batched triangular solve then waits for pool threads that both solves hold: a deadlock on a 2-core
    # machine (3 hangs in 12 runs of tests/kernels/test_gdn_prefill.py here, every pool thread parked in
    # lapack_strsm's ParallelBatchMap). One solve also means one launch instead of two on a GPU.
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    new_values, k_cumdecay = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    intra = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

    def step(s, xs):
        nv, kc, qd, kd, it, cd = xs
        v_new = nv - jnp.einsum("bhck,bhkv->bhcv", kc, s)
        out = jnp.einsum("bhck,bhkv->bhcv", qd, s) + jnp.einsum("bhij,bhjv->bhiv", it, v_new)
        s = s * cd[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, v_new)
        return s, (out, s)

    xs = tuple(jnp.moveaxis(t, 2, 0) for t in (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
    final, (out, boundaries) = jax.lax.scan(step, state, xs)
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, -1, v.shape[-1])[:, :, :seq]
    return jnp.moveaxis(out, 1, 2), final, jnp.moveaxis(boundaries, 0, 1)


def slot_states(cache: jax.Array, slots: jax.Array, fresh: jax.Array) -> jax.Array:
    """A batch's rows of a state cache [slots, ...] (the float32 recurrent states, the conv windows): their slots,
    zeros for rows that start a sequence."""
    return jnp.where(fresh.reshape((-1,) + (1,) * (cache.ndim - 1)), 0, cache[slots])


def delta_rule(q, k, v, a, b, A_log, dt_bias, ssm, slots, fresh, seq_lens):
    """The recurrence of one layer on its state slots (the reference of pallas_kernels/gdn_*): L2 norms, gates,
    then one recurrent step (decode) or the chunked scan (prefill).
    q, k: [B, S, nk, dk] after the conv, before the L2 norm; v: [B, S, nv, dv]; a, b: [B, S, nv] raw; A_log, dt_bias:
    [nv]; ssm: [slots, nv, dk, dv] float32; slots, fresh (rows starting a sequence read zeros), seq_lens: [B].
    Returns (out [B, S, nv, dv] in v's dtype, ssm with rows `slots` advanced by their seq_lens real tokens): out is
    computed in float32 and rounded once, where the layer (as HF) rounds it before the gated norm."""
    out_dtype = v.dtype
    valid = jnp.arange(q.shape[1])[None, :] < seq_lens[:, None]
    repeat = v.shape[2] // q.shape[2]  # value head j reads key head j // repeat
    q = jnp.repeat(l2_normalize(q.astype(jnp.float32)), repeat, axis=2) * q.shape[-1] ** -0.5
    k = jnp.repeat(l2_normalize(k.astype(jnp.float32)), repeat, axis=2)
    v = v.astype(jnp.float32)
    beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(b.dtype)  # HF computes sigmoid(b) in the model dtype
    beta = jnp.where(valid[..., None], beta.astype(jnp.float32), 0.0)
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    g = jnp.where(valid[..., None], g, 0.0)
    k = jnp.where(valid[..., None, None], k, 0.0)
    state = slot_states(ssm, slots, fresh)
    if q.shape[1] == 1:
        out, state = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
        out = out[:, None]
    else:
        out, state, _ = chunked_delta_rule(q, k, v, g, beta, state)
    return out.astype(out_dtype), ssm.at[slots].set(state)


def gdn_layer(x: jax.Array, p: dict, cache: dict, batch: dict, cfg, delta_rule_op=delta_rule, dense_op=dense,
              conv_op=causal_convs) -> tuple[jax.Array, dict]:
    """x: [B, S, H] -> ([B, S, H], updated {"conv_q", "conv_k", "conv_v", "ssm"} slots).
    `delta_rule_op`, `dense_op`, `conv_op`: the recurrence (`delta_rule`), the projections' dense and the convs
    (`causal_convs`), or kernels with their contracts (layers/ops.py picks)."""
    slots, seq_lens = batch["state_slots"], batch["seq_lens"]
    fresh = batch["positions"][:, 0] == 0  # a sequence starting at position 0 starts from a zero state
    q, k, v, z, b, a = linears(x, tuple(p[n] for n in "qkvzba"), dense_op)  # z: [B, S, Hv, Dv]; b, a: [B, S, Hv]
    (q, k, v), (conv_q, conv_k, conv_v) = conv_op(
        (q, k, v), (cache["conv_q"], cache["conv_k"], cache["conv_v"]), (p["conv_q"], p["conv_k"], p["conv_v"]),
        slots, fresh, seq_lens)

    out, ssm = delta_rule_op(q, k, v, a, b, p["A_log"], p["dt_bias"], cache["ssm"], slots, fresh, seq_lens)
    out = gated_rms_norm(out.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps)
    out = dense_op(out, p["out"], 2).astype(x.dtype)
    return out, {"conv_q": conv_q, "conv_k": conv_k, "conv_v": conv_v, "ssm": ssm}


__all__ = ["gdn_layer", "delta_rule", "chunked_delta_rule", "recurrent_step", "causal_conv", "causal_convs",
           "conv_state", "linear"]
