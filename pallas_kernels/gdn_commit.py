"""Speculative decoding's commit of a Gated DeltaNet layer's recurrent state as one Pallas launch: each verify row's
slot (its float32 delta-rule state and its q, k, v conv windows) set in place to the row's state after its accepted
tokens. Only copies and selects: it must never compute a state, nor write a slot of a row that accepted nothing."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.tiling import pallas_backend

STATES = ("ssm", "conv_q", "conv_k", "conv_v")  # the cache arrays, in the order the kernel takes and returns them


def _commit_window(window_ref, inputs_ref, slot, head, cols, start, accepted, fresh) -> None:
    """Window `head` (columns `cols`) of `slot` <- the K-1 inputs ending at the row's last accepted token, of (the
    slot's old window, zeros when fresh; the row's inputs from token `start` on). window_ref: [slots, K-1, heads, C];
    inputs_ref: [T, heads, C]. Every old entry is read before any is written: entry i moves to i - accepted."""
    kernel_1 = window_ref.shape[1]
    old = [window_ref[slot, i, head, cols] for i in range(kernel_1)]
    new = []
    for i in range(kernel_1):
        at = accepted + i  # entry i's place in (old window, row's inputs)
        kept = old[kernel_1 - 1]
        for src in range(kernel_1 - 1):
            kept = jnp.where(at == src, old[src], kept)
        kept = jnp.where(fresh, 0, kept).astype(inputs_ref.dtype)
        taken = inputs_ref[jnp.maximum(start + at - kernel_1, 0), head, cols]  # clipped where unused: never OOB
        new.append(jnp.where(at >= kernel_1, taken, kept).astype(window_ref.dtype))
    for i in range(kernel_1):
        window_ref[slot, i, head, cols] = new[i]


def _kernel(start_ref, len_ref, slots_ref, fresh_ref, accepted_ref, states_ref, x_q_ref, x_k_ref, x_v_ref,
            ssm_in_ref, conv_q_in_ref, conv_k_in_ref, conv_v_in_ref, ssm_ref, conv_q_ref, conv_k_ref, conv_v_ref,
            *, block_v: int):
    """One program: request `r`, value head `h`, value columns [j * block_v, (j + 1) * block_v). A row that accepted
    n >= 1 of its tokens (n clipped to its query_len) copies the state after token n of value head h's columns into
    its slot and rebuilds the same columns of its conv_v window; the j == 0 programs also rebuild the conv_q and
    conv_k windows of key heads h, h + nv, ... (under a mesh a device's key heads may outnumber its value heads).
    Every ref is the whole array, indexed here; the slot refs are aliased to the inputs (in place)."""
    del ssm_in_ref, conv_q_in_ref, conv_k_in_ref, conv_v_in_ref  # aliased to the outputs: same buffers
    r, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    accepted = jnp.minimum(jnp.maximum(accepted_ref[r], 0), len_ref[r])

    @pl.when(accepted > 0)
    def _():
        start, slot, fresh = start_ref[r], slots_ref[r], fresh_ref[r] != 0
        cols = pl.ds(j * block_v, block_v)
        ssm_ref[slot, h, :, cols] = states_ref[start + accepted - 1, h, :, cols]  # [dk, block_v] float32
        _commit_window(conv_v_ref, x_v_ref, slot, h, cols, start, accepted, fresh)

        @pl.when(j == 0)
        def _():
            for m in range(-(-conv_q_ref.shape[2] // ssm_ref.shape[1])):
                _commit_key_windows(conv_q_ref, conv_k_ref, x_q_ref, x_k_ref, slot, h + m * ssm_ref.shape[1], start,
                                    accepted, fresh)


def _commit_key_windows(conv_q_ref, conv_k_ref, x_q_ref, x_k_ref, slot, key_head, start, accepted, fresh) -> None:
    """The conv_q and conv_k windows of `key_head` (whole rows of dk), if the cache has that key head."""
    @pl.when(key_head < conv_q_ref.shape[2])
    def _():
        for window_ref, inputs_ref in ((conv_q_ref, x_q_ref), (conv_k_ref, x_k_ref)):
            _commit_window(window_ref, inputs_ref, slot, key_head, slice(None), start, accepted, fresh)


def default_block_v(dv: int) -> int:
    """min(64, dv) value columns a program, with 4 warps: the fastest, or within 0.5 us of it, of 16/32/64 columns x
    1/2/4 warps at 1, 4, 16 and 64 requests (H200, 35B-A3B shapes: 2.7 us at one request, 75.7 us at 64)."""
    return min(64, dv)


def commit(cache: dict, pending: dict, batch, num_accepted: jax.Array, *, block_v: int | None = None,
           num_warps: int = 4, num_stages: int = 1, interpret: bool | None = None) -> dict:
    """The contract of qwen_jax.layers.gated_deltanet.commit_verified, in one launch. cache: one GDN layer's
    {"ssm" [slots, nv, dk, dv] float32, "conv_q", "conv_k" [slots, K-1, nk, dk], "conv_v" [slots, K-1, nv, dv]};
    pending: gdn_layer_verify's {"ssm" [T, nv, dk, dv] float32, "conv_q", "conv_k" [T, nk, dk], "conv_v"
    [T, nv, dv]}; batch: a qwen_jax.layers.batch.Ragged (query_start, query_len, state_slot, fresh are read);
    num_accepted [R] int. Returns the cache with each row's slot set to its state after its first
    clip(num_accepted[r], 0, query_len[r]) tokens (none written at 0), all four arrays updated in place (aliased:
    donate them in the caller's jit), every other slot keeping its bits. One program per (request, value head,
    block of `block_v` value columns; None: `default_block_v`); interpret=None interprets on CPU only. On GPU this
    lowers through the Pallas Triton backend: dk and block_v must be powers of two."""
    slots, nv, dk, dv = cache["ssm"].shape
    tokens = pending["ssm"].shape[0]
    nk = cache["conv_q"].shape[2]
    kernel_1 = cache["conv_v"].shape[1]
    block_v = block_v or default_block_v(dv)
    want = {"ssm": ((tokens, nv, dk, dv), (slots, nv, dk, dv)), "conv_q": ((tokens, nk, dk), (slots, kernel_1, nk, dk)),
            "conv_k": ((tokens, nk, dk), (slots, kernel_1, nk, dk)),
            "conv_v": ((tokens, nv, dv), (slots, kernel_1, nv, dv))}
    if dv % block_v or cache["ssm"].dtype != jnp.float32 or pending["ssm"].dtype != jnp.float32 \
            or any((pending[n].shape, cache[n].shape) != want[n] for n in STATES):
        raise ValueError(f"gdn_commit: cache {({n: cache[n].shape for n in STATES})} ssm {cache['ssm'].dtype}, "
                         f"pending {({n: pending[n].shape for n in STATES})} ssm {pending['ssm'].dtype}, "
                         f"block_v {block_v}")
    fields = tuple(jnp.asarray(x).astype(jnp.int32) for x in (batch.query_start, batch.query_len, batch.state_slot,
                                                               batch.fresh, num_accepted))
    call = pl.pallas_call(
        functools.partial(_kernel, block_v=block_v),
        out_shape=tuple(jax.ShapeDtypeStruct(cache[n].shape, cache[n].dtype) for n in STATES),
        grid=(batch.query_len.shape[0], nv, dv // block_v),
        input_output_aliases={9: 0, 10: 1, 11: 2, 12: 3},
        **pallas_backend(interpret, num_warps, num_stages),
        name="gdn_commit",
    )
    return dict(zip(STATES, call(*fields, *(pending[n] for n in STATES), *(cache[n] for n in STATES)), strict=True))
