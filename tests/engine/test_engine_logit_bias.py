"""logit_bias on the engine: +100 forces a token, -100 bans one, a batch mixing biased and free rows gives every row
what it gets alone, a new request's bias compiles nothing new, and ids outside the vocabulary are refused."""

from __future__ import annotations

import pytest

from qwen_jax import SamplingParams
from qwen_jax.engine import step

FREE = dict(max_tokens=6, ignore_eos=True)


def test_large_positive_bias_forces_a_token_and_minus_100_bans_one(engines, kit):
    llm = engines("hybrid")
    prompt = kit.prompt(10, seed=21)
    forced = llm.generate([prompt], SamplingParams(temperature=1.0, logit_bias={77: 100}, **FREE))[0]
    assert forced.token_ids == [77] * 6

    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, **FREE))[0].token_ids
    banned = llm.generate([prompt], SamplingParams(temperature=0.0, logit_bias={greedy[0]: -100}, **FREE))[0]
    assert banned.token_ids[0] != greedy[0] and greedy[0] not in banned.token_ids
    kit.assert_idle(llm)


def test_mixed_batch_of_biased_and_free_rows_equals_one_at_a_time(engines, kit):
    llm = engines("hybrid")
    prompts = [kit.prompt(n, seed=30 + n) for n in (5, 18, 9, 26)]
    params = [SamplingParams(temperature=1.0, seed=3, logit_bias={5: 8.0, 300: -100, 301: 4}, **FREE),
              SamplingParams(temperature=0.0, **FREE),
              SamplingParams(temperature=0.0, logit_bias={t: -100 for t in range(100, 400)}, **FREE),
              SamplingParams(temperature=0.8, seed=11, **FREE)]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    assert not set(alone[2]) & set(range(100, 400))
    kit.assert_idle(llm)


def test_a_new_requests_bias_compiles_nothing(engines, kit):
    llm = engines("hybrid")
    prompt = kit.prompt(8, seed=40)
    llm.generate([prompt], SamplingParams(temperature=0.0, logit_bias={3: 2.0}, **FREE))
    compiled = step.sample_step._cache_size()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, logit_bias={9: -1.0, 200: 100, 17: 3}, **FREE))[0]
    assert out.token_ids == [200] * 6
    assert step.sample_step._cache_size() == compiled  # same batch bucket, same bias width (4): same program


@pytest.mark.parametrize("bias, message", [
    ({517: 1.0}, "outside the vocabulary"),
    ({3: 100.5}, r"\[-100, 100\]"),
    ({3: float("nan")}, r"\[-100, 100\]"),
    ({"3": 1.0}, "non-negative token ids"),
    ({-1: 1.0}, "non-negative token ids"),
    ({t: 1.0 for t in range(301)}, "at most 300"),
])
def test_bad_logit_bias_is_refused_naming_the_problem(engines, kit, bias, message):
    llm = engines("hybrid")
    with pytest.raises(ValueError, match=message):
        llm.generate([kit.prompt(4, seed=1)], SamplingParams(logit_bias=bias))
    kit.assert_idle(llm)
