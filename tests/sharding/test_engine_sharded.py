"""The engine (LLM) on 2, 4 and 8 devices, tensor- and expert-parallel, generates the single-device greedy tokens and
logprobs, with prefix caching on, and holds its weights and cache split over the devices as sharding/rules.py says.

A tiny float32 hybrid Qwen3.5-MoE HF checkpoint (GDN + attention, 8 experts top-2 + shared expert) is built once."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from qwen_jax import LLM, SamplingParams
from sharding import mesh, rules

# tp: tensor_parallel_size, ep: enable_expert_parallel. 8 query / 8 GDN value heads split at every size; the 2 KV
# and 4 GDN key heads split at 2 and replicate where the size does not divide them; 8 experts: 1 per device at EP8.
LAYOUTS = {"tp2": (2, False), "tp4": (4, False), "tp8": (8, False), "ep4": (4, True), "ep8": (8, True)}
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=8, num_kv_blocks=24,
                   num_snapshots=8, seed=0, enable_prefix_caching=True)
# Lengths 10, 11 and 13 (+ 3 new tokens: 2 KV blocks at most) prefill in two chunks cut at their snapshot boundary
# (token 8), all rows in step: 3 token buckets per layout, 32 (3 x 8), 16 (the tails) and 4 (3 decode rows);
# compiling is what this test spends its time on.
PROMPTS = [[int(t) for t in np.random.default_rng(seed).integers(1, 128, n)] for seed, n in enumerate((10, 11, 13))]
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
# Leaves the rules keep whole on every device in this model: norms, router, shared-expert gate, and the KV / GDN
# key-head projections where the model size does not divide their 2 / 4 heads.
SMALL_REPLICATED = {"input_norm", "post_norm", "final_norm", "q_norm", "k_norm", "norm", "router",
                    "shared_expert_gate"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    assert jax.device_count() == 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (scripts/test.sh)"
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        max_position_embeddings=128, initializer_range=0.1, eos_token_id=1, attn_implementation="eager")
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("sharded_engine") / "hybrid_moe"
    transformers.Qwen3_5MoeForCausalLM(config).float().save_pretrained(directory)
    config_file = directory / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "qwen3_5_moe"}))
    return str(directory)


def _generate_twice(llm: LLM) -> list:
    """The prompts, then the same prompts again: the second round hits the prefix cache (KV blocks and a restored
    recurrent-state snapshot)."""
    first = llm.generate(PROMPTS, GREEDY)
    hits = llm.engine.stats()["prefix_cache_hits"]
    second = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats()["prefix_cache_hits"] > hits, "the second round must hit the prefix cache"
    return first + second


@pytest.fixture(scope="module")
def reference(model_dir) -> list:
    return _generate_twice(LLM(model_dir, **ENGINE_ARGS))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_engine_matches_single_device(model_dir, reference, layout):
    tp, ep = LAYOUTS[layout]
    llm = LLM(model_dir, tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE_ARGS)
    m = llm.engine.replicas[0].mesh
    assert mesh.model_parallel_size(m) == tp and m.shape[mesh.EXPERT] == (tp if ep else 1)
    outputs = _generate_twice(llm)
    for out, ref in zip(outputs, reference, strict=True):
        assert out.token_ids == ref.token_ids
        got = np.array([lp.logprob for lp in out.logprobs])
        want = np.array([lp.logprob for lp in ref.logprobs])
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel <= 1e-5, f"{layout}: logprob relative error {rel:.2e}"
    _assert_weights_split(llm, tp)
    _assert_cache_split(llm)


def test_sharded_engine_with_pallas_kernels_matches_single_device(model_dir, reference):
    """kernels="gpu" (interpreted on the CPU) at EP4: the attention, GDN decode and MoE kernels run per device on
    their heads and experts and give the single-device kernels' greedy tokens and logprobs (and the jnp
    reference's tokens)."""
    single = _generate_twice(LLM(model_dir, kernels="gpu", **ENGINE_ARGS))
    outputs = _generate_twice(LLM(model_dir, tensor_parallel_size=4, enable_expert_parallel=True, kernels="gpu",
                                  **ENGINE_ARGS))
    for out, ref, jnp_ref in zip(outputs, single, reference, strict=True):
        assert out.token_ids == ref.token_ids == jnp_ref.token_ids
        np.testing.assert_allclose([lp.logprob for lp in out.logprobs], [lp.logprob for lp in ref.logprobs],
                                   rtol=1e-5, atol=1e-6)


def _assert_weights_split(llm: LLM, n: int) -> None:
    """Each of the n devices holds total/n of the weights plus the few leaves the rules replicate."""
    replica = llm.engine.replicas[0]
    cfg, m, params = llm.engine.cfg, replica.mesh, replica.runner.params
    per_device = rules.bytes_per_device(params)
    assert set(per_device) == set(m.devices.flat)
    specs = jax.tree.leaves(rules.param_specs(cfg, m), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    leaves = jax.tree.leaves(params)
    total = sum(a.nbytes for a in leaves)
    replicated = {str(path[-1].key) for path, spec in zip(paths, specs, strict=True) if rules.num_shards(spec, m) == 1}
    allowed = set(SMALL_REPLICATED)
    if cfg.num_kv_heads % n:
        allowed |= {"k", "v"}
    if cfg.linear_num_key_heads % n:
        allowed |= {"q", "k", "conv_q", "conv_k"}
    assert set(replicated) <= allowed, set(replicated) - allowed
    replicated_bytes = sum(a.nbytes for a, spec in zip(leaves, specs, strict=True) if rules.num_shards(spec, m) == 1)
    for device, held in per_device.items():
        assert held == pytest.approx((total - replicated_bytes) / n + replicated_bytes), device


def _assert_cache_split(llm: LLM) -> None:
    """KV pages and GDN state (and the prefix-cache snapshots) take their rules' per-device share."""
    replica = llm.engine.replicas[0]
    runner = replica.runner
    expected = rules.cache_bytes_per_device(replica.cfg, replica.mesh, replica.num_blocks, replica.block_size,
                                            replica.max_num_seqs + 1)
    assert set(rules.bytes_per_device(runner.cache).values()) == {expected}
    whole = sum(a.nbytes for a in jax.tree.leaves(runner.cache))
    assert expected < whole  # GDN state is split over heads at every size
    snapshots = rules.bytes_per_device(runner.snapshots)
    assert len(set(snapshots.values())) == 1
    assert next(iter(snapshots.values())) < sum(a.nbytes for a in jax.tree.leaves(runner.snapshots))
