"""Step time of the served step (engine/step.py: the forward and the sampler, issued one step ahead as the engine
core issues them) for decode batches and one-prompt prefills, next to the memory roofline (decode) and the FLOP rate
(prefill), plus one layer of each kind timed alone: where a step's time goes. A decode batch runs as many decode
steps per program as the engine would run it (num_scheduler_steps). `--verify`: speculative decoding's verify step
for k drafts a row (step.verify_step, on a runner that drafts k), next to the plain decode step of that runner.

Random weights with the real shapes (`dummy`); reads nothing from disk but config.json. Fake sequences stand in for
requests (no scheduler runs). Prints one JSON line per measurement, then the whole report as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.bench.gpu_profile import profile_calls
from qwen_jax.bench.roofline import H200_TBPS, decode_bytes, prefill_flops_per_token
from qwen_jax.bench.speculative import spec_config
from qwen_jax.config import load_config
from qwen_jax.engine import buckets
from qwen_jax.engine.core import engine_args
from qwen_jax.engine.programs import VERIFY_ROUNDS_PER_DECODE_STEP
from qwen_jax.engine.replica import DECODE_STEPS, Replica
from qwen_jax.engine.runner import ModelRunner
from qwen_jax.engine.scheduler import Row
from qwen_jax.engine.sequence import Sequence
from qwen_jax.engine.speculative import parse_speculative_config
from qwen_jax.layers.attention import attention_layer
from qwen_jax.layers.batch import ragged
from qwen_jax.layers.gated_deltanet import gdn_layer
from qwen_jax.layers.hot_ops import ops_for
from qwen_jax.layers.mlp import swiglu_mlp
from qwen_jax.sampling_params import SamplingParams
from qwen_jax.weights import dummy_params
from sharding import rules
from sharding.mesh import describe, make_mesh

BLOCK_SIZE = 16
_GREEDY = SamplingParams(temperature=0.0)


def blocks_for(length: int, steps: int = 1) -> int:
    """KV blocks of a sequence of `length` tokens that samples `steps` more."""
    return -(-(length + steps - 1) // BLOCK_SIZE)


def fake_sequences(count: int, length: int, vocab_size: int, seed: int, steps: int = 1) -> list[Sequence]:
    """`count` sequences of `length` random tokens each (identical rows would all route to the same experts), on
    state slots 1..count and KV blocks 1, 2, ... (each its own, covering its tokens and `steps` samples), as the
    scheduler leaves a sequence with `steps` samples pending."""
    width = blocks_for(length, steps)
    rng = np.random.default_rng([seed, count, length])
    seqs = []
    for i in range(count):
        seq = Sequence(f"fake-{i}", rng.integers(1, vocab_size, length).tolist(), _GREEDY)
        seq.slot, seq.block_table, seq.num_pending = i + 1, list(range(1 + i * width, 1 + (i + 1) * width)), steps
        seqs.append(seq)
    return seqs


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def time_steps(runner: ModelRunner, rows: list[Row], steps: int) -> dict:
    """The step of `rows` run `steps` times in the engine core's order: each issued before the previous one's tokens
    are read back (a verify step: caught up on the previous one on the device, as the core runs it). Median
    milliseconds of each iteration (in steady state: the step's time) and of its host parts: building the step's
    inputs, issuing its programs, waiting for the previous step's tokens. The first step (compiling its programs)
    is timed apart."""
    t0 = time.perf_counter()
    runner.fetch(runner.execute(runner.prepare(rows)))
    first = time.perf_counter() - t0
    parts = {"prepare": [], "issue": [], "wait": [], "step": []}
    in_flight = rows if rows[0].drafts else []
    previous = runner.execute(runner.prepare(rows))
    for _ in range(steps):
        t = [time.perf_counter()]
        ops = runner.prepare(rows, in_flight=in_flight)
        t.append(time.perf_counter())
        out = runner.execute(ops)
        t.append(time.perf_counter())
        runner.fetch(previous)
        t.append(time.perf_counter())
        previous = out
        for key, a, b in zip(("prepare", "issue", "wait"), t, t[1:]):
            parts[key].append(b - a)
        parts["step"].append(t[-1] - t[0])
    runner.fetch(previous)
    return {"compile_and_first_s": round(first, 2), "step_ms": _median_ms(parts.pop("step")),
            "host_ms": {k: _median_ms(v) for k, v in parts.items()}}


def gpu_ms(runner: ModelRunner, rows: list[Row]) -> float:
    """GPU busy milliseconds of one step of `rows`, the MTP head's drafts included (the last thing a step of a
    runner that speculates writes)."""
    return profile_calls(lambda: (runner.execute(runner.prepare(rows)).tokens, runner.drafts), calls=3,
                         top=0)["gpu_busy_ms_per_call"]


def decode_row(runner: ModelRunner, cfg, batch: int, context: int, steps: int, bandwidth: float,
               profile: int) -> dict:
    """Decode steps of `batch` rows, each one token at position `context` (its `context` earlier tokens' KV pages in
    its block table), as many a program as the engine runs for this batch (`decode_steps`; then `step_ms` is the
    program's and `token_ms` each token's)."""
    seqs = fake_sequences(batch, context + 1, cfg.vocab_size, 0, 1)
    decode_steps = runner.shapes.decode_steps_for(len(seqs))
    if decode_steps > 1:  # room for the program's steps in the block tables
        seqs = fake_sequences(batch, context + 1, cfg.vocab_size, 0, decode_steps)
    rows = [Row(seq, context, 1, samples=True, steps=decode_steps) for seq in seqs]
    timed = time_steps(runner, rows, steps)
    token_ms = timed["step_ms"] / decode_steps
    roofline_s = decode_bytes(cfg, batch, context).seconds(bandwidth)
    row = {"decode_batch": batch, "context": context, "decode_steps": decode_steps, **timed,
           "token_ms": round(token_ms, 3), "roofline_ms": round(roofline_s * 1e3, 3),
           "fraction_of_roofline": round(roofline_s * 1e3 / token_ms, 3)}
    if profile:
        row["profile"] = profile_calls(lambda: runner.execute(runner.prepare(rows)).tokens, top=profile)
    return row


def verify_row(runner: ModelRunner, cfg, batch: int, context: int, steps: int, profile: int = 0) -> dict:
    """Speculative decoding's step of `batch` decoding rows at position `context` on a runner that drafts
    k = runner.num_speculative_tokens tokens. k = 0: the plain one-token decode step. Else the verify step as the
    scheduler makes it (each row its last token and k drafts, Scheduler._speculate, in as many rounds a program as
    the engine runs for that many rows): step.verify_step verifies the drafts the head left on the device, commits
    every recurrent state and drafts the next k, round after round, and each program is issued before the one
    before it is read back. Wall and GPU time of a program and of each round; `profile`: also its TOP kernels."""
    k = runner.num_speculative_tokens
    rounds = runner.shapes.verify_rounds_for(batch) if k else 1
    # blocks for every round's tokens and the positions its last drafts are made at
    seqs = fake_sequences(batch, context + 1, cfg.vocab_size, 2, rounds * (k + 1) + k)
    row = {"verify_batch": batch, "draft_tokens": k, "rounds": rounds, "context": context}
    if not k:
        rows = [Row(seq, context, 1, samples=True) for seq in seqs]
        row.update(time_steps(runner, rows, steps), gpu_ms=gpu_ms(runner, rows))
    else:
        rows = [Row(seq, context, k + 1, samples=True, drafts=k, steps=rounds) for seq in seqs]
        row.update(time_steps(runner, rows, steps), gpu_ms=gpu_ms(runner, rows))
    if profile:
        row["profile"] = profile_calls(lambda: (runner.execute(runner.prepare(rows)).tokens, runner.drafts),
                                       calls=3, top=profile)
    if not k:
        return row
    return {**row, "round_ms": round(row["step_ms"] / rounds, 3), "round_gpu_ms": round(row["gpu_ms"] / rounds, 3)}


def free_cache(runner: ModelRunner) -> None:
    """Delete a runner's cache and step state on the device now, not whenever the collector runs (the params stay:
    the next runner shares them), so the device holds one runner's cache at a time."""
    state = (runner.cache, runner.snapshots, runner.tables, runner.last_tokens, runner.drafts)
    jax.block_until_ready(state)
    for array in jax.tree.leaves(state):
        array.delete()
    gc.collect()


def prefill_row(runner: ModelRunner, cfg, length: int, steps: int, profile: int) -> dict:
    """Steps that prefill one whole prompt of `length` tokens from position 0."""
    rows = [Row(fake_sequences(1, length, cfg.vocab_size, 1)[0], 0, length, samples=True)]
    timed = time_steps(runner, rows, steps)
    seconds = timed["step_ms"] / 1e3
    row = {"prefill_tokens": length, **timed, "tokens_per_s": round(length / seconds),
           "tflops": round(prefill_flops_per_token(cfg, length) * length / seconds / 1e12, 1)}
    if profile:
        row["profile"] = profile_calls(lambda: runner.execute(runner.prepare(rows)).tokens, calls=2, top=profile)
    return row


def _time(fn, *args, repeats: int = 20) -> float:
    """Median seconds of a call (after one that compiles), waiting for each."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def layer_row(runner: ModelRunner, cfg, batch: int, context: int) -> dict:
    """One layer of each kind (attention, Gated DeltaNet, MLP or MoE) and the LM head alone on a decode batch of
    `batch` tokens at position `context`, and their sum over the model's layers (milliseconds)."""
    params, cache = runner.params, runner.cache
    width = blocks_for(context + 1)
    tables = [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(batch)]
    ragged_batch = jax.tree.map(jnp.asarray, ragged([context] * batch, [1] * batch, range(1, batch + 1), tables,
                                                    batch, batch, runner.shapes.table_width))
    x = jax.random.normal(jax.random.key(0), (batch, cfg.hidden_size), jnp.float32).astype(cfg.jnp_dtype)
    inv, ops = jnp.asarray(cfg.rope_inv_freq()), ops_for(runner.shapes.kernels)
    row = {"layer_batch": batch}
    attn_i = cfg.attention_layers[0]
    f = jax.jit(lambda x, p, c, b: attention_layer(x, p, c, b, cfg, inv, ops.attention, ops.dense)[0])
    row["attention_ms"] = round(_time(f, x, params["layers"][attn_i]["mixer"], cache["layers"][attn_i],
                                      ragged_batch) * 1e3, 3)
    if cfg.linear_layers:
        gdn_i = cfg.linear_layers[0]
        f = jax.jit(lambda x, p, c, b: gdn_layer(x, p, c, b, cfg, ops.delta_rule, ops.dense, ops.conv)[0])
        row["gdn_ms"] = round(_time(f, x, params["layers"][gdn_i]["mixer"], cache["layers"][gdn_i],
                                    ragged_batch) * 1e3, 3)
    if cfg.is_moe_layer(0):
        f = jax.jit(lambda x, p: ops.moe(x, p, cfg.num_experts_per_tok, cfg.norm_topk_prob))
    else:
        f = jax.jit(lambda x, p: swiglu_mlp(x, p["w_gate"], p["w_up"], p["w_down"], ops.dense))
    row["mlp_ms"] = round(_time(f, x, params["layers"][0]["mlp"]) * 1e3, 3)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    f = jax.jit(lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32))
    row["lm_head_ms"] = round(_time(f, x, head) * 1e3, 3)
    row["sum_of_layers_ms"] = round(len(cfg.attention_layers) * row["attention_ms"]
                                    + len(cfg.linear_layers) * row.get("gdn_ms", 0.0)
                                    + cfg.num_layers * row["mlp_ms"] + row["lm_head_ms"], 3)
    return row


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: Seq[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--batches", default="1,16,64", help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, default=1024, help="tokens each decode row has cached")
    ap.add_argument("--kernels", default="reference", choices=("reference", "gpu"))
    ap.add_argument("--bandwidth", type=float, default=H200_TBPS, help="TB/s used for the roofline")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per decode batch (prefill: a quarter)")
    ap.add_argument("--num-scheduler-steps", type=int, default=None,
                    help="decode steps per program for small batches, as the engine argument (default: the engine's)")
    ap.add_argument("--profile", type=int, nargs="?", const=15, default=0, metavar="TOP",
                    help="also sum the GPU kernels of each step under the profiler (gpu_profile.py) and list the TOP "
                         "(default 15) that take the most time")
    ap.add_argument("--prefill", default="",
                    help="comma-separated prompt lengths: time the step that prefills one prompt of each length")
    ap.add_argument("--verify", default="",
                    help="comma-separated draft counts k (0..3; k > 0 needs a config with an MTP head): time each "
                         "decode batch's verify step with k drafts a row, and the plain step (k = 0: without the head)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="one replica over this many devices")
    ap.add_argument("--enable-expert-parallel", action="store_true", help="experts split over the devices (EP)")
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer-kind breakdown")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    batches, prefills, drafts = _ints(args.batches), _ints(args.prefill), sorted(set(_ints(args.verify)))
    for k in drafts:  # a bad k fails before any weights are made
        parse_speculative_config(spec_config(k))
    if any(drafts) and not cfg.has_mtp:
        raise ValueError("--verify with k > 0 needs a config with an MTP head (mtp_num_hidden_layers 1)")
    mesh = make_mesh(args.tensor_parallel_size, 1, args.enable_expert_parallel)
    params = dummy_params(cfg, seed=0, shardings=rules.param_shardings(cfg, mesh))
    ahead = args.num_scheduler_steps or DECODE_STEPS  # decode steps a program may run past the context
    # positions past the context a decode row (or a verify row's rounds and their drafts) writes
    room = max([ahead, *(ahead * VERIFY_ROUNDS_PER_DECODE_STEP * (k + 1) + k for k in drafts)])
    longest = max([args.context + room, *prefills])
    # KV blocks for every decode row's context; a prefill reuses the first rows' blocks.
    blocks = max(max(batches, default=0) * blocks_for(args.context + 1, room), blocks_for(longest))

    def build_runner(k: int, token_counts: list[int]) -> ModelRunner:
        """A runner over `params` that drafts k tokens a row (0: none), with the buckets of `token_counts` compiled
        up front several at once (as the engine's warm-up does), with the samplers its greedy rows use."""
        sizes = engine_args(dict(max_num_seqs=max(batches, default=1), max_num_batched_tokens=max(token_counts),
                                 block_size=BLOCK_SIZE, enable_prefix_caching=False, num_kv_blocks=blocks,
                                 num_scheduler_steps=args.num_scheduler_steps,
                                 kernels=args.kernels, speculative_config=spec_config(k)))
        replica = Replica(0, cfg, params, mesh, sizes, longest, [], seed=0)
        replica.compiler.compile(sorted({buckets.bucket_for(n, replica.shapes.token_buckets) for n in token_counts}),
                                 full=False)
        return replica.runner

    runner = build_runner(0, [*batches, *prefills])
    report = {"device": str(jax.devices()[0]), "config": args.config, "context": args.context,
              "kernels": args.kernels, "mesh": describe(mesh), "decode": [], "prefill": [], "layers": [], "verify": [],
              "param_gib_per_device": [round(b / 2**30, 2) for b in rules.bytes_per_device(params).values()]}
    print(json.dumps({k: report[k] for k in ("mesh", "param_gib_per_device")}), flush=True)
    for b in batches:
        row = decode_row(runner, cfg, b, args.context, args.steps, args.bandwidth, args.profile)
        row["peak_gib_per_device"] = [round((d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2)
                                      for d in mesh.devices.flat]
        report["decode"].append(row)
        print(json.dumps(row), flush=True)
    for length in prefills:
        report["prefill"].append(prefill_row(runner, cfg, length, max(1, args.steps // 4), args.profile))
        print(json.dumps(report["prefill"][-1]), flush=True)
    if not args.no_layers and mesh.size == 1:  # the layers alone are timed on one device only
        for b in batches:
            report["layers"].append(layer_row(runner, cfg, b, args.context))
            print(json.dumps(report["layers"][-1]), flush=True)
    # one runner per k, each over the same params; a runner's cache is freed before the next one's is made
    for k in drafts:
        if k:
            free_cache(runner)
            runner = build_runner(k, [*batches, *(b * (k + 1) for b in batches)])
        for b in batches:
            report["verify"].append(verify_row(runner, cfg, b, args.context, args.steps, args.profile))
            print(json.dumps(report["verify"][-1]), flush=True)
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
