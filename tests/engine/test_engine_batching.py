"""Continuous batching: a request's output does not depend on what else is in the batch (greedy exactly, seeded
sampling by its seed), with mixed prompt lengths, sampling parameters and more requests than batch rows.

Runs on the caching-off engine so that the one-at-a-time references and the batch compute every token themselves.
"""

from qwen_jax import SamplingParams


def test_batched_mixed_requests_equal_one_at_a_time(engines, kit):
    llm = engines("hybrid", False)
    requests = [  # (prompt, params): five requests for four rows, so one waits for a free row
        (kit.prompt(7, seed=201), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
        (kit.prompt(37, seed=202), SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)),
        (kit.prompt(45, seed=203), SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)),
        (kit.prompt(34, seed=204), SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=6, ignore_eos=True)),
        (kit.prompt(33, seed=205), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
    ]
    alone = [llm.generate([p], sp)[0] for p, sp in requests]
    batched = llm.generate([p for p, _ in requests], [sp for _, sp in requests])

    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert [len(o.token_ids) for o in batched] == [8, 12, 10, 6, 9]
    assert all(o.finish_reason == "length" for o in batched)
    # Different batch shapes round differently, but the logprobs of the chosen tokens agree closely.
    assert max(abs(x.logprob - y.logprob) for x, y in zip(batched[1].logprobs, alone[1].logprobs)) < 1e-5
    kit.assert_idle(llm)


def test_seed_fixes_the_draw_whatever_else_is_in_the_batch(engines, kit):
    llm = engines("hybrid", False)
    p, q = kit.prompt(34, seed=211), kit.prompt(36, seed=212)

    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)

    alone = llm.generate([p], seeded(7))[0].token_ids
    batch = llm.generate([q, p, p, p], [SamplingParams(max_tokens=8, temperature=0.0), seeded(7), seeded(7),
                                        seeded(8)])
    assert batch[1].token_ids == batch[2].token_ids == alone
    assert batch[3].token_ids != alone
    unseeded = llm.generate([p, p], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # unseeded rows of one step draw independently
    kit.assert_idle(llm)
