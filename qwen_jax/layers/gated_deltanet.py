"""Gated DeltaNet (Qwen3.5 linear attention): causal conv1d with a rolling state, L2-normed q/k, decay gates and
the delta-rule recurrence on a float32 state, as a chunked (WY-form) scan (a decode row is a chunk of one token).

Reference math for pallas_kernels/gdn_* and causal_conv, on the ragged token axis (layers/batch.py); state slots are
read and written only at the rows the batch's requests name. Speculative verify rows (`gdn_layer_verify`) leave
their slots alone until `commit_verified` writes the state after each row's accepted tokens.
"""

import jax
import jax.numpy as jnp

from qwen_jax.layers.batch import Ragged
from qwen_jax.layers.mlp import dense, linear, linears
from qwen_jax.layers.norms import gated_rms_norm

CHUNK_SIZE = 64


def ragged_causal_conv(x: jax.Array, states: jax.Array, weight: jax.Array, batch: Ragged) -> jax.Array:
    """Depthwise causal conv + SiLU on the ragged token axis. x: [T, C...]; states: [R, K-1, C...] (the K-1 inputs
    before each request's first token); weight: [K, C...]. Token t of request r, i tokens into it, reads for tap j
    the input i + j - (K-1) of its request: x[t + j - (K-1)] from 0 on, the state's row before. Padding tokens give
    garbage that nothing reads."""
    kernel, tokens = weight.shape[0], x.shape[0]
    states = states.astype(x.dtype)
    offset = jnp.arange(tokens) - batch.query_start[batch.token_request]  # [T] tokens before t in its request
    shifted = jnp.pad(x, [(kernel - 1, 0)] + [(0, 0)] * (x.ndim - 1))
    w = weight.astype(jnp.float32)
    expand = (slice(None),) + (None,) * (x.ndim - 1)

    def window(j):
        from_x = shifted[j:j + tokens]  # x[t + j - (K-1)]
        from_state = states[batch.token_request, jnp.clip(offset + j, 0, kernel - 2)]
        return jnp.where((offset + j >= kernel - 1)[expand], from_x, from_state)

    out = sum(window(j).astype(jnp.float32) * w[j] for j in range(kernel))
    return jax.nn.silu(out.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)  # HF rounds the conv, then SiLU


def ragged_conv_state(x: jax.Array, states: jax.Array, batch: Ragged) -> jax.Array:
    """Each request's new conv state: the K-1 inputs ending at its last token, of its state then its tokens.
    x: [T, C...]; states: [R, K-1, C...] -> [R, K-1, C...] in x's dtype (a padding request's state unchanged)."""
    kernel_1, tokens = states.shape[1], x.shape[0]
    at = batch.query_len[:, None] + jnp.arange(kernel_1)[None, :]  # [R, K-1] positions in (state, tokens)
    from_x = x[jnp.clip(batch.query_start[:, None] + at - kernel_1, 0, tokens - 1)]
    from_state = jnp.take_along_axis(states.astype(x.dtype),
                                     jnp.clip(at, 0, kernel_1 - 1).reshape(at.shape + (1,) * (x.ndim - 1)), axis=1)
    return jnp.where((at >= kernel_1).reshape(at.shape + (1,) * (x.ndim - 1)), from_x, from_state)


def causal_convs(xs: tuple[jax.Array, ...], caches: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                 batch: Ragged) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The layer's `conv` op: the causal conv + SiLU of each x with its requests' state slots. xs: [T, C...];
    caches: [slots, K-1, C...] (rows batch.state_slot read, zeros for fresh requests, and written back); weights:
    [K, C...]. Returns (outs [T, C...], caches with each request's slot advanced by its tokens).
    pallas_kernels/causal_conv.py is its kernel: q, k and v in one launch, decode rows' state updated in place."""
    outs, new_caches = [], []
    for x, cache, w in zip(xs, caches, weights, strict=True):
        states = slot_states(cache, batch.state_slot, batch.fresh)
        outs.append(ragged_causal_conv(x, states, w, batch))
        new_caches.append(cache.at[batch.state_slot].set(ragged_conv_state(x, states, batch).astype(cache.dtype)))
    return tuple(outs), tuple(new_caches)


def verify_causal_convs(xs: tuple[jax.Array, ...], caches: tuple[jax.Array, ...], weights: tuple[jax.Array, ...],
                        batch: Ragged) -> tuple[jax.Array, ...]:
    """The layer's `verify_conv` op: `causal_convs`' outputs for speculative verify rows, every slot left unwritten.
    xs: [T, C...]; caches: [slots, K-1, C...] (rows batch.state_slot read, zeros for fresh requests); weights:
    [K, C...]. Returns outs [T, C...], bitwise those of `causal_convs` (a token's taps are summed in one order
    however many tokens its request has). `commit_verified` rebuilds each slot's window from the same xs."""
    return tuple(ragged_causal_conv(x, slot_states(cache, batch.state_slot, batch.fresh), w, batch)
                 for x, cache, w in zip(xs, caches, weights, strict=True))


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


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


def chunk_items(batch: Ragged, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step's chunks of `chunk` tokens, request by request (a request of n tokens has ceil(n / chunk), its last
    partial), padded to the most a batch of T tokens and R requests can have, ceil(T / chunk) + R.
    Returns (request of each chunk [NC], its tokens [NC, chunk] (T past the request's end or on padding chunks),
    whether it is the request's first chunk [NC])."""
    tokens, requests = batch.token_request.shape[0], batch.query_len.shape[0]
    count = -(-batch.query_len // chunk)  # [R]
    ends = jnp.cumsum(count)
    item = jnp.arange(-(-tokens // chunk) + requests)
    request = jnp.minimum(jnp.searchsorted(ends, item, side="right"), requests - 1)
    index = item - (ends - count)[request]  # the chunk's place in its request
    inside = index[:, None] * chunk + jnp.arange(chunk)[None, :]  # [NC, chunk] offsets in the request
    live = (item < ends[-1])[:, None] & (inside < batch.query_len[request][:, None])
    return request, jnp.where(live, batch.query_start[request][:, None] + inside, tokens), index == 0


def delta_rule(q, k, v, a, b, A_log, dt_bias, ssm, batch: Ragged):
    """The recurrence of one layer on its requests' state slots (the reference of pallas_kernels/gdn_*): L2 norms,
    gates, then each request's tokens chunk by chunk (the chunked WY form; a decode row is a chunk of one token).
    q, k: [T, nk, dk] after the conv, before the L2 norm; v: [T, nv, dv]; a, b: [T, nv] raw; A_log, dt_bias: [nv];
    ssm: [slots, nv, dk, dv] float32, rows batch.state_slot read (zeros for fresh requests) and written back.
    Returns (out [T, nv, dv] in v's dtype, 0 on padding tokens; ssm with each request's slot advanced by its tokens):
    out is computed in float32 and rounded once, where the layer (as HF) rounds it before the gated norm."""
    out_dtype, tokens = v.dtype, q.shape[0]
    gated = _gated_inputs(q, k, v, a, b, A_log, dt_bias, batch.token_valid)
    request, at, _ = chunk_items(batch, CHUNK_SIZE)
    live = at < tokens

    def take(x):  # [T, ...] -> [NC, chunk, ...], 0 past a request's tokens (beta = g = 0: the state is untouched)
        rows = x[jnp.minimum(at, tokens - 1)]
        return jnp.where(live.reshape(live.shape + (1,) * (x.ndim - 1)), rows, 0.0)

    states = slot_states(ssm, batch.state_slot, batch.fresh)  # [R, nv, dk, dv]
    states, outs = _scan_chunks(states, request, tuple(map(take, gated)))
    out = jnp.zeros((tokens + 1,) + outs.shape[2:], jnp.float32).at[at.reshape(-1)].set(
        outs.reshape((-1,) + outs.shape[2:]))[:tokens]
    return out.astype(out_dtype), ssm.at[batch.state_slot].set(states)


def _gated_inputs(q, k, v, a, b, A_log, dt_bias, valid):
    """The recurrence's float32 inputs: q, k L2-normed and repeated to the value heads (q scaled), v, the log decay
    g and the write strength beta [T, nv] (both 0 on padding tokens, which then leave a state untouched)."""
    repeat = v.shape[1] // q.shape[1]  # value head j reads key head j // repeat
    q = jnp.repeat(l2_normalize(q.astype(jnp.float32)), repeat, axis=1) * q.shape[-1] ** -0.5
    k = jnp.repeat(l2_normalize(k.astype(jnp.float32)), repeat, axis=1)
    v = v.astype(jnp.float32)
    beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(b.dtype)  # HF computes sigmoid(b) in the model dtype
    beta = jnp.where(valid[:, None], beta.astype(jnp.float32), 0.0)
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    g = jnp.where(valid[:, None], g, 0.0)
    return q, k, v, g, beta


def _scan_chunks(states, request, chunks):
    """Chunk after chunk, each advancing its request's state. states: [R, nv, dk, dv]; request: [NC]; chunks: q, k,
    v, g, beta as [NC, CHUNK_SIZE, nv, ...] (zeros past a request's tokens). Returns (states, outs [NC, CHUNK_SIZE,
    nv, dv]). The one path of both delta_rule and verify_delta_rule: a token alone in its chunk gets the same bits in
    both."""
    def step(states, item):
        r, qc, kc, vc, gc, bc = item
        out, state, _ = chunked_delta_rule(qc[None], kc[None], vc[None], gc[None], bc[None], states[r][None])
        return states.at[r].set(state[0]), out[0]

    return jax.lax.scan(step, states, (request, *chunks))


def verify_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
                      dt_bias: jax.Array, ssm: jax.Array, batch: Ragged, draft_len: int
                      ) -> tuple[jax.Array, jax.Array]:
    """The recurrence of speculative verify rows, their slots left unwritten (the reference of
    pallas_kernels.gdn.verify_delta_rule). Every request of `batch` is a verify row of exactly draft_len + 1 tokens
    (its last accepted token, then draft_len drafts; draft_len static, >= 1) or a padding request of none.
    q, k: [T, nk, dk] after the conv, before the L2 norm; v: [T, nv, dv]; a, b: [T, nv] raw; A_log, dt_bias: [nv];
    ssm: [slots, nv, dk, dv] float32, rows batch.state_slot read (zeros for fresh requests), none written.
    Returns (out [T, nv, dv] in v's dtype, 0 on padding tokens; states [T, nv, dk, dv] float32, the row's state after
    each token, undefined on padding tokens), for `commit_verified`. Token by token, each as a decode step computes
    it (a chunk of one token): out and every state are bitwise those of draft_len + 1 one-token delta_rule steps."""
    out_dtype, tokens = v.dtype, q.shape[0]
    gated = _gated_inputs(q, k, v, a, b, A_log, dt_bias, batch.token_valid)
    requests = batch.query_len.shape[0]
    rows = jnp.arange(requests)
    states = slot_states(ssm, batch.state_slot, batch.fresh)  # [R, nv, dk, dv]
    out = jnp.zeros((tokens + 1,) + v.shape[1:], jnp.float32)
    per_token = jnp.zeros((tokens + 1,) + states.shape[1:], jnp.float32)

    def alone(x, live, at):  # [T, ...] -> [R, CHUNK_SIZE, ...]: each row's token `at`, then zeros (a decode chunk)
        first = jnp.where(live.reshape((-1,) + (1,) * (x.ndim - 1)), x[jnp.minimum(at, tokens - 1)], 0.0)
        return jnp.zeros((requests, CHUNK_SIZE) + x.shape[1:], x.dtype).at[:, 0].set(first)

    for i in range(draft_len + 1):
        live = i < batch.query_len  # [R]
        at = jnp.where(live, batch.query_start + i, tokens)  # token i of each row; T (dropped) on padding rows
        states, outs = _scan_chunks(states, rows, tuple(alone(x, live, at) for x in gated))
        out, per_token = out.at[at].set(outs[:, 0]), per_token.at[at].set(states)
    return out[:tokens].astype(out_dtype), per_token[:tokens]


CONVS = ("conv_q", "conv_k", "conv_v")  # the conv state caches and weights of q, k, v, in that order


def gdn_layer(x: jax.Array, p: dict, cache: dict, batch: Ragged, cfg, delta_rule_op=delta_rule, dense_op=dense,
              conv_op=causal_convs) -> tuple[jax.Array, dict]:
    """x: [T, H] -> ([T, H], updated {"conv_q", "conv_k", "conv_v", "ssm"} slots).
    `delta_rule_op`, `dense_op`, `conv_op`: the recurrence (`delta_rule`), the projections' dense and the convs
    (`causal_convs`), or kernels with their contracts (layers/hot_ops.py picks)."""
    q, k, v, z, b, a = linears(x, tuple(p[n] for n in "qkvzba"), dense_op)  # z: [T, Hv, Dv]; b, a: [T, Hv]
    (q, k, v), convs = conv_op((q, k, v), tuple(cache[n] for n in CONVS), tuple(p[n] for n in CONVS), batch)
    out, ssm = delta_rule_op(q, k, v, a, b, p["A_log"], p["dt_bias"], cache["ssm"], batch)
    return _gated_output(out, z, p, x.dtype, cfg, dense_op), dict(zip(CONVS, convs), ssm=ssm)


def gdn_layer_verify(x: jax.Array, p: dict, cache: dict, batch: Ragged, cfg, draft_len: int,
                     verify_delta_rule_op=verify_delta_rule, dense_op=dense,
                     verify_conv_op=verify_causal_convs) -> tuple[jax.Array, dict]:
    """The layer on speculative verify rows, its cache untouched: every request of `batch` has exactly draft_len + 1
    tokens (draft_len static, >= 1) or none. x: [T, H] -> (out [T, H], each token's output as a prefill of the
    row's tokens gives it, pending). `pending` is what `commit_verified` needs once the accepted counts are known:
    {"conv_q", "conv_k", "conv_v": the convs' inputs [T, C...] in the model dtype, "ssm": the state after each
    token [T, nv, dk, dv] float32}. The ops have the contracts of `verify_delta_rule` and `verify_causal_convs`
    (layers/hot_ops.py picks)."""
    q, k, v, z, b, a = linears(x, tuple(p[n] for n in "qkvzba"), dense_op)
    inputs = (q, k, v)
    q, k, v = verify_conv_op(inputs, tuple(cache[n] for n in CONVS), tuple(p[n] for n in CONVS), batch)
    out, states = verify_delta_rule_op(q, k, v, a, b, p["A_log"], p["dt_bias"], cache["ssm"], batch, draft_len)
    return _gated_output(out, z, p, x.dtype, cfg, dense_op), dict(zip(CONVS, inputs), ssm=states)


def commit_verified(cache: dict, pending: dict, batch: Ragged, num_accepted: jax.Array) -> dict:
    """Each verify row's slot set to its state after its first num_accepted[r] tokens, in one GDN layer's cache
    {"conv_q", "conv_k", "conv_v", "ssm"}: ssm <- pending's state after token num_accepted[r], each conv window
    <- the K-1 inputs ending there, of (the slot's window, the row's inputs). `batch` and `pending` are those of the
    `gdn_layer_verify` call, and no slot may have been written since. num_accepted: [R] int32 on the device,
    1..draft_len + 1 for verify rows, 0 for padding requests, whose slots (the sink 0) are not written; a count past
    the row's tokens is taken as all of them, so no row ever reads another's. Rejected tokens leave no trace. The
    states equal, bitwise, those num_accepted[r] one-token steps of gdn_layer give. Donate cache in the caller's jit."""
    accepted = jnp.clip(num_accepted, 0, batch.query_len)
    slots = jnp.where(accepted > 0, batch.state_slot, cache["ssm"].shape[0])  # out of range: dropped
    last = jnp.clip(batch.query_start + accepted - 1, 0, pending["ssm"].shape[0] - 1)
    new = {"ssm": cache["ssm"].at[slots].set(pending["ssm"][last], mode="drop")}
    upto = batch._replace(query_len=accepted)
    for name in CONVS:
        states = slot_states(cache[name], batch.state_slot, batch.fresh)
        window = ragged_conv_state(pending[name], states, upto).astype(cache[name].dtype)
        new[name] = cache[name].at[slots].set(window, mode="drop")
    return new


def _gated_output(out, z, p, dtype, cfg, dense_op):
    """The recurrence's out [T, nv, dv] through the gated RMS norm (gate z) and the output projection -> [T, H]."""
    out = gated_rms_norm(out.astype(dtype), z, p["norm"], cfg.rms_norm_eps)
    return dense_op(out, p["out"], 2).astype(dtype)


__all__ = ["gdn_layer", "gdn_layer_verify", "commit_verified", "delta_rule", "verify_delta_rule",
           "chunked_delta_rule", "causal_convs", "verify_causal_convs", "linear", "chunk_items"]
