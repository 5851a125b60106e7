"""Speculative acceptance (engine/speculative.py): greedy rows emit exactly the target's argmax tokens; sampled rows
emit exactly the tokens the plain sampler draws at each position with that position's key, so their distribution is
the sampler's (checked by chi-square over many independent rows on a tiny vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from qwen_jax.engine import speculative
from qwen_jax.engine.grammar import mask_words
from qwen_jax.engine.sampler import (
    SamplingTables,
    SamplingTensors,
    banned_row,
    bias_row,
    count_tokens,
    cut_path,
    next_step,
    sample,
    target_logits,
)
from qwen_jax.engine.speculative import DraftPolicy, Speculation, expected_tokens, verify
from qwen_jax.sampling_params import SamplingParams

EOS = (0,)


def tensors_for(params: list[SamplingParams], vocab: int, num_generated: list[int] | None = None) -> SamplingTensors:
    """The rows' tensors, row i's table rows in row i (tables_for)."""
    rows = len(params)
    host = SamplingTensors.build_host(params, num_generated or [0] * rows, list(range(rows)), vocab_size=vocab,
                                      batch_size=rows, num_slots=rows, eos_token_ids=EOS)
    return SamplingTensors(*(jnp.asarray(a) for a in host))


def tables_for(params: list[SamplingParams], vocab: int, seen: np.ndarray | None = None) -> SamplingTables:
    """Row i: params[i]'s logit bias and bans, `seen` [rows, V] its penalty counts (default: none)."""
    rows = len(params)
    counts = np.zeros((rows, vocab), np.int32) if seen is None else seen
    bias = np.stack([bias_row(p, vocab) for p in params])
    banned = np.stack([banned_row(p, EOS, vocab) for p in params])
    return SamplingTables(jnp.asarray(counts), jnp.asarray(bias), jnp.asarray(banned),
                          jnp.zeros((rows, mask_words(vocab)), jnp.int32))


def verify_rows(logits, drafts, params, vocab, seen=None, num_top_logprobs=0, path=None):
    """verify over rows of `params` (their tables from tables_for): (VerifyOutput, counts after)."""
    path = cut_path(params, vocab) if path is None else path
    return verify(logits, jnp.asarray(drafts, jnp.int32), tensors_for(params, vocab), tables_for(params, vocab, seen),
                  num_top_logprobs=num_top_logprobs, path=path)


def test_greedy_rows_emit_the_accepted_prefix_then_the_argmax():
    rng = np.random.default_rng(0)
    rows, k, vocab = 8, 3, 11
    logits = jnp.asarray(rng.normal(size=(rows, k + 1, vocab)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, axis=-1))
    matching = [0, 1, 2, 3, 0, 3, 1, 2]  # drafts that match the argmax before the first wrong one
    drafts = argmax[:, :k].copy()
    for r, m in enumerate(matching):
        if m < k:
            drafts[r, m] = (drafts[r, m] + 1) % vocab
    out, _ = verify_rows(logits, drafts, [SamplingParams(temperature=0.0)] * rows, vocab, num_top_logprobs=2, path=0)
    tokens, emitted = np.asarray(out.tokens), np.asarray(out.num_emitted)
    assert emitted.tolist() == [m + 1 for m in matching]
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for r, m in enumerate(matching):
        assert tokens[r, :m + 1].tolist() == argmax[r, :m + 1].tolist()  # drafts, then the target's correction/bonus
        assert (tokens[r, m + 1:] == -1).all()
        np.testing.assert_allclose(np.asarray(out.logprobs)[r, :m + 1], raw[r, np.arange(m + 1), tokens[r, :m + 1]],
                                   rtol=1e-6)
    assert np.asarray(out.top_ids)[:, :, 0].tolist() == argmax.tolist()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)],
                         ids=["temperature", "top_k", "top_p_min_p"])
def test_sampled_rows_emit_the_samplers_distribution(params):
    """Every row sees the same logits and drafts and draws its own numbers: the first emitted token must follow
    p_0; the second, among rows whose first was the accepted draft d_0, p_1; the third (the bonus after both drafts),
    p_2, where p_j is the plain sampler's distribution at position j."""
    vocab, k, rows = 6, 2, 40000
    rng = np.random.default_rng(1)
    position_logits = rng.normal(size=(k + 1, vocab)) * 1.5
    drafts = np.array([int(np.argsort(position_logits[0])[-2]), int(np.argmax(position_logits[1]))])  # likely, not sure
    logits = jnp.broadcast_to(jnp.asarray(position_logits, jnp.float32), (rows, k + 1, vocab))
    path = cut_path([params], vocab)
    out, _ = verify_rows(logits, np.broadcast_to(drafts, (rows, k)), [params] * rows, vocab)
    tokens, emitted = np.asarray(out.tokens), np.asarray(out.num_emitted)
    one, tables = tensors_for([params], vocab), tables_for([params], vocab)
    expected = [np.asarray(jax.nn.softmax(target_logits(jnp.asarray(position_logits[j:j + 1], jnp.float32), one,
                                                        tables, path)[1]))[0] for j in range(k + 1)]
    first, second = tokens[:, 0] == drafts[0], tokens[:, 1] == drafts[1]
    reaching = [np.ones(rows, bool), first, first & second]
    for j in range(k + 1):
        seen = tokens[reaching[j], j]
        assert (seen >= 0).all() and len(seen) > 2000
        support = expected[j] > 0
        assert set(np.unique(seen)) <= set(np.flatnonzero(support))  # never a token the sampler cuts
        counts = np.bincount(seen, minlength=vocab)[support]
        p = expected[j][support].astype(np.float64)
        p_value = stats.chisquare(counts, p / p.sum() * len(seen)).pvalue
        assert p_value > 1e-3, (j, counts, expected[j])
    assert (emitted == 1 + (tokens[:, 1] >= 0) + (tokens[:, 2] >= 0)).all()
    # the first draft is accepted with probability p_0(d_0)
    accepted = (tokens[:, 0] == drafts[0]) & (emitted > 1)
    assert abs(accepted.mean() - expected[0][drafts[0]]) < 4 * np.sqrt(expected[0][drafts[0]] / rows)


def test_drafts_must_match_the_positions():
    logits = jnp.zeros((2, 3, 5), jnp.float32)
    with pytest.raises(ValueError, match="drafts"):
        verify_rows(logits, np.zeros((2, 3), np.int32), [SamplingParams()] * 2, 5, path=0)


def test_each_emitted_token_is_the_plain_samplers_draw_with_that_positions_key():
    """Position j of a row draws as the plain sampler would for that output token (rng advanced j times by
    rng_step), whatever the drafts: seeded rows emit what they would emit without speculation."""
    rng = np.random.default_rng(3)
    rows, k, vocab = 6, 3, 9
    logits = jnp.asarray(rng.normal(size=(rows, k + 1, vocab)) * 2, jnp.float32)
    params = [SamplingParams(temperature=0.9, seed=40 + r, top_k=6 if r % 2 else 0) for r in range(rows)]
    tensors = tensors_for(params, vocab)
    path = cut_path(params, vocab)
    plain = np.stack([np.asarray(sample(logits[:, j], next_step(tensors, j), tables_for(params, vocab),
                                        num_top_logprobs=0, path=path)[0].tokens)
                      for j in range(k + 1)], axis=1)
    for drafts in (plain[:, :k], (plain[:, :k] + 1) % vocab, np.where(np.arange(k) < 2, plain[:, :k], 0)):
        out, _ = verify_rows(logits, drafts, params, vocab)
        tokens, emitted = np.asarray(out.tokens), np.asarray(out.num_emitted)
        for r in range(rows):
            assert tokens[r, :emitted[r]].tolist() == plain[r, :emitted[r]].tolist()
            assert emitted[r] == 1 + next((j for j in range(k) if drafts[r, j] != plain[r, j]), k)


def test_steps_past_the_verify_token_cap_do_not_verify():
    """A verify step of more than max_verify_tokens tokens never runs: a fixed k gives plain steps there, the default
    policy the largest paying k that fits."""
    fixed = DraftPolicy(Speculation(3, fixed=True), max_verify_tokens=100)
    assert (fixed.drafts_at(25), fixed.drafts_at(26)) == (3, 0)
    default = DraftPolicy(Speculation(3, fixed=False), max_verify_tokens=100)
    assert (default.drafts_at(25), default.drafts_at(40), default.drafts_at(60)) == (3, 1, 0)


def test_the_policy_picks_drafts_by_rows_and_turns_off_where_they_do_not_pay():
    policy = DraftPolicy(Speculation(3, fixed=False))
    largest = max(speculative.VERIFY_COST)
    assert policy.drafts_at(1) > 0 and policy.drafts_at(largest + 1) == 0  # unmeasured batch sizes: no verify
    assert expected_tokens(2, 0.5) == 1.75 and expected_tokens(3, 1.0) == 4
    k = policy.drafts_at(1)
    assert policy.drafts_for(1) == k and policy.wants_drafts(1)  # the prior acceptance pays
    for _ in range(80):  # rounds that accept nothing
        policy.record(k, [1])
    assert policy.acceptance < 0.1
    drawn = [policy.drafts_for(1) for _ in range(2 * speculative.PROBE_EVERY)]
    assert drawn.count(k) == 2 and set(drawn) == {0, k}  # plain steps, a probe every PROBE_EVERY
    for _ in range(200):  # then every draft accepted again
        policy.record(k, [k + 1])
    assert policy.acceptance > 0.9 and policy.drafts_for(1) == k


def test_a_fixed_draft_count_always_verifies():
    policy = DraftPolicy(Speculation(2, fixed=True))
    for _ in range(50):
        policy.record(2, [1])
    assert [policy.drafts_for(rows) for rows in (1, 64, 1000)] == [2, 2, 2]


def _position_p_values(out, drafts, expected) -> list[float]:
    """Chi-square p-value of each position's emitted tokens (among the rows that reached it) against `expected`."""
    tokens = np.asarray(out.tokens)
    reaching = np.ones(len(tokens), bool)
    p_values = []
    for j, p in enumerate(expected):
        seen = tokens[reaching, j]
        assert (seen >= 0).all() and len(seen) > 2000
        support = p > 0
        if not set(np.unique(seen)) <= set(np.flatnonzero(support)):  # a token the sampler would never draw there
            p_values.append(0.0)
        else:
            counts = np.bincount(seen, minlength=len(p))[support]
            p_values.append(stats.chisquare(counts, p[support] / p[support].sum() * len(seen)).pvalue)
        if j < len(drafts):
            reaching &= tokens[:, j] == drafts[j]
    return p_values


def test_speculation_keeps_the_distribution_of_penalised_truncated_biased_sampling(monkeypatch):
    """Rows whose distribution at a position depends on the tokens before it (repetition, presence and frequency
    penalties, the min_tokens ban of EOS) with top-k, top-p and a logit bias: position j follows the plain sampler's
    distribution after the drafts before it (they are the row's tokens whenever j is reached). A verifier that
    ignores what the drafts change (a biased one) fails the same fixed tolerance."""
    vocab, k, rows = 7, 2, 40000
    rng = np.random.default_rng(5)
    position_logits = rng.normal(size=(k + 1, vocab)) * 1.2
    position_logits[:, 0] += 1.0  # EOS likely once it may be drawn
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.95, repetition_penalty=1.8, presence_penalty=0.8,
                            frequency_penalty=0.6, logit_bias={2: 0.7}, min_tokens=2)
    seen = np.zeros((1, vocab), np.int32)
    seen[0, [3, 4]] = [1, 2]  # 3 in the prompt, 4 once in the output
    one, tables = tensors_for([params], vocab), tables_for([params], vocab, seen)
    expected, counts, drafts = [], tables.counts, []
    for j in range(k + 1):
        x = target_logits(jnp.asarray(position_logits[j:j + 1], jnp.float32), next_step(one, j),
                          tables._replace(counts=counts), cut_path([params], vocab))[1]
        expected.append(np.asarray(jax.nn.softmax(x))[0].astype(np.float64))
        if j < k:  # the likeliest token there is the draft
            drafts.append(int(np.argmax(expected[j])))
            counts = count_tokens(counts, one, jnp.asarray(drafts[-1:]))
    drafts = np.array(drafts)
    assert expected[0][0] == 0 and expected[1][0] == 0 and expected[2][0] > 0.05  # EOS banned for two tokens
    logits = jnp.broadcast_to(jnp.asarray(position_logits, jnp.float32), (rows, k + 1, vocab))

    def run():
        return verify_rows(logits, np.broadcast_to(drafts, (rows, k)), [params] * rows, vocab,
                           seen=np.repeat(seen, rows, axis=0))

    out, counts_after = run()
    assert min(_position_p_values(out, drafts, expected)) > 1e-3
    emitted = np.asarray(out.tokens)[0][:int(out.num_emitted[0])]  # the counts follow the emitted tokens
    want = seen[0].copy()
    for t in emitted:
        want[t] = max(want[t], 1) + 1
    np.testing.assert_array_equal(np.asarray(counts_after[0]), want)

    monkeypatch.setattr(speculative, "_seen_after_drafts",
                        lambda seen, drafts, penalised: jnp.broadcast_to(seen[:, None], (seen.shape[0], k + 1,
                                                                                           seen.shape[1])))
    speculative.verify.clear_cache()
    biased, _ = run()
    speculative.verify.clear_cache()
    assert min(_position_p_values(biased, drafts, expected)) < 1e-6
