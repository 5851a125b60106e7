"""The engine's served step (engine/step.py's forward) on TP 2/4/8 and EP 8 meshes gives its own logits on a single
device, holds about 1/N of the weights per device, and issues the expected collectives per decode
step. Data parallelism is one such program per replica (tests/sharding/test_data_parallel.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sharding_tiny_models import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    NUM_REAL,
    NUM_SLOTS,
    packed_steps,
    single_device_logits,
    tiny_config,
)

from qwen_jax.bench import collectives
from qwen_jax.engine import step
from qwen_jax.models import decoder
from sharding import mesh, rules

LAYOUTS = ("tp2", "tp4", "tp8", "ep8")
# The MoE kernel's tiles need 16 columns per device: the 32-column experts split at most 2 ways.
KERNEL_LAYOUTS = ("tp2", "ep8", "ep4")
# Leaves that stay whole on every device: norms, the router, the shared-expert gate scalar per token.
SMALL_REPLICATED = {"input_norm", "post_norm", "final_norm", "q_norm", "k_norm", "norm", "router",
                    "shared_expert_gate"}


@pytest.fixture(scope="module")
def reference(tiny_name):
    """(config, host params, single-device logits of each step) for one tiny model."""
    cfg = tiny_config(tiny_name)
    params = jax.tree.map(np.asarray, decoder.random_params(cfg, seed=0, scale=0.05))
    return cfg, params, single_device_logits(cfg, params)


def expected_decode_collectives(cfg) -> dict[str, int]:
    """Two all-reduces per layer (mixer output projection, MLP/MoE output) + one for the vocab-split embedding
    lookup, and one all-gather for the vocab-split logits (replicated for the sampler), at every model-parallel
    size. Unpacking the inputs and picking decode tokens from the previous step's samples work on replicated arrays
    (no collective). Attention and the delta rule run per head inside a shard_map (sharding/partitioned_ops.py), so
    replicated KV (GDN key) heads are computed whole on every device, never split and gathered."""
    return {"all-reduce": 2 * cfg.num_layers + 1, "all-gather": 1, "all-to-all": 0, "reduce-scatter": 0,
            "collective-permute": 0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_steps_match_single_device_logits(reference, layout):
    _check_sharded_steps(reference, layout, "reference")


@pytest.mark.parametrize("layout", KERNEL_LAYOUTS)
def test_sharded_pallas_kernels_match_single_device_logits(reference, layout):
    """kernels="gpu" (interpreted on the CPU) inside the shard_maps: each device runs the attention, GDN and MoE
    kernels on its own heads and experts, where KV / GDN key heads are split (tp2) or replicated (ep8, ep4)."""
    cfg, decode = _check_sharded_steps(reference, layout, "gpu")
    m = collectives.mesh_for(layout)
    calls = _pallas_calls(decode.jaxpr.jaxpr)
    shards = lambda logical, size: rules.num_shards(rules.logical_to_spec((logical,), (size,), m), m)  # noqa: E731
    # Operands: paged_attention_prefill (work, token_valid, query_start, query_len, context_len, block_table,
    # positions, kv_head_start, q [T, heads, D], k, v) and paged_attention_decode (the same from query_start);
    # gdn_decode (query_start, query_len, state_slot, fresh, q, k, v, a, b, A_log, dt_bias, out,
    # state [slots, nv, dk, dv]); moe_few_gate_up (the few-token MoE: first_expert, ids, weights, x, w_gate [E, H, I],
    # w_up).
    heads = cfg.num_heads // shards("heads", cfg.num_heads)
    assert calls["paged_attention_prefill"][8][1] == calls["paged_attention_decode"][6][1] == heads
    if cfg.linear_layers:
        nv = cfg.linear_num_value_heads
        assert calls["gdn_decode"][-1][1] == nv // shards("gdn_value_heads", nv)
    if cfg.moe_layers:
        assert calls["moe_few_gate_up"][4][0] == cfg.num_experts // shards("experts", cfg.num_experts)


def _pallas_calls(jaxpr) -> dict[str, list[tuple]]:
    """Operand shapes of the Pallas calls in a jaxpr (inside jits, shard_maps and other sub-jaxprs), by kernel
    name; every call of one kernel must have the same shapes."""
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


def _check_sharded_steps(reference, layout: str, kernels: str) -> tuple:
    """The steps' logits, decode collectives and weight bytes per device; returns the config it ran and the decode
    step's trace."""
    cfg, host_params, ref_logits = reference
    m = collectives.mesh_for(layout)
    params = rules.put_tree(host_params, rules.param_shardings(cfg, m))
    cache = rules.init_cache(cfg, m, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    decode = None
    for i, ((last_tokens, buffer, layout_), ref) in enumerate(zip(packed_steps(), ref_logits, strict=True)):
        last_tokens, buffer = jax.device_put((last_tokens, buffer), step.replicated(m))
        if i == 1:  # both decode steps have one layout: one program
            decode = step.forward.trace(params, cache, last_tokens, buffer, layout=layout_, cfg=cfg, mesh=m,
                                        kernels=kernels)
            program = decode.lower().compile()
        if i == 0:
            logits, cache = step.forward(params, cache, last_tokens, buffer, layout=layout_, cfg=cfg, mesh=m,
                                         kernels=kernels)
        else:
            logits, cache = program(params, cache, last_tokens, buffer)
        logits = np.asarray(logits)[:NUM_REAL]
        rel = np.abs(logits - ref).max() / np.abs(ref).max()
        assert rel <= 1e-5, f"step {i}: relative error {rel:.2e}"
    assert collectives.count_collectives(program.as_text()) == expected_decode_collectives(cfg)
    _assert_about_one_nth_per_device(cfg, m, params, host_params, mesh.model_parallel_size(m))
    return cfg, decode


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
