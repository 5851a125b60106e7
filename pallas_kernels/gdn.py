"""The Gated DeltaNet recurrence of a flat ragged batch on the GPU: the decode kernel (gdn_decode) for one-token
requests, the chunked prefill kernels (gdn_prefill) for the rest, into one output and one state buffer, both in place;
speculative verify rows through gdn_decode's verify kernel, and their commit (gdn_commit). They have the contracts of
qwen_jax.layers.gated_deltanet.delta_rule, verify_delta_rule and commit_verified and must never take over the layer's
projections, conv or gated norm."""

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_commit import commit
from pallas_kernels.gdn_decode import decode, verify
from pallas_kernels.gdn_prefill import prefill


def delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
               dt_bias: jax.Array, ssm: jax.Array, batch, *, chunk_size: int | None = None,
               block_v: int | None = None, num_warps: int = 4, num_stages: int | None = None,
               decode_block_v: int | None = None, decode_num_warps: int | None = None, interpret: bool | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """q, k: [T, nk, dk] after the conv, before the L2 norm; v: [T, nv, dv]; a, b: [T, nv] raw; A_log, dt_bias: [nv];
    ssm: [slots, nv, dk, dv] float32, rows batch.state_slot read (zeros for fresh requests) and written back; batch:
    a qwen_jax.layers.batch.Ragged. Returns (out [T, nv, dv] in v's dtype, 0 on padding tokens; ssm with each
    request's slot advanced by its tokens), and no other slot touched: padding requests and their sink slot are left
    alone. Donate ssm in the caller's jit: it is updated in place, never copied.

    Three launches: gdn_prefill's prepare (over work items x value heads) and recurrence (over value blocks x value
    heads x requests) write the tokens and slots of the requests of two or more tokens, then gdn_decode (over
    requests x value heads x value blocks) those of the one-token requests; each launch skips the requests that are
    not its own. out starts as zeros (what padding tokens keep) and, like ssm, goes through the recurrence and decode
    launches as an aliased operand. chunk_size, block_v, num_warps, num_stages: gdn_prefill.prefill's (None:
    gdn_prefill.default_tiles for this many request slots); decode_block_v, decode_num_warps: gdn_decode.decode's
    block_v, num_warps; interpret=None interprets on CPU only."""
    out = jnp.zeros(v.shape, v.dtype)
    out, ssm = prefill(q, k, v, a, b, A_log, dt_bias, ssm, batch, out, chunk_size=chunk_size, block_v=block_v,
                       num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return decode(q, k, v, a, b, A_log, dt_bias, ssm, batch, out, block_v=decode_block_v, num_warps=decode_num_warps,
                  interpret=interpret)


def verify_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
                      dt_bias: jax.Array, ssm: jax.Array, batch, draft_len: int, *, block_v: int | None = None,
                      num_warps: int | None = None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Speculative verify rows: every request of `batch` has exactly draft_len + 1 tokens (static, >= 1) or none;
    inputs as delta_rule's. Returns (out [T, nv, dv] in v's dtype, 0 on padding tokens; states [T, nv, dk, dv]
    float32, each row's state after each of its tokens, undefined on padding tokens); ssm is only read. One launch
    (gdn_decode.verify, block_v and num_warps its own); interpret=None interprets on CPU only."""
    return verify(q, k, v, a, b, A_log, dt_bias, ssm, batch, draft_len, jnp.zeros(v.shape, v.dtype),
                  block_v=block_v, num_warps=num_warps, interpret=interpret)


def commit_verified(cache: dict, pending: dict, batch, num_accepted: jax.Array, *, block_v: int | None = None,
                    num_warps: int = 4, interpret: bool | None = None) -> dict:
    """After verify rows: each row's slot of one GDN layer's cache {"ssm", "conv_q", "conv_k", "conv_v"} set to its
    state after its first num_accepted [R] tokens, from verify_delta_rule's states and the convs' inputs (`pending`,
    gdn_layer_verify's); all four updated in place (donate them). One launch (gdn_commit.commit, block_v and
    num_warps its own); interpret=None interprets on CPU only."""
    return commit(cache, pending, batch, num_accepted, block_v=block_v, num_warps=num_warps, interpret=interpret)
