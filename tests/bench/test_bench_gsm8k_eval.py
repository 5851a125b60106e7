"""The GSM8K evaluator's plumbing against a fake chat server that answers some questions right in the strict
format, some right only loosely, and some wrong."""

import asyncio

import pytest
from support import shared_data

from qwen_jax.bench import gsm8k

TEST = str(shared_data("gsm8k", "test.jsonl"))
DATA = dict(test_path=TEST, train_path=str(shared_data("gsm8k", "train.jsonl")))


def grader(messages):
    """Reply by question index in test.jsonl: 0 mod 3 strict and right, 1 loose and right (then rambles on
    into a new 'Q:' the server should have stopped at), 2 wrong."""
    questions = [ex["question"] for ex in gsm8k.read_jsonl(TEST)[:6]]
    q = messages[-1]["content"].removeprefix("Q: ").removesuffix("\nA:")
    i = questions.index(q)
    gold = gsm8k.reference_answer(gsm8k.read_jsonl(TEST)[i]["answer"])
    if i % 3 == 0:
        return f"Some steps. The answer is {gold}."
    if i % 3 == 1:
        return f"So she pays ${int(gold):,} in total.\n\nQ: A new question with 999 in it?"
    return f"The answer is {gold + 1}."


def test_evaluate_scores_strict_and_flexible(tokenizer, fake_server):
    async def go():
        async with fake_server(tokenizer, chat=grader) as (url, seen):
            out = await gsm8k.evaluate_async(url, "fake", limit=6, concurrency=3, **DATA)
        return out, seen

    out, seen = asyncio.run(go())
    assert out["num_questions"] == 6 and out["errors"] == 0
    assert out["strict_accuracy"] == pytest.approx(2 / 6)
    assert out["flexible_accuracy"] == pytest.approx(4 / 6)
    assert [r["strict"] for r in out["records"]] == [True, False, False] * 2
    assert [r["flexible"] for r in out["records"]] == [True, True, False] * 2
    assert "999" not in out["records"][1]["reply"]

    body = seen["chat_log"][0]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 256 and body["stop"] == ["Q:", "<|im_end|>"]
    msgs = body["messages"]
    assert len(msgs) == 2 * 8 + 1 and [m["role"] for m in msgs[:4]] == ["user", "assistant", "user", "assistant"]
    assert msgs[0]["content"].startswith("Q: Natalia sold clips") and msgs[0]["content"].endswith("\nA:")
    assert msgs[1]["content"].endswith("The answer is 72.") and "<<" not in msgs[1]["content"]


def test_sync_entry_point_takes_a_base_url(tokenizer, threaded_server):
    with threaded_server(tokenizer, chat=grader) as (url, _):
        out = gsm8k.evaluate(url, limit=3, concurrency=2, fewshot_seed=1, shots=2, **DATA)
    assert (out["strict_accuracy"], out["flexible_accuracy"]) == (pytest.approx(1 / 3), pytest.approx(2 / 3))


def test_unreachable_server_counts_errors_as_wrong():
    out = gsm8k.evaluate("http://127.0.0.1:9", limit=2, timeout_s=5, **DATA)
    assert out["errors"] == 2 and out["strict_accuracy"] == 0.0 and out["flexible_accuracy"] == 0.0
