"""Single-request latency benchmark against the fake streaming server: one request at a time, per category."""

import asyncio

from qwen_jax.bench.latency import DEFAULT_CATEGORIES, format_table, parse_categories, run_latency


def test_default_categories_are_short_medium_long():
    assert parse_categories(DEFAULT_CATEGORIES) == [("short", 64, 128), ("medium", 2048, 256), ("long", 8192, 256)]


def test_latency_per_category(tokenizer, fake_server):
    async def go():
        async with fake_server(tokenizer, first_delay=0.03, token_delay=0.005) as (url, seen):
            rows = await run_latency(url, "fake", tokenizer, [("tiny", 8, 4), ("small", 32, 10)], warmup=2,
                                     num_requests=5, progress=False)
        return rows, seen

    rows, seen = asyncio.run(go())
    assert seen["max_in_flight"] == 1
    assert [len(tokenizer.encode(b["prompt"], add_special_tokens=False)) for b in seen["log"]] == [8] * 7 + [32] * 7
    assert len({b["prompt"] for b in seen["log"]}) == 14  # a fresh prompt for every request
    tiny, small = rows
    for row, out in ((tiny, 4), (small, 10)):
        assert row["num_requests"] == 5 and row["errors"] == 0 and row["output_len"] == out
        # one request is first_delay + (out - 1) token delays at least
        assert row["latency_ms_p50"] >= 30 + (out - 1) * 5 - 1
        assert row["latency_ms_p50"] <= row["latency_ms_p99"]
        assert row["ttft_ms_p50"] >= 29 and row["tpot_ms_p50"] >= 4
        assert row["latency_ms_mean"] >= 30 + (out - 1) * 5 - 1
    assert small["latency_ms_p50"] > tiny["latency_ms_p50"]
    assert "small" in format_table(rows)
