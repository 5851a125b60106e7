"""The layers' hot ops partitioned over a mesh's model axes: each device runs the op (jnp reference or Pallas
kernel alike) on its own heads or experts inside a shard_map. The specs come from sharding/rules.py, never from here.

Why shard_map and not XLA's partitioner: XLA cannot split a Pallas call (it would gather the heads and run the whole
kernel on every device), and attention and the delta rule need no collective inside when split by heads.
Where the rules replicate the KV heads (or GDN key heads) but split the query (value) heads, a device reads only the
one KV (key) head its query (value) heads share: that needs the query heads of a KV head to stay on whole devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from qwen_jax.config import FULL_ATTENTION, ModelConfig
from qwen_jax.layers.hot_ops import Ops, ops_for
from sharding.mesh import MODEL_AXES, model_parallel_size
from sharding.moe import expert_parallel_moe
from sharding.rules import entry_axes, logical_to_spec


def _split_axes(logical: str, size: int, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that the rules split a `logical` dimension of `size` over (() when replicated)."""
    return entry_axes(logical_to_spec((logical,), (size,), mesh)[0])


def _shard_count(axes: tuple[str, ...], mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _shared_head(outer: int, inner: int, outer_axes: tuple, inner_axes: tuple, mesh: Mesh, what: str) -> bool:
    """Whether each device's share of `outer` heads (query / GDN value heads) reads one replicated `inner` head
    (KV / GDN key head). False when both are split alike (each device reads its own inner heads)."""
    if inner_axes == outer_axes:
        return False
    local, group = outer // _shard_count(outer_axes, mesh), outer // inner
    if inner_axes or group % local:
        raise NotImplementedError(f"{what}: {outer} heads split {_shard_count(outer_axes, mesh)} ways over "
                                  f"{inner} heads split {_shard_count(inner_axes, mesh)} ways: each device's heads "
                                  f"must share one of the {inner}")
    return True


def head_parallel_attention(cfg: ModelConfig, mesh: Mesh, attend: Callable) -> Callable:
    """`attend` (paged attention's contract) with query heads, KV heads and KV pages split as the rules say."""
    q_axes = _split_axes("heads", cfg.num_heads, mesh)
    kv_axes = _split_axes("kv_heads", cfg.num_kv_heads, mesh)
    if not q_axes:
        return attend
    shared = _shared_head(cfg.num_heads, cfg.num_kv_heads, q_axes, kv_axes, mesh, "attention")
    local_q, group = cfg.num_heads // _shard_count(q_axes, mesh), cfg.num_heads // cfg.num_kv_heads
    heads, kv_heads = P(None, q_axes, None), P(None, None, kv_axes or None, None)

    def attention(q, k_cache, v_cache, batch, scale, max_query_len=None):
        def local(q, k_cache, v_cache, batch):
            if not shared:
                return attend(q, k_cache, v_cache, batch, scale, max_query_len=max_query_len)
            start = jax.lax.axis_index(q_axes) * local_q // group
            return attend(q, k_cache, v_cache, batch, scale, start, 1, max_query_len=max_query_len)

        return jax.shard_map(local, mesh=mesh, in_specs=(heads, kv_heads, kv_heads, P()),
                             out_specs=heads, axis_names=set(MODEL_AXES), check_vma=False)(q, k_cache, v_cache, batch)

    return attention


def head_parallel_delta_rule(cfg: ModelConfig, mesh: Mesh, delta_rule: Callable) -> Callable:
    """`delta_rule` (the GDN recurrence's contract) with key heads, value heads and their state slots split as the
    rules say; every input a value head needs (v, a, b, its gates, its state) lives on its device."""
    if all(kind == FULL_ATTENTION for kind in cfg.layer_types):
        return delta_rule
    v_axes = _split_axes("gdn_value_heads", cfg.linear_num_value_heads, mesh)
    k_axes = _split_axes("gdn_key_heads", cfg.linear_num_key_heads, mesh)
    if not v_axes:
        return delta_rule
    nv, nk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    shared = _shared_head(nv, nk, v_axes, k_axes, mesh, "Gated DeltaNet")
    local_v, repeat = nv // _shard_count(v_axes, mesh), nv // nk
    key_heads, value_heads = P(None, k_axes or None, None), P(None, v_axes, None)
    gates, per_head, state = P(None, v_axes), P(v_axes), P(None, v_axes, None, None)

    def local(q, k, v, a, b, A_log, dt_bias, ssm, batch):
        if shared:  # this device's value heads all read one key head
            start = jax.lax.axis_index(v_axes) * local_v // repeat
            q, k = (jax.lax.dynamic_slice_in_dim(t, start, 1, axis=1) for t in (q, k))
        return delta_rule(q, k, v, a, b, A_log, dt_bias, ssm, batch)

    def sharded(*args):
        return jax.shard_map(
            local, mesh=mesh,
            in_specs=(key_heads, key_heads, value_heads, gates, gates, per_head, per_head, state, P()),
            out_specs=(value_heads, state), axis_names=set(MODEL_AXES), check_vma=False)(*args)

    return sharded


def head_parallel_verify_delta_rule(cfg: ModelConfig, mesh: Mesh, verify_delta_rule: Callable) -> Callable:
    """`verify_delta_rule` (the speculative verify contract) split as head_parallel_delta_rule splits the delta rule:
    its per-token states [T, nv, dk, dv] come out split on value heads, as ssm is."""
    def verify(q, k, v, a, b, A_log, dt_bias, ssm, batch, draft_len):
        op = functools.partial(verify_delta_rule, draft_len=draft_len)
        return head_parallel_delta_rule(cfg, mesh, op)(q, k, v, a, b, A_log, dt_bias, ssm, batch)

    return verify


def head_parallel_commit(cfg: ModelConfig, mesh: Mesh, commit: Callable) -> Callable:
    """`commit_verified` (one GDN layer's commit after a verify step) with each cache array and its pending
    counterpart split as the rules split them: ssm and conv_v (the per-token states, the v inputs) by value heads,
    conv_q and conv_k (the q, k inputs) by key heads. Each device copies its own heads (the kernel's programs write
    every key head a device holds, so replicated key heads are written whole on every device, alike)."""
    if all(kind == FULL_ATTENTION for kind in cfg.layer_types):
        return commit
    v_axes = _split_axes("gdn_value_heads", cfg.linear_num_value_heads, mesh)
    k_axes = _split_axes("gdn_key_heads", cfg.linear_num_key_heads, mesh) or None
    if not v_axes:
        return commit
    windows = {"conv_q": P(None, None, k_axes, None), "conv_k": P(None, None, k_axes, None),
               "conv_v": P(None, None, v_axes, None), "ssm": P(None, v_axes, None, None)}
    inputs = {"conv_q": P(None, k_axes, None), "conv_k": P(None, k_axes, None), "conv_v": P(None, v_axes, None),
              "ssm": P(None, v_axes, None, None)}

    def sharded(cache, pending, batch, num_accepted):
        return jax.shard_map(commit, mesh=mesh, in_specs=(windows, inputs, P(), P()), out_specs=windows,
                             axis_names=set(MODEL_AXES), check_vma=False)(cache, pending, batch, num_accepted)

    return sharded


def ops_for_mesh(cfg: ModelConfig, mesh: Mesh, kernels: str) -> Ops:
    """A mesh's ops: ops_for(kernels) when one device holds the whole model; else that bundle as XLA's
    partitioner runs it (layers/hot_ops.py keeps the projections, norms and convs on XLA, which splits a dot by the
    weights' shardings but cannot split a Pallas call), with attention, the delta rule (its verify form and the
    verify commit) and the MoE's experts (sharding/moe.py) each split over the model axes here."""
    if model_parallel_size(mesh) == 1:
        return ops_for(kernels)
    ops = ops_for(kernels, partitioned=True)
    return dataclasses.replace(ops, attention=head_parallel_attention(cfg, mesh, ops.attention),
                               delta_rule=head_parallel_delta_rule(cfg, mesh, ops.delta_rule),
                               verify_delta_rule=head_parallel_verify_delta_rule(cfg, mesh, ops.verify_delta_rule),
                               commit_verified=head_parallel_commit(cfg, mesh, ops.commit_verified),
                               moe=expert_parallel_moe(cfg, mesh, ops.experts) if cfg.moe_layers else ops.moe)
