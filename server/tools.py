"""Tool calling: which tool-call format a chat template asks the model for, the grammar that forces a call
(tool_choice "required" or a named function), and the parser that turns the model's text into OpenAI tool_calls,
whole or as a stream.

Text in, text and tool calls out; never touches the engine. Two formats: Qwen3.5's XML (`<tool_call>` around
`<function=NAME>` with one `<parameter=KEY>` block per argument) and Qwen3 / Hermes JSON (`<tool_call>` around
`{"name": ..., "arguments": {...}}`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
QWEN_XML = "qwen_3_5"  # xgrammar's names of the two formats' structural tags
HERMES_JSON = "qwen_3"
# Whitespace runs between a forced call's elements (xgrammar's max_whitespace_cnt): the formats put one newline
# there, and an unbounded run lets a weak model pad forever.
MAX_WHITESPACE = 2

_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def call_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches the model (None: it renders no tools)."""
    if not chat_template or CALL_OPEN not in chat_template:
        return None
    return QWEN_XML if "<function=" in chat_template else HERMES_JSON


def forcing_tag(fmt: str, tools: list[dict], tool_choice: str | dict, thinking: bool,
                parallel_tool_calls: bool) -> str:
    """The xgrammar structural tag (JSON) that makes the model call a tool: any of them ("required") or the named
    one. With thinking on, the prompt has opened a think block, which the grammar lets the model close first."""
    from xgrammar import get_model_structural_tag

    tag = get_model_structural_tag(fmt, tools=tools, tool_choice=tool_choice,
                                   reasoning="enabled" if thinking else "disabled", max_whitespace_cnt=MAX_WHITESPACE,
                                   parallel_tool_calls=parallel_tool_calls)
    return tag.model_dump_json()


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        """As a message's tool_calls entry (with `index`: as a stream delta's)."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return call if index is None else {"index": index, **call}


class ToolParser:
    """Splits a reply's content into text and tool calls, whole (`parse`) or streamed (`feed`, then `flush`): the
    text before the first call, then every call in order; text after a call is dropped, as the formats allow none,
    and a block that does not parse is text. `tools` (the request's, OpenAI shape) give each argument its JSON type
    in the XML format, whose values are bare text."""

    def __init__(self, tools: list[dict]):
        self.tools = tools
        self.schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}) for t in tools}
        self.pending = ""  # streamed text not released yet: trailing whitespace, a possible tag start, an open call
        self.calls: list[ToolCall] = []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole reply: (its text, its calls)."""
        parser = ToolParser(self.tools)
        content, calls = parser.feed(text)
        return content + parser.flush(), calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """A streamed piece: (the text that is surely no part of a call, the calls it completed)."""
        self.pending += delta
        text, calls = [], []
        while True:
            start = self.pending.find(CALL_OPEN)
            if start < 0:  # hold back what may still turn out to precede or open a call
                keep = _partial_suffix(self.pending, CALL_OPEN)
                released = self.pending[:len(self.pending) - keep].rstrip()
                self._text(text, released)
                self.pending = self.pending[len(released):]
                break
            before = self.pending[:start].rstrip()  # the whitespace before a call goes with it
            self._text(text, before)
            self.pending = self.pending[len(before):]
            start = self.pending.find(CALL_OPEN)
            end = self.pending.find(CALL_CLOSE, start)
            if end < 0:
                break
            call = self._call(self.pending[start + len(CALL_OPEN):end])
            if call is None:  # not a call after all: text
                self._text(text, self.pending[:end + len(CALL_CLOSE)])
            else:
                self.calls.append(call)
                calls.append(call)
            self.pending = self.pending[end + len(CALL_CLOSE):]
        return "".join(text), calls

    def flush(self) -> str:
        """What is still held back when the reply ends (an unfinished call is text)."""
        rest, self.pending = self.pending, ""
        return "" if self.calls else rest

    def _text(self, out: list[str], text: str) -> None:
        """Release text, with the whitespace held back before it (none once a call came: the rest is dropped)."""
        if text and not self.calls:
            out.append(text)

    def _call(self, body: str) -> ToolCall | None:
        body = body.strip()
        if body.startswith("<function="):
            match = _XML_FUNCTION.fullmatch(body)
            if match is None:
                return None
            name = match.group(1).strip()
            params = self.schemas.get(name, {}).get("properties", {})
            arguments = {key.strip(): _typed(value.strip(), params.get(key.strip(), {}))
                         for key, value in _XML_PARAMETER.findall(match.group(2))}
            return ToolCall(name, arguments)
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return ToolCall(data["name"], arguments) if isinstance(arguments, dict) else None


def _typed(value: str, schema: dict) -> Any:
    """An XML parameter's text as the JSON value its schema types it: strings stay text, anything else is read as
    JSON (the templates write objects and arrays as JSON; Python's True / False / None are accepted too)."""
    kind = schema.get("type")
    if kind == "string" or (kind is None and "enum" in schema and all(isinstance(e, str) for e in schema["enum"])):
        return value
    literal = {"True": "true", "False": "false", "None": "null"}.get(value, value)
    try:
        return json.loads(literal)
    except ValueError:
        return value


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
