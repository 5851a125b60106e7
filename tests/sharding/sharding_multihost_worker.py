"""One host of the 2-process test: joins the cluster, runs the tiny MoE through the engine's step program on a TP 8
(expert-parallel) mesh that spans both processes, and saves the logits of each step. Run by test_multihost.py only,
never imported by tests."""

from __future__ import annotations

import sys

import numpy as np

from sharding import distributed


def main(host_index: int, port: int, out: str) -> None:
    distributed.initialize(num_hosts=2, host_index=host_index, coordinator_address=f"127.0.0.1:{port}", timeout_s=60)
    import jax
    from sharding_tiny_models import BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, packed_steps, tiny_config

    from qwen_jax.engine import step
    from qwen_jax.models import decoder
    from sharding import mesh, rules

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    cfg = tiny_config("qwen3_5_moe")
    host_params = jax.tree.map(np.asarray, decoder.random_params(cfg, seed=0, scale=0.05))
    m = mesh.make_mesh(tensor_parallel_size=8, enable_expert_parallel=True)
    params = rules.put_tree(host_params, rules.param_shardings(cfg, m))
    cache = rules.init_cache(cfg, m, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    replicated = step.replicated(m)  # spans both hosts: each host puts only its own devices' copies (as the runner)
    logits = []
    for last_tokens, buffer, layout in packed_steps():
        step_logits, cache = step.forward(params, cache, rules.put(last_tokens, replicated),
                                          rules.put(buffer, replicated), layout=layout, cfg=cfg, mesh=m,
                                          kernels="reference")
        logits.append(np.asarray(step_logits))
    local_bytes = sum(rules.bytes_per_device(params).values())
    np.savez(out, *logits, local_bytes=np.int64(local_bytes))
    distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
