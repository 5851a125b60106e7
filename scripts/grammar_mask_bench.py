"""Structured outputs' host cost with two grammar engines, xgrammar (the engine's until it moved for a light
install) and llguidance (the engine's now): preparing a 248k vocabulary, compiling a JSON schema, and filling one row
of the token bitmask per generated token (the core does this between steps for every constrained row). Prints one
JSON line.

    python scripts/grammar_mask_bench.py <tokenizer dir>     (needs xgrammar and llguidance importable)
"""

import json
import statistics
import sys
import time

import numpy as np
from transformers import AutoTokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "email", "tags", "address"]}
OUTPUT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "engines"],
                     "address": {"city": "London", "zip": "W1"}})


def timed(fn):
    began = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - began


def xgrammar_run(tokenizer, vocab_size: int, tokens: list[int]) -> dict:
    import xgrammar as xgr

    info, setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    compiler = xgr.GrammarCompiler(info, max_threads=4)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True))
    matcher = xgr.GrammarMatcher(compiled)
    mask = np.zeros((1, -(-vocab_size // 32)), np.int32)
    fills = []
    for token in tokens:
        _, seconds = timed(lambda: matcher.fill_next_token_bitmask(mask, 0))
        fills.append(seconds)
        assert matcher.accept_token(token), token
    return {"vocab_setup_s": round(setup, 2), "schema_compile_s": round(compile_s, 3),
            "mask_ms_median": round(statistics.median(fills) * 1e3, 3), "mask_ms_max": round(max(fills) * 1e3, 3)}


def llguidance_run(tokenizer, vocab_size: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    ll_tokenizer, setup = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": True})
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(ll_tokenizer, grammar))
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.numpy.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    fills = []
    for token in tokens:
        _, seconds = timed(lambda: llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0))
        fills.append(seconds)
        assert matcher.consume_token(token), (token, matcher.get_error())
    return {"vocab_setup_s": round(setup, 2), "schema_compile_s": round(compile_s, 3),
            "mask_ms_median": round(statistics.median(fills) * 1e3, 3), "mask_ms_max": round(max(fills) * 1e3, 3)}


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    vocab_size = len(tokenizer)
    tokens = tokenizer.encode(OUTPUT, add_special_tokens=False)
    report = {"vocab": vocab_size, "tokens": len(tokens),
              "xgrammar": xgrammar_run(tokenizer, vocab_size, tokens),
              "llguidance": llguidance_run(tokenizer, vocab_size, tokens)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
