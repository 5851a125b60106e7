"""The serving benchmark client: score formula, count verification, and a full run against a fake streaming
OpenAI-compatible server on 127.0.0.1 whose pace and token counts are known."""

import asyncio
import json

import pytest

from qwen_jax.bench import serve
from qwen_jax.bench.serve import RequestResult, level_weight, summarize, weighted_score


def test_weighted_score_uses_weights_1_1_2_2_4_4_8():
    levels = [{"concurrency": c, "total_tok_s": 100.0} for c in (1, 2, 4, 8, 16, 32, 64)]
    assert weighted_score(levels) == (1 + 1 + 2 + 2 + 4 + 4 + 8) * 100.0
    assert weighted_score([{"concurrency": 4, "total_tok_s": 10.0}, {"concurrency": 64, "total_tok_s": 1.5}]) == 32.0
    assert [level_weight(c) for c in (1, 3, 12, 64, 128, 256)] == [1, 1, 2, 8, 8, 8]


def test_summary_verifies_counts_and_times(tokenizer):
    good = RequestResult(ok=True, text=" hello world the", start=10.0, end=10.5, chunk_times=[10.1, 10.3, 10.5],
                         usage_prompt_tokens=8, usage_completion_tokens=3)
    lying = RequestResult(ok=True, text=" hello world the", start=10.0, end=10.5, chunk_times=[10.2, 10.3, 10.4],
                          usage_prompt_tokens=9, usage_completion_tokens=4)
    silent = RequestResult(ok=True, text=" cat cat", start=10.0, end=10.2, chunk_times=[10.1, 10.2])
    failed = RequestResult(ok=False, error="HTTP 500: boom", start=10.0, end=10.1)
    s = summarize([good, lying, silent, failed], wall_s=2.0, tokenizer=tokenizer, input_len=8, output_len=3)
    assert s["num_requests"] == 4 and s["errors"] == 1 and s["error_samples"] == ["HTTP 500: boom"]
    assert s["prompt_tokens"] == 8 + 9 + 8  # usage when sent, else the prompt length we built
    assert s["completion_tokens"] == 3 + 4 + 2  # usage when sent, else the re-tokenized count
    assert s["total_tok_s"] == pytest.approx((25 + 9) / 2.0) and s["output_tok_s"] == pytest.approx(9 / 2.0)
    assert s["verification"] == {"prompt_usage_mismatches": 1, "completion_retokenize_mismatches": 1,
                                 "completion_length_mismatches": 2, "missing_usage": 1}
    assert s["ttft_ms_p50"] == pytest.approx(100.0)  # TTFTs 100, 200, 100 ms
    # TPOT per request: (10.5-10.1)/2 = 200 ms, (10.4-10.2)/3 ~ 66.7 ms, (10.2-10.1)/1 = 100 ms
    assert s["tpot_ms_p50"] == pytest.approx(100.0)
    assert s["tpot_ms_p99"] == pytest.approx(200.0 - 0.02 * 100.0)


def test_run_against_fake_server_measures_pace_and_verifies_counts(tokenizer, fake_server):
    async def go():
        async with fake_server(tokenizer, first_delay=0.05, token_delay=0.01) as (url, seen):
            run = await serve.run_benchmark(url, "fake", tokenizer, concurrency=[1, 4], num_requests=6, input_len=48,
                                            output_len=12, progress=False)
        return run, seen

    run, seen = asyncio.run(go())
    c1, c4 = run["levels"]
    for level in (c1, c4):
        assert level["num_requests"] == 6 and level["errors"] == 0
        assert level["prompt_tokens"] == 6 * 48 and level["completion_tokens"] == 6 * 12
        assert level["verification"] == {"prompt_usage_mismatches": 0, "completion_retokenize_mismatches": 0,
                                         "completion_length_mismatches": 0, "missing_usage": 0}
        assert 45 <= level["ttft_ms_p50"] <= 1000 and level["ttft_ms_p50"] <= level["ttft_ms_p99"]
        assert 9 <= level["tpot_ms_p50"] <= 100
        assert level["total_tok_s"] == pytest.approx(6 * 60 / level["wall_s"])
        assert level["spot_check"]["correct"] == level["spot_check"]["total"] == 2
    assert c4["wall_s"] < 0.75 * c1["wall_s"]  # 4 in flight: two waves instead of six requests in a row
    assert seen["max_in_flight"] == 4
    assert run["weighted_score"] == pytest.approx(c1["total_tok_s"] + 2 * c4["total_tok_s"])

    bodies = seen["log"]
    assert len(bodies) == 2 * (6 + 2)  # two warm-ups per level
    for body in bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 12 and body["temperature"] == 1.0
    assert not {b["prompt"] for b in bodies[:8]} & {b["prompt"] for b in bodies[8:]}  # fresh prompts per level
    for chat in seen["chat_log"]:
        assert chat["temperature"] == 0.0


def test_reused_prompts_and_reported_failures(tokenizer, fake_server):
    async def go():
        async with fake_server(tokenizer, completion_usage_offset=1, fail_every=5) as (url, seen):
            run = await serve.run_benchmark(url, "fake", tokenizer, concurrency=[2, 3], num_requests=8, input_len=16,
                                            output_len=4, reuse_prompts=True, progress=False)
        return run, seen

    run, seen = asyncio.run(go())
    prompts = [b["prompt"] for b in seen["log"]]
    assert sorted(prompts[:10]) == sorted(prompts[10:])  # the same prompts (concurrent ones arrive in any order)
    errors = sum(level["errors"] for level in run["levels"])
    assert errors == 4  # requests 5, 10, 15, 20 of 2 x (2 warm-ups + 8) fail, all of them measured ones
    for level in run["levels"]:
        ok = level["num_requests"] - level["errors"]
        assert level["verification"]["completion_retokenize_mismatches"] == ok  # usage says 5, text has 4 tokens
        assert level["verification"]["completion_length_mismatches"] == ok
        assert level["completion_tokens"] == 5 * ok
        if level["errors"]:
            assert level["error_samples"][0].startswith("RuntimeError: HTTP 500")


def test_cli_appends_a_run_to_results(tokenizer, fake_server, tmp_path, capsys):
    results = tmp_path / "RESULTS.json"
    results.write_text(json.dumps([{"benchmark": "earlier"}]))

    async def go():
        async with fake_server(tokenizer) as (url, _):
            return await serve.main_async([
                "--base-url", url, "--model", "fake", "--tokenizer", "unused-cached-below", "--concurrency", "1,2",
                "--num-requests", "3", "--input-len", "20", "--output-len", "5", "--results", str(results),
                "--device", "cpu-test", "--layout", "TP=1", "--weights", "random", "--no-progress"])

    serve.load_tokenizer.cache_clear()
    original = serve.load_tokenizer
    serve.load_tokenizer = lambda path: tokenizer
    try:
        entry = asyncio.run(go())
    finally:
        serve.load_tokenizer = original
    runs = json.loads(results.read_text())
    assert [r["benchmark"] for r in runs] == ["earlier", "serve"]
    saved = runs[-1]
    assert saved == json.loads(json.dumps(entry))
    assert saved["device"] == "cpu-test" and saved["layout"] == "TP=1" and saved["weights"] == "random"
    assert saved["commit"] and saved["date"] and "--concurrency 1,2" in saved["command"]
    assert [lv["concurrency"] for lv in saved["levels"]] == [1, 2]
    assert saved["weighted_score"] == pytest.approx(sum(lv["total_tok_s"] for lv in saved["levels"]))
    out = capsys.readouterr().out
    assert "weighted score" in out and "meaningless with random weights" in out


def test_a_run_split_in_two_scores_every_level(tokenizer, fake_server, tmp_path):
    """--levels-out of a first partial run, fed back as --previous-levels: one entry, one score over all levels."""
    levels = tmp_path / "levels.json"
    results = tmp_path / "RESULTS.json"
    common = ["--model", "fake", "--tokenizer", "unused", "--input-len", "20", "--output-len", "5", "--waves", "1",
              "--results", str(results), "--no-progress"]

    async def go(*extra):
        async with fake_server(tokenizer) as (url, _):
            return await serve.main_async(["--base-url", url, *common, *extra])

    original = serve.load_tokenizer
    serve.load_tokenizer = lambda path: tokenizer
    try:
        asyncio.run(go("--concurrency", "1,2", "--levels-out", str(levels)))
        assert [lv["concurrency"] for lv in json.loads(levels.read_text())] == [1, 2]
        entry = asyncio.run(go("--concurrency", "4", "--previous-levels", str(levels)))
    finally:
        serve.load_tokenizer = original
    assert [lv["concurrency"] for lv in entry["levels"]] == [1, 2, 4]
    assert [lv["num_requests"] for lv in entry["levels"]] == [2, 2, 4]  # --waves 1: c requests, at least 2
    weights = {1: 1, 2: 1, 4: 2}
    assert entry["weighted_score"] == pytest.approx(sum(weights[lv["concurrency"]] * lv["total_tok_s"]
                                                        for lv in entry["levels"]))


def test_spot_check_wants_the_exact_number(tokenizer, fake_server):
    replies = iter(["The sum is {}.", "1{}"])

    def chat(messages):
        a, b = messages[-1]["content"].removeprefix("What is ").split("?")[0].split(" + ")
        return next(replies).format(int(a) + int(b))

    async def go():
        async with fake_server(tokenizer, chat=chat) as (url, seen):
            async with serve.make_client(1, 10.0) as client:
                return await serve.spot_check(client, url, "fake", seed=5, max_tokens=16), seen

    result, seen = asyncio.run(go())
    assert [c["correct"] for c in result["checks"]] == [True, False]
    assert result["correct"] == 1 and result["total"] == 2
    assert all(b["messages"][0]["content"].endswith("Answer with the number only.") for b in seen["chat_log"])


def test_speculative_decoding_counters_give_the_levels_acceptance_length():
    page = lambda drafts, tokens, accepted: (  # noqa: E731
        f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}\n'
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {tokens}\n'
        f'qwen_jax_spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}\n'
        "qwen_jax_spec_decode_num_drafts_created 1.7e9\n")
    before, after = serve.parse_spec_decode(page(10, 30, 12)), serve.parse_spec_decode(page(110, 330, 182))
    assert before == {"num_drafts": 10.0, "num_draft_tokens": 30.0, "num_accepted_tokens": 12.0}
    assert serve.spec_decode_delta(before, after) == {"num_drafts": 100, "num_draft_tokens": 300,
                                                      "num_accepted_tokens": 170, "acceptance_length": 2.7}
    assert serve.spec_decode_delta(after, after) is None and serve.parse_spec_decode("up 1\n") == {}
