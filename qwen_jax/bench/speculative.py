"""Acceptance of a checkpoint's MTP head measured through the engine: held-out GSM8K test questions served as chat
requests with thinking off (as scripts/train_mtp_model.py renders its prompts), greedy, at each draft count k.

Per k: the acceptance length and rates from the engine core's speculative counters, output tokens/s, and how many
prompts' outputs differ from k = 0's (greedy speculation must change none). One engine at a time: each is freed
before the next is built, so the device never holds two models. Never trains and never writes weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

import jax

from qwen_jax.bench.results import DEFAULT_RESULTS, REPO_ROOT, append_result, make_entry
from qwen_jax.engine.model_files import load_tokenizer
from qwen_jax.engine.speculative import parse_speculative_config
from qwen_jax.llm import LLM
from qwen_jax.sampling_params import SamplingParams

DEFAULT_DATA = os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")
SPEC_COUNTERS = ("spec_verified_rows_total", "spec_drafted_tokens_total", "spec_accepted_tokens_total")


def spec_config(k: int) -> dict | None:
    """The engine's speculative_config for k drafts a step (k = 0: "off"). The one place that knows its
    shape."""
    return "off" if k == 0 else {"method": "mtp", "num_speculative_tokens": k}


def load_questions(path: str, count: int) -> list[str]:
    """The first `count` questions of a GSM8K jsonl."""
    questions = []
    with open(path) as f:
        for line in f:
            if line.strip():
                questions.append(json.loads(line)["question"])
            if len(questions) == count:
                break
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """A question as a served chat request: the user turn and the generation prompt with thinking off, token ids
    (scripts/train_mtp_model.py's prompt_ids, which its head was trained after)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                         add_generation_prompt=True, enable_thinking=False, return_dict=False)


def _device_gib_in_use() -> float | None:
    stats = jax.devices()[0].memory_stats()
    return round(stats["bytes_in_use"] / 2**30, 2) if stats and "bytes_in_use" in stats else None


def measure(llm: LLM, k: int, prompts: list[list[int]], max_tokens: int, one_at_a_time: bool
            ) -> tuple[dict, list[list[int]]]:
    """Greedy outputs of every prompt, all in one generate call or (`one_at_a_time`) one call a prompt, and what
    the engine's speculative counters say about them: (the level's numbers, each prompt's output token ids)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = llm.engine.stats()
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    else:
        outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    after = llm.engine.stats()
    rows, drafted, accepted = (after[key] - before[key] for key in SPEC_COUNTERS)
    at_position = [a - b for a, b in zip(after["spec_accepted_tokens_per_position"][:k],
                                         before["spec_accepted_tokens_per_position"][:k], strict=True)]
    tokens = [list(out.token_ids) for out in outputs]
    output_tokens = sum(len(t) for t in tokens)
    return {
        "drafts": k, "prompts": len(prompts), "output_tokens": output_tokens, "wall_s": round(wall, 3),
        "output_tokens_per_s": round(output_tokens / wall, 1),
        "engine_steps": after["steps_total"] - before["steps_total"],
        "verified_rows": rows, "drafted_tokens": drafted, "accepted_tokens": accepted,
        # tokens a verified row emits: its accepted drafts and the target's own token
        "acceptance_length": round(1 + accepted / rows, 4) if rows else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        # of the rows verified, the share that accepted their j-th draft (and so every one before it)
        "acceptance_rate_by_position": [round(a / rows, 4) for a in at_position] if rows else None,
        "accepted_by_position": at_position,
    }, tokens


def compare(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """How many prompts' outputs differ from the reference's, and where the first few first differ (prompt index,
    token index)."""
    differ = []
    for i, (got, expected) in enumerate(zip(tokens, reference, strict=True)):
        if got != expected:
            first = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            differ.append([i, first])
    return {"outputs_differ_from_k0": len(differ), "first_differences": differ[:8]}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " / ".join(f"{v:.3f}" for v in value) or "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown_table(levels: list[dict]) -> str:
    header = ("| k | prompts | output tokens | tokens/s | acceptance length | acceptance rate | rate by position "
              "| outputs differing from k=0 |")
    lines = [header, "|" + "---|" * 8]
    for lv in levels:
        lines.append("| " + " | ".join(_cell(lv.get(key)) for key in (
            "drafts", "prompts", "output_tokens", "output_tokens_per_s", "acceptance_length", "acceptance_rate",
            "acceptance_rate_by_position", "outputs_differ_from_k0")) + " |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",") if v.strip()})


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory with an MTP head and a tokenizer")
    ap.add_argument("--drafts", default="0,1,2,3", help="comma-separated draft counts k (0: no speculation)")
    ap.add_argument("--prompts", type=int, default=64, help="the first N questions of --data")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--data", default=DEFAULT_DATA, help="GSM8K jsonl (held out: the test split)")
    ap.add_argument("--kernels", default="auto", choices=("auto", "gpu", "reference"))
    ap.add_argument("--max-num-seqs", type=int, default=None, help="engine argument (default: the engine's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="engine argument (default: the engine's); fewer token buckets compile faster")
    ap.add_argument("--max-model-len", type=int, default=None, help="engine argument (default: the engine's)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="submit the prompts one by one (batch size 1, where speculation pays most)")
    ap.add_argument("--results", default=DEFAULT_RESULTS, help="RESULTS.json to append to; 'none' to skip")
    args = ap.parse_args(argv)
    drafts = _ints(args.drafts)
    for k in drafts:  # a bad k fails here, before any engine is built
        parse_speculative_config(spec_config(k))
    if args.prompts < 1 or args.max_tokens < 1:
        raise ValueError("--prompts and --max-tokens must be at least 1")
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer: the prompts are chat-rendered questions")
    prompts = [chat_prompt_ids(tokenizer, q) for q in load_questions(args.data, args.prompts)]
    mode = "one_at_a_time" if args.one_at_a_time else "batch"
    print(json.dumps({"model": args.model, "mode": mode, "prompts": len(prompts),
                      "prompt_tokens_median": statistics.median(len(p) for p in prompts)}), flush=True)
    levels, reference = [], None
    for k in drafts:
        in_use = _device_gib_in_use()
        llm = LLM(args.model, speculative_config=spec_config(k), kernels=args.kernels, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
        if llm.engine.on_accelerator:  # every step program compiled before the clock starts
            llm.engine.warmup(full=True)
        level, tokens = measure(llm, k, prompts, args.max_tokens, args.one_at_a_time)
        del llm
        gc.collect()  # the next engine sizes its cache from the memory this one frees
        if k == 0:
            reference = tokens
        level.update(compare(tokens, reference) if reference is not None else {"outputs_differ_from_k0": None})
        level["device_gib_in_use_before"] = in_use
        levels.append({"mode": mode, **level})
        print(json.dumps(levels[-1]), flush=True)
    print(markdown_table(levels), flush=True)
    report = {"model": args.model, "mode": mode, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "levels": levels}
    if args.results.lower() != "none":
        entry = make_entry(
            "speculative", device=jax.devices()[0].device_kind, device_count=1, layout="TP=1,EP=1,DP=1",
            model=os.path.basename(os.path.normpath(args.model)), weights="real", config=None, levels=levels,
            argv=["python", "-m", "qwen_jax.bench.speculative", *(sys.argv[1:] if argv is None else argv)],
            mode=mode, prompts=len(prompts), max_tokens=args.max_tokens, kernels=args.kernels,
            max_num_seqs=args.max_num_seqs, data=os.path.basename(args.data))
        append_result(entry, args.results)
        print(f"appended to {args.results}")
    return report


if __name__ == "__main__":
    main()
