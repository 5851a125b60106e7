"""GPU benchmark of the kernels of pallas_kernels/ against their jnp references (`python -m qwen_jax.bench.kernels`):
time, achieved bandwidth (and TFLOP/s for the MoE GEMM and attention) and on-device error per shape, as markdown
tables. Never touches the model. `--only gdn`, `--only gdn_prefill`, `--only moe` or `--only paged_attention` runs
one kernel; `--only skinny_matmul` the one-row projections, `--only router` the MoE routing. `--write PATH` also
writes the one-page table of every kernel at its default tiles (pallas_kernels/BENCH_H200.md is this file).

Exit status: 0 when every kernel configuration lowered, ran and matched its reference; 1 otherwise (the reference
timings are printed either way); 2 when there is no GPU and --small was not given.
"""

import argparse
import datetime
import functools
import itertools
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gdn, gdn_decode, gdn_prefill, moe_gemm, paged_attention, router, skinny_matmul
from pallas_kernels.tiling import triton_available
from qwen_jax.bench.gpu_profile import profile_calls
from qwen_jax.bench.results import git_commit
from qwen_jax.layers.attention import paged_attention as attention_reference
from qwen_jax.layers.batch import ragged
from qwen_jax.layers.gated_deltanet import causal_convs
from qwen_jax.layers.gated_deltanet import delta_rule as gdn_reference
from qwen_jax.layers.hot_ops import ops_for
from qwen_jax.layers.mlp import dense, route, route_logits, routed_experts_f32

PEAK_TBS = 4.3  # H200 HBM3e
PEAK_TFLOPS = 989.0  # H100/H200 dense bf16 tensor cores
# A real indexing or gating bug shows as an error of order 1; float32 rounding as ~1e-6. The slack between: beta is
# rounded to bf16 (as HF does), and one ulp of difference in the GPU's sigmoid can flip that rounding for a head.
MAX_REL_ERR = 1e-3
CONFIGS = [(64, 4), (32, 4), (16, 2), (8, 1)]  # gdn_decode's (block_v, num_warps); the first is its default
FULL = dict(batches=(1, 16, 64), nk=16, nv=32, dk=128, dv=128, repeats=50, inner=10)  # Qwen3.5-35B-A3B
SMALL = dict(batches=(1, 3), nk=2, nv=4, dk=16, dv=16, repeats=3, inner=2)  # CPU interpret-mode smoke test


# Roofline peaks by device kind: (HBM TB/s, dense bf16 TFLOP/s), the vendors' figures.
ROOFLINES = {"NVIDIA H200": (4.8, 989.0), "NVIDIA H100 80GB HBM3": (3.35, 989.0)}


@dataclass
class Summary:
    """One line of the one-page table (--write): a kernel at its default tiles on one shape."""

    kernel: str
    shape: str
    us: float  # the kernel's time: its launches' GPU time (profiler) where measured, else per call
    per_call_us: float  # the kernel timed as the reference is (chained, queued or profiled)
    ref_us: float  # the layers' jnp reference compiled by XLA, per call
    moved: float = float("nan")  # bytes the op reads and writes
    flops: float = float("nan")


def summary_table(rows: list[Summary], device_kind: str) -> str:
    """The one-page table: per kernel and shape, its time, what it achieved against the device's roofline (the
    bound its bytes or FLOPs set, whichever takes longer) and XLA's reference."""
    tbs_peak, tflops_peak = ROOFLINES.get(device_kind, (float("nan"), float("nan")))
    shown = lambda value, spec: "-" if value != value else format(value, spec)  # noqa: E731  (NaN: not measured)
    lines = ["| kernel | shape | time (us) | achieved | of roofline | per call (us) | XLA reference (us) | vs XLA |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tbs, tflops = r.moved / r.us / 1e6, r.flops / r.us / 1e6
        compute_bound = r.flops / tflops_peak > r.moved / tbs_peak  # False when the FLOPs are not counted
        achieved = f"{tflops:.1f} TFLOP/s" if compute_bound else shown(tbs, ".2f") + " TB/s" * (tbs == tbs)
        ratio = tflops / tflops_peak if compute_bound else tbs / tbs_peak
        lines.append(f"| {r.kernel} | {r.shape} | {shown(r.us, '.1f')} | {achieved} | {shown(ratio, '.0%')} "
                     f"| {shown(r.per_call_us, '.1f')} | {shown(r.ref_us, '.1f')} "
                     f"| {shown(r.ref_us / r.per_call_us, '.2f')}{'x' * (r.ref_us == r.ref_us)} |")
    return "\n".join(lines)


def write_summary(path: str, rows: list[Summary], device_kind: str, command: str, commit: str | None,
                  date: str, jax_version: str = jax.__version__, note: str = "") -> None:
    """pallas_kernels/BENCH_H200.md's format: what was run where, how to read it, the table (`note`: a paragraph
    after the list, for what the run does not say itself)."""
    tbs_peak, tflops_peak = ROOFLINES.get(device_kind, (float("nan"), float("nan")))
    header = f"""# Kernel benchmark

Each kernel of pallas_kernels/ at its default tiles against its jnp reference in qwen_jax/layers/, at the
Qwen3.5-35B-A3B shapes. Written by the benchmark itself; rerun its command on the GPU to refresh it (the history of
the numbers is this file's git log; the command without `--defaults-only` also sweeps each kernel's tiles and prints
per-kernel tables).

- Device: {device_kind}, jax {jax_version}; measured {date} at commit {commit or "unknown"}.
- Command: `{command}`
- time: the GPU time of the kernel's launches (profiler) where the row has it, else its time per call. achieved
  and of roofline: from that time, against {tbs_peak} TB/s of HBM or {tflops_peak:.0f} TFLOP/s of dense bf16,
  whichever bound the op's bytes or FLOPs make the longer ("-": not counted). per call and XLA reference: the
  kernel and the reference timed alike (calls chained in one program, queued, or profiled), so "vs XLA" compares
  like with like.
"""
    with open(path, "w") as f:
        f.write("\n".join([header, *([note, ""] if note else []), summary_table(rows, device_kind), ""]))


@dataclass
class Row:
    batch: int
    impl: str
    config: str
    queued_us: float = float("nan")  # median over `repeats` of (inner back-to-back calls, then block) / inner
    blocked_us: float = float("nan")  # median over `repeats` single calls, each blocked on (dispatch included)
    tbs: float = float("nan")
    err_o: float = float("nan")
    err_state: float = float("nan")
    note: str = ""


def make_inputs(batch: int, nk: int, nv: int, dk: int, dv: int) -> tuple[dict, jax.Array]:
    """A decode batch: `batch` one-token requests mid-sequence (a ragged batch of as many tokens and requests), bf16
    activations as the model feeds them; slots 1..batch in a shuffled order (slot 0 is never addressed). Returns
    (the op's arguments but ssm, ssm)."""
    keys = jax.random.split(jax.random.key(batch), 8)
    normal = lambda i, shape, scale=1.0: (scale * jax.random.normal(keys[i], shape)).astype(jnp.bfloat16)
    slots = np.random.default_rng(batch).permutation(batch) + 1
    requests = ragged([100] * batch, [1] * batch, slots, [[0]] * batch, batch, batch, 1)
    inputs = dict(q=normal(0, (batch, nk, dk), 2.0), k=normal(1, (batch, nk, dk), 2.0), v=normal(2, (batch, nv, dv)),
                  a=normal(3, (batch, nv), 2.0), b=normal(4, (batch, nv), 2.0),
                  A_log=jax.random.normal(keys[5], (nv,)) * 0.7, dt_bias=jax.random.normal(keys[6], (nv,)),
                  batch=jax.tree.map(jnp.asarray, requests))
    state = jax.random.normal(keys[7], (batch + 1, nv, dk, dv), jnp.float32) * 0.1
    return inputs, state


def bytes_moved(batch: int, nk: int, nv: int, dk: int, dv: int) -> int:
    state = 2 * batch * nv * dk * dv * 4  # read + write of the addressed float32 state rows
    activations = (2 * batch * nk * dk + batch * nv * dv + 2 * batch * nv) * 2  # bf16 q, k, v, a, b
    return state + activations + batch * nv * dv * 4 + batch * 16  # + bf16 o zeroed, then written + the batch's ints


def time_step(step: Callable, inputs: dict, state: jax.Array, repeats: int, inner: int) -> tuple[float, float]:
    """(queued, blocked) median microseconds per call; two donated state buffers take turns."""
    states = [state, jnp.copy(state)]
    for i in range(3):
        _, states[i % 2] = step(states[i % 2], inputs)
    jax.block_until_ready(states)
    blocked = []
    for i in range(repeats):
        t0 = time.perf_counter()
        _, states[i % 2] = step(states[i % 2], inputs)
        states[i % 2].block_until_ready()
        blocked.append(time.perf_counter() - t0)
    queued = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(inner):
            _, states[i % 2] = step(states[i % 2], inputs)
        jax.block_until_ready(states)
        queued.append((time.perf_counter() - t0) / inner)
    return statistics.median(queued) * 1e6, statistics.median(blocked) * 1e6


def failure_note(error: Exception, label: str) -> str:
    """A kernel that failed to lower, compile or run: its traceback to stderr, a one-line note for the table."""
    print(f"{label}: kernel failed\n" + "".join(traceback.format_exc(limit=8))[-4000:], file=sys.stderr, flush=True)
    first = str(error).splitlines()[0][:160] if str(error) else ""
    return f"FAILED: {type(error).__name__}: {first}"


def rel_err(x: jax.Array, y: jax.Array) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))


def reference_on_cpu(inputs: dict, state: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """The float32 reference computed on the host CPU: no TF32 or GPU reduction order in what the kernel is held to."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: the accelerator at full float32 precision instead
        with jax.default_matmul_precision("highest"):
            out, new_state = jax.jit(gdn_reference)(**inputs, ssm=state)
    else:
        out, new_state = jax.jit(gdn_reference)(**jax.device_put(inputs, cpu), ssm=jax.device_put(state, cpu))
    return np.asarray(out), np.asarray(new_state)


def bench_shape(batch: int, dims: dict, configs: list, interpret: bool, deadline: float, failures: list,
                summary: list[Summary]) -> list[Row]:
    nk, nv, dk, dv = dims["nk"], dims["nv"], dims["dk"], dims["dv"]
    repeats, inner = dims["repeats"], dims["inner"]
    inputs, state = make_inputs(batch, nk, nv, dk, dv)
    moved = bytes_moved(batch, nk, nv, dk, dv)
    want_o, want_state = reference_on_cpu(inputs, state)
    slots = np.asarray(inputs["batch"].state_slot)
    rows = []

    ref_step = jax.jit(lambda s, x: gdn_reference(**x, ssm=s), donate_argnums=0)
    row = Row(batch, "jnp reference (XLA)", "-")
    row.queued_us, row.blocked_us = time_step(ref_step, inputs, jnp.copy(state), repeats, inner)
    row.tbs = moved / row.queued_us / 1e6
    rows.append(row)
    print(f"B={batch} reference: {row.queued_us:.1f} us/call queued, {row.blocked_us:.1f} us blocked", flush=True)

    for block_v, num_warps in configs:
        row = Row(batch, "pallas delta_rule (all launches)", f"BV={block_v} warps={num_warps}")
        rows.append(row)
        if time.perf_counter() > deadline:
            row.note = "skipped: time budget"
            continue
        step = jax.jit(lambda s, x, bv=block_v, nw=num_warps: gdn.delta_rule(
            **x, ssm=s, decode_block_v=bv, decode_num_warps=nw, interpret=interpret), donate_argnums=0)
        try:
            got_o, got_state = step(jnp.copy(state), inputs)
            row.err_o = rel_err(got_o, want_o)
            row.err_state = rel_err(got_state[slots], want_state[slots])
            if not np.array_equal(np.asarray(got_state[0]), np.asarray(state[0])):
                row.note = "slot 0 (not addressed) changed"
            elif not (row.err_o < MAX_REL_ERR and row.err_state < MAX_REL_ERR):
                row.note = f"rel err above {MAX_REL_ERR:g}"
            row.queued_us, row.blocked_us = time_step(step, inputs, jnp.copy(state), repeats, inner)
            row.tbs = moved / row.queued_us / 1e6
            if (block_v, num_warps) == configs[0] and not interpret:
                # the whole op, and its decode launch alone (the prefill launches' programs all exit at once here)
                alone = jax.jit(lambda s, x, bv=block_v, nw=num_warps: gdn_decode.decode(
                    **x, ssm=s, out=jnp.zeros(x["v"].shape, x["v"].dtype), block_v=bv, num_warps=nw),
                    donate_argnums=0)
                profiled = []
                for impl, fn in (("pallas delta_rule", step), ("pallas gdn_decode alone", alone)):
                    kernel = Row(batch, f"{impl}, GPU kernel time (profiler)", row.config)
                    kernel.queued_us = gpu_us(functools.partial(_step_in_place, fn, inputs, {"state": jnp.copy(state)}))
                    kernel.tbs = moved / kernel.queued_us / 1e6
                    profiled.append(kernel)
                rows.extend(profiled)
            if (block_v, num_warps) == configs[0]:  # the whole op (every launch): its GPU time where profiled
                whole_us = row.queued_us if interpret else profiled[0].queued_us
                summary.append(Summary("gdn (decode)", f"decode B={batch}", whole_us, row.queued_us,
                                       rows[0].queued_us, moved))
        except Exception as e:  # a lowering or compile error: report it and keep going
            row.note = failure_note(e, f"B={batch} {row.config}")
        if row.note:
            failures.append(f"B={batch} {row.config}: {row.note}")
        print(f"B={batch} {row.config}: {row.queued_us:.1f} us/call queued, {row.blocked_us:.1f} us blocked, "
              f"err o {row.err_o:.2e} state {row.err_state:.2e} {row.note}", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| B | impl | config | us/call (queued) | us (blocked) | TB/s | of 4.3 TB/s | vs reference "
             "| rel err o | rel err state | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ref_us = {r.batch: r.queued_us for r in rows if r.config == "-"}
    for r in rows:
        lines.append(f"| {r.batch} | {r.impl} | {r.config} | {r.queued_us:.1f} | {r.blocked_us:.1f} | {r.tbs:.2f} "
                     f"| {r.tbs / PEAK_TBS:.0%} | {ref_us[r.batch] / r.queued_us:.2f}x | {r.err_o:.1e} "
                     f"| {r.err_state:.1e} | {r.note} |")
    return "\n".join(lines)


def _step_in_place(step: Callable, inputs, holder: dict) -> jax.Array:
    """One call of step(state, inputs) with its state donated: the holder keeps the state it returns."""
    out, holder["state"] = step(holder["state"], inputs)
    return out


def time_call(fn: Callable, args: tuple, repeats: int, inner: int) -> float:
    """Median microseconds per call over `repeats` rounds of `inner` calls queued back to back."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times) * 1e6


def gpu_us(call: Callable[[], object]) -> float:
    """Microseconds of GPU time per call(): the durations of the kernels it launched, summed (the profiler,
    qwen_jax/bench/gpu_profile.py), so no host dispatch or gaps between launches. time_chained's figure for a ~70 us
    kernel runs 20-30 us above this on an H200; this is the one to hold against the roofline. NaN on the CPU (no
    kernel events)."""
    busy_ms = profile_calls(call, calls=5)["gpu_busy_ms_per_call"]
    return busy_ms * 1e3 if busy_ms > 0 else float("nan")


# Input sets that a memory-bound measurement cycles through where one call reads about as much as the GPU's L2
# holds (50 MB on an H100 / H200): one token's 8 experts are 50 MB, a GDN layer's input projections 51 MB. Timed on
# one set, every call after the first finds much of its weights still in L2, which the model never does (each
# layer reads other weights in between): one token's MoE measured 16 us that way and 19.4 us cycling through 8
# routings, 19-20 us inside a decode step.
CYCLED_SETS = 8


def gpu_us_cycled(fn: Callable, arg_sets: list[tuple]) -> float:
    """gpu_us per call of jit(fn), the calls taking `arg_sets` in turn."""
    compiled = jax.jit(fn)

    def call():
        for args in arg_sets:
            out = compiled(*args)
        return out

    return gpu_us(call) / len(arg_sets)


def time_chained(fn: Callable, args: tuple, chain: int, repeats: int, operand_sets: list[tuple] | None = None
                 ) -> float:
    """Median device microseconds per call of fn(q, *operands) -> q's shape: `chain` calls unrolled in one jitted
    program, each call's output the next one's q (no host dispatch or loop condition per call). An optimization
    barrier before each call hides that the operands repeat, so XLA cannot share work between the calls (the
    reference's page gather, say). operand_sets: call c takes operand_sets[c % len] instead of args[1:] (see
    CYCLED_SETS)."""
    sets = operand_sets or [tuple(args[1:])]

    def chained(q, sets):
        for c in range(chain):
            q, operands = jax.lax.optimization_barrier((q, sets[c % len(sets)]))
            q = fn(q, *operands)
        return q

    looped = jax.jit(chained)
    jax.block_until_ready(looped(args[0], sets))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(looped(args[0], sets))
        times.append((time.perf_counter() - t0) / chain)
    return statistics.median(times) * 1e6


# ---- MoE grouped GEMM ------------------------------------------------------------------------------------------
MOE_FULL = dict(tokens=(1, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384), experts=256, hidden=2048, inter=512,
                shared_inter=512, top_k=8, chain=10, repeats=5)
MOE_SMALL = dict(tokens=(1, 9), experts=8, hidden=64, inter=32, shared_inter=32, top_k=2, chain=2, repeats=1)
# Expert-major few-token kernels, tried up to twice FEW_TOKENS: (block_n, block_k, num_warps, num_stages, split_k,
# down's tiles); None: moe_gemm.FEW_TOKEN_TILES' at that size. Narrower column tiles (16-32: more programs at one
# token) and 128-deep k steps were slower at every size, also with programs per pair; at 2-4 tokens 8 warps and no
# split lead gate_up and 2 warps down (H200, ~200 pairs of tiles by GPU time, RESULTS.json).
MOE_FEW_CONFIGS = [(64, 64, 4, 4, None, (64, 64, 4, 4)), (64, 64, 4, 3, None, (64, 64, 4, 3)),
                   (128, 64, 4, 3, None, (128, 64, 4, 3)), (128, 64, 8, 4, 1, (128, 64, 2, 3)),
                   (64, 64, 8, 3, 2, (64, 64, 2, 2))]
# Sorted blocks: (block_m, block_n, block_k, num_warps, num_stages), None: moe_gemm.default_tiles; below
# MOE_SORTED_SWEEP tokens only the defaults run (for comparison with the few-token kernels).
MOE_SORTED_CONFIGS = [(None,) * 5, (64, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3),
                      (64, 64, 64, 4, 4)]
MOE_SORTED_SWEEP = 4096
# Native Triton kernels (pallas_kernels/moe_triton.py, GPU only) from MOE_SORTED_SWEEP tokens: (block_m, block_n,
# block_k, num_warps, num_stages, down's (block_n, block_k, num_warps, num_stages) or None: gate_up's, tail_m or
# None: the default's; tail_m = block_m: no short blocks).
MOE_TRITON_CONFIGS = [(128, 128, 64, 8, 4, (256, 64, 8, 4), 128), (128, 128, 64, 8, 4, (256, 64, 8, 4), 32),
                      (128, 128, 64, 8, 3, (256, 64, 8, 3), 64), (64, 128, 64, 4, 3, None, 64),
                      (128, 64, 64, 4, 3, None, 64), (64, 128, 64, 4, 4, (128, 64, 4, 4), 32)]
# ... and below MOE_SORTED_SWEEP, where the sorted layout is memory-bound (few rows per expert)
MOE_TRITON_SMALL_CONFIGS = [(16, 64, 64, 4, 3, None, None), (16, 128, 64, 4, 3, None, None),
                            (32, 64, 64, 4, 3, None, None), (64, 128, 64, 4, 3, (128, 64, 4, 3), 32)]
MOE_MAX_REL_ERR = 2e-2  # bf16 outputs; a routing or indexing bug gives errors of order 1


def moe_inputs(tokens: int, dims: dict):
    keys = jax.random.split(jax.random.key(tokens), 5)
    e, h, i = dims["experts"], dims["hidden"], dims["inter"]
    x = jax.random.normal(keys[0], (tokens, h)).astype(jnp.bfloat16)
    router = (jax.random.normal(keys[1], (h, e)) * 0.05).astype(jnp.bfloat16)
    weights, ids = route(x, router, dims["top_k"], True)
    w = lambda k, shape: (jax.random.normal(k, shape) * 0.02).astype(jnp.bfloat16)
    return (x, weights, ids, w(keys[2], (e, h, i)), w(keys[3], (e, h, i)), w(keys[4], (e, i, h))), router


def moe_routings(tokens: int, dims: dict, router: jax.Array, count: int) -> list[tuple[jax.Array, ...]]:
    """`count` more sets of fresh tokens with their routing through `router`, (x, weights, ids) each, for cycled
    measurements."""
    xs = [jax.random.normal(jax.random.key(1000 * tokens + r), (tokens, dims["hidden"])).astype(jnp.bfloat16)
          for r in range(count)]
    return [(x,) + route(x, router, dims["top_k"], True) for x in xs]


def moe_layer_params(router: jax.Array, experts: tuple, dims: dict) -> dict:
    """A whole sparse-MoE layer's params (router, routed and shared expert) around the benchmark's expert weights."""
    keys = jax.random.split(jax.random.key(1), 4)
    h, si = dims["hidden"], dims["shared_inter"]
    w = lambda k, shape: (jax.random.normal(k, shape) * 0.02).astype(jnp.bfloat16)
    return dict(router=router, w_gate=experts[0], w_up=experts[1], w_down=experts[2], shared_gate=w(keys[0], (h, si)),
                shared_up=w(keys[1], (h, si)), shared_down=w(keys[2], (si, h)), shared_expert_gate=w(keys[3], (h, 1)))


def _moe_line(lines, tokens, used, moved, flops, ref_us, impl, config, us, err=float("nan"), note=""):
    tbs = moved / us / 1e6
    lines.append(f"| {tokens} | {used} | {impl} | {config} | {us:.1f} | {tbs:.2f} | {tbs / PEAK_TBS:.0%} "
                 f"| {flops / us / 1e6:.1f} | {ref_us / us:.2f}x | {err:.1e} | {note} |")
    print(lines[-1], flush=True)


def _moe_candidates(tokens: int, dims: dict, interpret: bool, small: bool, defaults_only: bool = False) -> list:
    """(impl, config label, routed_experts with that configuration) to time at this token count: the defaults,
    then (unless defaults_only) each layout's sweep (native Triton only on a GPU with jax-triton)."""
    native = not interpret and triton_available()
    sweep = tokens >= MOE_SORTED_SWEEP and not small
    candidates = [dict()]
    if tokens <= 2 * moe_gemm.FEW_TOKENS:
        candidates += [dict(few_tokens=True, block_n=bn, block_k=bk, num_warps=w, num_stages=st, split_k=sk,
                            down=down)
                       for bn, bk, w, st, sk, down in (MOE_FEW_CONFIGS[:2] if small else MOE_FEW_CONFIGS)]
    candidates += [dict(few_tokens=False, triton=False, block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                        num_stages=st) for bm, bn, bk, w, st in (MOE_SORTED_CONFIGS if sweep else [(None,) * 5])]
    if native and tokens > moe_gemm.FEW_TOKENS:
        candidates += [dict(few_tokens=False, triton=True, block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                            num_stages=st, down=down, tail_m=tail)
                       for bm, bn, bk, w, st, down, tail in (MOE_TRITON_CONFIGS if sweep else
                                                              MOE_TRITON_SMALL_CONFIGS)]
    if defaults_only:
        candidates = candidates[:1]
    out = []
    for given in candidates:
        t = moe_gemm.resolve_tiles(tokens, tokens * dims["top_k"], native, **given)
        impl = ("default: " if not given else "") + ("pallas moe_gemm, few-token" if t["few_tokens"] else
                                                      "triton moe (jax-triton), sorted" if t["triton"] else
                                                      "pallas moe_gemm, sorted")
        down = f"; down BN={t['down'][0]} BK={t['down'][1]} w={t['down'][2]} s={t['down'][3]}" if t["down"] else ""
        down += f"; tail_m={t['tail_m']}" if t.get("tail_m") else ""
        down += f"; split_k={t['split_k']}" if t.get("split_k") else ""
        label = ("" if t["few_tokens"] else f"BM={t['block_m']} ") + \
            f"BN={t['block_n']} BK={t['block_k']} w={t['num_warps']} s={t['num_stages']}" + down
        out.append((impl, label, functools.partial(moe_gemm.routed_experts, interpret=interpret, **given)))
    return out


def bench_moe(dims: dict, interpret: bool, small: bool, deadline: float, failures: list, summary: list[Summary],
              defaults_only: bool = False) -> str:
    """Routed experts alone (every configuration, or the default one), then the whole MoE layer (router, top-k,
    routed and shared expert) with the default kernels and with the reference, each chained `chain` times in one
    program; up to FEW_TOKENS tokens the calls cycle through CYCLED_SETS routings ("experts read": their mean)."""
    lines = ["| tokens | experts read | impl | config | us/call | TB/s (weights read) | of 4.3 TB/s | TFLOP/s "
             "| vs reference | rel err | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    h, i, chain, repeats = dims["hidden"], dims["inter"], dims["chain"], dims["repeats"]
    as_x = lambda fn: lambda x, *rest: fn(x, *rest).astype(x.dtype)  # chained: each call's output is the next x
    for tokens in dims["tokens"]:
        args, router = moe_inputs(tokens, dims)
        x, experts = args[0], args[3:]
        # up to FEW_TOKENS the experts read fit in L2 or nearly: each call of a chain takes another routing
        cycled = [args[:3]]
        if tokens <= moe_gemm.FEW_TOKENS:
            cycled += moe_routings(tokens, dims, router, CYCLED_SETS - 1)
        operand_sets = [tuple(routing) + experts for _, *routing in cycled]
        used = round(float(np.mean([np.unique(np.asarray(ids)).size for _, _, ids in cycled])), 1)
        moved = used * 3 * h * i * 2 + tokens * h * 2 * 2  # distinct experts' bf16 weights + x in, out
        flops = 2 * tokens * dims["top_k"] * 3 * h * i
        # ragged_dot materialises [groups, rows, H] on the GPU: the reference runs 2,048 tokens at a time (exact:
        # tokens are independent)
        ref = jax.jit(routed_experts_f32)
        want = np.concatenate([np.asarray(ref(x[t:t + 2048], args[1][t:t + 2048], args[2][t:t + 2048], *experts),
                                          np.float64) for t in range(0, tokens, 2048)])
        # ragged_dot takes ~80 ms at 4,096 tokens and grows linearly: timed up to there
        ref_us = time_chained(as_x(routed_experts_f32), args, chain, repeats, operand_sets) if tokens <= 4096 \
            else float("nan")
        line = functools.partial(_moe_line, lines, tokens, used, moved, flops, ref_us)
        line("ragged_dot (XLA)", "-", ref_us)
        for impl, config, fn in _moe_candidates(tokens, dims, interpret, small, defaults_only):
            if time.perf_counter() > deadline:
                line(impl, config, float("nan"), note="skipped: time budget")
                continue
            try:
                got = np.asarray(jax.jit(fn)(*args), np.float64)
                err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                note = "" if err < MOE_MAX_REL_ERR else f"rel err above {MOE_MAX_REL_ERR:g}"
                chained = time_chained(as_x(fn), args, chain, repeats, operand_sets)
                line(impl, config, chained, err, note)
                # the default's GPU time, and every few-token configuration's: their chained time is mostly
                # launch overhead
                kernel_us = chained
                if not interpret and (impl.startswith("default") or "few-token" in impl):
                    kernel_us = gpu_us_cycled(fn, [(x,) + ops for ops in operand_sets])
                    line(impl + ", GPU kernel time (profiler)", config, kernel_us, err, note)
                if impl.startswith("default"):
                    kernel = "moe_gemm, few-token" if "few-token" in impl else \
                        "moe_triton, sorted" if "triton" in impl else "moe_gemm, sorted"
                    summary.append(Summary(kernel, f"T={tokens} ({used:g} experts read)", kernel_us, chained,
                                           ref_us, moved, flops))
            except Exception as e:  # a lowering or compile error: report it and keep going
                note = failure_note(e, f"moe T={tokens} {config}")
                line(impl, config, float("nan"), note=note)
            if note:
                failures.append(f"moe T={tokens} {config}: {note}")
        # The whole layer: what the decode step pays per MoE layer (router GEMM, softmax top-k, experts, shared).
        p = moe_layer_params(router, experts, dims)
        layer_moved = moved + (h * dims["experts"] + 3 * h * dims["shared_inter"]) * 2
        for kernels in ("reference", "gpu"):
            if kernels == "reference" and tokens > 4096 or time.perf_counter() > deadline:
                continue
            layer = functools.partial(ops_for(kernels).moe, top_k=dims["top_k"], renormalize=True)
            # chained through a residual, as in the model, each call on the next set's tokens (feeding the MoE's
            # small output back as x would route every token to the same few experts)
            us = time_chained(lambda q, tokens_in, p, layer=layer: q + layer(tokens_in, p), (x, x, p), chain,
                              repeats, [(tokens_in, p) for tokens_in, *_ in cycled])
            _moe_line(lines, tokens, used, layer_moved, flops, ref_us, f"whole MoE layer, kernels={kernels}",
                      "router + top-k + experts + shared", us)
    return "\n".join(lines)


# ---- paged attention -------------------------------------------------------------------------------------------
PA_FULL = dict(heads=16, kv_heads=2, head_dim=256, block_size=16, decode=((1, 2048), (16, 2048), (64, 2048)),
               prefill=((1, 4096), (8, 1024)), chain=10, repeats=10)  # Qwen3.5-35B-A3B; (rows, context)
PA_SMALL = dict(heads=4, kv_heads=2, head_dim=16, block_size=4, decode=((3, 24),), prefill=((2, 16),), chain=2,
                repeats=2)
# (block_m, block_k, num_splits, num_warps, num_stages); None: the kernel's default (block_m has no say in decode)
PA_DECODE_CONFIGS = [(None,) * 5, (None, 32, None, 4, 3), (None, 32, 4, 4, 3), (None, 32, 8, 4, 3),
                     (None, 64, 4, 4, 2), (None, 64, 8, 4, 2), (None, 32, None, 4, 4), (None, 32, 8, 2, 4),
                     (None, 64, 4, 8, 2), (None, 128, None, 4, 2), (None, 64, None, 4, 3), (None, 64, 16, 4, 2)]
PA_PREFILL_CONFIGS = [(None,) * 5, (128, 64, None, 8, 2), (128, 32, None, 8, 3), (64, 64, None, 4, 2),
                      (64, 32, None, 4, 3)]
PA_PEAK_TBS = 4.8  # H200 HBM3e, the decode roofline
PA_MAX_REL_ERR = 2e-2  # bf16 (the reference also rounds its scores to bf16); an indexing bug gives errors of order 1


def attention_inputs(rows: int, seq: int, context: int, dims: dict) -> tuple:
    """One ragged batch of `rows` requests, each the last `seq` tokens of a `context`-token sequence (bf16 q
    [rows * seq, heads, D], the requests one after another); every request's pages distinct and shuffled across the
    cache (page 0, the padding sink, unused)."""
    heads, kv, dim, bs = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["block_size"]
    pages = -(-context // bs)
    keys = jax.random.split(jax.random.key(rows * 7919 + seq), 3)
    q = jax.random.normal(keys[0], (rows * seq, heads, dim)).astype(jnp.bfloat16)
    k_cache = jax.random.normal(keys[1], (rows * pages + 1, bs, kv, dim)).astype(jnp.bfloat16)
    v_cache = jax.random.normal(keys[2], (rows * pages + 1, bs, kv, dim)).astype(jnp.bfloat16)
    tables = np.random.default_rng(rows).permutation(rows * pages).reshape(rows, pages) + 1
    batch = ragged([context - seq] * rows, [seq] * rows, [0] * rows, tables, rows * seq, rows, pages)
    return q, k_cache, v_cache, jax.tree.map(jnp.asarray, batch)


def _pa_line(lines, case, moved, flops, roof, ref_us, impl, config, us, err=float("nan"), note=""):
    tbs, tflops = moved / us / 1e6, flops / us / 1e6
    ratio = tbs / PA_PEAK_TBS if roof == "HBM" else tflops / PEAK_TFLOPS
    lines.append(f"| {case} | {impl} | {config} | {us:.1f} | {tbs:.2f} | {tflops:.1f} | {ratio:.0%} of {roof} "
                 f"| {ref_us / us:.2f}x | {err:.1e} | {note} |")
    print(lines[-1], flush=True)


def bench_paged_attention(dims: dict, interpret: bool, small: bool, deadline: float, failures: list,
                          summary: list[Summary], defaults_only: bool = False) -> str:
    lines = [f"| case | impl | config | us/call | TB/s (K, V, q, o) | TFLOP/s | roofline ({PA_PEAK_TBS} TB/s HBM or "
             f"{PEAK_TFLOPS:.0f} TFLOP/s) | vs reference | rel err | note |", "|---" * 10 + "|"]
    heads, kv, dim = dims["heads"], dims["kv_heads"], dims["head_dim"]
    cases = [("decode", rows, 1, context) for rows, context in dims["decode"]]
    cases += [("prefill", rows, context, context) for rows, context in dims["prefill"]]
    for kind, rows, seq, context in cases:
        case = f"{kind} B={rows} ctx={context}" + (f" S={seq}" if seq > 1 else "")
        q, k_cache, v_cache, batch = attention_inputs(rows, seq, context, dims)
        scale = dim ** -0.5
        moved = rows * context * kv * dim * 2 * 2 + 2 * rows * seq * heads * dim * 2
        causal_pairs = seq * (seq + 1) // 2 + seq * (context - seq)  # (query, key) pairs a causal mask keeps
        flops = 2 * 2 * rows * causal_pairs * heads * dim
        roof = "HBM" if kind == "decode" else "MMA"
        line = functools.partial(_pa_line, lines, case, moved, flops, roof)
        chain, repeats = dims["chain"], dims["repeats"]

        args = (q, k_cache, v_cache, batch)  # fn(q, k_cache, v_cache, batch); the batch an operand, as in a step
        ref = functools.partial(attention_reference, scale=scale)
        want = np.asarray(jax.jit(ref)(*args), np.float64)
        ref_us = time_chained(ref, args, chain, repeats)
        line = functools.partial(line, ref_us)
        line("jnp reference (XLA)", "-", ref_us)

        if not interpret:  # the dense-attention baseline: cuDNN's fused kernel on K/V already gathered
            dense_k = k_cache[batch.block_table].reshape(rows, -1, kv, dim)[:, :context]
            dense_v = v_cache[batch.block_table].reshape(rows, -1, kv, dim)[:, :context]
            dense_q = q.reshape(rows, seq, heads, dim)
            cudnn = functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=seq > 1,
                                      implementation="cudnn")
            try:
                err = rel_err(jax.jit(cudnn)(dense_q, dense_k, dense_v).reshape(q.shape), want)
                line("cuDNN dot_product_attention, dense K/V", "-",
                     time_chained(cudnn, (dense_q, dense_k, dense_v), chain, repeats), err)
            except Exception as e:  # cuDNN refuses this shape or is not installed
                line("cuDNN dot_product_attention, dense K/V", "-", float("nan"),
                     note=f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")

        configs = PA_DECODE_CONFIGS if kind == "decode" else PA_PREFILL_CONFIGS
        for bm, bk, splits, warps, stages in configs[:1] if defaults_only else configs[:2] if small else configs:
            config = "defaults" if (bm, bk, splits, warps, stages) == (None,) * 5 else \
                f"BM={bm or '-'} BK={bk} splits={splits or 'auto'} w={warps} s={stages}"
            if time.perf_counter() > deadline:
                line("pallas paged_attention", config, float("nan"), note="skipped: time budget")
                continue
            fn = functools.partial(paged_attention.paged_attention, scale=scale, block_m=bm, block_k=bk,
                                   num_splits=splits, num_warps=warps, num_stages=stages, interpret=interpret)
            try:
                err = rel_err(jax.jit(fn)(*args), want)
                note = "" if err < PA_MAX_REL_ERR else f"rel err above {PA_MAX_REL_ERR:g}"
                chained = time_chained(fn, args, chain, repeats)
                line("pallas paged_attention", config, chained, err, note)
                if config == "defaults":
                    kernel_us = chained if interpret else gpu_us(functools.partial(jax.jit(fn), *args))
                    if not interpret:
                        line("pallas paged_attention, GPU kernel time (profiler)", config, kernel_us, err, note)
                    summary.append(Summary("paged_attention", case, kernel_us, chained, ref_us, moved, flops))
            except Exception as e:  # a lowering or compile error: report it and keep going
                note = failure_note(e, f"paged_attention {case} {config}")
                line("pallas paged_attention", config, float("nan"), note=note)
            if note:
                failures.append(f"paged_attention {case} {config}: {note}")
    return "\n".join(lines)


# ---- GDN chunked prefill ---------------------------------------------------------------------------------------
GP_FULL = dict(nk=16, nv=32, dk=128, dv=128, cases=((1, 2048, False), (1, 4096, False), (2, 1024, False),
                                                  (8, 1024, False), (64, 1024, False), (64, 1024, True)),
               repeats=10, inner=3)  # Qwen3.5-35B-A3B
GP_SMALL = dict(nk=2, nv=4, dk=16, dv=32, cases=((1, 80, False), (3, 40, True)), repeats=2, inner=1)
# (chunk_size, block_v, num_warps, num_stages); None: gdn_prefill's defaults (gdn_prefill.default_tiles, 4 warps)
GP_CONFIGS = [(None,) * 4, (64, 32, 4, 3), (64, 32, 4, 2), (64, 16, 4, 3), (64, 64, 4, 3), (32, 32, 4, 3),
              (32, 64, 4, 3)]
GP_SMALL_CONFIGS = [(None,) * 4, (16, 16, 4, 2)]
# bf16 dot operands (and T) against the float32 reference: ~5e-3 at these shapes on CPU; a bug gives order 1
GP_MAX_REL_ERR = 2e-2


def gdn_prefill_inputs(rows: int, seq: int, spread: bool, dims: dict) -> dict:
    """The op's arguments for `rows` prompts continuing from their slots (1..rows, shuffled), one after another on a
    token axis of rows * seq (a step's bucket); spread: lengths over [1, seq] (shuffled; the one-token prompt goes to
    the decode kernel, the tokens left over are padding), else all seq. bf16 activations as the model feeds them."""
    nk, nv, dk, dv = dims["nk"], dims["nv"], dims["dk"], dims["dv"]
    tokens = rows * seq
    keys = jax.random.split(jax.random.key(rows * 7919 + seq), 8)
    normal = lambda i, shape, scale=1.0: (scale * jax.random.normal(keys[i], shape)).astype(jnp.bfloat16)
    lens = np.random.default_rng(rows).permutation(np.linspace(1, seq, rows).astype(np.int32)) if spread \
        else np.full(rows, seq, np.int32)
    slots = np.random.default_rng(rows + 1).permutation(rows) + 1
    batch = ragged([seq] * rows, lens.tolist(), slots, [[0]] * rows, tokens, rows, 1)
    return dict(q=normal(0, (tokens, nk, dk), 2.0), k=normal(1, (tokens, nk, dk), 2.0), v=normal(2, (tokens, nv, dv)),
                a=normal(3, (tokens, nv), 2.0), b=normal(4, (tokens, nv), 2.0),
                A_log=jax.random.normal(keys[5], (nv,)) * 0.7 - 1.0, dt_bias=jax.random.normal(keys[6], (nv,)),
                ssm=jax.random.normal(keys[7], (rows + 1, nv, dk, dv), jnp.float32) * 0.1,
                batch=jax.tree.map(jnp.asarray, batch))


def gdn_prefill_cost(seq_lens: np.ndarray, seq: int, dims: dict, chunk: int = 64) -> tuple[float, float]:
    """(FLOPs, bytes) of the chunked algorithm. FLOPs per value head and live chunk of C tokens: the dots
    K_beta K^T, w = T K', Q K^T (C^2 dk MACs each), u = T V_beta, P v_new (C^2 dv), w S, Q S, K^T v_new (C dk dv),
    plus the inverse by block doubling (2 (log2 C - 1) C^3 MACs): 2 (3 C^2 dk + 2 C^2 dv + 3 C dk dv)
    + 4 (log2 C - 1) C^3, not counting what the kernel repeats per value block. Bytes: bf16 q, k, v, a, b of
    every token (padding included), bf16 out (v's dtype, since ecf7108), float32 state read and written; the
    intermediates between the kernel's launches not counted."""
    nk, nv, dk, dv = dims["nk"], dims["nv"], dims["dk"], dims["dv"]
    live_chunks = int(np.sum(-(-seq_lens // chunk)))
    per_chunk = 2 * (3 * chunk ** 2 * dk + 2 * chunk ** 2 * dv + 3 * chunk * dk * dv) \
        + 4 * (int(np.log2(chunk)) - 1) * chunk ** 3
    tokens = len(seq_lens) * seq
    moved = tokens * (2 * nk * dk + 2 * nv * dv + 2 * nv) * 2 + 2 * len(seq_lens) * nv * dk * dv * 4
    return float(live_chunks * nv * per_chunk), float(moved)


def _gp_line(lines, case, flops, moved, ref_us, impl, config, us, err_o=float("nan"), err_state=float("nan"),
             note=""):
    tflops, tbs = flops / us / 1e6, moved / us / 1e6
    roofline_us = max(flops / PEAK_TFLOPS / 1e6, moved / PA_PEAK_TBS / 1e6)
    lines.append(f"| {case} | {impl} | {config} | {us:.1f} | {tflops:.1f} | {tbs:.2f} | {roofline_us / us:.0%} "
                 f"| {ref_us / us:.2f}x | {err_o:.1e} | {err_state:.1e} | {note} |")
    print(lines[-1], flush=True)


def bench_gdn_prefill(dims: dict, configs: list, interpret: bool, deadline: float, failures: list,
                      summary: list[Summary]) -> str:
    lines = [f"| case | impl | config | us/call | TFLOP/s | TB/s | of roofline ({PEAK_TFLOPS:.0f} TFLOP/s, "
             f"{PA_PEAK_TBS} TB/s) | vs reference | rel err out | rel err state | note |", "|---" * 11 + "|"]
    for rows, seq, spread in dims["cases"]:
        inputs = gdn_prefill_inputs(rows, seq, spread, dims)
        seq_lens = np.asarray(inputs["batch"].query_len)
        case = f"B={rows} S={seq}" + (f" ragged ({int(seq_lens.sum())} tokens)" if spread else "")
        real = np.asarray(inputs["batch"].token_valid)
        args = tuple(inputs.values())  # in the order of the contract: q, k, v, a, b, A_log, dt_bias, ssm, batch
        with jax.default_matmul_precision("highest"):  # what the kernel is held to: float32 throughout
            want_o, want_state = map(np.asarray, jax.jit(gdn_reference)(*args))
        ref_us = time_call(jax.jit(gdn_reference), args, dims["repeats"], dims["inner"])
        _gp_line(lines, case, *gdn_prefill_cost(seq_lens, seq, dims), ref_us, "jnp reference (XLA)", "-", ref_us)
        for chunk, block_v, warps, stages in configs:
            defaults = gdn_prefill.default_tiles(rows, dims["dv"])
            cost = gdn_prefill_cost(seq_lens, seq, dims, chunk or defaults["chunk_size"])  # the kernel's own chunking
            line = functools.partial(_gp_line, lines, case, *cost, ref_us)
            config = "defaults" if chunk is None else f"C={chunk} BV={block_v} w={warps} s={stages}"
            if time.perf_counter() > deadline:
                line("pallas gdn delta_rule", config, float("nan"), note="skipped: time budget")
                continue
            options = {} if chunk is None else dict(chunk_size=chunk, block_v=block_v, num_warps=warps,
                                                    num_stages=stages)
            fn = jax.jit(functools.partial(gdn.delta_rule, **options, interpret=interpret))
            try:
                got_o, got_state = map(np.asarray, fn(*args))
                err_o, err_state = rel_err(got_o[real], want_o[real]), rel_err(got_state, want_state)
                note = "" if max(err_o, err_state) < GP_MAX_REL_ERR else f"rel err above {GP_MAX_REL_ERR:g}"
                if got_o[~real].any() or not np.isfinite(got_o).all():
                    note = "padding outputs not 0 or outputs not finite"
                us = time_call(fn, args, dims["repeats"], dims["inner"])
                line("pallas gdn delta_rule", config, us, err_o, err_state, note)
                if chunk is None:
                    summary.append(Summary("gdn (prefill)", case, us, us, ref_us, cost[1], cost[0]))
            except Exception as e:  # a lowering or compile error: report it and keep going
                note = failure_note(e, f"gdn_prefill {case} {config}")
                line("pallas gdn delta_rule", config, float("nan"), note=note)
            if note:
                failures.append(f"gdn_prefill {case} {config}: {note}")
        if time.perf_counter() < deadline:
            for stage, us in gdn_prefill_stages(args, dims, interpret).items():
                _gp_line(lines, case, float("nan"), float("nan"), ref_us, f"pallas {stage} alone", "defaults", us)
    return "\n".join(lines)


def gdn_prefill_stages(args: tuple, dims: dict, interpret: bool) -> dict:
    """Microseconds of each of gdn_prefill's two launches alone, at its defaults (`default_tiles`)."""
    q, k, v, a, b, A_log, dt_bias, ssm, batch = args
    config = gdn_prefill.launch_config(q, v, batch.query_len.shape[0], interpret=interpret)
    block_v = config.pop("block_v")
    timed = lambda fn, *inputs: time_call(fn, inputs, dims["repeats"], dims["inner"])
    prepare = jax.jit(functools.partial(gdn_prefill.prepare_chunks, **config))
    prepared = prepare(q, k, v, a, b, A_log, dt_bias, batch)
    recurrence = jax.jit(functools.partial(gdn_prefill.recurrence, block_v=block_v, **config))
    return {"gdn_prefill_prepare": timed(prepare, q, k, v, a, b, A_log, dt_bias, batch),
            "gdn_prefill_recurrence": timed(recurrence, q, *prepared, ssm, batch, jnp.zeros(v.shape, v.dtype))}


# ---- one-row projections ---------------------------------------------------------------------------------------
# [K, N] of the 35B-A3B projections a decode step of one sequence runs: GDN q/k, v/z, out; attention q/gate, k/v, o;
# shared expert gate/up, down; router; and the GDN input projections as one 50 MB weight.
# (K, widths): one x [1, K] through weights [K, N] side by side, the projections a layer takes of one x. Single
# widths: the projections with one weight of their own shape; then 35B-A3B's groups: a GDN layer's q/k/v/z, an
# attention layer's q/k/v/gate, an MoE layer's router and shared-expert gate/up.
SKINNY_FULL = ((2048, (2048,)), (2048, (4096,)), (4096, (2048,)), (2048, (512,)), (512, (2048,)), (2048, (256,)),
               (2048, (12288,)), (2048, (2048, 2048, 4096, 4096)), (2048, (2048, 2048, 4096, 4096, 32, 32)),
               (2048, (4096, 512, 512, 4096)), (2048, (256, 512, 512)))
SKINNY_SMALL = ((64, (64,)), (128, (96,)), (128, (32, 64, 32)))
SKINNY_ROWS, SKINNY_ROWS_SMALL = (1, 4, 8, 64), (1, 33)  # a decode step's rows (4: a verify row of k = 3)
SKINNY_MAX_REL_ERR = 1e-2  # bf16 out; float32 sums in another order, nothing else


def _rounded(outs) -> tuple:
    return tuple(o.astype(jnp.bfloat16) for o in outs)


def bench_skinny_matmul(shapes: tuple, row_counts: tuple, interpret: bool, failures: list,
                        summary: list[Summary]) -> str:
    """x [rows, K] @ each w [K, N] rounded to bf16, as the layers' dense op does: XLA's dots (reduction fusions at one
    row, GEMMs from two) against the kernel launched once per weight and once for all of them (matmul_many, with
    `dense`'s tiles), GPU time from the profiler (gpu_us_cycled over copies of the weights; NaN on the CPU). `dense`
    takes the kernel at one row, and at up to 64 rows through 32 MB of weights or more."""
    lines = ["| rows | K x N | weight MB | XLA us | kernel per weight us | one launch us | TB/s | of 4.3 TB/s | vs XLA "
             "| rel err | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (k, widths), rows in itertools.product(shapes, row_counts):
        keys = jax.random.split(jax.random.key(k * 7 + sum(widths)), 1 + len(widths))
        x = jax.random.normal(keys[0], (rows, k)).astype(jnp.bfloat16)
        ws = tuple((jax.random.normal(key, (k, n)) * 0.02).astype(jnp.bfloat16) for key, n in zip(keys[1:], widths))
        tiles = skinny_matmul.row_tiles(rows)  # as the layers' dense op (qwen_jax/layers/hot_ops.py)
        xla = jax.jit(lambda x, *ws: _rounded(dense(x, w) for w in ws))
        apart = jax.jit(lambda x, *ws, tiles=tiles: _rounded(skinny_matmul.matmul(x, w, interpret=interpret, **tiles)
                                                             for w in ws))
        fused = jax.jit(lambda x, *ws, tiles=tiles: _rounded(skinny_matmul.matmul_many(x, ws, interpret=interpret,
                                                                                       **tiles)))
        label, note = f"{k} x {' + '.join(map(str, widths))}", ""
        try:
            want = np.concatenate([np.asarray(o, np.float64) for o in xla(x, *ws)], axis=1)
            err = max(float(np.max(np.abs(np.concatenate([np.asarray(o, np.float64) for o in f(x, *ws)], axis=1)
                                           - want)) / np.max(np.abs(want))) for f in (apart, fused))
            note = "" if err < SKINNY_MAX_REL_ERR else f"rel err above {SKINNY_MAX_REL_ERR:g}"
            # each call on other copies of the weights (CYCLED_SETS): a layer's projections fit in L2
            copies = [ws] + [tuple(w + jnp.asarray(c, w.dtype) for w in ws) for c in range(1, CYCLED_SETS)]
            xla_us, apart_us, us = (gpu_us_cycled(f, [(x, *w) for w in copies]) for f in (xla, apart, fused))
        except Exception as e:  # a lowering or compile error: report it and keep going
            err, xla_us, apart_us, us = (float("nan"),) * 4
            note = failure_note(e, f"skinny {rows} x {label}")
        if note:
            failures.append(f"skinny_matmul {rows} x {label}: {note}")
        mb = k * sum(widths) * 2 / 1e6
        summary.append(Summary("skinny_matmul", f"x [{rows}, {k}] @ w [{k}, {' + '.join(map(str, widths))}]", us, us,
                               xla_us, mb * 1e6))
        lines.append(f"| {rows} | {label} | {mb:.1f} | {xla_us:.1f} | {apart_us:.1f} | {us:.1f} | {mb / us:.2f} "
                     f"| {mb / us / PEAK_TBS:.0%} | {xla_us / us:.2f}x | {err:.1e} | {note} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


ROUTER_TOKENS_FULL, ROUTER_TOKENS_SMALL = (1, 8, 64, 512, 4096), (1, 5)
ROUTER_DIMS = {"experts": 256, "top_k": 8}  # 35B-A3B


def bench_router(token_counts: tuple, interpret: bool, failures: list, summary: list[Summary]) -> str:
    """Softmax top-k routing from bf16 logits: XLA (the reference's softmax, top_k and renormalisation) against the
    one-launch kernel; GPU time from the profiler (NaN on the CPU). The ids must equal the reference's."""
    lines = ["| tokens | XLA us | kernel us | vs XLA | ids equal | max weight diff | note |",
             "|---|---|---|---|---|---|---|"]
    experts, top_k = ROUTER_DIMS["experts"], ROUTER_DIMS["top_k"]
    xla = jax.jit(lambda x: route_logits(x, top_k, True))
    kernel = jax.jit(lambda x: router.route_logits(x, top_k, True, interpret=interpret))
    for tokens in token_counts:
        x = (jax.random.normal(jax.random.key(tokens), (tokens, experts)) * 2).astype(jnp.bfloat16)
        note = ""
        try:
            (w_ref, ids_ref), (w, ids) = xla(x), kernel(x)
            same = bool(jnp.all(ids == ids_ref))
            diff = float(jnp.max(jnp.abs(w.astype(jnp.float32) - w_ref.astype(jnp.float32))))
            note = "" if same else "ids differ from the reference"
            xla_us, us = gpu_us(functools.partial(xla, x)), gpu_us(functools.partial(kernel, x))
        except Exception as e:  # a lowering or compile error: report it and keep going
            same, diff, xla_us, us = False, float("nan"), float("nan"), float("nan")
            note = failure_note(e, f"router {tokens}")
        if note:
            failures.append(f"router {tokens} tokens: {note}")
        summary.append(Summary("router", f"T={tokens}", us, us, xla_us))
        lines.append(f"| {tokens} | {xla_us:.1f} | {us:.1f} | {xla_us / us:.2f}x | {same} | {diff:.1e} | {note} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


CONV_FULL = ((1, 4096), (8, 1024), (64, 1024))  # (rows, tokens a row) of a prefill
CONV_CHANNELS = ((16, 128), (16, 128), (32, 128))  # 35B-A3B's q, k, v: (heads, head dim)
CONV_DECODE = (1, 8, 64)  # rows of a decode step


def conv_inputs(seed: int, shapes: list, scale: float) -> tuple:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return tuple((jax.random.normal(key, shape) * scale).astype(jnp.bfloat16) for key, shape in zip(keys, shapes))


def bench_causal_conv(shapes: tuple, failures: list, summary: list[Summary]) -> str:
    """The GDN layer's three causal convs on their state slots (caches donated, as the engine runs the op) over
    ragged batches: prefills of `shapes` (rows x tokens a row; the last row a third as long, then padding tokens;
    every row a chunk after 64 tokens already in, its state read from its slot), then decode steps of CONV_DECODE
    rows (every fourth a one-token prompt). XLA's fusions of the reference (compiled as the engine compiles) against
    the kernels' two launches, GPU time from the profiler; the kernels must equal the reference bitwise (the real
    tokens' outputs, every cache slot). Native Triton (jax-triton): nothing to time without a GPU."""
    lines = ["| rows x tokens | MB read + written | XLA us | kernel us | TB/s | of 4.3 TB/s | vs XLA | bitwise "
             "| note |", "|---|---|---|---|---|---|---|---|---|"]
    if not triton_available():
        return "\n".join(lines + ["| - | - | - | - | - | - | - | - | skipped: needs a GPU with jax-triton |"])
    from pallas_kernels import causal_conv  # imports triton: GPU machines only

    exact = {"xla_allow_excess_precision": False}  # as the engine compiles: every bf16 rounding kept
    xla = jax.jit(causal_convs, compiler_options=exact, donate_argnums=(1,))
    kernel = jax.jit(causal_conv.causal_convs, donate_argnums=(1,))
    cases = [(f"{rows} x {seq}", [64] * rows, [seq] * (rows - 1) + [max(1, seq // 3)], rows * seq)
             for rows, seq in shapes]
    cases += [(f"decode B={rows}", [0 if i % 4 == 1 else 100 + i for i in range(rows)], [1] * rows, rows)
              for rows in (CONV_DECODE if shapes else ())]
    for label, starts, lens, tokens in cases:
        rows = len(lens)
        batch = jax.tree.map(jnp.asarray, ragged(starts, lens, range(rows, 0, -1), [[0]] * rows, tokens, rows, 1))
        xs = conv_inputs(3 * tokens + rows, [(tokens,) + c for c in CONV_CHANNELS], 1.0)
        caches = conv_inputs(3 * tokens + rows + 1, [(rows + 1, 3) + c for c in CONV_CHANNELS], 1.0)
        weights = conv_inputs(3 * tokens + rows + 2, [(4,) + c for c in CONV_CHANNELS], 0.5)
        note = ""
        try:
            want = xla(xs, tuple(jnp.array(c) for c in caches), weights, batch)
            got = kernel(xs, tuple(jnp.array(c) for c in caches), weights, batch)
            valid = batch.token_valid  # padding tokens: garbage in the reference, 0 from the kernels
            same = all(bool(jnp.array_equal(a[valid], b[valid])) for a, b in zip(want[0], got[0], strict=True)) \
                and all(bool(jnp.array_equal(a, b)) for a, b in zip(want[1], got[1], strict=True))
            note = "" if same else "differs from the reference"
            # each call donates the caches the last one returned
            xla_us, us = (gpu_us(functools.partial(
                _step_in_place, lambda caches, args, f=f: f(args[0], caches, *args[1:]), (xs, weights, batch),
                {"state": tuple(jnp.array(c) for c in caches)})) for f in (xla, kernel))
        except Exception as e:  # a lowering or compile error: report it and keep going
            same, xla_us, us = False, float("nan"), float("nan")
            note = failure_note(e, f"causal_conv {label}")
        if note:
            failures.append(f"causal_conv {label}: {note}")
        # bf16 x in and out (the K taps re-read their inputs from L1); a decode row also reads and writes its K - 1
        # state rows
        mb = (8 if max(lens) == 1 else 2) * sum(x.size for x in xs) * 2 / 1e6
        summary.append(Summary("causal_conv", label, us, us, xla_us, mb * 1e6))
        lines.append(f"| {label} | {mb:.2f} | {xla_us:.1f} | {us:.1f} | {mb / us:.2f} | {mb / us / PEAK_TBS:.0%} "
                     f"| {xla_us / us:.2f}x | {same} | {note} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes, interpret mode on CPU (a smoke test)")
    parser.add_argument("--budget-s", type=float, default=70.0, help="start no kernel configuration after this "
                        "(per kernel)")
    parser.add_argument("--defaults-only", action="store_true", help="each kernel's default configuration only, "
                        "no tile sweep (gdn_prefill: also each launch alone)")
    parser.add_argument("--moe-tokens", help="moe: comma-separated token counts instead of the full list")
    parser.add_argument("--only", choices=("gdn", "gdn_prefill", "moe", "paged_attention", "skinny_matmul", "router",
                                           "causal_conv"),
                        help="benchmark one kernel")
    parser.add_argument("--write", metavar="PATH", help="also write the one-page table of the kernels at their "
                        "default tiles there (pallas_kernels/BENCH_H200.md)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    backend = jax.default_backend()
    print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}", flush=True)
    if backend == "cpu" and not args.small:
        print("error: no GPU backend; run with --small for a CPU interpret-mode smoke test", file=sys.stderr)
        return 2
    interpret = backend == "cpu"
    failures, summary = [], []
    if args.only in (None, "moe"):
        dims = MOE_SMALL if args.small else MOE_FULL
        if args.moe_tokens:
            dims = dict(dims, tokens=tuple(int(t) for t in args.moe_tokens.split(",")))
        print(f"moe_gemm: E={dims['experts']} H={dims['hidden']} I={dims['inter']} top_k={dims['top_k']}; "
              f"us/call = median of {dims['repeats']} x ({dims['chain']} calls chained in one program) / chain",
              flush=True)
        text = bench_moe(dims, interpret, args.small, time.perf_counter() + args.budget_s, failures, summary,
                         args.defaults_only)
        print(f"\n### moe_gemm on {jax.devices()[0].device_kind} ({time.perf_counter() - start:.0f} s)\n\n{text}\n")
    if args.only in (None, "gdn"):
        dims = SMALL if args.small else FULL
        configs = [(8, 1)] if args.small else CONFIGS[:1] if args.defaults_only else CONFIGS
        print(f"gdn_decode: nk={dims['nk']} nv={dims['nv']} dk={dims['dk']} dv={dims['dv']}, slots = B + 1, "
              f"{dims['repeats']} repeats; queued = {dims['inner']} calls back to back, then block", flush=True)
        rows, gdn_start = [], time.perf_counter()
        for batch in dims["batches"]:
            rows += bench_shape(batch, dims, configs, interpret, gdn_start + args.budget_s, failures, summary)
        print(f"\n### gdn_decode on {jax.devices()[0].device_kind} ({time.perf_counter() - gdn_start:.0f} s)\n")
        print(table(rows))
    if args.only in (None, "paged_attention"):
        dims, pa_start = PA_SMALL if args.small else PA_FULL, time.perf_counter()
        print(f"\npaged_attention: heads={dims['heads']} kv_heads={dims['kv_heads']} D={dims['head_dim']} "
              f"block_size={dims['block_size']}, bf16; us/call = median of {dims['repeats']} x ({dims['chain']} "
              "calls chained in one program) / chain; roofline: decode HBM, prefill tensor cores", flush=True)
        text = bench_paged_attention(dims, interpret, args.small, pa_start + args.budget_s, failures, summary,
                                     args.defaults_only)
        print(f"\n### paged_attention on {jax.devices()[0].device_kind} ({time.perf_counter() - pa_start:.0f} s)"
              f"\n\n{text}\n")
    if args.only in (None, "gdn_prefill"):
        dims, gp_start = GP_SMALL if args.small else GP_FULL, time.perf_counter()
        print(f"\ngdn_prefill: nk={dims['nk']} nv={dims['nv']} dk={dims['dk']} dv={dims['dv']}, bf16 in and "
              "out, float32 state (not donated: the kernel's in-place update costs a copy of it); us/call = median of "
              f"{dims['repeats']} x ({dims['inner']} calls queued, then block); roofline = max(FLOPs / peak, "
              "bytes / HBM)", flush=True)
        configs = GP_SMALL_CONFIGS if args.small else GP_CONFIGS
        text = bench_gdn_prefill(dims, configs[:1] if args.defaults_only else configs, interpret,
                                 gp_start + args.budget_s, failures, summary)
        print(f"\n### gdn_prefill on {jax.devices()[0].device_kind} ({time.perf_counter() - gp_start:.0f} s)"
              f"\n\n{text}\n")
    if args.only in (None, "skinny_matmul"):
        print("\nskinny_matmul: decode rows, bf16; GPU time per call (profiler)", flush=True)
        text = bench_skinny_matmul(SKINNY_SMALL if args.small else SKINNY_FULL,
                                   SKINNY_ROWS_SMALL if args.small else SKINNY_ROWS, interpret, failures, summary)
        print(f"\n### skinny_matmul on {jax.devices()[0].device_kind}\n\n{text}\n")
    if args.only in (None, "router"):
        print(f"\nrouter: E={ROUTER_DIMS['experts']} top_k={ROUTER_DIMS['top_k']}, bf16 logits; GPU time per call "
              "(profiler)", flush=True)
        text = bench_router(ROUTER_TOKENS_SMALL if args.small else ROUTER_TOKENS_FULL, interpret, failures, summary)
        print(f"\n### router on {jax.devices()[0].device_kind}\n\n{text}\n")
    if args.only in (None, "causal_conv"):
        print("\ncausal_conv: the GDN layer's q, k, v convs (kernel 4), bf16; GPU time per call (profiler)", flush=True)
        text = bench_causal_conv(() if args.small else CONV_FULL, failures, summary)
        print(f"\n### causal_conv on {jax.devices()[0].device_kind}\n\n{text}\n")
    if args.write:
        command = shlex.join(["python", "-m", "qwen_jax.bench.kernels",
                              *(sys.argv[1:] if argv is None else argv)])
        write_summary(args.write, summary, jax.devices()[0].device_kind, command, git_commit(),
                      datetime.date.today().isoformat())
    return _report(failures)


def _report(failures: list[str]) -> int:
    if failures:
        print("\nFAILED:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
