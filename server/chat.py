"""Chat prompts and replies: render messages with the model directory's chat template, split think blocks off.

Text in, token ids or text out; never touches the engine. Thinking is off unless the request turns it on.
"""

from __future__ import annotations

from typing import Any

from server.protocol import APIError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def render_chat(tokenizer: Any, messages: list[dict], enable_thinking: bool = False) -> str:
    """The prompt text for `messages`, ending with the assistant generation prompt (with an empty, closed think
    block when thinking is off, an open one when it is on)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=enable_thinking)
    except Exception as exc:  # jinja raise_exception(...) and template errors: the messages do not fit it
        raise APIError(f"the chat template rejected the messages: {str(exc)[:300]}", param="messages") from None


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of an already rendered prompt (special tokens in the text are parsed; nothing is added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


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
