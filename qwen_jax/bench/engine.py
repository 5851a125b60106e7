"""Offline engine benchmarks: throughput of fixed prefill/decode/remove traces, and a one-batch latency table.

Drives `qwen_jax.create_engine` (traces) and `qwen_jax.LLM` (one batch) directly; never starts a server.

Traces (base / --scale):
  prefill  prefill 4 x 128 then remove                         / 64 x 1,024
  decode   prefill 8 x 32, 16 decode steps, remove             / 64 x 1,024, 16 steps
  mixed    prefill 4x64, decode 2, prefill 2x128, decode 6, remove 2, prefill 4x32, decode 2 (8 live), remove all
           / every batch x8 and every length x8 (64 live at the end)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from qwen_jax.bench.results import DEFAULT_RESULTS, append_result, make_entry

# Ops: ("prefill", count, length) adds `count` new requests; ("decode", steps) steps every live request;
# ("remove", count) removes the oldest `count` live requests, or all when count is None.
TRACES: dict[str, list[tuple]] = {
    "prefill": [("prefill", 4, 128), ("remove", None)],
    "decode": [("prefill", 8, 32), ("decode", 16), ("remove", None)],
    "mixed": [("prefill", 4, 64), ("decode", 2), ("prefill", 2, 128), ("decode", 6), ("remove", 2),
              ("prefill", 4, 32), ("decode", 2), ("remove", None)],
}
SCALED_TRACES: dict[str, list[tuple]] = {
    "prefill": [("prefill", 64, 1024), ("remove", None)],
    "decode": [("prefill", 64, 1024), ("decode", 16), ("remove", None)],
    "mixed": [("prefill", 32, 512), ("decode", 2), ("prefill", 16, 1024), ("decode", 6), ("remove", 16),
              ("prefill", 32, 256), ("decode", 2), ("remove", None)],
}


def trace_needs(trace: Sequence[tuple]) -> tuple[int, int]:
    """(most live requests at once, longest sequence) a trace reaches: what the engine must be sized for."""
    live: list[int] = []
    most = longest = 0
    for op in trace:
        if op[0] == "prefill":
            live += [op[2]] * op[1]
        elif op[0] == "decode":
            live = [n + op[1] for n in live]
        else:
            live = [] if op[1] is None else live[op[1]:]
        most = max(most, len(live))
        longest = max([longest, *live])
    return most, longest


# ---- building the engine ---------------------------------------------------------------------------------------

def build_engine(config_path: str, weight_dir: str | None, device: str, max_num_seqs: int, max_model_len: int,
                 seed: int = 0, kernels: str | None = None) -> tuple[Any, str]:
    """A create_engine engine sized for the trace over the checkpoint in `weight_dir` ("real") or random weights
    of the config's shapes drawn from `seed` ("random")."""
    from qwen_jax import create_engine

    file = os.path.join(config_path, "config.json") if os.path.isdir(config_path) else config_path
    with open(file) as f:
        hf_config = json.load(f)
    kwargs = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
              **({"kernels": kernels} if kernels is not None else {})}
    if weight_dir is not None:
        return create_engine(hf_config, weight_dir, device, **kwargs), "real"
    return create_engine(hf_config, None, device, load_format="dummy", seed=seed, **kwargs), "random"


def peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first device since start, where the backend reports it (GPU/TPU; not CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def _greedy(logits: Any) -> np.ndarray:
    """Next tokens from [batch, vocab] logits, fetched to the host (this is the step's synchronization point)."""
    import jax.numpy as jnp

    return np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)).astype(np.int32)


# ---- (a) traces ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TraceRun:
    seconds: float
    decode_seconds: float
    prefill_tokens: int
    decode_tokens: int


def run_trace(engine: Any, trace: Sequence[tuple], vocab: int, rng: np.random.Generator, tag: str) -> TraceRun:
    """Play one trace; prompts are random ids below `vocab`, decode feeds back the greedy token."""
    live: list[str] = []
    last: dict[str, int] = {}
    counter = 0
    prefill_tokens = decode_tokens = 0
    decode_s = 0.0
    start = time.perf_counter()
    for op in trace:
        if op[0] == "prefill":
            ids = [f"{tag}-{counter + i}" for i in range(op[1])]
            counter += op[1]
            prompts = [rng.integers(0, vocab, op[2], dtype=np.int32) for _ in ids]
            last.update(zip(ids, _greedy(engine.prefill(ids, prompts)).tolist(), strict=True))
            live += ids
            prefill_tokens += op[1] * op[2]
        elif op[0] == "decode":
            t0 = time.perf_counter()
            for _ in range(op[1]):
                tokens = np.array([last[r] for r in live], np.int32)
                last.update(zip(live, _greedy(engine.decode(live, tokens)).tolist(), strict=True))
                decode_tokens += len(live)
            decode_s += time.perf_counter() - t0
        else:
            gone = live if op[1] is None else live[:op[1]]
            engine.remove(list(gone))
            live = [] if op[1] is None else live[op[1]:]
    return TraceRun(time.perf_counter() - start, decode_s, prefill_tokens, decode_tokens)


def bench_trace(engine: Any, name: str, trace: Sequence[tuple], vocab: int, warmup: int = 2, repeats: int = 3,
                seed: int = 0) -> dict:
    """Warm-up runs (compilation; the second catches recompiles once the cache is committed to the device),
    then the median of `repeats` timed runs."""
    rng = np.random.default_rng(seed)
    for i in range(warmup):
        run_trace(engine, trace, vocab, rng, f"{name}-warm{i}")
    runs = [run_trace(engine, trace, vocab, rng, f"{name}-{i}") for i in range(repeats)]
    seconds = statistics.median(r.seconds for r in runs)
    decode_s = statistics.median(r.decode_seconds for r in runs)
    tokens = runs[0].prefill_tokens + runs[0].decode_tokens
    return {
        "trace": name, "repeats": repeats, "seconds": seconds, "prefill_tokens": runs[0].prefill_tokens,
        "decode_tokens": runs[0].decode_tokens, "tok_s": tokens / seconds,
        "decode_tok_s": runs[0].decode_tokens / decode_s if decode_s > 0 else None,
        "peak_memory_bytes": peak_memory_bytes(),
    }


# ---- (b) one-batch latency -------------------------------------------------------------------------------------

def bench_one_batch(engine: Any, batch: int, input_len: int, output_len: int, vocab: int, seed: int = 0,
                    warmup: int = 2) -> dict:
    """Like SGLang's bench_one_batch: prefill `batch` x `input_len`, then `output_len - 1` decode steps (the
    prefill yields the first token). Reports latency, input and output tok/s and the median inter-token latency."""
    rng = np.random.default_rng(seed)

    def once(tag: str) -> tuple[float, list[float]]:
        ids = [f"{tag}-{i}" for i in range(batch)]
        prompts = [rng.integers(0, vocab, input_len, dtype=np.int32) for _ in ids]
        t0 = time.perf_counter()
        tokens = _greedy(engine.prefill(ids, prompts))
        prefill_s = time.perf_counter() - t0
        steps = []
        for _ in range(output_len - 1):
            t = time.perf_counter()
            tokens = _greedy(engine.decode(ids, tokens))
            steps.append(time.perf_counter() - t)
        engine.remove(ids)
        return prefill_s, steps

    for i in range(warmup):
        once(f"b{batch}-warm{i}")
    prefill_s, steps = once(f"b{batch}")
    decode_s = sum(steps)
    return {
        "batch": batch, "input_len": input_len, "output_len": output_len,
        "latency_s": prefill_s + decode_s, "prefill_s": prefill_s,
        "input_tok_s": batch * input_len / prefill_s,
        "output_tok_s": batch * (output_len - 1) / decode_s if decode_s > 0 else None,
        "itl_ms_median": statistics.median(steps) * 1e3 if steps else None,
        "peak_memory_bytes": peak_memory_bytes(),
    }


def build_llm(model_dir: str, weights: str | None, max_batch: int, max_len: int, batched_tokens: int,
              kernels: str | None = None, layout_args: dict | None = None) -> Any:
    """The offline LLM for one-batch runs: dummy weights unless `weights` is given (then it must equal
    `model_dir`, the LLM reads config and checkpoint from one directory), no prefix cache, and a prefill token
    budget of `batched_tokens` per step (64 x 4,096 tokens in one step would need memory for their activations).
    `layout_args`: tensor_parallel_size, data_parallel_size, enable_expert_parallel (only those given)."""
    from qwen_jax import LLM

    if weights is not None and os.path.abspath(weights) != os.path.abspath(model_dir):
        raise SystemExit("with --api llm the checkpoint is read from --config's directory; pass the same path")
    return LLM(model_dir, load_format="auto" if weights else "dummy", max_num_seqs=max_batch,
                   max_model_len=max_len, max_num_batched_tokens=batched_tokens, enable_prefix_caching=False,
                   **({"kernels": kernels} if kernels else {}), **(layout_args or {}))


def layout_args(args: argparse.Namespace) -> dict:
    """The parallel layout flags that were given, as LLM keyword arguments."""
    given = {"tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size,
             "enable_expert_parallel": args.enable_expert_parallel or None}
    return {k: v for k, v in given.items() if v is not None}


def llm_one_batch(llm: Any, batch: int, input_len: int, output_len: int, vocab: int, seed: int = 0,
                  warmup: int = 2) -> dict:
    """bench_one_batch through `LLM.generate`, timed by the RequestOutput timestamps: latency is the last finish
    minus the first arrival, prefill the last first token minus the first arrival, the rest is decode."""
    from qwen_jax.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def once() -> tuple[float, float]:
        prompts = [rng.integers(0, vocab, input_len).tolist() for _ in range(batch)]
        outs = llm.generate(prompts, params)
        if any(len(o.token_ids) != output_len for o in outs):
            raise RuntimeError(f"LLM.generate returned {[len(o.token_ids) for o in outs]} tokens, "
                               f"expected {output_len} each (ignore_eos)")
        start = min(o.arrival_time for o in outs)
        return max(o.finish_time for o in outs) - start, max(o.first_token_time for o in outs) - start

    for _ in range(warmup):
        once()
    wall, prefill_s = once()
    decode_s = wall - prefill_s
    return {
        "batch": batch, "input_len": input_len, "output_len": output_len, "api": "llm",
        "latency_s": wall, "prefill_s": prefill_s,
        "input_tok_s": batch * input_len / prefill_s,
        "output_tok_s": batch * (output_len - 1) / decode_s if output_len > 1 and decode_s > 0 else None,
        "itl_ms_median": decode_s / (output_len - 1) * 1e3 if output_len > 1 else None,  # mean: no per-step times
        "peak_memory_bytes": peak_memory_bytes(),
    }


# ---- CLI -------------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="HF config.json or model directory")
    p.add_argument("--weights", default=None, help="checkpoint directory; random (dummy) weights when absent")
    p.add_argument("--device", default="auto", help="'cuda', 'cpu' or 'auto'")
    p.add_argument("--mode", choices=["traces", "one-batch", "both"], default="both")
    p.add_argument("--traces", default="prefill,decode,mixed")
    p.add_argument("--scale", action="store_true", help="batch 64 and 1,024-token prompts")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before each measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", default="1,2,4,8,16,64", help="one-batch sizes")
    p.add_argument("--api", choices=["auto", "llm", "engine"], default="auto",
                   help="one-batch through qwen_jax.LLM or create_engine; auto: LLM when --config is a model "
                        "directory")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="one-batch: the LLM's prefill token budget per step (at most batch x input-len)")
    p.add_argument("--kernels", choices=["reference", "gpu"], default=None,
                   help="this repo's kernel switch (default: the engine's own default)")
    p.add_argument("--results", default=DEFAULT_RESULTS, help="RESULTS.json to append to; 'none' to skip")
    p.add_argument("--device-name", default=None, help="recorded in RESULTS.json, e.g. 'H200'")
    p.add_argument("--layout", default=None, help="recorded in RESULTS.json, e.g. 'TP=2'")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="one-batch LLM: devices per replica")
    p.add_argument("--data-parallel-size", type=int, default=None, help="one-batch LLM: replicas")
    p.add_argument("--enable-expert-parallel", action="store_true", help="one-batch LLM: experts split (EP)")
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)

    from qwen_jax.config import load_config

    cfg = load_config(args.config)
    table = SCALED_TRACES if args.scale else TRACES
    traces = {n: table[n] for n in args.traces.split(",")} if args.mode != "one-batch" else {}
    batches = [int(b) for b in args.batch.split(",")] if args.mode != "traces" else []
    vocab = cfg.vocab_size
    api = args.api
    if api == "auto":
        api = "llm" if os.path.isdir(args.config) else "engine"
    needs = [trace_needs(t) for t in traces.values()]
    if api == "engine":
        needs += [(b, args.input_len + args.output_len) for b in batches]
    engine = None
    weights = "real" if args.weights else "random"
    if needs:
        max_seqs = max(n for n, _ in needs)
        max_len = max(length for _, length in needs)
        engine, weights = build_engine(args.config, args.weights, args.device, max_seqs, max_len, args.seed,
                                       args.kernels)
    out: dict[str, list] = {"traces": [], "one_batch": []}
    for name, trace in traces.items():
        row = bench_trace(engine, name, trace, vocab, args.warmup, args.repeats, args.seed)
        out["traces"].append(row)
        decode = "-" if row["decode_tok_s"] is None else f"{row['decode_tok_s']:.1f}"
        print(f"trace {name:>8}: {row['seconds'] * 1e3:9.1f} ms  {row['tok_s']:10.1f} tok/s  decode {decode} tok/s"
              f"  peak {row['peak_memory_bytes']}")
    if batches:
        print(f"one batch through {'qwen_jax.LLM' if api == 'llm' else 'create_engine'}")
        print(f"{'batch':>6} {'latency s':>10} {'input tok/s':>12} {'output tok/s':>13} {'ITL ms':>8}")
    if batches and api == "llm":
        engine = None  # free the trace engine's cache before the LLM allocates its own
        llm = build_llm(args.config, args.weights, max(batches), args.input_len + args.output_len,
                        min(max(batches) * args.input_len, args.max_num_batched_tokens), args.kernels,
                        layout_args(args))
    for b in batches:
        if api == "llm":
            row = llm_one_batch(llm, b, args.input_len, args.output_len, vocab, args.seed, args.warmup)
        else:
            row = {**bench_one_batch(engine, b, args.input_len, args.output_len, vocab, args.seed, args.warmup),
                   "api": "engine"}
        out["one_batch"].append(row)
        itl = "-" if row["itl_ms_median"] is None else f"{row['itl_ms_median']:.2f}"
        outs = "-" if row["output_tok_s"] is None else f"{row['output_tok_s']:.1f}"
        print(f"{b:>6} {row['latency_s']:>10.3f} {row['input_tok_s']:>12.1f} {outs:>13} {itl:>8}")
    import jax

    entry = make_entry(
        "engine", device=args.device_name or jax.devices()[0].device_kind, device_count=jax.device_count(),
        layout=args.layout, model=os.path.basename(os.path.normpath(args.config)), weights=weights,
        config=args.config, levels=out, label=args.label, scale=args.scale, kernels=args.kernels,
        argv=["python", "-m", "qwen_jax.bench.engine", *(sys.argv[1:] if argv is None else argv)])
    if args.results and args.results.lower() != "none":
        append_result(entry, args.results)
        print(f"appended to {args.results}")
    return entry


if __name__ == "__main__":
    main()
