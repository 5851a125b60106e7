"""The native Triton MoE path on a GPU over random shapes (the CPU tests run the same kernels under Triton's
interpreter, in float32 only): moe_triton.plan must return moe_gemm.plan's arrays, and routed experts through the
native kernels (random block_m and tail_m, experts held elsewhere, skewed routings, odd token counts, expert counts
that are not powers of two) must match the jnp reference within bf16 rounding. Prints one JSON line a case and
exits non-zero on any failure. Usage (GPU with jax-triton): python3 scripts/check_moe_triton_gpu.py"""
import functools
import json
import sys

import jax
import jax.numpy as jnp
import jax_triton
import numpy as np

from pallas_kernels import moe_gemm, moe_triton
from qwen_jax.layers.mlp import routed_experts_f32

reference_plan = jax.jit(moe_gemm.plan, static_argnums=(1, 3))
native_plan = jax.jit(functools.partial(moe_triton.plan, triton_call=jax_triton.triton_call), static_argnums=(1, 3))
rng = np.random.default_rng(0)
bad = 0
for case in range(40):
    experts = int(rng.choice([8, 20, 64, 256]))
    top_k = int(rng.integers(1, min(8, experts) + 1))
    tokens = int(rng.integers(1, 3000))
    num_local = int(rng.choice([experts, max(1, experts // 2)]))
    first = int(rng.choice([0, experts - num_local]))
    block_m = int(rng.choice([16, 32, 64, 128]))
    skew = rng.random() < 0.3
    p = rng.dirichlet(np.ones(experts) * (0.2 if skew else 5.0))
    ids = np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(tokens)]).astype(np.int32)
    ids = jnp.asarray(ids)
    want = [np.asarray(a) for a in reference_plan(ids, num_local, first, block_m)]
    got = [np.asarray(a) for a in native_plan(ids, num_local, jnp.int32(first), block_m)]
    used = int(want[3][0]) * block_m
    ok = np.array_equal(got[0][:used], want[0][:used]) and all(np.array_equal(g, w) for g, w in zip(got[1:], want[1:]))
    # the GEMMs on small dims with these routings
    h, i = 256, 128
    k = jax.random.split(jax.random.key(case), 5)
    x = jax.random.normal(k[0], (tokens, h)).astype(jnp.bfloat16)
    w = jax.random.uniform(k[1], (tokens, top_k)).astype(jnp.bfloat16)
    wg = (jax.random.normal(k[2], (num_local, h, i)) * 0.05).astype(jnp.bfloat16)
    wu = (jax.random.normal(k[3], (num_local, h, i)) * 0.05).astype(jnp.bfloat16)
    wd = (jax.random.normal(k[4], (num_local, i, h)) * 0.05).astype(jnp.bfloat16)
    tail = int(rng.choice([block_m, max(16, block_m // 2), 16]))
    out = jax.jit(functools.partial(moe_gemm.routed_experts, triton=True, block_m=block_m, tail_m=tail,
                                    block_n=64, block_k=64, num_warps=4, num_stages=3))(x, w, ids, wg, wu, wd, first)
    ref = jax.jit(routed_experts_f32)(x, w, ids, wg, wu, wd, first)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    err = float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))
    line = dict(case=case, experts=experts, local=num_local, first=first, top_k=top_k, tokens=tokens, block_m=block_m,
                tail_m=tail, skew=skew, plan_equal=ok, rel_err=err, finite=bool(np.isfinite(out).all()))
    bad += (not ok) or err > 2e-2 or not line["finite"]
    print(json.dumps(line), flush=True)
print(f"{bad} of 40 cases failed")
sys.exit(1 if bad else 0)
