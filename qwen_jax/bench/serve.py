"""Online serving benchmark against any OpenAI-compatible server: throughput, TTFT and TPOT per concurrency level.

Talks HTTP only (never imports the engine) and verifies every token count it reports by re-tokenizing.

Score: the weighted sum over levels of total (prompt + completion) tok/s, with weights 1, 1, 2, 2, 4, 4, 8 for
concurrency 1, 2, 4, 8, 16, 32, 64. A level between two of these takes the weight of the largest listed level
not above it, and any level beyond 64 takes weight 8, so more levels only ever add to the score.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

try:
    import httpx
except ImportError:  # some images ship the same client under its successor's name
    import httpx2 as httpx

from qwen_jax.bench.results import DEFAULT_RESULTS, append_result, make_entry

LEVEL_WEIGHTS = {1: 1, 2: 1, 4: 2, 8: 2, 16: 4, 32: 4, 64: 8}
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
WARMUP_REQUESTS = 2
SPOT_CHECKS = 2


# ---- prompts ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    """The HF tokenizer in `path` (a directory with tokenizer.json / tokenizer_config.json), loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def ordinary_token_ids(tokenizer: Any) -> np.ndarray:
    """Every id of the full vocabulary except added tokens (specials like <|im_end|> and control tokens)."""
    added = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    ids = np.arange(len(tokenizer), dtype=np.int64)
    return ids[~np.isin(ids, np.fromiter(added, np.int64, len(added)))]


def build_prompt(tokenizer: Any, length: int, rng: np.random.Generator, allowed: np.ndarray,
                 max_rounds: int = 200) -> tuple[str, list[int]]:
    """Text that tokenizes to exactly `length` ordinary tokens: decode random ids, re-encode, then cut the excess
    (twice over, so a tail that re-grows when cut, like a split UTF-8 character, cannot trap the loop) or append
    fresh random ids, until the round trip is exact. Returns (text, its token ids)."""
    if length < 1:
        raise ValueError(f"prompt length must be >= 1, got {length}")
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ids = rng.choice(allowed, length).tolist()
    for _ in range(max_rounds):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == length and not special.intersection(encoded):
            return text, encoded
        encoded = [t for t in encoded if t not in special]  # random pieces may spell a special token: drop it
        keep = encoded[:max(0, 2 * length - len(encoded))] if len(encoded) > length else encoded
        ids = keep + rng.choice(allowed, length - len(keep)).tolist()
    raise RuntimeError(f"no exact {length}-token prompt after {max_rounds} rounds")


def build_prompts(tokenizer: Any, length: int, count: int, seed: int) -> list[str]:
    """`count` prompts of exactly `length` tokens, a deterministic function of (tokenizer, length, count, seed)."""
    rng = np.random.default_rng(seed)
    allowed = ordinary_token_ids(tokenizer)
    return [build_prompt(tokenizer, length, rng, allowed)[0] for _ in range(count)]


def arithmetic_questions(seed: int, count: int = SPOT_CHECKS) -> list[tuple[str, int]]:
    """(question, answer) pairs like "What is 17 + 25? Answer with the number only."."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        a, b = (int(x) for x in rng.integers(2, 100, 2))
        out.append((f"What is {a} + {b}? Answer with the number only.", a + b))
    return out


# ---- one request -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RequestResult:
    """One streamed completion: what came back, when, and what the server said it counted."""

    ok: bool = False
    error: str | None = None
    text: str = ""
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # arrival of each chunk carrying text
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    def tpot(self, completion_tokens: int) -> float | None:
        """Mean time per output token after the first: (last chunk - first chunk) / (tokens - 1)."""
        if len(self.chunk_times) < 1 or completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (completion_tokens - 1)


def make_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """An AsyncClient with one connection per in-flight request and bounded connect/read/write timeouts."""
    timeout = httpx.Timeout(connect=min(30.0, timeout_s), read=timeout_s, write=min(60.0, timeout_s), pool=None)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str, prompt: str, max_tokens: int,
                            temperature: float = 1.0, ignore_eos: bool = True,
                            total_timeout_s: float = 3600.0) -> RequestResult:
    """POST a streaming /v1/completions request and time every chunk; errors are recorded, not raised."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
    }
    result = RequestResult(start=time.perf_counter())
    pieces: list[str] = []
    try:
        async with asyncio.timeout(total_timeout_s):
            async with client.stream("POST", base_url.rstrip("/") + "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    raise RuntimeError(f"HTTP {response.status_code}: {detail}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(f"server error in stream: {chunk['error']}")
                    text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                    if text:
                        result.chunk_times.append(time.perf_counter())
                        pieces.append(text)
                    usage = chunk.get("usage")
                    if usage:
                        result.usage_prompt_tokens = usage.get("prompt_tokens")
                        result.usage_completion_tokens = usage.get("completion_tokens")
        result.ok = True
    except Exception as e:  # noqa: BLE001 - a benchmark counts failures instead of stopping
        result.error = f"{type(e).__name__}: {e}"
    result.end = time.perf_counter()
    result.text = "".join(pieces)
    return result


async def chat_completion(client: httpx.AsyncClient, base_url: str, model: str, messages: list[dict],
                          max_tokens: int, temperature: float = 0.0, stop: Sequence[str] | None = None,
                          extra: dict | None = None) -> str:
    """Non-streaming /v1/chat/completions; returns the assistant message content (raises on HTTP errors)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": temperature, **(extra or {})}
    if stop:
        body["stop"] = list(stop)
    response = await client.post(base_url.rstrip("/") + "/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


# ---- one level -------------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(results: Sequence[RequestResult], wall_s: float, tokenizer: Any, input_len: int,
              output_len: int) -> dict:
    """Per-level numbers. Token counts come from the server's usage when it sent one, else from re-tokenizing;
    every count is checked against the re-tokenized text and the requested lengths."""
    ok = [r for r in results if r.ok]
    prompt_tokens = completion_tokens = 0
    ttfts, tpots, latencies = [], [], []
    prompt_mismatch = completion_mismatch = short = missing_usage = 0
    for r in ok:
        local = len(tokenizer.encode(r.text, add_special_tokens=False))
        p = r.usage_prompt_tokens if r.usage_prompt_tokens is not None else input_len
        c = r.usage_completion_tokens if r.usage_completion_tokens is not None else local
        missing_usage += r.usage_completion_tokens is None or r.usage_prompt_tokens is None
        prompt_mismatch += p != input_len
        completion_mismatch += c != local
        short += c != output_len
        prompt_tokens += p
        completion_tokens += c
        latencies.append(r.latency)
        if r.ttft is not None:
            ttfts.append(r.ttft)
        if r.tpot(c) is not None:
            tpots.append(r.tpot(c))
    ms = lambda v: None if v is None else v * 1e3
    return {
        "num_requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
        "wall_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tok_s": (prompt_tokens + completion_tokens) / wall_s if wall_s > 0 else 0.0,
        "output_tok_s": completion_tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms_p50": ms(percentile(ttfts, 50)),
        "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "tpot_ms_p50": ms(percentile(tpots, 50)),
        "tpot_ms_p99": ms(percentile(tpots, 99)),
        "latency_s_mean": float(np.mean(latencies)) if latencies else None,
        "verification": {
            "prompt_usage_mismatches": prompt_mismatch,  # usage.prompt_tokens != input_len
            "completion_retokenize_mismatches": completion_mismatch,  # usage.completion_tokens != re-tokenized
            "completion_length_mismatches": short,  # completion_tokens != output_len (ignore_eos was sent)
            "missing_usage": missing_usage,
        },
    }


async def spot_check(client: httpx.AsyncClient, base_url: str, model: str, seed: int, max_tokens: int) -> dict:
    """Greedy arithmetic chat requests; `correct` counts replies containing the right number (not as part of a
    longer number)."""
    checks = []
    for question, answer in arithmetic_questions(seed):
        try:
            reply = await chat_completion(client, base_url, model, [{"role": "user", "content": question}],
                                          max_tokens=max_tokens, temperature=0.0)
            correct = re.search(rf"(?<!\d){answer}(?!\d)", reply) is not None
            checks.append({"question": question, "answer": answer, "reply": reply[:200], "correct": correct})
        except Exception as e:  # noqa: BLE001
            checks.append({"question": question, "answer": answer, "error": f"{type(e).__name__}: {e}",
                           "correct": False})
    return {"correct": sum(c["correct"] for c in checks), "total": len(checks), "checks": checks}


async def run_level(base_url: str, model: str, tokenizer: Any, concurrency: int, prompts: Sequence[str],
                    warmup_prompts: Sequence[str], input_len: int, output_len: int, seed: int,
                    timeout_s: float = 600.0, spot_check_tokens: int = 64, progress: bool = True,
                    temperature: float = 1.0) -> dict:
    """Warm up, run `len(prompts)` requests with at most `concurrency` in flight, then the spot checks."""
    async with make_client(concurrency, timeout_s) as client:
        await asyncio.gather(*(stream_completion(client, base_url, model, p, output_len, temperature)
                               for p in warmup_prompts))
        sem = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(prompts), desc=f"c={concurrency}", disable=not progress, file=sys.stderr)

        async def one(prompt: str) -> RequestResult:
            async with sem:
                r = await stream_completion(client, base_url, model, prompt, output_len, temperature)
            bar.update(1)
            return r

        counters = await spec_decode_counters(client, base_url)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
        bar.close()
        spec = spec_decode_delta(counters, await spec_decode_counters(client, base_url))
        checks = await spot_check(client, base_url, model, seed, spot_check_tokens)
    level = {"concurrency": concurrency, **summarize(results, wall, tokenizer, input_len, output_len),
             "spot_check": checks}
    return {**level, "spec_decode": spec} if spec else level


SPEC_DECODE_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def spec_decode_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The server's speculative-decoding counters from /metrics (vLLM's spec_decode_* names, under any prefix);
    empty when it has none or no /metrics."""
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return {}
    return parse_spec_decode(response.text) if response.status_code == 200 else {}


def parse_spec_decode(metrics: str) -> dict[str, float]:
    """The spec_decode_* counters in a Prometheus text page (summed over label sets)."""
    found: dict[str, float] = {}
    for name in SPEC_DECODE_COUNTERS:
        for match in re.finditer(rf"^\S*spec_decode_{name}_total(?:{{[^}}]*}})? (\S+)$", metrics, re.M):
            found[name] = found.get(name, 0.0) + float(match.group(1))
    return found


def spec_decode_delta(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """The level's speculative decoding from two counter reads: drafts, draft and accepted tokens, the acceptance
    length (tokens a verify step emits per request: 1 + accepted / drafts); None without drafts."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SPEC_DECODE_COUNTERS}
    if delta["num_drafts"] <= 0:
        return None
    return {**{k: int(v) for k, v in delta.items()},
            "acceptance_length": round(1 + delta["num_accepted_tokens"] / delta["num_drafts"], 3)}


# ---- the whole run ---------------------------------------------------------------------------------------------

def level_weight(concurrency: int) -> int:
    """Weight of a level in the score (see the module docstring)."""
    below = [c for c in LEVEL_WEIGHTS if c <= concurrency]
    return LEVEL_WEIGHTS[max(below)] if below else 0


def weighted_score(levels: Sequence[dict]) -> float:
    """sum over levels of level_weight(concurrency) * total_tok_s."""
    return float(sum(level_weight(lv["concurrency"]) * lv["total_tok_s"] for lv in levels))


def default_num_requests(concurrency: int, waves: int | None = None) -> int:
    """max(8, 4 x concurrency); with `waves`, that many full waves of `concurrency` requests (at least 2 requests)."""
    return max(2, waves * concurrency) if waves else max(8, 4 * concurrency)


async def run_benchmark(base_url: str, model: str, tokenizer: Any, concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
                        num_requests: int | None = None, input_len: int = 1024, output_len: int = 1024,
                        reuse_prompts: bool = False, seed: int = 0, timeout_s: float = 600.0,
                        spot_check_tokens: int = 64, progress: bool = True,
                        roofline: Callable[[int, float], float] | None = None, waves: int | None = None,
                        previous_levels: Sequence[dict] = (), levels_out: str | None = None,
                        temperature: float = 1.0, warmup_requests: int = WARMUP_REQUESTS) -> dict:
    """Every level in turn; returns {"levels": [...], "weighted_score": ...}. Prompts of each level are new unless
    `reuse_prompts`; every request samples at `temperature` (0: greedy); `roofline(concurrency, tpot_s)` (optional)
    gives the measured/roofline ratio of a level. `previous_levels` (from an earlier `levels_out` of the same setup,
    e.g. a run split over two sessions) count in the table and the score; `levels_out` is rewritten after every
    level."""
    levels = list(previous_levels)
    for i, c in enumerate(concurrency):
        n = num_requests or default_num_requests(c, waves)
        level_seed = seed if reuse_prompts else seed + 1000 * (i + 1)
        prompts = build_prompts(tokenizer, input_len, n + warmup_requests, level_seed)
        level = await run_level(base_url, model, tokenizer, c, prompts[warmup_requests:], prompts[:warmup_requests],
                                input_len, output_len, seed + i, timeout_s, spot_check_tokens, progress, temperature)
        if roofline is not None and level["tpot_ms_p50"] is not None:
            level["roofline_ratio"] = roofline(c, level["tpot_ms_p50"] / 1e3)
        levels.append(level)
        # each level's row as soon as it is done (a long run cut short still shows its levels)
        print(format_table([level]).splitlines()[-1], file=sys.stderr, flush=True)
        if levels_out:
            with open(levels_out, "w") as f:
                json.dump(levels, f)
    return {"levels": levels, "weighted_score": weighted_score(levels)}


def format_table(levels: Sequence[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [f"{'conc':>5} {'reqs':>5} {'err':>4} {'wall s':>8} {'total tok/s':>12} {'out tok/s':>10} "
             f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'mismatch':>8} {'spot':>5} {'w':>2}"]
    for lv in levels:
        v = lv["verification"]
        mism = v["prompt_usage_mismatches"] + v["completion_retokenize_mismatches"] + v["completion_length_mismatches"]
        sc = lv["spot_check"]
        lines.append(
            f"{lv['concurrency']:>5} {lv['num_requests']:>5} {lv['errors']:>4} {lv['wall_s']:>8.2f} "
            f"{lv['total_tok_s']:>12.1f} {lv['output_tok_s']:>10.1f} {fmt(lv['ttft_ms_p50'], '9.1f')} "
            f"{fmt(lv['ttft_ms_p99'], '9.1f')} {fmt(lv['tpot_ms_p50'], '9.2f')} {fmt(lv['tpot_ms_p99'], '9.2f')} "
            f"{mism:>8} {sc['correct']:>2}/{sc['total']:<2} {level_weight(lv['concurrency']):>2}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory used to build and verify prompts")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)))
    p.add_argument("--num-requests", type=int, default=None, help="per level (default max(8, 4 x concurrency))")
    p.add_argument("--waves", type=int, default=None,
                   help="instead of --num-requests: that many waves of `concurrency` requests per level (at least 2)")
    p.add_argument("--warmup-requests", type=int, default=WARMUP_REQUESTS,
                   help="untimed requests that open each level (0: none, as a judge's client runs it)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--reuse-prompts", action="store_true", help="the same prompts at every level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="every request's temperature (0: greedy, e.g. for --load-format dummy_echo's full acceptance)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds between chunks before a request fails")
    p.add_argument("--spot-check-tokens", type=int, default=64)
    p.add_argument("--results", default=DEFAULT_RESULTS, help="RESULTS.json to append to; 'none' to skip")
    p.add_argument("--label", default=None)
    p.add_argument("--device", default=None, help="e.g. 'H200'")
    p.add_argument("--device-count", type=int, default=None)
    p.add_argument("--layout", default=None, help="e.g. 'TP=1,EP=1,DP=1'")
    p.add_argument("--weights", default=None, choices=["real", "random"])
    p.add_argument("--model-config", default=None, help="config.json: adds measured-TPOT/roofline ratios")
    p.add_argument("--bandwidth", type=float, default=None, help="TB/s for the roofline (default H200 4.3)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--levels-out", default=None, help="JSON file rewritten with the finished levels after each level")
    p.add_argument("--previous-levels", default=None,
                   help="a --levels-out file of an earlier partial run of the same setup: its levels join this run's")
    return p.parse_args(argv)


async def main_async(argv: Sequence[str] | None = None) -> dict:
    """The CLI inside a running event loop: run, print the table, append to RESULTS.json; returns the entry."""
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    roofline = None
    if args.model_config:
        from qwen_jax.bench.roofline import H200_TBPS, decode_bytes, roofline_ratio
        from qwen_jax.config import load_config

        cfg = load_config(args.model_config)
        bw = args.bandwidth or H200_TBPS
        mid_context = args.input_len + args.output_len // 2
        roofline = lambda c, tpot_s: roofline_ratio(tpot_s, decode_bytes(cfg, c, mid_context).total, bw)
    previous = []
    if args.previous_levels:
        with open(args.previous_levels) as f:
            previous = json.load(f)
    run = await run_benchmark(
        args.base_url, args.model, tokenizer, [int(c) for c in args.concurrency.split(",")], args.num_requests,
        args.input_len, args.output_len, args.reuse_prompts, args.seed, args.timeout, args.spot_check_tokens,
        not args.no_progress, roofline, args.waves, previous, args.levels_out, args.temperature,
        args.warmup_requests)
    print(format_table(run["levels"]))
    print(f"weighted score (sum of weight x total tok/s): {run['weighted_score']:.1f}")
    for lv in run["levels"]:
        if "spec_decode" in lv:
            sd = lv["spec_decode"]
            print(f"c={lv['concurrency']} speculative decoding: acceptance length {sd['acceptance_length']} "
                  f"({sd['num_accepted_tokens']} of {sd['num_draft_tokens']} draft tokens accepted over "
                  f"{sd['num_drafts']} verify rows)")
    spot = sum(lv["spot_check"]["correct"] for lv in run["levels"])
    total = sum(lv["spot_check"]["total"] for lv in run["levels"])
    print(f"arithmetic spot checks: {spot}/{total} correct (meaningless with random weights)")
    checks = {k: sum(lv["verification"][k] for lv in run["levels"]) for k in run["levels"][0]["verification"]}
    print("count checks (requests): " + ", ".join(f"{k} {v}" for k, v in checks.items()) +
          " (re-tokenized text may differ from usage when random tokens split characters; rates use usage)")
    entry = make_entry(
        "serve", device=args.device, device_count=args.device_count, layout=args.layout, model=args.model,
        weights=args.weights, config=args.model_config, levels=run["levels"], score=run["weighted_score"],
        roofline={lv["concurrency"]: lv.get("roofline_ratio") for lv in run["levels"]} if roofline else None,
        argv=["python", "-m", "qwen_jax.bench.serve", *(sys.argv[1:] if argv is None else argv)], label=args.label,
        base_url=args.base_url, input_len=args.input_len, output_len=args.output_len,
        reuse_prompts=args.reuse_prompts, temperature=args.temperature)
    if args.results and args.results.lower() != "none":
        append_result(entry, args.results)
        print(f"appended to {args.results}")
    return entry


def main(argv: Sequence[str] | None = None) -> dict:
    return asyncio.run(main_async(argv))


if __name__ == "__main__":
    main()
