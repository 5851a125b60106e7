"""Streaming text for generated tokens: incremental detokenization and stop-string matching with hold-back.

Never re-decodes a whole sequence per step and never emits text that is still an incomplete character or could be
the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context, so that the first output token is decoded the way it reads in context (for
# sentencepiece tokenizers, whose decoder strips the leading space of a window's first token). vLLM uses 5 as well.
_PROMPT_CONTEXT = 5


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids `tokenizer.decode(..., skip_special_tokens=True)` drops: added tokens flagged special, plus the named
    special tokens. (`convert_ids_to_tokens(skip_special_tokens=True)` drops only the latter: for Qwen3.5 it keeps
    `<|im_start|>` and the vision tokens, which decode drops.)
    """
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(i for i, tok in added.items() if getattr(tok, "special", False)) | frozenset(
        tokenizer.all_special_ids
    )


class IncrementalDetokenizer:
    """Turns the ids of one request, as they arrive, into text deltas whose concatenation is tokenizer.decode(ids).

    The prefix_offset / read_offset method of HF text-generation-inference and vLLM: only the window
    tokens[prefix_offset:] is decoded; text is released once the window no longer ends in U+FFFD (a character whose
    bytes are split across tokens, in byte-level BPE and byte-fallback vocabularies alike). The window stays a few
    tokens long, so each call costs O(new tokens).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        context = [t for t in prompt_token_ids[-_PROMPT_CONTEXT:] if t not in self._special]
        self._tokens: list[str] = [t for t in tokenizer.convert_ids_to_tokens(context) if t is not None]
        # The window must start the output on a character boundary: drop a prompt tail that ends mid-character.
        while self._tokens and self._decode(self._tokens).endswith(_REPLACEMENT):
            self._tokens.pop()
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)

    def _decode(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Feeds new output ids; returns the text they complete (possibly "", when a character is still open)."""
        out = []
        for token_id in token_ids:
            token = None if token_id in self._special else self.tokenizer.convert_ids_to_tokens(int(token_id))
            if token is None:  # a skipped special token, or an id past the tokenizer (padded embedding rows)
                continue
            self._tokens.append(token)
            text = self._decode(self._tokens[self._prefix_offset:])
            if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT):
                out.append(text[len(self._prefix_text):])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
                self._prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        return "".join(out)

    def flush(self) -> str:
        """At the end of a request: the held-back text, an unfinished character decoded as U+FFFD."""
        text = self._decode(self._tokens[self._prefix_offset:])
        delta = text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset = len(self._tokens)
        self._prefix_text = ""
        return delta


class StopChecker:
    """Finds stop strings in streamed text. The match that completes first wins (ties: the one that starts earliest),
    which is what a character-by-character check would find, so the result does not depend on how the text is split
    into deltas. Text that could still begin a stop string is held back until disambiguated; the stop string and
    everything after it are never emitted.
    """

    def __init__(self, stop: Sequence[str]):
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(stop)
        self.matched: str | None = None
        self._held = ""
        self._prefixes = {s[:i] for s in self.stop for i in range(1, len(s))}
        self._longest = max((len(s) for s in self.stop), default=0)

    def feed(self, delta_text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string that matched or None); after a match, ("", that stop)."""
        if self.matched is not None:
            return "", self.matched
        if not self.stop:
            return delta_text, None
        text = self._held + delta_text
        best = None  # (end, start, stop)
        for s in self.stop:
            # A match must end inside the new text, otherwise an earlier feed would have found it.
            i = text.find(s, max(0, len(self._held) - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self._held = ""
            self.matched = best[2]
            return text[: best[1]], best[2]
        keep = 0
        for n in range(min(len(text), self._longest - 1), 0, -1):
            if text[-n:] in self._prefixes:
                keep = n
                break
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """At the end of the stream (no match): the held-back text."""
        held, self._held = self._held, ""
        return held
