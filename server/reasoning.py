"""Splits a chat reply into reasoning (the think block) and content, as it streams.

Text in, text out; never touches the engine or the chat template. Thinking is off unless the request turns it on.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningSplitter:
    """Splits a streamed reply into (reasoning, content). With thinking on, the prompt opened a think block, so text
    up to `</think>` is reasoning; with it off, the reply is all content and stray think tags are dropped from it.
    Text that may be the start of a tag is held back until the next piece (or `flush`) decides it."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self.pending = ""
        self.content_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while (cut := _find_tag(self.pending))[0] >= 0:
            at, length = cut
            self._emit(self.pending[:at], reasoning, content)
            if self.pending[at:at + length] == THINK_CLOSE:
                self.in_reasoning = False
            self.pending = self.pending[at + length:]
        keep = _partial_tag_suffix(self.pending)
        self._emit(self.pending[:len(self.pending) - keep], reasoning, content)
        self.pending = self.pending[len(self.pending) - keep:]
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        self._emit(self.pending, reasoning, content)
        self.pending = ""
        return "".join(reasoning), "".join(content)

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self.in_reasoning:
            reasoning.append(text)
            return
        if not self.content_started:  # the template puts "\n\n" after </think>
            text = text.lstrip("\n")
            self.content_started = bool(text)
        if text:
            content.append(text)


def _find_tag(text: str) -> tuple[int, int]:
    """Position and length of the first think tag in `text` (-1 when none)."""
    hits = [(text.find(t), len(t)) for t in (THINK_OPEN, THINK_CLOSE) if text.find(t) >= 0]
    return min(hits) if hits else (-1, 0)


def _partial_tag_suffix(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a think tag."""
    for size in range(min(len(text), len(THINK_CLOSE) - 1), 0, -1):
        tail = text[-size:]
        if THINK_OPEN.startswith(tail) or THINK_CLOSE.startswith(tail):
            return size
    return 0
