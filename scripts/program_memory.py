"""The working memory (XLA's temp buffers) of the step programs a server of these engine arguments would compile, on
this machine's first device, without weights: the replica is sized and built on the weights' shapes as the engine
core builds it, then the programs whose names match --only are compiled and their memory analysis printed, largest
first. Shows which program a start-up would fail on, and why.

    python3 scripts/program_memory.py --model DIR [--only 'forward|verify'] [--max-num-seqs 32] [--max-model-len 4096]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from qwen_jax.engine.compilation import working_bytes
from qwen_jax.engine.core import engine_args
from qwen_jax.engine.model_files import read_model_config, resolve_max_model_len
from qwen_jax.engine.replica import Replica
from qwen_jax.layers.hot_ops import resolve_kernels
from sharding import rules
from sharding.mesh import make_mesh


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--only", default=".", help="a regular expression over the program names")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="skip the KV sizing (the programs' working memory "
                   "hardly depends on it)")
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    args = engine_args(dict(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
                            max_num_batched_tokens=a.max_num_batched_tokens,
                            gpu_memory_utilization=a.gpu_memory_utilization, num_kv_blocks=a.num_kv_blocks))
    args["kernels"] = resolve_kernels(args["kernels"])
    cfg = read_model_config(a.model)
    mesh = make_mesh(1)
    began = time.perf_counter()
    replica = Replica(0, cfg, rules.abstract_params(cfg, mesh), mesh, args, resolve_max_model_len(cfg, a.max_model_len),
                      [cfg.vocab_size - 1], seed=0)
    held = "unknown" if replica.held_back is None else f"{replica.held_back / 2**30:.2f} GiB"
    print(replica.describe(), f"; the caches leave {held}; max_verify_tokens {replica.max_verify_tokens}", flush=True)
    jobs = [key for key in replica.compiler.jobs(list(replica.shapes.token_buckets)) if re.search(a.only, key.name)]
    print(f"{len(jobs)} programs", flush=True)

    def one(key):
        start = time.perf_counter()
        compiled = replica.runner.programs.lower(key).compile()
        analysis = compiled.memory_analysis()
        return dict(name=key.name, temp_gib=round(working_bytes(compiled) / 2**30, 3),
                    argument_gib=round(analysis.argument_size_in_bytes / 2**30, 3),
                    output_gib=round(analysis.output_size_in_bytes / 2**30, 3),
                    alias_gib=round(analysis.alias_size_in_bytes / 2**30, 3),
                    seconds=round(time.perf_counter() - start, 1))

    rows = []
    with ThreadPoolExecutor(a.threads) as pool:
        for row in pool.map(one, jobs):
            print(json.dumps(row), flush=True)
            rows.append(row)
    rows.sort(key=lambda r: -r["temp_gib"])
    print("| program | working GiB | arguments GiB | outputs GiB | aliased GiB |\n|---|---|---|---|---|")
    for r in rows[:25]:
        print(f"| {r['name']} | {r['temp_gib']} | {r['argument_gib']} | {r['output_gib']} | {r['alias_gib']} |")
    print(f"{jax.devices()[0].device_kind}; {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
