"""The GDN causal conv kernels (pallas_kernels/causal_conv.py) on a GPU over random ragged batches (the CPU tests run
the same kernels under Triton's interpreter, in float32 only): the kernels against the layers' `conv` op reference
(qwen_jax.layers.gated_deltanet.causal_convs), both compiled as the engine compiles (every bf16 rounding kept), caches
donated. The real tokens' outputs and every cache slot must agree bitwise, padding tokens' outputs be 0, and the
compiled kernels copy no cache (they update it in place).
Cases: decode rows and prefill chunks mixed (chunks mid-sequence, fresh prompts, one-token prompts, requests shorter
than the conv's state), requests shuffled on the token axis between padding tokens, padding requests, slots out of
order, one to three inputs, channel counts that do not fill a tile, bf16 and float32; every third case a decode step.
Prints one JSON line a case and exits non-zero on any failure.
Usage (GPU with jax-triton): python3 scripts/check_causal_conv_gpu.py"""
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import causal_conv
from qwen_jax.engine.step import EXACT  # the engine's compile options: every bf16 rounding kept
from qwen_jax.layers.batch import Ragged, ragged
from qwen_jax.layers.gated_deltanet import causal_convs

CASES = 30


def shuffled_batch(rng, requests, num_tokens, num_requests) -> Ragged:
    """A Ragged of `requests` ((start position, new tokens, slot) each) at random request indices among
    `num_requests` (the others padding requests), laid out on the token axis in another random order, with padding
    tokens before, between and after them."""
    count, total = len(requests), sum(n for _, n, _ in requests)
    index = rng.permutation(num_requests)[:count]
    gaps = rng.multinomial(num_tokens - total, np.full(count + 1, 1 / (count + 1)))
    query_start, at = np.zeros(count, np.int32), 0
    for gap, i in zip(gaps, rng.permutation(count)):
        query_start[i], at = at + gap, at + gap + requests[i][1]
    starts, lens, slots = zip(*requests, strict=True)
    return ragged(starts, lens, slots, [[]] * count, num_tokens, num_requests, 1, query_start, index)


def cache_copies(hlo: str, sizes: set[int]) -> list[str]:
    """The copy instructions of compiled HLO text whose element count is one of `sizes` (the caches')."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= \w+\[([\d,]*)\]\S* copy\(", line)
        if match and int(np.prod([int(d) for d in match.group(1).split(",") if d])) in sizes:
            found.append(line.strip()[:160])
    return found


def main() -> int:
    reference = jax.jit(causal_convs, compiler_options=EXACT, donate_argnums=(1,))
    kernel = jax.jit(causal_conv.causal_convs, donate_argnums=(1,))
    rng = np.random.default_rng(0)
    bad = 0
    for case in range(CASES):
        decode = case % 3 == 0
        count = int(rng.integers(1, 70 if decode else 10))
        if decode:
            lens = [1] * count
        else:  # one token, shorter than the state (2-3), or a chunk of up to 700
            lens = [int(rng.choice([1, int(rng.integers(2, 4)), int(rng.integers(4, 700))])) for _ in range(count)]
        starts = [0 if rng.random() < 0.3 else int(rng.integers(1, 2000)) for _ in range(count)]
        num_slots = 2 * count + 1
        slots = rng.permutation(np.arange(1, num_slots))[:count]  # slot 0: the padding requests' sink
        num_tokens = sum(lens) + int(rng.integers(0, 20))
        num_requests = count + int(rng.integers(0, 4))
        batch = shuffled_batch(rng, list(zip(starts, lens, slots.tolist())), num_tokens, num_requests)
        dtype = jnp.float32 if case % 5 == 4 else jnp.bfloat16
        shapes = [(int(rng.choice([2, 16])), int(rng.choice([24, 128]))) for _ in range(int(rng.integers(1, 4)))]
        normal = lambda shape, scale=1.0, dtype=dtype: jnp.asarray(scale * rng.standard_normal(shape), dtype)  # noqa: E731
        xs = tuple(normal((num_tokens,) + s) for s in shapes)
        caches = tuple(normal((num_slots, 3) + s) for s in shapes)
        weights = tuple(normal((4,) + s, 0.5) for s in shapes)
        batch = jax.tree.map(jnp.asarray, batch)
        want = reference(xs, tuple(jnp.array(c) for c in caches), weights, batch)
        compiled = kernel.lower(xs, caches, weights, batch).compile()
        got = compiled(xs, tuple(jnp.array(c) for c in caches), weights, batch)
        valid = np.asarray(batch.token_valid)
        ok = all(np.array_equal(np.asarray(g, np.float32)[valid], np.asarray(w, np.float32)[valid])
                 for g, w in zip(got[0], want[0]))
        zeros = all(not np.asarray(g, np.float32)[~valid].any() for g in got[0])
        same_caches = all(np.array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
                          for g, w in zip(got[1], want[1]))
        copies = cache_copies(compiled.as_text(), {c.size for c in caches})
        good = ok and zeros and same_caches and not copies
        bad += not good
        print(json.dumps(dict(case=case, decode=decode, requests=count, tokens=num_tokens, lens=lens[:12],
                              dtype=jnp.dtype(dtype).name, inputs=len(shapes), shapes=shapes, outputs_bitwise=ok,
                              padding_zero=zeros, caches_bitwise=same_caches, cache_copies=copies, ok=good)),
              flush=True)
    print(json.dumps(dict(cases=CASES, failures=bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
