"""The GDN causal conv kernels (pallas_kernels/causal_conv.py) on a GPU over random shapes (the CPU tests run the same
kernels under Triton's interpreter, in float32 only): the layers' `conv` op on the kernels against its jnp reference,
both compiled as the engine compiles (every bf16 rounding kept), must agree bitwise. Prefill cases: ragged lengths
(rows of 0 to S tokens), odd batch sizes, one to three inputs, channels that do not fill a tile, fresh rows; decode
cases: slots out of order, fresh rows, padding rows (seq_len 0) on a shared sink slot, every other slot checked
untouched. Prints one JSON line a case and exits non-zero on any failure.
Usage (GPU with jax-triton): python3 scripts/check_causal_conv_gpu.py"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import causal_conv
from qwen_jax.engine.runner import EXACT  # compiled as the engine compiles: every bf16 rounding kept

reference = jax.jit(causal_conv.reference_convs, compiler_options=EXACT)
kernel = jax.jit(causal_conv.causal_convs)
rng = np.random.default_rng(0)
bad = 0
for case in range(30):
    decode = case % 2 == 1
    batch = int(rng.integers(1, 70 if decode else 9))
    seq = 1 if decode else int(rng.integers(2, 700))
    shapes = [(int(rng.choice([2, 16])), int(rng.choice([24, 128]))) for _ in range(int(rng.integers(1, 4)))]
    num_slots = 2 * batch + 1
    normal = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    xs = tuple(normal((batch, seq) + s) for s in shapes)
    caches = tuple(normal((num_slots, 3) + s) for s in shapes)
    weights = tuple(normal((4,) + s, 0.5) for s in shapes)
    slots = rng.permutation(np.arange(1, num_slots))[:batch]
    lens = rng.integers(0, seq + 1, batch) if not decode else (rng.random(batch) < 0.85).astype(np.int64)
    slots = np.where(lens == 0, 0, slots) if decode else slots  # decode padding rows share the sink, slot 0
    fresh = rng.random(batch) < 0.3
    args = (xs, caches, weights, jnp.asarray(slots, jnp.int32), jnp.asarray(fresh), jnp.asarray(lens, jnp.int32))
    want, got = reference(*args), kernel(*args)
    keep = np.ones(num_slots, bool)
    keep[0] = not decode or bool(np.all(lens > 0))  # the sink's contents are garbage when padding rows write it
    ok = all(np.array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32)) for g, w in zip(got[0], want[0]))
    ok &= all(np.array_equal(np.asarray(g, np.float32)[keep], np.asarray(w, np.float32)[keep])
              for g, w in zip(got[1], want[1]))
    bad += not ok
    print(json.dumps(dict(case=case, decode=decode, batch=batch, seq=seq, inputs=len(shapes), shapes=shapes,
                          bitwise=bool(ok))), flush=True)
print(json.dumps(dict(cases=30, failures=bad)))
sys.exit(1 if bad else 0)
