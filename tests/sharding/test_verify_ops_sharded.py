"""The GDN verify ops split over a mesh's model axes (sharding/partitioned_ops.py: value heads and their per-token
states on their devices; the commit's slots with their heads) give the single-device reference's outputs and states,
for value heads split alone and with key heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharding_tiny_models import tiny_config

from qwen_jax.layers.batch import ragged
from qwen_jax.layers.gated_deltanet import commit_verified, verify_delta_rule
from sharding import mesh
from sharding.partitioned_ops import ops_for_mesh


@pytest.mark.parametrize("tensor_parallel_size", [2, 8])  # key heads split alongside (2) or replicated (8)
def test_sharded_verify_delta_rule_matches_one_device(tensor_parallel_size):
    cfg = tiny_config("qwen3_5")
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    draft_len, tokens = 2, 12
    batch = ragged([4, 9, 1], [3, 3, 3], [2, 1, 3], [[]] * 3, tokens, 4, 1, query_start=[0, 4, 8])
    keys = jax.random.split(jax.random.key(0), 8)
    args = (jax.random.normal(keys[0], (tokens, nk, dk)), jax.random.normal(keys[1], (tokens, nk, dk)),
            jax.random.normal(keys[2], (tokens, nv, dv)), jax.random.normal(keys[3], (tokens, nv)),
            jax.random.normal(keys[4], (tokens, nv)), jax.random.normal(keys[5], (nv,)) - 1.0,
            jax.random.normal(keys[6], (nv,)), jax.random.normal(keys[7], (4, nv, dk, dv)))
    ops = ops_for_mesh(cfg, mesh.make_mesh(tensor_parallel_size=tensor_parallel_size), "reference")
    got = jax.jit(ops.verify_delta_rule, static_argnums=9)(*args, batch, draft_len)
    want = jax.jit(verify_delta_rule, static_argnums=9)(*args, batch, draft_len)
    valid = batch.token_valid
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g)[valid], np.asarray(w)[valid], rtol=1e-6, atol=1e-6)
    assert jnp.abs(want[1][valid]).max() > 0


@pytest.mark.parametrize("tensor_parallel_size", [2, 8])  # key heads split alongside (2) or replicated (8)
def test_sharded_commit_kernel_is_bitwise_one_device(tensor_parallel_size):
    """The commit kernel (interpreted) in the shard_map, each device writing its own value heads' states and conv_v
    windows and its key heads' conv_q, conv_k windows, against the reference on one device: the same bits. Rows
    accept 1, all (a count past the row's tokens) and 2 of their 3 tokens; the padding request writes nothing."""
    cfg = tiny_config("qwen3_5")
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kernel_1 = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim - 1
    tokens, slots = 12, 5
    batch = ragged([4, 0, 1], [3, 3, 3], [2, 4, 3], [[]] * 3, tokens, 4, 1, query_start=[0, 4, 8])
    keys = jax.random.split(jax.random.key(1), 8)
    cache = dict(ssm=jax.random.normal(keys[0], (slots, nv, dk, dv)),
                 conv_q=jax.random.normal(keys[1], (slots, kernel_1, nk, dk)),
                 conv_k=jax.random.normal(keys[2], (slots, kernel_1, nk, dk)),
                 conv_v=jax.random.normal(keys[3], (slots, kernel_1, nv, dv)))
    pending = dict(ssm=jax.random.normal(keys[4], (tokens, nv, dk, dv)),
                   conv_q=jax.random.normal(keys[5], (tokens, nk, dk)),
                   conv_k=jax.random.normal(keys[6], (tokens, nk, dk)),
                   conv_v=jax.random.normal(keys[7], (tokens, nv, dv)))
    accepted = jnp.asarray([1, 5, 2, 0], jnp.int32)
    ops = ops_for_mesh(cfg, mesh.make_mesh(tensor_parallel_size=tensor_parallel_size), "gpu")
    sharded = jax.jit(ops.commit_verified)
    assert "gdn_commit" in str(sharded.trace(cache, pending, batch, accepted).jaxpr)
    got = sharded(cache, pending, batch, accepted)
    want = jax.jit(commit_verified)(cache, pending, batch, accepted)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
        assert (np.asarray(want[name])[[2, 4, 3]] != np.asarray(cache[name])[[2, 4, 3]]).any()
        np.testing.assert_array_equal(np.asarray(got[name])[[0, 1]], np.asarray(cache[name])[[0, 1]])
