"""GSM8K chain-of-thought evaluation against an OpenAI-compatible server: 8-shot chat turns, greedy, two scores.

Reads a local GSM8K jsonl (never downloads); `evaluate(base_url, ...)` is the entry point for scripts and tests.

Scores: strict counts a reply whose last "The answer is N" equals the reference; flexible takes the last number
anywhere in the reply. Numbers may carry $, thousands commas, a sign, decimals and a trailing period.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

from tqdm import tqdm

from qwen_jax.bench.results import DEFAULT_RESULTS, REPO_ROOT, append_result, make_entry
from qwen_jax.bench.serve import chat_completion, make_client

DATA_DIR = os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k")
DEFAULT_TEST = os.path.join(DATA_DIR, "test.jsonl")
DEFAULT_TRAIN = os.path.join(DATA_DIR, "train.jsonl")
STOP = ("Q:", "<|im_end|>")

_NUMBER = r"-?\$?-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"The answer is:?\s*(" + _NUMBER + ")", re.IGNORECASE)
_FLEXIBLE = re.compile(_NUMBER)
_CALCULATOR = re.compile(r"<<[^>]*>>")


def normalize_number(text: str) -> Decimal | None:
    """'$1,234.50' -> Decimal('1234.50'), '-$5' -> -5, '12.' is not a number here (the caller strips '.')."""
    cleaned = re.sub(r"[\s$,]", "", text).rstrip(".")
    negative = cleaned.count("-") % 2 == 1
    cleaned = cleaned.replace("-", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return -value if negative else value


def truncate_at_stop(text: str, stop: Sequence[str] = STOP) -> str:
    """Cut the reply at the first stop string, for servers that ignore `stop`."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def extract_strict(text: str) -> Decimal | None:
    """The number after the last 'The answer is'."""
    matches = _STRICT.findall(truncate_at_stop(text))
    return normalize_number(matches[-1]) if matches else None


def extract_flexible(text: str) -> Decimal | None:
    """The last number in the reply."""
    for m in reversed(_FLEXIBLE.findall(truncate_at_stop(text))):
        value = normalize_number(m)
        if value is not None:
            return value
    return None


def reference_answer(answer: str) -> Decimal:
    """The number after '####' in a GSM8K answer."""
    value = normalize_number(answer.split("####")[-1].strip())
    if value is None:
        raise ValueError(f"no reference number in {answer[-60:]!r}")
    return value


def chain_of_thought(answer: str) -> str:
    """A GSM8K training answer as one CoT paragraph ending in 'The answer is N.' (calculator marks removed)."""
    reasoning, final = answer.split("####")
    lines = [line.strip() for line in _CALCULATOR.sub("", reasoning).splitlines() if line.strip()]
    return " ".join(lines) + f" The answer is {final.strip()}."


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fewshot_messages(train: Sequence[dict], shots: int = 8, seed: int | None = None) -> list[dict]:
    """`shots` worked examples as alternating user/assistant turns: the first ones, or a seeded sample."""
    picked = list(train[:shots]) if seed is None else random.Random(seed).sample(list(train), shots)
    messages = []
    for ex in picked:
        messages.append({"role": "user", "content": f"Q: {ex['question']}\nA:"})
        messages.append({"role": "assistant", "content": chain_of_thought(ex["answer"])})
    return messages


def score(reply: str, gold: Decimal) -> tuple[bool, bool]:
    """(strict correct, flexible correct)."""
    return extract_strict(reply) == gold, extract_flexible(reply) == gold


async def evaluate_async(base_url: str, model: str = "", test_path: str = DEFAULT_TEST,
                         train_path: str = DEFAULT_TRAIN, limit: int | None = None, concurrency: int = 8,
                         max_tokens: int = 256, shots: int = 8, fewshot_seed: int | None = None,
                         extra_body: dict | None = None, timeout_s: float = 600.0, progress: bool = False) -> dict:
    """Ask every question (the first `limit`) greedily with the few-shot turns; returns both accuracies,
    the error count and one record per question."""
    questions = read_jsonl(test_path)[:limit]
    context = fewshot_messages(read_jsonl(train_path), shots, fewshot_seed)
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(questions), desc="gsm8k", disable=not progress, file=sys.stderr)
    async with make_client(concurrency, timeout_s) as client:

        async def one(ex: dict) -> dict:
            gold = reference_answer(ex["answer"])
            messages = [*context, {"role": "user", "content": f"Q: {ex['question']}\nA:"}]
            async with sem:
                try:
                    reply = await chat_completion(client, base_url, model, messages, max_tokens, 0.0, STOP,
                                                  extra_body)
                    error = None
                except Exception as e:  # noqa: BLE001 - counted as wrong and reported
                    reply, error = "", f"{type(e).__name__}: {e}"
            bar.update(1)
            strict, flexible = score(reply, gold)
            return {"question": ex["question"], "gold": str(gold), "reply": truncate_at_stop(reply),
                    "strict": strict, "flexible": flexible, "error": error}

        records = await asyncio.gather(*(one(ex) for ex in questions))
    bar.close()
    n = max(len(records), 1)
    return {
        "num_questions": len(records),
        "strict_accuracy": sum(r["strict"] for r in records) / n,
        "flexible_accuracy": sum(r["flexible"] for r in records) / n,
        "errors": sum(r["error"] is not None for r in records),
        "records": records,
    }


def evaluate(base_url: str, model: str = "", **kwargs) -> dict:
    """Synchronous `evaluate_async` (same arguments), for scripts and tests that run no event loop."""
    return asyncio.run(evaluate_async(base_url, model, **kwargs))


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="a name the server serves (default: none given, its own)")
    p.add_argument("--data", default=DEFAULT_TEST, help="GSM8K test jsonl")
    p.add_argument("--train", default=DEFAULT_TRAIN, help="GSM8K train jsonl for the few-shot turns")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--shots", type=int, default=8)
    p.add_argument("--fewshot-seed", type=int, default=None, help="sample the shots (default: the first ones)")
    p.add_argument("--disable-thinking", action="store_true",
                   help="send chat_template_kwargs.enable_thinking=false (Qwen3/3.5 templates)")
    p.add_argument("--results", default=DEFAULT_RESULTS, help="RESULTS.json to append to; 'none' to skip")
    p.add_argument("--device", default=None)
    p.add_argument("--device-count", type=int, default=None)
    p.add_argument("--layout", default=None)
    p.add_argument("--weights", default=None, choices=["real", "random"])
    args = p.parse_args(argv)
    extra = {"chat_template_kwargs": {"enable_thinking": False}} if args.disable_thinking else None
    out = evaluate(args.base_url, args.model, test_path=args.data, train_path=args.train, limit=args.limit,
                   concurrency=args.concurrency, max_tokens=args.max_tokens, shots=args.shots,
                   fewshot_seed=args.fewshot_seed, extra_body=extra, progress=True)
    print(f"GSM8K-CoT {args.shots}-shot, {out['num_questions']} questions, {out['errors']} errors: "
          f"strict {out['strict_accuracy']:.4f}, flexible {out['flexible_accuracy']:.4f}")
    if args.results and args.results.lower() != "none":
        entry = make_entry(
            "gsm8k", device=args.device, device_count=args.device_count, layout=args.layout, model=args.model,
            weights=args.weights, config=None,
            argv=["python", "-m", "qwen_jax.bench.gsm8k", *(sys.argv[1:] if argv is None else argv)],
            num_questions=out["num_questions"], strict_accuracy=out["strict_accuracy"],
            flexible_accuracy=out["flexible_accuracy"], errors=out["errors"])
        append_result(entry, args.results)
        print(f"appended to {args.results}")
    return out


if __name__ == "__main__":
    main()
