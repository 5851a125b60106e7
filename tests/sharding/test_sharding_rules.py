"""The partitioning rules on the real Qwen3.5-35B-A3B shapes (no allocation) and `place` on a tiny model: heads,
experts, vocab and cache split as sharding/README.md says; each placed tensor lands only in its shards."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from sharding_tiny_models import tiny_config
from support import shared_data

from qwen_jax.config import load_config
from qwen_jax.models import decoder
from sharding import mesh, rules

REAL = str(shared_data("configs", "Qwen3.5-35B-A3B.json"))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_real_35b_a3b_specs_at_8_devices(expert_parallel):
    cfg = load_config(REAL)
    m = mesh.make_mesh(tensor_parallel_size=8, enable_expert_parallel=expert_parallel)
    model = "expert" if expert_parallel else "tensor"
    specs = rules.param_specs(cfg, m)
    attn, gdn = specs["layers"][3], specs["layers"][0]
    assert specs["embed"] == P(model, None) and specs["lm_head"] == P(None, model)
    assert attn["mixer"]["q"] == P(None, model, None) and attn["mixer"]["o"] == P(model, None, None)
    assert attn["mixer"]["k"] == P(None, None, None)  # 2 KV heads on 8 devices: replicated
    assert gdn["mixer"]["q"] == P(None, model, None) and gdn["mixer"]["out"] == P(model, None, None)
    assert gdn["mixer"]["conv_v"] == P(None, model, None) and gdn["mixer"]["A_log"] == P(model)
    moe = gdn["mlp"]
    assert moe["w_gate"] == (P("expert", None, None) if expert_parallel else P(None, None, "tensor"))
    assert moe["w_down"] == (P("expert", None, None) if expert_parallel else P(None, "tensor", None))
    assert moe["shared_gate"] == P(None, model) and moe["router"] == P(None, None)
    cache = rules.cache_specs(cfg, m, num_blocks=64, block_size=16, num_slots=8)["layers"]
    assert cache[3]["k"] == P(None, None, None, None)
    assert cache[0]["ssm"] == P(None, model, None, None) and cache[0]["conv_q"] == P(None, None, model, None)
    leaves = jax.tree.leaves(decoder.param_shapes(cfg))
    total = sum(s.size * s.dtype.itemsize for s in leaves)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    per_device = sum(s.size * s.dtype.itemsize / rules.num_shards(spec, m)
                     for s, spec in zip(leaves, spec_leaves, strict=True))
    # about 8.4 GiB of the 66.1 GiB bf16 weights per device (the MTP head's included: its 16 MB fc is replicated)
    assert 1 / 8 <= per_device / total < 1.011 / 8


def test_data_parallel_cache_needs_divisible_pages():
    cfg = tiny_config("llama")
    with pytest.raises(ValueError, match="data-parallel"):
        rules.cache_specs(cfg, mesh.make_mesh(4, data_parallel_size=2), num_blocks=15, block_size=4, num_slots=8)


def test_place_puts_each_tensor_only_into_its_shards():
    cfg = tiny_config("qwen3_5_moe")
    m = mesh.make_mesh(tensor_parallel_size=4, data_parallel_size=2)
    place = rules.make_place(cfg, m)
    shapes = decoder.param_shapes(cfg)
    rng = np.random.default_rng(0)
    for path, s in jax.tree_util.tree_leaves_with_path(shapes):
        host = rng.standard_normal(s.shape).astype(s.dtype)
        placed = place(tuple(k.key if hasattr(k, "key") else k.idx for k in path), host)
        np.testing.assert_array_equal(np.asarray(placed), host)
        spec = placed.sharding.spec
        for shard in placed.addressable_shards:
            np.testing.assert_array_equal(shard.data, host[shard.index])
            if any(spec):
                assert shard.data.size * 4 == host.size  # 1/4 (tensor) of a sharded tensor, replicated over data


def test_load_params_with_place_gives_sharded_copy_of_the_checkpoint():
    import torch
    import transformers
    from sharding_tiny_models import TINY_CONFIGS

    from qwen_jax.weights import DictSource, load_params

    hf = {k: v for k, v in TINY_CONFIGS["llama"].items() if k != "torch_dtype"}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    source = DictSource(model.state_dict())
    cfg = tiny_config("llama")
    m = mesh.make_mesh(tensor_parallel_size=4)
    sharded = load_params(cfg, source, place=rules.make_place(cfg, m))
    plain = load_params(cfg, source)
    shardings = rules.param_shardings(cfg, m)
    for got, want, sharding in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain), jax.tree.leaves(shardings),
                                   strict=True):
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert max(rules.bytes_per_device(sharded).values()) <= 0.27 * sum(a.nbytes for a in jax.tree.leaves(plain))


def test_partitioned_ops_reject_heads_that_straddle_a_replicated_kv_head():
    """24 query heads over 3 KV heads (8 each) on 4 devices: the KV heads replicate, and a device's 6 query heads
    would need two of them; the engine refuses such a layout at start (ops_for_mesh), not in the middle of a step."""
    from sharding.partitioned_ops import ops_for_mesh

    cfg = dataclasses.replace(tiny_config("llama"), num_heads=24, num_kv_heads=3)
    with pytest.raises(NotImplementedError, match="24 heads split 4 ways over 3 heads"):
        ops_for_mesh(cfg, mesh.make_mesh(tensor_parallel_size=4), "reference")
    ops_for_mesh(cfg, mesh.make_mesh(tensor_parallel_size=3), "reference")  # 8 query heads and their KV head per device
