"""What the sampler's pieces cost on the device at Qwen3.5's vocabulary: the full sampler (engine/sampler.py `sample`)
by top-k/top-p path and top-logprobs width, and the primitives behind them (lax.top_k, a full sort), for several row
counts. Each is run ITERS times inside one jitted loop (fresh logits each time), so the figure is device time a call,
without the host's issue cost.

    python3 scripts/sampler_cost.py [--vocab 248320] [--rows 1,8,32,64,256] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.engine.sampler import SamplingTables, SamplingTensors, sample, table_shapes
from qwen_jax.sampling_params import SamplingParams


def timed(fn, *args, iters: int) -> float:
    """Milliseconds a call of fn(*args, i) takes on the device: `iters` calls in one jitted loop."""
    @jax.jit
    def loop(*args):
        def body(i, acc):
            out = fn(*args, i)
            return acc + jnp.sum(jax.tree.leaves(out)[0].astype(jnp.float32))
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

    jax.block_until_ready(loop(*args))
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        jax.block_until_ready(loop(*args))
        best = min(best, time.perf_counter() - began)
    return 1e3 * best / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--rows", default="1,8,32,64,256")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    vocab = args.vocab
    results = []
    for rows in map(int, args.rows.split(",")):
        logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32) * 4

        def noisy(i, logits=logits):  # fresh logits each call, so nothing is hoisted out of the loop
            return logits + i.astype(jnp.float32) * 1e-3

        row = {"rows": rows}
        row["top_k64_ms"] = timed(lambda x, i: jax.lax.top_k(noisy(i), 64)[0], logits, iters=args.iters)
        row["top_k20_ms"] = timed(lambda x, i: jax.lax.top_k(noisy(i), 20)[0], logits, iters=args.iters)
        row["sort_ms"] = timed(lambda x, i: -jnp.sort(-noisy(i), axis=-1), logits, iters=args.iters)
        settings = {0: SamplingParams(temperature=1.0), 1: SamplingParams(temperature=1.0, top_k=20, top_p=0.95),
                    2: SamplingParams(temperature=1.0, top_p=0.95)}
        tables = SamplingTables(*(jnp.zeros(s.shape, s.dtype) for s in table_shapes(rows + 1, vocab)))
        for path, params in settings.items():
            tensors = SamplingTensors.build([params] * rows, [0] * rows, list(range(rows)), vocab_size=vocab,
                                            batch_size=rows, num_slots=rows + 1)
            for top in (0, 20):
                def call(t, tables, i, path=path, top=top):
                    return sample(noisy(i), t, tables, num_top_logprobs=top, path=path)[0].tokens
                row[f"sample_path{path}_top{top}_ms"] = timed(call, tensors, tables, iters=args.iters)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        results.append(row)
    keys = [k for k in results[0] if k != "rows"]
    print("| ms a call | " + " | ".join(str(r["rows"]) + " rows" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{r[k]:.3f}" for r in results) + " |")
    print(f"device: {jax.devices()[0].device_kind}; vocab {vocab}; {args.iters} calls a loop, best of 3; "
          f"jax {jax.__version__}; numpy {np.__version__}")


if __name__ == "__main__":
    main()
