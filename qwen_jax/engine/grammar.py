"""Structured outputs through xgrammar: a request's StructuredOutputsParams parsed (`check`, for a front that wants to
refuse a bad grammar early) and compiled in the core into one matcher per constrained request, which fills its row
of the token bitmask and advances with each token read back.

xgrammar (and the torch it imports) and the tokenizer are loaded on the first constrained request only. Nothing here
touches a device: the bitmask is host data the sampler applies (engine/sampler.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from qwen_jax.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept by the core's compiler (vLLM keeps 512 MiB by default).
CACHE_LIMIT_BYTES = 256 << 20
# Compiler threads: a compile runs in the core between steps.
COMPILE_THREADS = 4
# xgrammar's messages start with a log prefix ("[12:00:00] /project/cpp/x.cc:12: Check failed: ... is false: ").
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of the token bitmask (bit v % 32 of word v // 32: token v is allowed)."""
    return -(-vocab_size // 32)


def check(spec: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem when the spec's grammar does not parse (schema, regex, EBNF or
    structural tag); needs no tokenizer, so a front can refuse a bad grammar before the core compiles it."""
    xgr = _xgrammar()
    kind, source = spec.kind, spec.source
    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(source, **_whitespace(spec))
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(source)
        else:
            xgr.Grammar.from_ebnf(source)
    except Exception as exc:  # xgrammar raises RuntimeError, its own errors and pydantic's
        raise ValueError(f"structured_outputs.{kind} is not a valid {_WHAT[kind]}: {_message(exc)}") from None


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "list of choices", "grammar": "EBNF grammar", "structural_tag": "structural tag"}


def _message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", text)[:300]


def _xgrammar():
    import xgrammar

    return xgrammar


class RequestGrammar:
    """One constrained request's matcher: the tokens it accepted so far are exactly the request's output tokens
    read back (the core never hands it a token it has not read, so it never has to roll back)."""

    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self._matcher = matcher

    def fill_mask(self, masks: np.ndarray, row: int) -> None:
        """Row `row` of `masks` [n, mask_words] int32 <- the tokens allowed next."""
        self._matcher.fill_next_token_bitmask(masks, row)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise ValueError(f"token {token} does not fit the request's structured output grammar")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may follow."""
        return self._matcher.is_terminated()


class GrammarCompiler:
    """The core's grammar engine for one tokenizer and model vocabulary: the vocabulary as xgrammar reads it (built
    on the first constrained request, a few seconds for a 248k vocabulary) and a compiler whose cache keeps compiled
    grammars, so a schema seen before compiles at once. `load_tokenizer()` gives the HF tokenizer, or None when the
    model has none."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: list[int]):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None

    def matcher(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher of the spec's grammar; ValueError naming the problem when it does not compile."""
        xgr = _xgrammar()
        compiled = self._compile(spec)
        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids))

    def _compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        compiler = self._get_compiler()
        kind, source = spec.kind, spec.source
        try:
            if kind in ("json", "json_object"):
                return compiler.compile_json_schema(source, **_whitespace(spec))
            if kind == "regex":
                return compiler.compile_regex(source)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(source)
            return compiler.compile_grammar(source)
        except Exception as exc:
            raise ValueError(f"structured_outputs.{kind} is not a valid {_WHAT[kind]}: {_message(exc)}") from None

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._build()
        return self._compiler

    def _build(self) -> xgrammar.GrammarCompiler:
        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        xgr = _xgrammar()
        # xgrammar detects how the entries encode bytes; the vocabulary it then reads is ours
        detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
        info = xgr.TokenizerInfo.from_vocab_and_metadata(_encoded_vocab(tokenizer, self.vocab_size),
                                                         detected.dump_metadata())
        return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_limit_bytes=CACHE_LIMIT_BYTES)


def _whitespace(spec: StructuredOutputsParams) -> dict:
    """xgrammar's JSON whitespace options for the spec's json_whitespace_run."""
    run = spec.json_whitespace_run
    if run == 0:
        return dict(any_whitespace=False)
    return dict(any_whitespace=True) if run is None else dict(any_whitespace=True, max_whitespace_cnt=run)


def _encoded_vocab(tokenizer, vocab_size: int) -> list[str]:
    """Each token id's vocabulary entry, with the special added tokens (<|im_start|>, ...) left empty: xgrammar then
    treats them as special and never allows them inside a grammar's text (they would vanish from the detokenized
    output and break what the grammar checked). Ids past the tokenizer's vocabulary are empty too."""
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = token
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if added.special and token_id < vocab_size:
            encoded[token_id] = ""
    return encoded
