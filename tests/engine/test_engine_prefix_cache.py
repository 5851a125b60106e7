"""Prefix caching: a hit reuses every full prompt block and never changes a logit (hybrid and pure attention).

Each request runs alone, so runs with caching on and off see the same batches; equality is exact, not approximate.
"""

import numpy as np
import pytest

from qwen_jax import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("model", ["hybrid", "llama"])
def test_prefix_cache_hit_gives_identical_logits(engines, kit, model):
    vocab = kit.LLAMA_VOCAB if model == "llama" else 500
    a = kit.prompt(40, seed=101, vocab=vocab)  # 2 full blocks + 8 tokens
    b = a[:32] + kit.prompt(12, seed=102, vocab=vocab)  # shares a's 2 full blocks, then diverges
    d = kit.prompt(48, seed=104, vocab=vocab)  # exactly 3 blocks: the last one is recomputed for its logits
    runs = run_on_and_off(engines, kit, model, [a, b, a, d, d], expected_cached=[0, 32, 32, 0, 32])
    assert runs[True] == runs[False]  # tokens and float logprobs, bit for bit
    assert runs[True][0] == runs[True][2] and runs[True][3] == runs[True][4]  # a hit repeats its miss exactly


@pytest.mark.parametrize("model", ["hybrid", "llama"])
def test_prefix_shared_below_the_last_block(engines, kit, model):
    """c shares only a's first block. Hybrid models keep one recurrent-state snapshot per prompt, at its last full
    block before the final token, so c cannot reuse anything there. Attention models reuse the block; c's blocks
    1.. are then computed in a chunk of their own instead of together with block 0, which changes float rounding
    (not tokens) by about 1e-7: bit-exactness holds only for hits that reach the prompt's last full block."""
    vocab = kit.LLAMA_VOCAB if model == "llama" else 500
    a = kit.prompt(40, seed=121, vocab=vocab)
    c = a[:16] + kit.prompt(27, seed=122, vocab=vocab)
    runs = run_on_and_off(engines, kit, model, [a, c], expected_cached=[0, 0 if model == "hybrid" else 16])
    assert [tokens for tokens, _ in runs[True]] == [tokens for tokens, _ in runs[False]]
    if model == "hybrid":
        assert runs[True] == runs[False]
    else:
        np.testing.assert_allclose(runs[True][1][1], runs[False][1][1], rtol=0, atol=1e-5)


def run_on_and_off(engines, kit, model: str, prompts: list[list[int]], expected_cached: list[int]) -> dict:
    """Run the prompts one at a time (identical batches in both runs) with caching off and on; check the cache
    accounting; returns caching -> [(tokens, chosen-token logprobs)]."""
    runs = {}
    for caching in (False, True):
        llm = engines(model, caching)
        before = llm.engine.stats()
        outs = [llm.generate([p], GREEDY)[0] for p in prompts]
        after = llm.engine.stats()
        runs[caching] = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]
        assert [o.num_cached_tokens for o in outs] == (expected_cached if caching else [0] * len(prompts))
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        assert (hits, queries) == ((sum(expected_cached), sum(map(len, prompts))) if caching else (0, 0))
        assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outs)
        kit.assert_idle(llm)
    return runs


def test_second_identical_request_in_one_batch_shares_blocks_once_registered(engines, kit):
    """Two identical prompts submitted together: the second is admitted in the same step before the first has
    registered any block, so it misses; a third one submitted afterwards hits every full block."""
    llm = engines("hybrid")
    p = kit.prompt(45, seed=111)
    first, second = llm.generate([p, p], GREEDY)
    third = llm.generate([p], GREEDY)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 0, 32)
    assert first.token_ids == second.token_ids == third.token_ids
    kit.assert_idle(llm)
