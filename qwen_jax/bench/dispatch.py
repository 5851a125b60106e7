"""What issuing one engine step costs the host: `python -m qwen_jax.bench.dispatch --config config.json`.

Builds one replica on random weights with the real shapes (the full model by default) and compiles the one-token step
from engine/step.py's programs, on the replica's cache and inputs (never the runner's internals). Then times, over
many steps issued one ahead of the device as the engine issues them: the transfer of the step's inputs, the
forward's call, the sampler's call; and, for comparison, a jitted program that only touches every argument the
forward takes (params and cache), so the cost of passing them shows on its own. Prints a table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.config import load_config
from qwen_jax.engine import step
from qwen_jax.engine.core import engine_args
from qwen_jax.engine.replica import Replica
from qwen_jax.engine.sampler import SamplingTensors
from qwen_jax.weights import dummy_params
from sharding import rules
from sharding.mesh import make_mesh


def host_table(one_step, steps: int) -> None:
    """Trace `steps` steps issued one ahead; print the host events (summed per name over every host thread) and the
    GPU kernels, per step."""
    import collections
    import glob
    import tempfile

    from jax.profiler import ProfileData

    previous = one_step()
    jax.block_until_ready(previous)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            result = one_step()
            jax.device_get(previous.tokens)
            previous = result
        jax.block_until_ready(previous)
        jax.profiler.stop_trace()
        host, kernels = collections.defaultdict(float), collections.Counter()
        gpu_us = 0.0
        for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
            for plane in ProfileData.from_file(path).planes:
                for line in plane.lines:
                    for event in line.events:
                        if plane.name.startswith("/device:GPU") and line.name.startswith("Stream"):
                            kernels[event.name] += 1
                            gpu_us += event.duration_ns / 1e3
                        elif plane.name.startswith("/host"):
                            host[f"{line.name}: {event.name}"[:110]] += event.duration_ns / 1e3
    print(f"\nper step: {sum(kernels.values()) / steps:.0f} GPU kernels, {gpu_us / steps:.0f} us of GPU time")
    print("| host thread: event | us per step |\n|---|---|")
    for name, us in sorted(host.items(), key=lambda item: -item[1])[:40]:
        print(f"| {name} | {us / steps:.1f} |")


def median_us(samples: list[float]) -> float:
    return round(1e6 * statistics.median(samples), 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--kernels", default="gpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--profile", action="store_true",
                        help="also trace 20 steps issued one ahead: the host's events and the GPU's kernels per step")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    mesh = make_mesh(1)
    params = dummy_params(cfg, seed=0, shardings=rules.param_shardings(cfg, mesh))
    sizes = engine_args(dict(max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, num_snapshots=0,
                             num_kv_blocks=4096, kernels=args.kernels, speculative_config="off"))  # the plain step
    replica = Replica(0, cfg, params, mesh, sizes, 4096, [0], seed=0)
    runner = replica.runner
    runner.allocate()  # a lazy runner's state (compile workers are none of this benchmark's)
    leaves = len(jax.tree.leaves(params)), len(jax.tree.leaves(runner.cache))
    rows = []

    # 1. Passing the arguments alone: a program that reads one element of every param and writes nothing back but
    # the donated cache.
    @jax.jit
    def touch(params, cache, buffer):
        total = sum(jnp.sum(leaf.reshape(-1)[:1].astype(jnp.float32)) for leaf in jax.tree.leaves(params))
        return total + buffer[0], cache

    touch = jax.jit(touch.__wrapped__, donate_argnums=(1,))
    replicated = step.replicated(mesh)
    buffer = jax.device_put(np.zeros(64, np.int32), replicated)
    out, runner.cache = touch(params, runner.cache, buffer)
    jax.block_until_ready(out)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out, runner.cache = touch(params, runner.cache, buffer)
        times.append(time.perf_counter() - t0)
    jax.block_until_ready(out)
    rows.append(("jit call, params + cache only (no work)", median_us(times)))

    # 2. The real one-token step, issued one ahead: transfer, forward, sampler; each step's inputs copied into one
    # buffer in place, as the runner stages them.
    host, layout = runner.shapes.step_inputs(1)
    tensors = SamplingTensors.build_host([], [], vocab_size=cfg.vocab_size, batch_size=1, num_slots=runner.num_slots)
    sampling, sampling_layout = step.pack(tensors._asdict())
    inputs = jax.device_put(np.zeros(layout.size, np.int32), replicated)
    forward = functools.partial(step.forward, layout=layout, cfg=cfg, mesh=mesh, kernels=args.kernels)
    compiled = forward.func.lower(params, runner.cache, runner.last_tokens, inputs, **forward.keywords).compile()
    logits = jax.ShapeDtypeStruct((1, cfg.vocab_size), np.float32, sharding=replicated)
    sample = step.sample_step.lower(logits, jax.device_put(sampling, replicated), runner.last_tokens, runner.tables,
                                    layout=sampling_layout, num_top_logprobs=0, path=0).compile()

    def issue_ahead(label: str, forward_for) -> None:
        """Steps issued one ahead with forward_for(i) as step i's forward program."""
        nonlocal inputs
        put, call_f, call_s, whole = [], [], [], []
        previous = None
        for i in range(args.steps + 5):
            t0 = time.perf_counter()
            device_in = jax.device_put((host, sampling), replicated)
            inputs = step.stage_inputs(inputs, device_in[0])
            t1 = time.perf_counter()
            logits, runner.cache = forward_for(i)(params, runner.cache, runner.last_tokens, inputs)
            t2 = time.perf_counter()
            result, runner.last_tokens, runner.tables = sample(logits, device_in[1], runner.last_tokens,
                                                               runner.tables)
            t3 = time.perf_counter()
            if previous is not None:
                jax.device_get(previous.tokens)
            previous = result
            if i >= 5:
                put.append(t1 - t0)
                call_f.append(t2 - t1)
                call_s.append(t3 - t2)
                whole.append(time.perf_counter() - t0)
        rows.extend([(f"{label}: transfer of the step's inputs", median_us(put)),
                     (f"{label}: forward call (1 token)", median_us(call_f)),
                     (f"{label}: sampler call", median_us(call_s)),
                     (f"{label}: whole step, issued one ahead", median_us(whole))])

    issue_ahead("compiled", lambda i: compiled)
    t0 = time.perf_counter()
    _, runner.cache = forward(params, runner.cache, runner.last_tokens, inputs)  # compiles, or hits
    rows.append(("jit: first call (compile or cache hit)", median_us([time.perf_counter() - t0])))
    issue_ahead("jit", lambda i: forward)
    blocked = []
    for _ in range(20):
        t0 = time.perf_counter()
        logits, runner.cache = compiled(params, runner.cache, runner.last_tokens, inputs)
        jax.block_until_ready(logits)
        blocked.append(time.perf_counter() - t0)
    rows.append(("forward call and wait (1 token)", median_us(blocked)))
    if args.profile:
        def one_step():
            nonlocal inputs
            device_in = jax.device_put((host, sampling), replicated)
            inputs = step.stage_inputs(inputs, device_in[0])
            logits, runner.cache = compiled(params, runner.cache, runner.last_tokens, inputs)
            result, runner.last_tokens, runner.tables = sample(logits, device_in[1], runner.last_tokens,
                                                               runner.tables)
            return result

        host_table(one_step, steps=20)
    print(f"\n{leaves[0]} param leaves, {leaves[1]} cache leaves, {jax.devices()[0].device_kind}")
    print("| what | host us (median) |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us} |")


if __name__ == "__main__":
    main()
