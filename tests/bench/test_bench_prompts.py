"""Exact-length random prompts for the serving benchmarks, checked with the real Qwen3.5 tokenizer.

Prompts must never contain a special or added token, and must be reproducible from their seed.
"""

import numpy as np

from qwen_jax.bench.serve import arithmetic_questions, build_prompt, build_prompts, load_tokenizer, ordinary_token_ids


def test_ordinary_ids_are_the_base_vocabulary_without_added_tokens(tokenizer):
    ids = ordinary_token_ids(tokenizer)
    assert len(tokenizer) == 248077
    assert ids.min() == 0 and ids.max() == 248043 and len(ids) == 248044  # 33 added tokens come after the BPE ids


def test_prompts_tokenize_to_exactly_the_requested_length(tokenizer):
    added = set(tokenizer.added_tokens_decoder)
    for length in (1, 2, 5, 33, 128, 1024):
        for text in build_prompts(tokenizer, length, 3, seed=length):
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert len(ids) == length
            assert not added.intersection(ids)


def test_prompts_are_deterministic_per_seed_and_differ_across_seeds(tokenizer):
    a = build_prompts(tokenizer, 64, 4, seed=7)
    assert a == build_prompts(tokenizer, 64, 4, seed=7)
    b = build_prompts(tokenizer, 64, 4, seed=8)
    assert not set(a) & set(b)
    assert len(set(a)) == 4


def test_random_pieces_spelling_a_special_token_are_dropped(tokenizer):
    # Start from ids that decode to "<|im_end|>" split over ordinary tokens: the builder must not keep it.
    pieces = tokenizer.encode("x<|im_", add_special_tokens=False) + tokenizer.encode("end|>y", add_special_tokens=False)
    assert 248046 in tokenizer.encode(tokenizer.decode(pieces), add_special_tokens=False)

    class Replay:  # an rng whose first draw is those pieces, then ordinary random ids
        def __init__(self):
            self.first = True
            self.rng = np.random.default_rng(0)

        def choice(self, allowed, n):
            if self.first:
                self.first = False
                return np.array(pieces[:n])
            return self.rng.choice(allowed, n)

    text, ids = build_prompt(tokenizer, len(pieces), Replay(), ordinary_token_ids(tokenizer))
    assert len(tokenizer.encode(text, add_special_tokens=False)) == len(pieces) == len(ids)
    assert "<|im_end|>" not in text
    assert 248046 not in ids


def test_arithmetic_questions_carry_their_sums():
    for question, answer in arithmetic_questions(seed=3, count=5):
        a, b = question.removeprefix("What is ").split("?")[0].split(" + ")
        assert int(a) + int(b) == answer
        assert question.endswith("Answer with the number only.")


def test_exact_lengths_with_a_tiny_byte_level_vocabulary(tmp_path):
    # 512 BPE ids, most of them byte fragments: cutting a decoded prompt can split a UTF-8 character, which
    # re-encodes longer; the builder must still land on the exact length.
    from qwen_jax.default_model import ensure_default_model

    tiny = load_tokenizer(ensure_default_model(str(tmp_path)))
    for length in (1, 3, 32, 200):
        for text in build_prompts(tiny, length, 10, seed=1000 + length):
            assert len(tiny.encode(text, add_special_tokens=False)) == length
