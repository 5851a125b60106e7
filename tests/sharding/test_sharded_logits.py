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


def expected_decode_collectives(cfg, model_size: int) -> dict[str, int]:
    """Two all-reduces per layer (mixer output, MLP/MoE output) + one for the vocab-split embedding lookup; one
    all-gather for the vocab-split logits, and two more per layer whose KV (GDN key) heads are replicated while its
    query (value) heads are split: XLA computes new k/v split like q and gathers them for the replicated cache."""
    gathers = 1
    if cfg.num_kv_heads % model_size and not cfg.num_heads % model_size:
        gathers += 2 * len(cfg.attention_layers)
    if cfg.linear_num_key_heads % model_size and not cfg.linear_num_value_heads % model_size:
        gathers += 2 * len(cfg.linear_layers)
    return {"all-reduce": 2 * cfg.num_layers + 1, "all-gather": gathers, "all-to-all": 0, "reduce-scatter": 0,
            "collective-permute": 0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_steps_match_single_device_logits(reference, layout):
    cfg, host_params, ref_logits = reference
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
    assert collectives.count_collectives(decode.as_text()) == expected_decode_collectives(cfg, model_size)
    _assert_about_one_nth_per_device(cfg, m, params, host_params, model_size)


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
