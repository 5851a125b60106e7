"""Sharded forward steps (TP 2/4/8, EP 8, DP 2 x TP 4) give the single-device logits, hold about 1/N of the
weights per device, and issue the expected collectives per decode step."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sharding_tiny_models import BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, step_batches, tiny_config

from qwen_jax.models import decoder
from sharding import collectives, mesh, rules, step

LAYOUTS = ("tp2", "tp4", "tp8", "ep8", "dp2xtp4")
# The MoE kernel's tiles need 16 columns per device: the 32-column experts split at most 2 ways.
KERNEL_LAYOUTS = ("tp2", "ep8", "dp2xep4")
# Leaves that stay whole on every device: norms, the router, the shared-expert gate scalar per token.
SMALL_REPLICATED = {"input_norm", "post_norm", "final_norm", "q_norm", "k_norm", "norm", "router",
                    "shared_expert_gate"}


@pytest.fixture(scope="module")
def reference(tiny_name):
    """(config, host params, single-device logits of each step) for one tiny model."""
    cfg = tiny_config(tiny_name)
    params = decoder.random_params(cfg, seed=0, scale=0.05)
    cache = decoder.init_cache(cfg, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    forward = jax.jit(lambda p, c, b: decoder.forward(p, c, b, cfg))
    logits = []
    for batch in step_batches(1):
        out, cache = forward(params, cache, batch)
        logits.append(np.asarray(out))
    return cfg, jax.tree.map(np.asarray, params), logits


def expected_decode_collectives(cfg) -> dict[str, int]:
    """Two all-reduces per layer (mixer output, MLP/MoE output) + one for the vocab-split embedding lookup, and one
    all-gather for the vocab-split logits, at every model-parallel size. Attention and the delta rule run per head
    inside a shard_map (sharding/ops.py), so replicated KV (GDN key) heads are computed whole on every device, never
    split and gathered."""
    return {"all-reduce": 2 * cfg.num_layers + 1, "all-gather": 1, "all-to-all": 0, "reduce-scatter": 0,
            "collective-permute": 0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_steps_match_single_device_logits(reference, layout):
    _check_sharded_steps(reference, layout, "reference")


@pytest.mark.parametrize("layout", KERNEL_LAYOUTS)
def test_sharded_pallas_kernels_match_single_device_logits(reference, layout):
    """kernels="gpu" (interpreted on the CPU) inside the shard_maps: each device runs the attention, GDN and MoE
    kernels on its own heads and experts, where KV / GDN key heads are split (tp2) or replicated (ep8, dp2xep4)."""
    cfg = _check_sharded_steps(reference, layout, "gpu")
    m = collectives.mesh_for(layout)
    batch = step_batches(m.shape[mesh.DATA])[1]  # a decode step
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), reference[1])
    cache = decoder.cache_shapes(cfg, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    calls = _pallas_calls(jax.make_jaxpr(step.sharded_forward(cfg, m))(shapes, cache, batch).jaxpr)
    shards = lambda logical, size: rules.num_shards(rules.logical_to_spec((logical,), (size,), m), m)  # noqa: E731
    # Operands: paged_attention (context_lens, tables, positions, kv start, q [B, S, heads, D], ...), gdn_decode
    # (slots, fresh, q, k, v, a, b, A_log, dt_bias, state [slots, nv, dk, dv]), moe_few_gate_up (the decode MoE:
    # first_expert, ids, weights, x, w_gate [E, H, I], w_up).
    assert calls["paged_attention"][4][2] == cfg.num_heads // shards("heads", cfg.num_heads)
    if cfg.linear_layers:
        nv = cfg.linear_num_value_heads
        assert calls["gdn_decode"][-1][1] == nv // shards("gdn_value_heads", nv)
    if cfg.moe_layers:
        assert calls["moe_few_gate_up"][4][0] == cfg.num_experts // shards("experts", cfg.num_experts)


def _pallas_calls(jaxpr) -> dict[str, list[tuple]]:
    """Operand shapes of the Pallas calls in a jaxpr (inside shard_maps and other sub-jaxprs), by kernel name;
    every call of one kernel must have the same shapes."""
    found: dict[str, list[tuple]] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            name = eqn.params.get("name") or eqn.params["name_and_src_info"].name
            shapes = [tuple(v.aval.shape) for v in eqn.invars]
            assert found.setdefault(name, shapes) == shapes, name
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    for name, shapes in _pallas_calls(sub).items():
                        assert found.setdefault(name, shapes) == shapes, name
    return found


def _check_sharded_steps(reference, layout: str, kernels: str):
    """The steps' logits, decode collectives and weight bytes per device; returns the config it ran."""
    cfg, host_params, ref_logits = reference
    cfg = cfg.with_kernels(kernels)
    m = collectives.mesh_for(layout)
    params = rules.put_tree(host_params, rules.param_shardings(cfg, m))
    cache = step.init_cache(cfg, m, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    forward = step.jit_forward(cfg, m, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    batches = step_batches(m.shape[mesh.DATA])
    decode = None
    for i, (batch, ref) in enumerate(zip(batches, ref_logits, strict=True)):
        if i == 1:
            decode = forward.lower(params, cache, batch).compile()
        logits, cache = (forward if i == 0 else decode)(params, cache, batch)
        logits = np.asarray(logits)[:3]  # row 3 is padding
        rel = np.abs(logits - ref[:3]).max() / np.abs(ref[:3]).max()
        assert rel <= 1e-5, f"step {i}: relative error {rel:.2e}"
    model_size = mesh.model_parallel_size(m)
    assert collectives.count_collectives(decode.as_text()) == expected_decode_collectives(cfg)
    _assert_about_one_nth_per_device(cfg, m, params, host_params, model_size)
    return cfg


def _assert_about_one_nth_per_device(cfg, m, params, host_params, model_size):
    """Every device holds total/N of the weights plus only the leaves the rules replicate: small norms, routers and
    (when N does not divide them) KV or GDN key-head projections."""
    total = sum(a.nbytes for a in jax.tree.leaves(host_params))
    specs = jax.tree_util.tree_leaves_with_path(rules.param_specs(cfg, m))
    replicated = {str(path[-1].key) for path, spec in specs if not any(spec)}
    allowed = set(SMALL_REPLICATED)
    if cfg.num_kv_heads % model_size:
        allowed |= {"k", "v"}
    if cfg.linear_num_key_heads % model_size:
        allowed |= {"q", "k", "conv_q", "conv_k"}
    assert replicated <= allowed, replicated - allowed
    replicated_bytes = sum(a.nbytes for (path, spec), a in zip(specs, jax.tree.leaves(host_params), strict=True)
                           if not any(spec))
    per_device = rules.bytes_per_device(params)
    assert len(per_device) == m.size
    for nbytes in per_device.values():
        assert total / model_size <= nbytes <= total / model_size + replicated_bytes
    assert replicated_bytes <= 0.1 * total
