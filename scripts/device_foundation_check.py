"""Full-size random-weight check of the foundation on one GPU: load, memory, 1,024-token prefill, 100 decode
steps, and BF16-vs-float32 logits on the first 8 layers. Prints a JSON summary; writes nothing else.
"""

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.config import load_config
from qwen_jax.models.decoder import forward, init_cache, make_batch, param_shapes, random_params


def device_bytes() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {k: round(stats.get(k, 0) / 2**30, 2) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="../shared/data/configs/Qwen3.5-35B-A3B.json")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=100)
    ap.add_argument("--compare-layers", type=int, default=8)
    ap.add_argument("--compare-only", action="store_true", help="skip the full-size load/prefill/decode part")
    args = ap.parse_args()
    # The float32 reference must be real float32: XLA on GPU would otherwise use TF32 for float32 matmuls.
    jax.config.update("jax_default_matmul_precision", "highest")
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    cfg = load_config(args.config)
    block_size = 64
    num_blocks = (args.prompt_len + args.decode_steps) // block_size + 4
    step = jax.jit(forward, static_argnames=("cfg", "all_logits"), donate_argnums=(1,))
    prompt = np.random.default_rng(0).integers(0, 248000, size=(1, args.prompt_len))
    table = np.arange(1, num_blocks, dtype=np.int32)[None]
    if not args.compare_only:
        out.update(full_size_run(cfg, args, step, prompt, table, num_blocks, block_size))
    out["bf16_vs_fp32"] = compare_precisions(cfg, args, step, prompt, table, num_blocks, block_size)
    print(json.dumps(out, indent=1))


def full_size_run(cfg, args, step, prompt, table, num_blocks, block_size) -> dict:
    out = {}
    t0 = time.perf_counter()
    params = random_params(cfg, seed=0)
    jax.block_until_ready(params)
    out["load_s"] = round(time.perf_counter() - t0, 2)
    out["param_gib"] = round(sum(x.nbytes for x in jax.tree.leaves(params)) / 2**30, 2)
    cache = init_cache(cfg, num_blocks, block_size, num_slots=2)
    out["after_load"] = device_bytes()
    batch = make_batch(prompt, [0], [args.prompt_len], [1], table)
    t0 = time.perf_counter()
    logits, cache = step(params, cache, batch, cfg)
    logits.block_until_ready()
    out["prefill_first_call_s"] = round(time.perf_counter() - t0, 2)
    # Time a second prefill of the same shape (same slot restarts from position 0).
    t0 = time.perf_counter()
    logits, cache = step(params, cache, batch, cfg)
    logits.block_until_ready()
    out["prefill_s"] = round(time.perf_counter() - t0, 4)
    token = int(jnp.argmax(logits[0]))
    times, tokens = [], []
    for i in range(args.decode_steps):
        b = make_batch([[token]], [args.prompt_len + i], [1], [1], table)
        t0 = time.perf_counter()
        logits, cache = step(params, cache, b, cfg)
        token = int(jnp.argmax(logits[0]))
        times.append(time.perf_counter() - t0)
        tokens.append(token)
    out["decode_first_call_s"] = round(times[0], 2)
    out["decode_step_ms_median"] = round(1000 * float(np.median(times[1:])), 3)
    out["decode_all_finite"] = bool(np.isfinite(np.asarray(logits)).all())
    out["after_decode"] = device_bytes()
    return out


def compare_precisions(cfg, args, step, prompt, table, num_blocks, block_size) -> dict:
    """BF16 vs float32 on the first N layers with identical weights: top-1 agreement and logit error, and the
    relative error of the final hidden state (less sensitive to near-ties of random-weight logits)."""
    small = dataclasses.replace(cfg, num_layers=args.compare_layers, layer_types=cfg.layer_types[:args.compare_layers],
                                moe_layers=tuple(i for i in cfg.moe_layers if i < args.compare_layers))
    p32 = random_params(small.with_dtype("float32"), seed=1)
    shapes16 = param_shapes(small)  # A_log and dt_bias stay float32 in the BF16 model too
    p16 = jax.tree.map(lambda x, s: x.astype(s.dtype), p32, shapes16)
    n = 256
    b = make_batch(prompt[:, :n], [0], [n], [1], table)
    small32 = small.with_dtype("float32")
    l32, _ = step(p32, init_cache(small32, num_blocks, block_size, 2), b, small32, all_logits=True)
    l16, _ = step(p16, init_cache(small, num_blocks, block_size, 2), b, small, all_logits=True)
    l32, l16 = np.asarray(l32[0]), np.asarray(l16[0])
    top32, top16 = l32.argmax(-1), l16.argmax(-1)
    srt = np.sort(l32, axis=-1)
    margin = srt[:, -1] - srt[:, -2]
    decisive = margin > 0.05 * np.abs(l32).max()
    return {
        "layers": args.compare_layers, "tokens": n,
        "top1_agreement": float((top32 == top16).mean()),
        "max_abs_err": float(np.abs(l32 - l16).max()),
        "max_rel_err": float(np.abs(l32 - l16).max() / np.abs(l32).max()),
        "logit_absmax": float(np.abs(l32).max()),
        "top1_agreement_where_fp32_margin_gt_5pct": float((top32 == top16)[decisive].mean()) if decisive.any()
        else None,
        "decisive_positions": int(decisive.sum()),
        "mean_rel_err_per_position": float(np.mean(np.linalg.norm(l32 - l16, axis=-1)
                                                   / np.linalg.norm(l32, axis=-1))),
    }


if __name__ == "__main__":
    main()
