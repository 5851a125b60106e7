"""Single-request latency against an OpenAI-compatible server: short, medium and long prompts, one at a time.

Talks HTTP only; prompts are exact-length random text (see serve.build_prompts), fresh per request so no prefix
cache can hide the prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from qwen_jax.bench.results import DEFAULT_RESULTS, append_result, make_entry
from qwen_jax.bench.serve import build_prompts, load_tokenizer, make_client, percentile, stream_completion

DEFAULT_CATEGORIES = "short:64:128,medium:2048:256,long:8192:256"


def parse_categories(spec: str) -> list[tuple[str, int, int]]:
    """'short:64:128,long:8192:256' -> [('short', 64, 128), ('long', 8192, 256)]."""
    out = []
    for item in spec.split(","):
        name, inp, outp = item.split(":")
        out.append((name, int(inp), int(outp)))
    return out


async def run_latency(base_url: str, model: str, tokenizer: object,
                      categories: Sequence[tuple[str, int, int]], warmup: int = 5, num_requests: int = 50,
                      seed: int = 0, timeout_s: float = 600.0, progress: bool = True) -> list[dict]:
    """For each (name, input_len, output_len): `warmup` then `num_requests` sequential streamed requests.
    Latency is request start to last chunk; failed requests are counted, not timed."""
    rows = []
    async with make_client(1, timeout_s) as client:
        for i, (name, input_len, output_len) in enumerate(categories):
            prompts = build_prompts(tokenizer, input_len, warmup + num_requests, seed + 1000 * (i + 1))
            for p in prompts[:warmup]:
                await stream_completion(client, base_url, model, p, output_len)
            results = []
            for p in tqdm(prompts[warmup:], desc=name, disable=not progress, file=sys.stderr):
                results.append(await stream_completion(client, base_url, model, p, output_len))
            ok = [r for r in results if r.ok]
            lat = [r.latency for r in ok]
            ttft = [r.ttft for r in ok if r.ttft is not None]
            tpot = [t for r in ok if (t := r.tpot(r.usage_completion_tokens or output_len)) is not None]
            ms = lambda v: None if v is None else v * 1e3
            rows.append({
                "category": name, "input_len": input_len, "output_len": output_len,
                "num_requests": len(results), "errors": len(results) - len(ok),
                "latency_ms_mean": ms(float(np.mean(lat))) if lat else None,
                "latency_ms_p50": ms(percentile(lat, 50)), "latency_ms_p99": ms(percentile(lat, 99)),
                "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
                "tpot_ms_p50": ms(percentile(tpot, 50)),
            })
    return rows


def format_table(rows: Sequence[dict]) -> str:
    fmt = lambda v: "        -" if v is None else f"{v:9.1f}"
    lines = [f"{'category':>9} {'in':>6} {'out':>5} {'n':>4} {'err':>4} {'mean ms':>9} {'p50 ms':>9} {'p99 ms':>9} "
             f"{'TTFT p50':>9} {'TPOT p50':>9}"]
    for r in rows:
        lines.append(f"{r['category']:>9} {r['input_len']:>6} {r['output_len']:>5} {r['num_requests']:>4} "
                     f"{r['errors']:>4} {fmt(r['latency_ms_mean'])} {fmt(r['latency_ms_p50'])} "
                     f"{fmt(r['latency_ms_p99'])} {fmt(r['ttft_ms_p50'])} {fmt(r['tpot_ms_p50'])}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--categories", default=DEFAULT_CATEGORIES, help="name:input_len:output_len,...")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--num-requests", type=int, default=50, help="measured requests per category")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--results", default=DEFAULT_RESULTS, help="RESULTS.json to append to; 'none' to skip")
    p.add_argument("--device", default=None)
    p.add_argument("--device-count", type=int, default=None)
    p.add_argument("--layout", default=None)
    p.add_argument("--weights", default=None, choices=["real", "random"])
    p.add_argument("--label", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    rows = asyncio.run(run_latency(args.base_url, args.model, tokenizer, parse_categories(args.categories),
                                   args.warmup, args.num_requests, args.seed, args.timeout, not args.no_progress))
    print(format_table(rows))
    if args.results and args.results.lower() != "none":
        entry = make_entry(
            "latency", device=args.device, device_count=args.device_count, layout=args.layout, model=args.model,
            weights=args.weights, config=None, levels=rows, label=args.label, base_url=args.base_url,
            argv=["python", "-m", "qwen_jax.bench.latency", *(sys.argv[1:] if argv is None else argv)])
        append_result(entry, args.results)
        print(f"appended to {args.results}")
    return rows


if __name__ == "__main__":
    main()
