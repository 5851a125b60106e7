import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import shared_data
from transformers import AutoTokenizer, LlamaTokenizer

from qwen_jax.engine.detokenizer import IncrementalDetokenizer, StopChecker
from qwen_jax.engine.model_files import load_tokenizer

MULTILINGUAL = (
    "Hello, world! Ünïcödé façade — naïve café. 你好，世界！今日は良い天気ですね。한국어 텍스트. "
    "Привет, мир! مرحبا بالعالم. नमस्ते दुनिया। สวัสดีชาวโลก. "
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 🇯🇵 👍🏽 ❤️‍🔥 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠜎𠜱 and code: `x = [i**2 for i in range(10)]`\n\tend."
)


@pytest.fixture(scope="module")
def qwen_tok():
    return AutoTokenizer.from_pretrained(shared_data("qwen3_5_tokenizer"))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("chunk", [1, 3])
def test_multilingual_emoji_cjk_token_by_token_equals_full_decode(qwen_tok, chunk):
    ids = qwen_tok.encode(MULTILINGUAL)
    detok = IncrementalDetokenizer(qwen_tok, qwen_tok.encode("Translate: "), skip_special_tokens=True)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == qwen_tok.decode(ids) == MULTILINGUAL
    assert detok.flush() == ""
    assert not any("\ufffd" in d for d in deltas)
    if chunk == 1:
        assert deltas.count("") >= 10  # characters split across byte-level tokens were held back, then completed


def test_window_stays_short_so_each_call_is_o_new_tokens(qwen_tok):
    sizes = []

    class Recording:
        def __getattr__(self, name):
            return getattr(qwen_tok, name)

        def convert_tokens_to_string(self, tokens):
            sizes.append(len(tokens))
            return qwen_tok.convert_tokens_to_string(tokens)

    ids = qwen_tok.encode(MULTILINGUAL * 8)
    detok = IncrementalDetokenizer(Recording(), [], skip_special_tokens=True)
    assert "".join(stream(detok, ids)) == MULTILINGUAL * 8
    assert len(ids) > 1000 and max(sizes) <= 8


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), prompt=st.text(max_size=8), cut=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       chunk=st.integers(1, 4))
def test_property_concatenated_deltas_equal_full_decode(qwen_tok, text, prompt, cut, chunk):
    ids = qwen_tok.encode(text)
    ids = ids[cut[0]:len(ids) - cut[1]]  # cutting may start or end inside a multi-byte character
    full = qwen_tok.decode(ids)
    detok = IncrementalDetokenizer(qwen_tok, qwen_tok.encode(prompt), skip_special_tokens=True)
    emitted = "".join(stream(detok, ids, chunk))
    if not full.endswith("\ufffd"):
        assert emitted == full
    assert emitted + detok.flush() == full


def test_skip_special_tokens_follows_decode(qwen_tok):
    chat = "<|im_start|>assistant\n<think>\n\n</think>\n\nSure: 北京 🎉<|im_end|><|endoftext|>"
    ids = qwen_tok.encode(chat)
    assert 248045 in ids and 248046 in ids and 248068 in ids
    kept = "".join(stream(IncrementalDetokenizer(qwen_tok, [248045], skip_special_tokens=False), ids))
    skipped = "".join(stream(IncrementalDetokenizer(qwen_tok, [248045], skip_special_tokens=True), ids))
    assert kept == qwen_tok.decode(ids, skip_special_tokens=False) == chat
    assert skipped == qwen_tok.decode(ids, skip_special_tokens=True)
    assert skipped == "assistant\n<think>\n\n</think>\n\nSure: 北京 🎉"


def test_ids_past_the_tokenizer_are_ignored(qwen_tok):
    detok = IncrementalDetokenizer(qwen_tok, [], skip_special_tokens=True)
    assert detok.add([248300]) + detok.add(qwen_tok.encode("ok")) == "ok"


def test_byte_fallback_sentencepiece_tokenizer(tmp_path):
    shutil.copy(shared_data("tiny_llama", "tok512.model"), tmp_path / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(tmp_path)
    prompt = tok.encode("Once upon a time,")  # starts with BOS (special, skipped)
    out = tok.encode(" Lily saw 你好 and é ü 🎉 there.", add_special_tokens=False)
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(out))
    deltas = stream(IncrementalDetokenizer(tok, prompt, skip_special_tokens=True), out)
    # In context the leading space of the first output piece is kept: the stream continues the prompt's text.
    full = tok.decode(prompt + out, skip_special_tokens=True)
    assert "".join(deltas) == full[len(tok.decode(prompt, skip_special_tokens=True)):]
    assert "".join(deltas) == " Lily saw 你好 and é ü 🎉 there."
    alone = stream(IncrementalDetokenizer(tok, [1], skip_special_tokens=True), out)
    assert "".join(alone) == tok.decode(out) == "Lily saw 你好 and é ü 🎉 there."
    loaded = load_tokenizer(str(tmp_path))  # a model directory whose only tokenizer is this file (protobuf reads it)
    assert loaded.encode(" Lily saw 你好 and é ü 🎉 there.", add_special_tokens=False) == out
    assert loaded.decode(out) == "Lily saw 你好 and é ü 🎉 there."


def feed_all(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    emitted, matched = [], None
    for d in deltas:
        text, matched = checker.feed(d)
        emitted.append(text)
        if matched is not None:
            return emitted, matched
    emitted.append(checker.flush())
    return emitted, None


def test_stop_string_spanning_several_deltas_is_held_then_removed():
    checker = StopChecker(["<|stop|>"])
    assert checker.feed("The answer is 4") == ("The answer is 4", None)
    assert checker.feed(". <|") == (". ", None)  # "<|" could begin the stop string: held
    assert checker.feed("st") == ("", None)
    assert checker.feed("op|> and more") == ("", "<|stop|>")
    assert checker.feed("later") == ("", "<|stop|>")


def test_false_start_is_released_once_disambiguated():
    emitted, matched = feed_all(StopChecker(["abcd"]), list("xabcabd"))
    assert matched is None and emitted == ["x", "", "", "", "abc", "", "abd", ""]
    emitted, matched = feed_all(StopChecker(["abcd"]), list("abcabcd!"))
    assert matched == "abcd" and "".join(emitted) == "abc"


def test_stop_at_the_very_beginning():
    assert StopChecker(["Hello"]).feed("Hello world") == ("", "Hello")
    emitted, matched = feed_all(StopChecker(["\n\n"]), ["\n", "\nrest"])
    assert matched == "\n\n" and emitted == ["", ""]


def test_multiple_stop_strings_earliest_match_wins():
    assert StopChecker(["END", "\n\n"]).feed("abc\n\nxyz END") == ("abc", "\n\n")
    assert StopChecker(["\n\n", "END"]).feed("abc END\n\n") == ("abc ", "END")
    assert StopChecker(["world", "o w"]).feed("hello world") == ("hell", "o w")
    # same end: the one that starts earlier (the longer) wins
    assert StopChecker(["c", "abc"]).feed("xxabc") == ("xx", "abc")


def test_flush_releases_held_text_and_no_stop_passes_through():
    checker = StopChecker(["</answer>"])
    assert checker.feed("42 </ans") == ("42 ", None)
    assert checker.flush() == "</ans"
    assert StopChecker([]).feed("anything") == ("anything", None)


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end - len(s)], s
    return text, None


@settings(max_examples=300, deadline=None, database=None)
@given(text=st.text(alphabet="ab c", max_size=30), stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4),
                                                                  min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_property_streaming_stop_matches_one_pass_and_never_leaks_a_prefix(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    checker, emitted, matched, so_far = StopChecker(stops), "", None, ""
    for d in deltas:
        so_far += d
        out, matched = checker.feed(d)
        emitted += out
        if matched is not None:
            break
        for s in stops:  # nothing emitted may be the start of a stop string that could still complete
            for k in range(1, len(s)):
                if so_far.endswith(s[:k]):
                    assert len(emitted) <= len(so_far) - k
    if matched is None:
        emitted += checker.flush()
    assert (emitted, matched) == _reference_stop(text, stops)
