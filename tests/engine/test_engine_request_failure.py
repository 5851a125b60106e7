"""A request whose handling raises inside a step fails alone: its caller gets the error, the engine goes on, and the
other requests' outputs are those they get without it (offline LLM and AsyncLLM with its core process).

Failures are injected where validation would normally stop them: a stop token id past int32 that slipped past the
edge check (it raises while the sampler's bans are built, issue 33's bricking request), and a request whose tokens
cannot be applied when they come back.
"""

from __future__ import annotations

import asyncio

import jax
import pytest

from qwen_jax import SamplingParams
from qwen_jax.engine import core as core_module
from qwen_jax.llm import AsyncLLM
from qwen_jax.outputs import RequestFailed

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


def outputs_alone(llm, prompts, params):
    return [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def test_request_failing_while_its_step_is_built_fails_alone(engines, kit, monkeypatch):
    llm = engines("hybrid")
    prompts = [kit.prompt(9, seed=1), kit.prompt(21, seed=2), kit.prompt(14, seed=3)]
    good = [SamplingParams(**GREEDY), SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)]
    expected = outputs_alone(llm, [prompts[0], prompts[2]], good)

    monkeypatch.setattr(core_module, "check_request", lambda *args: None)  # the id slips past the edge
    bad = SamplingParams(**GREEDY, min_tokens=4, stop_token_ids=[2**31])
    outs = llm.generate(prompts, [good[0], bad, good[1]])

    assert [o.token_ids for o in (outs[0], outs[2])] == expected
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert isinstance(outs[1].error, RequestFailed) and "IndexError" in str(outs[1].error)
    assert outs[1].token_ids == [] and outs[1].finished
    kit.assert_idle(llm)
    monkeypatch.undo()
    assert outputs_alone(llm, [prompts[0], prompts[2]], good) == expected  # the engine still serves


def test_request_failing_while_its_tokens_are_applied_fails_alone(engines, kit, monkeypatch):
    llm = engines("hybrid")
    engine = llm.engine
    prompts = [kit.prompt(12, seed=4), kit.prompt(7, seed=5), kit.prompt(30, seed=6)]
    params = [SamplingParams(**GREEDY)] * 3
    expected = outputs_alone(llm, prompts, params)

    scheduler = engine.replicas[0].scheduler  # the one replica
    check_stop = scheduler._check_stop

    def failing_check_stop(seq):
        if seq.prompt_token_ids == prompts[1] and len(seq.output_token_ids) == 3:
            raise RuntimeError("injected failure")
        return check_stop(seq)

    monkeypatch.setattr(scheduler, "_check_stop", failing_check_stop)
    outs = llm.generate(prompts, params)

    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0], expected[2]]
    assert outs[1].finish_reason == "error" and "injected failure" in str(outs[1].error)
    assert outs[1].token_ids == expected[1][:2]  # what came out before the failing token
    kit.assert_idle(llm)


@pytest.fixture
def persistent_compilation_cache():
    """The server's persistent compilation cache, which the core process inherits: a rerun skips its compiles."""
    from server.__main__ import enable_compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    enable_compilation_cache(None)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_async_llm_request_failing_in_the_core_raises_for_its_caller_only(hybrid_dir, kit,
                                                                          persistent_compilation_cache):
    async def run() -> tuple[list, BaseException, list]:
        engine = AsyncLLM.from_engine_args(hybrid_dir, **kit.ENGINE_ARGS)
        await engine.start()
        try:
            async def collect(rid: str, prompt: list[int], params: SamplingParams):
                final = None
                async for out in engine.generate(prompt, params, rid):
                    final = out
                return final.token_ids

            prompts = [kit.prompt(9, seed=11), kit.prompt(15, seed=12)]
            alone = [await collect(f"alone-{i}", p, SamplingParams(**GREEDY)) for i, p in enumerate(prompts)]
            bad = SamplingParams(**GREEDY)
            bad.temperature = "hot"  # past SamplingParams' own check: raises when the core builds its sampling row
            results = await asyncio.gather(collect("a", prompts[0], SamplingParams(**GREEDY)),
                                           collect("bad", kit.prompt(11, seed=13), bad),
                                           collect("b", prompts[1], SamplingParams(**GREEDY)),
                                           return_exceptions=True)
            after = await collect("after", prompts[0], SamplingParams(**GREEDY))
            return alone, results, after
        finally:
            await engine.shutdown()

    alone, results, after = asyncio.run(run())
    assert [results[0], results[2]] == alone
    assert isinstance(results[1], RequestFailed) and "'hot'" in str(results[1])
    assert after == alone[0]
