"""Structured outputs through llguidance: a request's StructuredOutputsParams made into an llguidance grammar,
checked (`check_structured_outputs`, for a front that wants to refuse a bad grammar early) and compiled in the core
into one matcher per constrained request, which fills its row of the token bitmask and advances with each token read
back.

The vocabulary llguidance reads comes from the tokenizer's own tokenizer.json (no transformers, no torch); it is
built on the first constrained request, or at start-up with `prepare` (a full warm-up does). Nothing here touches a
device: the bitmask is host data the sampler applies (engine/sampler.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from qwen_jax.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("qwen_jax")

_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "list of choices", "grammar": "grammar (GBNF or Lark)", "structural_tag": "structural tag"}


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of the token bitmask (bit v % 32 of word v // 32: token v is allowed)."""
    return -(-vocab_size // 32)


def definition(spec: StructuredOutputsParams) -> str:
    """The spec's llguidance grammar, not yet checked (`check_structured_outputs`); ValueError when it cannot even be
    converted."""
    import llguidance

    kind, source = spec.kind, spec.source
    matcher = llguidance.LLMatcher
    try:
        if kind in ("json", "json_object"):
            return matcher.grammar_from_json_schema(source, defaults=json_options(spec.json_whitespace_run))
        if kind == "regex":
            return matcher.grammar_from_regex(source)
        if kind == "structural_tag":
            return _structural_tag(json.loads(source))
        return llguidance.grammar_from("grammar", source)  # choice: a Lark grammar of its literals
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise _invalid(spec, exc) from None


def json_options(whitespace_run: int | None) -> dict:
    """llguidance's JSON options for a longest whitespace run between tokens: 0 (none), n, or None (any)."""
    if whitespace_run is None:
        return {"whitespace_flexible": True}
    if whitespace_run == 0:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{whitespace_run}}}"}


def _structural_tag(tag: dict) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text in which each
    `begin` starts a JSON value of its schema, closed by its `end`), as llguidance grammar."""
    import llguidance

    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise ValueError('expected {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}')
    triggers = tag.get("triggers") or []
    tags = []
    for structure in tag["structures"]:
        begin = structure["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger starts the structure begin {begin!r}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=structure.get("schema") or {},
                                         end=structure.get("end", "")))
    return llguidance.StructTag.to_grammar(tags)


def check_structured_outputs(spec: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem when the spec's grammar does not parse; needs no vocabulary, so a front
    can refuse a bad grammar before the core compiles it."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(definition(spec))
    if error:
        raise _invalid(spec, error)


def _invalid(spec: StructuredOutputsParams, error: Exception | str) -> ValueError:
    """The error of a spec whose grammar does not parse or compile, naming its field and what llguidance said."""
    return ValueError(f"structured_outputs.{spec.kind} is not a valid {_WHAT[spec.kind]}: {_message(error)}")


def _message(error: Exception | str) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


class RequestGrammar:
    """One constrained request's matcher: the tokens it accepted so far are exactly the request's output tokens
    read back (the scheduler never hands it a token it has not read, so it never has to roll back). With `begins_after`
    (a token id), every token is allowed up to and including that token, and the grammar applies from the next."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: list[int], begins_after: int | None = None):
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._waiting_for = begins_after
        self._stopped = False  # a stop token ended the grammar

    def fill_mask(self, masks: np.ndarray, row: int) -> None:
        """Row `row` of `masks` [n, mask_words] int32 <- the tokens allowed next."""
        if self._waiting_for is not None:
            masks[row] = -1
            return
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, masks, row)

    def accept(self, token: int) -> None:
        if self._waiting_for is not None:
            if token == self._waiting_for:
                self._waiting_for = None
            return
        if not self._matcher.consume_token(token):
            raise ValueError(f"token {token} does not fit the request's structured output grammar: "
                             f"{_message(self._matcher.get_error())}")
        self._stopped = token in self._stop_token_ids

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may follow. (A grammar that can
        take no more text allows only the stop tokens next.)"""
        return self._stopped


class GrammarCompiler:
    """The core's grammar engine for one tokenizer and model vocabulary: the vocabulary as llguidance reads it
    (`tokenizer_json()` gives the tokenizer's tokenizer.json text, or None when the model has none; about 2 s for a
    248k vocabulary, holding the GIL), and a matcher per request (a grammar compiles in about a millisecond)."""

    def __init__(self, tokenizer_json: Callable[[], str | None], vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    def prepare(self) -> None:
        """Build the vocabulary now (a server's start-up), not on the first constrained request. A tokenizer that
        cannot be read only costs the structured outputs: their requests are refused, naming why."""
        try:
            self._get_tokenizer()
        except ValueError as exc:
            log.warning("structured outputs are unavailable: %s", exc)

    def matcher(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher of the spec's grammar; ValueError naming the problem when it does not compile."""
        import llguidance

        tokenizer = self._get_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, definition(spec), log_level=0)
        if matcher.is_error():
            raise _invalid(spec, matcher.get_error())
        begins_after = None
        if spec.begins_after is not None:
            ids = tokenizer.tokenize_str(spec.begins_after, parse_special=True)
            if len(ids) != 1:
                raise ValueError(f"structured_outputs.begins_after must be one token of the vocabulary, and "
                                 f"{spec.begins_after!r} is {len(ids)}")
            begins_after = ids[0]
        return RequestGrammar(matcher, self.stop_token_ids, begins_after)

    def _get_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            text = self._tokenizer_json()
            if text is None:
                raise ValueError("structured outputs need the model's tokenizer (its tokenizer.json), and this "
                                 "model has none")
            import llguidance

            try:
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                         eos_token=self.stop_token_ids)
            except Exception as exc:  # llguidance raises its own errors for a tokenizer it cannot read
                raise ValueError(f"structured outputs need a tokenizer llguidance can read: {_message(exc)}") from None
        return self._tokenizer
