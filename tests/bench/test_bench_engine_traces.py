"""The engine benchmark's traces and one-batch loop, played against a recording engine with the skeleton's
prefill / decode / remove contract (logits [batch, vocab] back from each call)."""

import numpy as np
import pytest

from qwen_jax.bench.engine import (
    SCALED_TRACES,
    TRACES,
    bench_one_batch,
    bench_trace,
    llm_one_batch,
    run_trace,
    trace_needs,
)
from qwen_jax.outputs import RequestOutput

VOCAB = 11


class RecordingEngine:
    def __init__(self):
        self.live: dict[str, int] = {}
        self.calls: list[tuple] = []

    def prefill(self, ids, prompts):
        assert not set(ids) & set(self.live)
        self.live.update({r: len(p) for r, p in zip(ids, prompts, strict=True)})
        self.calls.append(("prefill", len(ids), {len(p) for p in prompts}))
        return np.eye(VOCAB, dtype=np.float32)[[len(p) % VOCAB for p in prompts]]

    def decode(self, ids, tokens):
        assert set(ids) == set(self.live) and len(tokens) == len(ids)
        for r in ids:
            self.live[r] += 1
        self.calls.append(("decode", len(ids)))
        return np.eye(VOCAB, dtype=np.float32)[[self.live[r] % VOCAB for r in ids]]

    def remove(self, ids):
        for r in ids:
            del self.live[r]
        self.calls.append(("remove", len(ids)))


def test_trace_needs():
    assert trace_needs(TRACES["prefill"]) == (4, 128)
    assert trace_needs(TRACES["decode"]) == (8, 48)
    assert trace_needs(TRACES["mixed"]) == (8, 128 + 6 + 2)
    assert trace_needs(SCALED_TRACES["prefill"]) == (64, 1024)
    assert trace_needs(SCALED_TRACES["decode"]) == (64, 1024 + 16)
    assert trace_needs(SCALED_TRACES["mixed"]) == (64, 1024 + 6 + 2)


def test_mixed_trace_calls_and_counts():
    engine = RecordingEngine()
    run = run_trace(engine, TRACES["mixed"], VOCAB, np.random.default_rng(0), "t")
    assert engine.calls == [("prefill", 4, {64}), ("decode", 4), ("decode", 4), ("prefill", 2, {128})] + \
        [("decode", 6)] * 6 + [("remove", 2), ("prefill", 4, {32}), ("decode", 8), ("decode", 8), ("remove", 8)]
    assert not engine.live
    assert run.prefill_tokens == 4 * 64 + 2 * 128 + 4 * 32
    assert run.decode_tokens == 2 * 4 + 6 * 6 + 2 * 8
    assert run.seconds >= run.decode_seconds > 0


def test_bench_trace_and_one_batch_report_rates():
    engine = RecordingEngine()
    row = bench_trace(engine, "decode", TRACES["decode"], VOCAB, repeats=3)
    assert row["prefill_tokens"] == 8 * 32 and row["decode_tokens"] == 8 * 16
    assert row["tok_s"] == pytest.approx((8 * 32 + 8 * 16) / row["seconds"])
    assert row["peak_memory_bytes"] is None  # the CPU backend keeps no memory statistics
    assert sum(c[0] == "prefill" for c in engine.calls) == 5  # two warm-ups and three timed runs

    engine = RecordingEngine()
    one = bench_one_batch(engine, batch=3, input_len=20, output_len=5, vocab=VOCAB)
    assert engine.calls[-6:] == [("prefill", 3, {20})] + [("decode", 3)] * 4 + [("remove", 3)]
    assert one["input_tok_s"] == pytest.approx(3 * 20 / one["prefill_s"])
    assert one["output_tok_s"] > 0 and one["itl_ms_median"] >= 0
    assert one["latency_s"] >= one["prefill_s"]


class TimedLLM:
    """LLM.generate's contract: one finished RequestOutput per prompt, in order, with its timestamps."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), {len(p) for p in prompts}, params))
        return [RequestOutput(request_id=str(i), prompt_token_ids=p, token_ids=[1] * params.max_tokens, text="",
                              delta_token_ids=[], delta_text="", finished=True, arrival_time=100.0 + 0.01 * i,
                              first_token_time=100.5 + 0.01 * i, finish_time=101.0) for i, p in enumerate(prompts)]


def test_one_batch_through_the_offline_llm_uses_request_timestamps():
    llm = TimedLLM()
    row = llm_one_batch(llm, batch=4, input_len=16, output_len=6, vocab=VOCAB)
    assert [c[:2] for c in llm.calls] == [(4, {16})] * 3  # two warm-ups, then the timed batch
    params = llm.calls[-1][2]
    assert params.max_tokens == 6 and params.ignore_eos and params.greedy
    assert row["latency_s"] == pytest.approx(1.0)  # last finish (101.0) - first arrival (100.0)
    assert row["prefill_s"] == pytest.approx(0.53)  # last first token (100.53) - first arrival
    assert row["input_tok_s"] == pytest.approx(4 * 16 / 0.53)
    assert row["output_tok_s"] == pytest.approx(4 * 5 / 0.47)
    assert row["itl_ms_median"] == pytest.approx(0.47 / 5 * 1e3)


def test_a_trace_runs_through_create_engine_on_random_weights_of_the_configs_shapes(hybrid_mtp_dir):
    from qwen_jax.bench.engine import main

    entry = main(["--config", f"{hybrid_mtp_dir}/config.json", "--device", "cpu", "--mode", "traces", "--traces",
                  "prefill", "--warmup", "0", "--repeats", "1", "--results", "none"])
    assert entry["weights"] == "random"
    (row,) = entry["levels"]["traces"]
    assert row["trace"] == "prefill" and row["tok_s"] > 0
