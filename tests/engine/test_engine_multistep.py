"""Several decode steps in one program (num_scheduler_steps): the same tokens, logprobs and finish reasons as one
step a program, with fewer engine steps; a request that ends inside a program's steps returns nothing past its end.
"""

import pytest

from qwen_jax import LLM, SamplingParams

STEPS = 4


@pytest.fixture(scope="module")
def multistep(hybrid_dir, kit):
    return LLM(hybrid_dir, enable_prefix_caching=False, num_scheduler_steps=STEPS, **kit.ENGINE_ARGS)


def workload(kit):
    """Greedy, seeded sampling (with a logit bias; with logprobs), EOS two tokens in, a stop token id, lengths not a
    multiple of STEPS."""
    requests = [
        (kit.prompt(7, seed=901), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        (kit.prompt(37, seed=902), SamplingParams(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True,
                                                  logit_bias={40: 3.0, 41: -100})),
        (kit.prompt(30, seed=903), SamplingParams(max_tokens=11, temperature=1.0, top_k=20, seed=3, logprobs=2,
                                                  ignore_eos=True)),
        (kit.EOS_PROMPT, SamplingParams(max_tokens=12, temperature=0.0)),
    ]
    return [p for p, _ in requests], [sp for _, sp in requests]


def test_several_decode_steps_a_program_give_the_single_step_outputs(engines, multistep, kit):
    single = engines("hybrid", False)
    prompts, params = workload(kit)
    steps_before = single.engine.stats()["steps_total"]
    expected = single.generate(prompts, params)
    single_steps = single.engine.stats()["steps_total"] - steps_before
    got = multistep.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [(o.finish_reason, o.stop_reason) for o in got] == [(o.finish_reason, o.stop_reason) for o in expected]
    assert [len(o.token_ids) for o in got] == [10, 9, 11, kit.EOS_STEP + 1]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got[2].logprobs, expected[2].logprobs)) < 1e-5
    got_top, expected_top = got[2].logprobs[3].top, expected[2].logprobs[3].top  # [(token id, logprob)]
    assert [t for t, _ in got_top] == [t for t, _ in expected_top] and len(got_top) == 2
    assert [v for _, v in got_top] == pytest.approx([v for _, v in expected_top], abs=1e-5)
    assert multistep.engine.stats()["steps_total"] < single_steps
    kit.assert_idle(multistep)


def test_a_stop_inside_a_programs_steps_returns_nothing_past_it(engines, multistep, kit):
    """EOS and a stop token id fall inside a program's STEPS steps: the tokens computed after them are dropped."""
    full = engines("hybrid", False).generate([kit.EOS_PROMPT], SamplingParams(max_tokens=8, temperature=0.0,
                                                                               ignore_eos=True))[0].token_ids
    eos = multistep.generate([kit.EOS_PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert eos.token_ids == full[:kit.EOS_STEP + 1] and (eos.finish_reason, eos.stop_reason) == ("stop", kit.EOS)
    stop_id = full[1]
    stopped = multistep.generate([kit.EOS_PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                   stop_token_ids=[stop_id]))[0]
    assert stopped.token_ids == full[:2] and stopped.stop_reason == stop_id
    kit.assert_idle(multistep)
