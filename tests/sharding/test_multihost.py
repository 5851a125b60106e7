"""Two processes x 4 CPU devices joined by jax.distributed (gloo collectives) run the engine's step program on one
TP 8 expert-parallel mesh and give the same logits as that program in one process on one device."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
from sharding_hosts import HERE, free_port, host_env
from sharding_tiny_models import NUM_REAL, single_device_logits, tiny_config

from qwen_jax.models import decoder

TIMEOUT_S = 150


def test_two_processes_give_single_process_logits(tmp_path):
    port = free_port()
    env = host_env(4)
    outs = [tmp_path / f"host{i}.npz" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "sharding_multihost_worker.py"), str(i), str(port),
                               str(outs[i])], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"host {i} failed:\n{logs[i][-3000:]}"

    cfg = tiny_config("qwen3_5_moe")
    params = jax.tree.map(np.asarray, decoder.random_params(cfg, seed=0, scale=0.05))
    results = [np.load(o) for o in outs]
    for n, ref in enumerate(single_device_logits(cfg, params)):
        for host, result in enumerate(results):
            rel = np.abs(result[f"arr_{n}"][:NUM_REAL] - ref).max() / np.abs(ref).max()
            assert rel <= 1e-5, f"host {host} step {n}: relative error {rel:.2e}"
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    for result in results:  # each host holds its 4 devices' shards: about half the weights, never all of them
        assert total / 2 <= int(result["local_bytes"]) < 0.75 * total
