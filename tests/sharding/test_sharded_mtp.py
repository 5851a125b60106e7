"""The MTP head (models/mtp.py) on TP and EP meshes: with its params and KV pages in their rules' shards and the hot
ops partitioned per device, a prefill chunk and a decode step give the head's single-device logits and outputs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from sharding_tiny_models import BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, step_batches, tiny_config

from qwen_jax.bench import collectives
from qwen_jax.models import decoder
from qwen_jax.models.mtp import mtp_forward
from sharding import mesh, rules
from sharding.partitioned_ops import ops_for_mesh


def _run(cfg, host_params: dict, hiddens: list[np.ndarray], m) -> list[tuple[np.ndarray, np.ndarray]]:
    """(logits, head output) of each step of step_batches, the head's input hidden states `hiddens`, on mesh m."""
    params = rules.put_tree(host_params, rules.param_shardings(cfg, m))
    cache = rules.init_cache(cfg, m, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    ops = ops_for_mesh(cfg, m, "reference")

    @jax.jit
    def head(params, cache, hidden, tokens, batch):
        logits, out, cache = mtp_forward(params, cache, hidden, tokens, batch, cfg, ops)
        return logits, out, rules.constrain_cache(cfg, m, cache)

    results = []
    for (tokens, batch), hidden in zip(step_batches()[:2], hiddens, strict=True):
        logits, out, cache = head(params, cache, hidden, tokens, batch)
        results.append((np.asarray(logits), np.asarray(out)))
    want = rules.cache_shardings(cfg, m, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)["mtp"]
    assert all(v.sharding.is_equivalent_to(want[k], v.ndim) for k, v in cache["mtp"].items())  # pages in own shards
    return results


@pytest.mark.parametrize("layout", ["tp2", "ep8"])
def test_sharded_mtp_head_matches_one_device(layout):
    cfg = dataclasses.replace(tiny_config("qwen3_5_moe"), num_mtp_layers=1)
    host_params = jax.tree.map(np.asarray, decoder.random_params(cfg, seed=0, scale=0.05))
    rng = np.random.default_rng(0)
    hiddens = [rng.standard_normal((len(tokens), cfg.hidden_size)).astype(np.float32)
               for tokens, _ in step_batches()[:2]]
    reference = _run(cfg, host_params, hiddens, mesh.make_mesh(1))
    for (logits, out), (ref_logits, ref_out) in zip(_run(cfg, host_params, hiddens, collectives.mesh_for(layout)),
                                                     reference, strict=True):
        assert np.abs(logits - ref_logits).max() <= 1e-5 * np.abs(ref_logits).max()
        assert np.abs(out - ref_out).max() <= 1e-5 * np.abs(ref_out).max()
