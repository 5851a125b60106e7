from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax.engine import sampler
from qwen_jax.engine.grammar import mask_words
from qwen_jax.engine.sampler import (
    TOP_K_FAST_MAX,
    SamplingTables,
    SamplingTensors,
    apply_penalties,
    banned_row,
    bias_row,
    cut_path,
    init_penalty_rows,
    seen_counts,
)
from qwen_jax.sampling_params import SamplingParams as SP

V = 64  # most tests share (B=64, V=64, K=0) so they share one compilation
B = 64


class Batch(NamedTuple):
    """A step's sampling tensors and the tables their rows name."""

    tensors: SamplingTensors
    tables: SamplingTables

    def at_counter(self, counter: int) -> Batch:
        return self._replace(tensors=self.tensors._replace(rng=self.tensors.rng.at[:, 2].set(counter)))


def build(params, vocab=V, batch=B, num_generated=None, eos=(), step_seed=0, counts=None, constrained_rows=(),
          token_masks=None) -> Batch:
    """Tensors for `params`, row i's table rows in row i of the tables (its penalty counts: `counts`, from
    `counts_for`; its logit bias and bans from its params; the masks of `constrained_rows`: token_masks)."""
    n = len(params)
    tensors = SamplingTensors.build(params, num_generated or [0] * n, list(range(n)), vocab_size=vocab,
                                    batch_size=batch, num_slots=batch, eos_token_ids=eos, step_seed=step_seed,
                                    constrained_rows=constrained_rows)
    bias, banned = np.zeros((batch, vocab), np.float32), np.zeros((batch, vocab), bool)
    for i, p in enumerate(params):
        bias[i], banned[i] = bias_row(p, vocab), banned_row(p, eos, vocab)
    masks = np.zeros((batch, mask_words(vocab)), np.int32)
    if constrained_rows:
        masks[list(constrained_rows)] = token_masks
    counts = jnp.zeros((batch, vocab), jnp.int32) if counts is None else counts
    return Batch(tensors, SamplingTables(counts, *map(jnp.asarray, (bias, banned, masks))))


def counts_for(histories, vocab=V, batch=B):
    """Penalty counts [batch, vocab] with row i made from histories[i] = (prompt ids, output ids) (None: empty)."""
    rows, length = len(histories), 16
    while length < max((len(p) + len(o) for p, o in filter(None, histories)), default=0):
        length *= 2
    ids = np.zeros((rows, length), np.int32)
    num_prompt, num_tokens = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for i, h in enumerate(histories):
        if h is not None:
            tokens = list(h[0]) + list(h[1])
            ids[i, :len(tokens)], num_prompt[i], num_tokens[i] = tokens, len(h[0]), len(tokens)
    return init_penalty_rows(jnp.zeros((batch, vocab), jnp.int32), jnp.arange(rows), jnp.asarray(ids),
                             jnp.asarray(num_prompt), jnp.asarray(num_tokens))


def sample(logits, batch: Batch, *, num_top_logprobs, params=None):
    """The sampler as the runner calls it: the cut path chosen from the rows' params on the host (the sort path,
    exact for any batch, when not given). The tables are donated: a copy goes in."""
    path = 2 if params is None else cut_path(params, logits.shape[1])
    tables = jax.tree.map(jnp.copy, batch.tables)
    return sampler.sample(logits, batch.tensors, tables, num_top_logprobs=num_top_logprobs, path=path)[0]


def pad_rows(row_logits, batch=B):
    row_logits = np.atleast_2d(np.asarray(row_logits, np.float32))
    return jnp.asarray(np.concatenate([row_logits, np.zeros((batch - len(row_logits), row_logits.shape[1]),
                                                            np.float32)]))


def crafted_logits(seed=0, vocab=V):
    """Geometric probabilities 0.7^i on a random permutation of ids: no ties, known order."""
    probs = 0.7 ** np.arange(vocab)
    probs /= probs.sum()
    perm = np.random.default_rng(seed).permutation(vocab)
    logits = np.empty(vocab, np.float32)
    logits[perm] = np.log(probs)
    return logits, perm, probs


def draw_many(row_logits, params, steps=16, vocab=V):
    """B rows of the same logits and params, unseeded, over `steps` engine steps: B * steps draws."""
    logits = jnp.asarray(np.tile(row_logits, (B, 1)))
    out = [np.asarray(sample(logits, build([params] * B, vocab=vocab, step_seed=s), num_top_logprobs=0,
                             params=[params] * B).tokens)
           for s in range(steps)]
    return np.concatenate(out)


def test_greedy_rows_are_exact_argmax_even_beside_sampled_rows():
    logits = np.random.default_rng(1).normal(size=(B, V)).astype(np.float32) * 4
    params = [SP(temperature=0.0) if i % 2 == 0 else SP(temperature=1.0, top_p=0.5, repetition_penalty=1.1)
              for i in range(B)]
    counts = counts_for([([1, 2, 3], [])] * B)
    tokens = np.asarray(sample(jnp.asarray(logits), build(params, counts=counts), num_top_logprobs=5,
                               params=params).tokens)
    np.testing.assert_array_equal(tokens[::2], logits[::2].argmax(-1))
    assert tokens.dtype == np.int32


def test_top_k_1_is_greedy():
    logits = np.random.default_rng(2).normal(size=(B, V)).astype(np.float32)
    params = [SP(temperature=1.5, top_k=1, seed=i) for i in range(B)]
    tokens = np.asarray(sample(jnp.asarray(logits), build(params), num_top_logprobs=0).tokens)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("params", [SP(temperature=0.9, seed=1234), SP(temperature=0.9, top_k=20, top_p=0.9, seed=7),
                                    SP(temperature=1.0, top_p=0.95, min_p=0.01, seed=99)])
def test_seeded_row_ignores_batch_position_and_composition(params):
    """The same seeded row sits at position 0 of a batch of greedy rows and at position 37 of a batch whose other rows
    force the sort path; its tokens over 12 steps must be identical."""
    row = np.random.default_rng(3).normal(size=V).astype(np.float32)
    alone, crowded = [], []
    for step in range(12):
        plain = build([params, SP(temperature=0)], num_generated=[step, 0], step_seed=1000 + step)
        alone.append(int(sample(pad_rows([row]), plain, num_top_logprobs=0, params=[params]).tokens[0]))
        others = [SP(temperature=1.0, top_p=0.3), SP(temperature=0.5, top_k=TOP_K_FAST_MAX + 1), SP(seed=5)]
        batch_params = [others[i % 3] for i in range(B)]
        batch_params[37] = params
        rows = np.random.default_rng(100 + step).normal(size=(B, V)).astype(np.float32)
        rows[37] = row
        done = [step if i == 37 else 3 for i in range(B)]
        crowded.append(int(sample(jnp.asarray(rows), build(batch_params, num_generated=done, step_seed=step),
                                  num_top_logprobs=0, params=batch_params).tokens[37]))
    assert alone == crowded
    assert len(set(alone)) > 1  # the counter advances the key every step


def test_different_seeds_give_different_draws():
    flat = np.zeros(V, np.float32)  # uniform: two streams agree with probability 1/64 per draw
    logits = jnp.asarray(np.tile(flat, (B, 1)))
    a = [SP(seed=1)] * 32 + [SP(seed=2)] * 32
    draws = np.stack([np.asarray(sample(logits, build(a, num_generated=[s] * B), num_top_logprobs=0).tokens)
                      for s in range(8)])  # [steps, B]; each half of the batch repeats one seeded stream
    np.testing.assert_array_equal(draws[:, :32], np.repeat(draws[:, :1], 32, axis=1))
    assert np.sum(draws[:, 0] == draws[:, 32]) <= 2
    # unseeded rows differ from one another within a step and across steps
    free = np.stack([np.asarray(sample(logits, build([SP()] * B, step_seed=s), num_top_logprobs=0).tokens)
                     for s in range(2)])
    assert len(set(free[0].tolist())) > 30 and np.sum(free[0] == free[1]) <= 6


def test_seeds_beyond_32_bits_are_distinct_streams():
    logits = jnp.zeros((B, V), jnp.float32)
    t = build([SP(seed=1), SP(seed=1 + 2**32), SP(seed=-1)] * 20 + [SP()] * 4)
    tokens = np.asarray(sample(logits, t, num_top_logprobs=0).tokens)
    assert not (np.array_equal(tokens[0:60:3], tokens[1:60:3]) or np.array_equal(tokens[0:60:3], tokens[2:60:3]))


def _allowed_top_p(perm, probs, p):
    before = np.cumsum(probs) - probs
    return set(perm[before < p].tolist())


@pytest.mark.parametrize("params, allowed", [
    (SP(top_k=5), lambda perm, probs: set(perm[:5].tolist())),
    (SP(top_p=0.8), lambda perm, probs: _allowed_top_p(perm, probs, 0.8)),
    (SP(min_p=0.2), lambda perm, probs: set(perm[probs >= 0.2 * probs[0]].tolist())),
    (SP(top_k=3, top_p=0.99), lambda perm, probs: set(perm[:3].tolist())),
    # top-p over the renormalised top-6: 0.7^i for i < 6 sums to 2.94; 0.5 of it is covered after 2 tokens (1.7)
    (SP(top_k=6, top_p=0.5), lambda perm, probs: set(perm[:2].tolist())),
    (SP(top_k=TOP_K_FAST_MAX - 4, top_p=0.9), lambda perm, probs: _allowed_top_p(perm, probs, 0.9)),
])
def test_cuts_never_sample_outside_the_allowed_set(params, allowed):
    row, perm, probs = crafted_logits(seed=4)
    expected = allowed(perm, probs)
    seen = set(draw_many(row, params).tolist())
    assert seen <= expected
    assert seen == expected  # 1,024 draws reach every allowed token at these probabilities


def test_cuts_at_full_vocab_on_the_sort_path():
    vocab = 248_320
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(2, vocab)).astype(np.float32)
    top = np.argsort(-logits, axis=-1)
    logits[0, top[0, :3]] += 12.0  # row 0: three tokens hold almost all the mass
    params = [SP(top_p=0.9, seed=s) for s in range(2)]
    tokens = np.stack([np.asarray(sample(jnp.asarray(logits), build(params, vocab=vocab, batch=2, num_generated=[s, s]),
                                         num_top_logprobs=0, params=params).tokens)
                       for s in range(2)])
    assert set(tokens[:, 0].tolist()) <= set(top[0, :3].tolist())


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_frequencies(temperature):
    probs = np.array([0.5, 0.3, 0.2])
    row = np.full(V, -1e4, np.float32)
    row[[7, 19, 40]] = np.log(probs)
    draws = draw_many(row, SP(temperature=temperature), steps=32)
    counts = np.array([np.sum(draws == t) for t in (7, 19, 40)])
    assert counts.sum() == len(draws) == 2048
    expected = probs ** (1 / temperature)
    expected = expected / expected.sum() * len(draws)
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 13.8, (counts, expected)  # df = 2, p = 0.001


def test_penalties_change_logits_exactly_as_the_formulas():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 3
    prompts = [[1, 2, 3, 3], [4, 5], [6]]
    outputs = [[3, 8, 8, 8, 9], [5, 10], [11, 11]]
    params = [SP(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SP(repetition_penalty=0.8, frequency_penalty=-1.0), SP(presence_penalty=-2.0)]
    counts = counts_for(list(zip(prompts, outputs, strict=True)), batch=4)
    t = build(params, batch=4, counts=counts)
    padded = jnp.asarray(np.concatenate([logits, np.zeros((1, V), np.float32)]))
    got = np.asarray(jax.jit(apply_penalties)(padded, t.tensors, seen_counts(t.tables, t.tensors)))
    expected = np.concatenate([logits, np.zeros((1, V), np.float32)])
    for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs, strict=True)):
        r = np.float32(p.repetition_penalty)
        for tok in set(prompt) | set(out):
            x = expected[i, tok]
            expected[i, tok] = x / r if x > 0 else x * r
        for tok, c in Counter(out).items():
            expected[i, tok] -= np.float32(p.frequency_penalty) * np.float32(c) + np.float32(p.presence_penalty)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got[:3], logits)
    assert got[2, 6] == logits[2, 6]  # prompt-only token: presence and frequency do not touch it


def test_repetition_penalty_flips_greedy_choice():
    row = np.zeros(V, np.float32)
    row[10], row[11] = 2.0, 1.8
    counts = counts_for([([10], [])] * 3)
    plain = sample(pad_rows([row, row]), build([SP(temperature=0)] * 2 + [SP(repetition_penalty=2.0)], counts=counts),
                   num_top_logprobs=5)
    penal = sample(pad_rows([row, row]), build([SP(temperature=0, repetition_penalty=1.2)] * 2, counts=counts),
                   num_top_logprobs=5)
    assert plain.tokens[:2].tolist() == [10, 10] and penal.tokens[:2].tolist() == [11, 11]
    assert plain.top_ids[0, :2].tolist() == penal.top_ids[0, :2].tolist() == [10, 11]  # logprobs stay raw


def test_penalty_counts_follow_each_penalised_rows_tokens_on_the_device():
    """A row's counts: 0 for never-seen ids, 1 + output occurrences for seen ones; the sampler counts each new token
    of a penalised row (and only of those) into its row, where the next step's penalties read it."""
    counts = counts_for([([5, 1, 5, 9], [9, 60]), ([2], []), None], batch=4)
    np.testing.assert_array_equal(np.asarray(counts[0, [5, 1, 9, 60, 2]]), [1, 1, 2, 2, 0])
    row = np.full(V, -1e4, np.float32)
    row[60] = 0.0  # every row samples 60
    params = [SP(temperature=0, frequency_penalty=0.1), SP(temperature=0), SP(temperature=0, presence_penalty=0.1)]
    t = build(params, batch=4, counts=counts)
    tokens, tables = sampler.sample(pad_rows([row] * 3, batch=4), t.tensors, t.tables, num_top_logprobs=0, path=0)
    counts = tables.counts
    assert tokens.tokens[:3].tolist() == [60, 60, 60]
    np.testing.assert_array_equal(np.asarray(counts[:3, 60]), [3, 0, 2])  # row 1 has no penalty: not counted
    np.testing.assert_array_equal(np.asarray(counts[0, [5, 9]]), [1, 2])


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(B, V)).astype(np.float32) * 2
    params = [SP(temperature=0.7, top_p=0.9, seed=i, repetition_penalty=1.5) for i in range(B)]
    counts = counts_for([(rng.integers(0, V, 10).tolist(), []) for _ in range(B)])
    out = sample(jnp.asarray(logits), build(params, counts=counts), num_top_logprobs=5, params=params)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(B), tokens], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-ref, axis=-1)[:, :5])
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-ref, axis=-1)[:, :5], rtol=1e-6)
    assert np.all(np.diff(np.asarray(out.top_logprobs), axis=-1) <= 0)
    assert out.top_ids.shape == (B, 5) and out.top_ids.dtype == jnp.int32


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    eos = [60, 61]
    row = np.zeros(V, np.float32)
    row[[60, 61, 62, 3]] = [9.0, 8.0, 7.0, 6.0]
    rows = [row] * 4
    params = [SP(temperature=0, min_tokens=4, stop_token_ids=[62]),
              SP(temperature=0, min_tokens=4, stop_token_ids=[62]),
              SP(temperature=0, min_tokens=4, stop_token_ids=[62], ignore_eos=True),
              SP(temperature=1.0, min_tokens=2, seed=0)]
    t = build(params, batch=8, num_generated=[3, 4, 0, 1], eos=eos)
    tokens = sample(pad_rows(rows, batch=8), t, num_top_logprobs=0).tokens[:4].tolist()
    assert tokens[0] == 3  # EOS ids and the stop id banned before min_tokens
    assert tokens[1] == 60  # min_tokens reached
    assert tokens[2] == 60  # ignore_eos: EOS is not a stop, only the stop id is banned
    assert tokens[3] not in eos


def test_logit_bias_of_100_forces_a_token_and_of_minus_100_bans_one():
    row, perm, _ = crafted_logits(seed=9)
    least, best = int(perm[-1]), int(perm[0])
    assert set(draw_many(row, SP(logit_bias={least: 100})).tolist()) == {least}
    assert best not in set(draw_many(row, SP(logit_bias={best: -100})).tolist())
    params = [SP(temperature=0, logit_bias={best: -100.0}), SP(temperature=0), SP(temperature=0, logit_bias={7: 0.5})]
    tokens = sample(pad_rows([row] * 3), build(params), num_top_logprobs=0).tokens[:3].tolist()
    assert tokens == [int(perm[1]), best, best]  # greedy rows see the bias too; a small one changes nothing here


def test_logit_bias_adds_to_the_logits_of_its_row_only_and_logprobs_stay_raw():
    row = np.zeros(V, np.float32)
    row[[4, 5]] = [1.0, 2.0]
    params = [SP(temperature=0, logit_bias={4: 1.5, 9: -3.0}), SP(temperature=0), SP(temperature=0, logit_bias={9: 3})]
    out = sample(pad_rows([row] * 3), build(params), num_top_logprobs=2)
    assert out.tokens[:3].tolist() == [4, 5, 9]  # 1 + 1.5 > 2; 0 + 3 > 2
    assert out.top_ids[0].tolist() == [5, 4]  # the raw distribution


def bitmask(allowed_sets, vocab=V):
    """llguidance's layout: bit v % 32 of int32 word v // 32 is set when token v is allowed."""
    masks = np.zeros((len(allowed_sets), -(-vocab // 32)), np.uint32)
    for row, allowed in enumerate(allowed_sets):
        for v in allowed:
            masks[row, v // 32] |= np.uint32(1 << (v % 32))
    return masks.view(np.int32)


def test_grammar_masks_restrict_only_their_rows_to_the_allowed_tokens():
    row, perm, _ = crafted_logits(seed=10)
    # the second: the least likely token; the third: two tokens on the sign bit of their words
    allowed = [{int(perm[2]), int(perm[3]), int(perm[5])}, {int(perm[-1])}, {31, 63}]
    params = [SP(seed=1), SP(temperature=0), SP(seed=1), SP(temperature=0), SP(temperature=0)]
    t = build(params, constrained_rows=[0, 3, 4], token_masks=bitmask(allowed))
    draws = [sample(pad_rows([row] * 5), t.at_counter(s), num_top_logprobs=0).tokens[:5]
             for s in range(64)]
    draws = np.asarray(draws)
    assert set(draws[:, 0].tolist()) == allowed[0]  # every allowed token comes up in 64 draws at these odds
    assert set(draws[:, 3].tolist()) == allowed[1]
    assert set(draws[:, 4].tolist()) == {31 if row[31] > row[63] else 63}
    free = sample(pad_rows([row] * 5), build(params), num_top_logprobs=0).tokens[:5].tolist()
    assert draws[0, 1:3].tolist() == free[1:3]  # unconstrained rows draw as without any mask


@pytest.mark.parametrize("ties", [False, True])
def test_the_largest_entries_are_lax_top_ks_without_a_full_sort(ties):
    """sampler.largest gives lax.top_k's values and ids, in its order (ties by the lower id), at the full vocabulary:
    random rows, rows with many equal values (bf16-like logits), rows partly -inf."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(4, 248_320)).astype(np.float32)
    if ties:
        x = np.round(x * 4) / 4
    x[1, :200_000] = -np.inf
    for k in (20, TOP_K_FAST_MAX):
        want = jax.lax.top_k(jnp.asarray(x), k)
        got = jax.jit(sampler.largest, static_argnums=1)(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_the_min_tokens_clock_runs_down_over_several_steps():
    """A row `steps` tokens on (sampler.next_step, as several decode steps or verify positions see it) bans the
    ending tokens exactly while its output is shorter than min_tokens."""
    eos = [60]
    row = np.zeros(V, np.float32)
    row[[60, 3]] = [9.0, 6.0]
    params = [SP(temperature=0, min_tokens=3)]
    t = build(params, batch=2, num_generated=[1], eos=eos)
    tokens = [int(sample(pad_rows([row], batch=2), t._replace(tensors=sampler.next_step(t.tensors, j)),
                         num_top_logprobs=0).tokens[0]) for j in range(3)]
    assert tokens == [3, 3, 60]  # outputs 1 and 2 are short of 3: EOS banned; the third may end it
