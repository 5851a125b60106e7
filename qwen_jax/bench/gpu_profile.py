"""Where a step's device time goes: run a function under the JAX profiler and sum the GPU kernels it launched.

Reports, per call: wall time, GPU busy time (sum of kernel durations), the number of kernels, and the kernels that
took the most time, alone and by family (the name without its numbers). Needs a GPU backend for kernel events (on
the CPU the tables come back empty).
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time
from collections.abc import Callable

import jax


def _kernel_events(path: str) -> list[tuple[str, str, float]]:
    """(device, name, duration in us) of every kernel on the device planes' stream lines of one .xplane.pb file."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                events += [(plane.name, e.name, e.duration_ns / 1e3) for e in line.events]
    return events


def profile_calls(fn: Callable[[], object], calls: int = 5, top: int = 15) -> dict:
    """Call fn() `calls` times (after one warm-up call) under the profiler; per-call averages of the kernels. With
    several GPUs (a sharded step) the busy time is the busiest device's and the kernel table averages the devices."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        events = [e for f in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True) for e in _kernel_events(f)]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_family = collections.defaultdict(lambda: [0, 0.0])  # names without their numbers: XLA's fusions by kind
    busy_us = collections.defaultdict(float)
    for device, name, us in events:
        for table, key in ((by_name, name), (by_family, re.sub(r"[._]?\d+", "", name)[:60])):
            table[key][0] += 1
            table[key][1] += us
        busy_us[device] += us
    per_call = calls * max(len(busy_us), 1)  # per call and device

    def ranked(table):
        return [{"name": n[:80], "per_call": round(c / per_call, 1), "us_per_call": round(t / per_call, 1)}
                for n, (c, t) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]]

    return {
        "wall_ms_per_call": round(wall / calls * 1e3, 3),
        "gpu_busy_ms_per_call": round(max(busy_us.values(), default=0.0) / calls / 1e3, 3),
        "gpu_busy_ms_per_device": [round(us / calls / 1e3, 3) for _, us in sorted(busy_us.items())],
        "kernels_per_call": round(len(events) / per_call, 1),
        "top_kernels": ranked(by_name),
        "top_kernel_families": ranked(by_family),
    }
