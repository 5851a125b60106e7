"""Decode step time of the engine's jitted step (forward + sampler) at several batch sizes, next to the memory
roofline, plus a per-layer-type breakdown and compile times: where a decode step's time goes.

Random weights with the real shapes (`dummy`); reads nothing from disk but config.json. Prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.bench.gpu_profile import profile_calls
from qwen_jax.bench.roofline import H200_TBPS, decode_bytes, prefill_flops_per_token
from qwen_jax.config import load_config
from qwen_jax.engine import runner
from qwen_jax.engine.runner import run_step
from qwen_jax.engine.sampler import SamplingTensors
from qwen_jax.layers.attention import attention_layer
from qwen_jax.layers.gated_deltanet import gdn_layer
from qwen_jax.layers.mlp import swiglu_mlp
from qwen_jax.layers.ops import ops_for
from qwen_jax.models.decoder import make_batch, prepare_batch, random_params
from qwen_jax.sampling_params import SamplingParams
from sharding import rules
from sharding import step as sharded_step
from sharding.mesh import describe, make_mesh


def _time(fn, *args, repeats: int = 20) -> tuple[float, float]:
    """(first call incl. compile, median of repeats) in seconds."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times))


def decode_batch(batch: int, context: int, block_size: int, width: int, vocab_size: int = 2) -> dict:
    """Rows with distinct random tokens (identical rows would all route to the same 8 experts)."""
    tables = np.arange(1, batch * width + 1, dtype=np.int32).reshape(batch, width)
    tokens = np.random.default_rng(batch).integers(1, vocab_size, (batch, 1), dtype=np.int32)
    return make_batch(tokens, np.full(batch, context), np.ones(batch), np.arange(1, batch + 1), tables)


def host_breakdown(params: dict, state: dict, batch: dict, cfg, mesh, layers_per_program: int,
                   steps: int = 20) -> dict:
    """A step as the engine's ModelRunner.execute runs it, host milliseconds (median) in each part: put the sampling
    tensors and the batch (with prepare_batch's mask) on the devices, dispatch the layers' program(s), dispatch the
    head + sampler, then wait for the sampled tokens on the host. Where the step's wall time goes beside the GPU's."""
    rows = batch["tokens"].shape[0]
    host_tensors = SamplingTensors.build_host([SamplingParams(temperature=0.0)] * rows, [0] * rows, [None] * rows,
                                              vocab_size=cfg.vocab_size, batch_size=rows)
    parts = {k: [] for k in ("put_tensors", "put_batch", "layers", "head", "wait", "total")}
    for i in range(steps + 3):
        t = [time.perf_counter()]
        tensors = SamplingTensors(*runner.put_batch(tuple(host_tensors), mesh))
        t.append(time.perf_counter())
        on_device = runner.put_batch(prepare_batch(batch), mesh)
        t.append(time.perf_counter())
        x, state["cache"] = runner.run_layers(params, state["cache"], on_device, cfg, mesh, layers_per_program)
        t.append(time.perf_counter())
        out = runner._head_sample(x, runner.head_params(params), on_device, tensors, cfg=cfg, num_top_logprobs=0)
        t.append(time.perf_counter())
        np.asarray(out.tokens)
        t.append(time.perf_counter())
        if i >= 3:  # the first calls compile
            for key, a, b in zip(parts, t, t[1:]):
                parts[key].append(b - a)
            parts["total"].append(t[-1] - t[0])
    return {k: round(float(np.median(v)) * 1e3, 3) for k, v in parts.items()}


def _prefill_row(params: dict, state: dict, cfg, mesh, length: int, block_size: int, profile: bool) -> dict:
    """One step that prefills a whole prompt of `length` random tokens (one row, from position 0)."""
    width = -(-length // block_size)
    tokens = np.random.default_rng(length).integers(1, cfg.vocab_size, (1, length), dtype=np.int32)
    batch = make_batch(tokens, [0], [length], [1], np.arange(1, width + 1)[None])
    tensors = SamplingTensors.build([SamplingParams(temperature=0.0)], [0], [None], vocab_size=cfg.vocab_size,
                                    batch_size=1)

    def step():
        out, state["cache"] = run_step(params, state["cache"], batch, tensors, cfg, 0, mesh)
        return out.tokens

    first, median = _time(step, repeats=5)
    row = {"prefill_tokens": length, "compile_and_first_s": round(first, 2), "step_ms": round(median * 1e3, 2),
           "tokens_per_s": round(length / median),
           "tflops": round(prefill_flops_per_token(cfg, length) * length / median / 1e12, 1)}
    if profile:
        row["profile"] = profile_calls(step, calls=2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kernels", default="reference", choices=("reference", "gpu"))
    ap.add_argument("--bandwidth", type=float, default=H200_TBPS, help="TB/s used for the roofline")
    ap.add_argument("--layers-per-program", default="1",
                    help="comma-separated values of the engine's layers_per_program to compare (0: all layers)")
    ap.add_argument("--profile", action="store_true",
                    help="also sum the GPU kernels of each step under the profiler (gpu_profile.py)")
    ap.add_argument("--prefill", default="",
                    help="comma-separated prompt lengths: time one prefill step of one prompt of each length")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="one replica over this many devices (the engine's layouts; kernels must be 'reference')")
    ap.add_argument("--enable-expert-parallel", action="store_true", help="experts split over the devices (EP)")
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer-type breakdown")
    ap.add_argument("--host-breakdown", action="store_true",
                    help="also time each decode step's host parts as the engine runs them (host_breakdown)")
    args = ap.parse_args()
    cfg = load_config(args.config).with_kernels(args.kernels)
    batches = [int(b) for b in args.batches.split(",")]
    block_size = 16
    width = (args.context + 1 + block_size - 1) // block_size
    mesh = make_mesh(args.tensor_parallel_size, 1, args.enable_expert_parallel)  # the engine's step takes its mesh
    params = random_params(cfg, shardings=rules.param_shardings(cfg, mesh))
    cache = sharded_step.init_cache(cfg, mesh, max(batches) * width + 1, block_size, max(batches) + 1)
    report = {"device": str(jax.devices()[0]), "config": args.config, "context": args.context,
              "kernels": args.kernels, "mesh": describe(mesh), "decode": [], "prefill": [], "layers": [],
              "param_gib_per_device": [round(b / 2**30, 2) for b in rules.bytes_per_device(params).values()]}
    print(json.dumps({k: report[k] for k in ("mesh", "param_gib_per_device")}), flush=True)
    state = {"cache": cache}
    for lpp in [int(v) for v in args.layers_per_program.split(",")]:
        for b in batches:
            batch = decode_batch(b, args.context, block_size, width, cfg.vocab_size)
            tensors = SamplingTensors.build([SamplingParams(temperature=0.0)] * b, [0] * b, [None] * b,
                                            vocab_size=cfg.vocab_size, batch_size=b)

            def step(batch=batch, tensors=tensors, lpp=lpp):
                out, state["cache"] = run_step(params, state["cache"], batch, tensors, cfg, 0, mesh, lpp)
                return out.tokens

            first, median = _time(step)
            need = decode_bytes(cfg, b, args.context)
            total = need.total if hasattr(need, "total") else float(need)
            row = {"layers_per_program": lpp, "batch": b, "compile_and_first_s": round(first, 2),
                   "step_ms": round(median * 1e3, 3), "roofline_ms": round(total / (args.bandwidth * 1e12) * 1e3, 3),
                   "fraction_of_roofline": round(total / (args.bandwidth * 1e12) / median, 3)}
            if args.profile:
                row["profile"] = profile_calls(step)
            if args.host_breakdown:
                row["host_ms"] = host_breakdown(params, state, batch, cfg, mesh, lpp)
            row["peak_gib_per_device"] = [round((d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2)
                                          for d in mesh.devices.flat]
            report["decode"].append(row)
            print(json.dumps(row), flush=True)
    for length in [int(v) for v in args.prefill.split(",") if v]:
        report["prefill"].append(_prefill_row(params, state, cfg, mesh, length, block_size, args.profile))
        print(json.dumps(report["prefill"][-1]), flush=True)
    cache = state["cache"]
    if args.no_layers or mesh.size > 1:
        print(json.dumps(report))
        return

    # One layer of each kind at each batch: which part of the step dominates.
    attn_i = cfg.attention_layers[0]
    gdn_i = cfg.linear_layers[0] if cfg.linear_layers else None
    inv = jnp.asarray(cfg.rope_inv_freq())
    ops = ops_for(cfg.kernels)
    for b in batches:
        batch = dict(decode_batch(b, args.context, block_size, width))
        batch["valid"] = jnp.ones((b, 1), bool)
        x = jax.random.normal(jax.random.key(0), (b, 1, cfg.hidden_size), jnp.float32).astype(cfg.jnp_dtype)
        row = {"batch": b}
        f = jax.jit(lambda x, p, c, bt: attention_layer(x, p, c, bt, cfg, inv, ops.attention, ops.dense)[0])
        row["attention_ms"] = round(_time(f, x, params["layers"][attn_i]["mixer"], cache["layers"][attn_i], batch)[1]
                                    * 1e3, 3)
        if gdn_i is not None:
            f = jax.jit(lambda x, p, c, bt: gdn_layer(x, p, c, bt, cfg, ops.delta_rule, ops.dense, ops.conv)[0])
            row["gdn_ms"] = round(_time(f, x, params["layers"][gdn_i]["mixer"], cache["layers"][gdn_i], batch)[1]
                                  * 1e3, 3)
        mlp = params["layers"][0]["mlp"]
        flat = x.reshape(b, -1)
        if cfg.is_moe_layer(0):
            f = jax.jit(lambda x, p: ops.moe(x, p, cfg.num_experts_per_tok, cfg.norm_topk_prob))
        else:
            f = jax.jit(lambda x, p: swiglu_mlp(x, p["w_gate"], p["w_up"], p["w_down"], ops.dense))
        row["mlp_ms"] = round(_time(f, flat, mlp)[1] * 1e3, 3)
        head = params.get("lm_head", params["embed"].T)
        f = jax.jit(lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32))
        row["lm_head_ms"] = round(_time(f, flat, head)[1] * 1e3, 3)
        n_attn, n_gdn = len(cfg.attention_layers), len(cfg.linear_layers)
        row["sum_of_layers_ms"] = round(n_attn * row["attention_ms"] + n_gdn * row.get("gdn_ms", 0)
                                        + cfg.num_layers * row["mlp_ms"] + row["lm_head_ms"], 3)
        report["layers"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
