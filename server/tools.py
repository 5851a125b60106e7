"""Tool calling: which tool-call format a chat template asks the model for, the grammar that forces a call
(tool_choice "required" or a named function), and the parser that turns the model's text into OpenAI tool_calls,
whole or as a stream.

Text in, text and tool calls out; never touches the engine. Two formats: Qwen3.5's XML (`<tool_call>` around
`<function=NAME>` with one `<parameter=KEY>` block per argument) and Qwen3 / Hermes JSON (`<tool_call>` around
`{"name": ..., "arguments": {...}}`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import uuid
from collections.abc import Callable, Collection
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
QWEN_XML = "qwen_3_5"  # Qwen3.5's XML format
HERMES_JSON = "qwen_3"  # Qwen3's (Hermes) JSON format
# Whitespace inside a forced call's JSON values (llguidance's JSON option): runs of at most 2 characters. The
# templates write json.dumps' single spaces, and an unbounded run lets a weak model pad forever.
JSON_WHITESPACE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,2}"}

_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def call_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches the model (None: it renders no tools)."""
    if not chat_template or CALL_OPEN not in chat_template:
        return None
    return QWEN_XML if "<function=" in chat_template else HERMES_JSON


def forcing_grammar(fmt: str, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool,
                    added_tokens: Collection[str]) -> str:
    """The grammar (llguidance's Lark) of a reply that is only tool calls, written as the chat template writes them:
    calls of any of the tools ("required") or of the named one, one or (`parallel_tool_calls`) several, each
    argument of its schema's type. `added_tokens`: the tokenizer's added tokens, which the grammar names as tokens
    (`<tool_call>` is one in Qwen's vocabularies; llguidance never spells a token's text out in other tokens)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")

    def tag(text: str) -> str:
        return text if text in added_tokens else _lit(text)

    calls = r'call ("\n" call)*' if parallel_tool_calls else "call"
    functions = " | ".join(f"fn_{i}" for i in range(len(tools)))
    rules = [rf"start: /\n{{0,2}}/ {calls}",  # the blank line a template puts after a closed think block
             rf'call: {tag(CALL_OPEN)} "\n" ({functions}) "\n" {tag(CALL_CLOSE)}',
             r"string_value[lazy]: /(.|\n)*\n<\/parameter>\n/"]  # up to the first closing tag
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        if fmt == HERMES_JSON:
            head = '{"name": ' + json.dumps(function["name"]) + ', "arguments": '
            rules.append(f'fn_{i}: {_lit(head)} %json {_json_schema(schema)} "}}"')
            continue
        required = set(schema.get("required") or ())
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what a property's $ref names
        params = []
        for j, (key, value_schema) in enumerate((schema.get("properties") or {}).items()):
            rules.append(f"p_{i}_{j}: {_lit(f'<parameter={key}>' + chr(10))} {_xml_value({**value_schema, **defs})}")
            params.append(f"p_{i}_{j}" + ("" if key in required else "?"))
        head = f"<function={function['name']}>\n"
        rules.append(f'fn_{i}: {_lit(head)} {" ".join(params)} "</function>"')
    return "\n".join(rules) + "\n"


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _xml_value(schema: dict) -> str:
    """An XML parameter's value and its closing tag: bare text for a string (one of an enum's, when it has one),
    JSON otherwise, as the template writes them (`_typed` reads them back)."""
    close = r'"\n</parameter>\n"'
    enum = schema.get("enum")
    if schema.get("type") in (None, "string") and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(_lit(e) for e in enum) + ") " + close
    if schema.get("type") == "string" and "enum" not in schema and "const" not in schema or not set(schema) & _TYPED:
        return "string_value"
    return f"%json {_json_schema(schema)} {close}"


# The keywords that make a schema's value JSON rather than bare text (a schema with none of them takes any text).
_TYPED = {"type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const", "properties", "items"}


def _json_schema(schema: dict) -> str:
    """A JSON schema inline in Lark, its whitespace bounded (JSON_WHITESPACE)."""
    return json.dumps({**schema, "x-guidance": JSON_WHITESPACE})


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text (an unfinished call's: what was generated of it)
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        """As a message's tool_calls entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """Splits a reply's content into text and tool calls, whole (`parse`) or streamed (`feed`, its last piece with
    `end`): the text before the first call, then every call in order; text after a call is dropped, as the formats
    allow none (`keep_text_after_calls`: kept, for a think block), and a block that does not parse is text. `tools`
    (the request's, OpenAI shape) give each argument its JSON type in the XML format, whose values are bare text.

    A call's arguments are always strict JSON (no NaN or Infinity; see `_strict_json`): an object of the arguments
    that read, in order, up to the first that does not. A call is streamed as it is generated: its id and name once
    its name is complete, then its arguments an argument at a time (XML: a parameter; JSON: an object member as
    written), then the closing brace, so the pieces add up to the arguments a whole parse gives. Once its name is out
    a call stays a call: a reply cut short inside it ends with the arguments complete so far, closed. `next_index`
    numbers the calls (shared by a choice's parsers)."""

    def __init__(self, tools: list[dict], keep_text_after_calls: bool = False,
                 next_index: Callable[[], int] | None = None):
        self.tools = tools
        self.schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}) for t in tools}
        self.keep_text_after_calls = keep_text_after_calls
        self.next_index = next_index or itertools.count().__next__
        self.pending = ""  # streamed text not released yet: trailing whitespace, a possible tag start, an open call
        self.calls: list[ToolCall] = []  # every call whose name is out, the open one last
        self._open: tuple[int, ToolCall] | None = None  # the call being streamed (its index) and its arguments so far

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole reply: (its text, its calls)."""
        parser = ToolParser(self.tools, self.keep_text_after_calls)
        content, _ = parser.feed(text, end=True)
        return content, parser.calls

    def feed(self, delta: str, end: bool = False) -> tuple[str, list[dict]]:
        """A streamed piece: (the text that is surely no part of a call, the tool-call deltas it makes: OpenAI's
        stream entries, one per call index). `end`: the reply ends with this piece, so nothing is held back: the rest
        is text, unless a call was cut short (it ends with its arguments so far)."""
        self.pending += delta
        text: list[str] = []
        deltas: dict[int, dict] = {}
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
            end_at = self.pending.find(CALL_CLOSE, start)
            body = self.pending[start + len(CALL_OPEN):end_at if end_at >= 0 else len(self.pending)]
            if end_at < 0:  # open: stream what of it is certain
                self._stream(body, deltas, final=False)
                break
            if not self._stream(body, deltas, final=True):  # not a call after all: text
                self._text(text, self.pending[:end_at + len(CALL_CLOSE)])
            self.pending = self.pending[end_at + len(CALL_CLOSE):]
        if end:
            rest, self.pending = self.pending, ""
            if self._open is not None:
                self._close(deltas)
            else:
                self._text(text, rest)
        return "".join(text), list(deltas.values())

    def _text(self, out: list[str], text: str) -> None:
        """Release text, with the whitespace held back before it (none once a call came: the rest is dropped)."""
        if text and (self.keep_text_after_calls or not self.calls):
            out.append(text)

    def _stream(self, body: str, deltas: dict[int, dict], final: bool) -> bool:
        """Send what is new of the call whose body (so far) is `body`; `final`: the body is whole. Whether it is a
        call: one whose name reads is, even if its arguments do not (it keeps those that do, as a stream that sent
        its name must)."""
        name, arguments = self._read(body)
        if self._open is None:
            if name is None:
                return False
            call = ToolCall(name, "")
            index = self.next_index()
            self._open = (index, call)
            self.calls.append(call)
            deltas[index] = {"index": index, "id": call.id, "type": "function",
                             "function": {"name": name, "arguments": ""}}
        if arguments is not None:
            self._send(deltas, arguments)
        if final:
            self._close(deltas)
        return True

    def _send(self, deltas: dict[int, dict], arguments: str) -> None:
        """The open call's arguments are now `arguments`: send what is new of them (they only ever grow)."""
        index, call = self._open
        if arguments.startswith(call.arguments) and len(arguments) > len(call.arguments):
            entry = deltas.setdefault(index, {"index": index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += arguments[len(call.arguments):]
            call.arguments = arguments

    def _close(self, deltas: dict[int, dict]) -> None:
        """End the open call: its arguments object closed (`{}` when none were read)."""
        _, call = self._open
        self._send(deltas, (call.arguments or "{") + "}")
        self._open = None

    def _read(self, body: str) -> tuple[str | None, str | None]:
        """(the call's name, its arguments' JSON text without the closing brace: the arguments complete in `body`)
        as far as `body` makes them certain; None where there is none (yet)."""
        stripped = body.lstrip()
        if stripped.startswith("<function="):
            return self._read_xml(stripped)
        if stripped.startswith("{"):
            return _read_json(stripped)
        return None, None

    def _read_xml(self, body: str) -> tuple[str | None, str | None]:
        head = re.match(r"<function=([^>\n]+)>", body)
        if head is None:
            return None, None
        name = head.group(1).strip()
        params = self.schemas.get(name, {}).get("properties", {})
        pairs = [f"{json.dumps(key.strip(), ensure_ascii=False)}: "
                 f"{json.dumps(_typed(value.strip(), params.get(key.strip(), {})), ensure_ascii=False)}"
                 for key, value in _XML_PARAMETER.findall(body[head.end():])]
        return name, "{" + ", ".join(pairs)


_KEY = re.compile(r'\s*"((?:[^"\\]|\\.)*)"\s*:\s*')  # an object member's key and its colon


def _read_json(body: str) -> tuple[str | None, str | None]:
    """A JSON-format call's name (once its member is complete) and its arguments (the `arguments` or `parameters`
    member: an object, or a string holding one, read once complete) as far as they are complete."""
    name, arguments = None, None
    for member_start, member_end in _members(body):
        key = _KEY.match(body, member_start)
        if key is None:
            break
        if key.group(1) == "name" and member_end is not None:
            try:
                value = json.loads(body[key.end():member_end])
            except ValueError:
                break
            name = value if isinstance(value, str) else None
        elif key.group(1) in ("arguments", "parameters") and arguments is None:
            value_text = body[key.end():member_end]
            if value_text.startswith("{"):
                arguments = _arguments(value_text)
            elif value_text.startswith('"') and member_end is not None:
                try:
                    inner = json.loads(value_text).strip()
                except ValueError:
                    continue
                arguments = _arguments(inner) if inner.startswith("{") else None
    return name, arguments


def _arguments(text: str) -> str:
    """The JSON object at the start of `text` (perhaps unfinished) as arguments without their closing brace: its
    members as written, up to the first that is not strict JSON (a number too large for a double: the text the model
    wrote, as `_strict_json` keeps it)."""
    members = []
    for start, end in _members(text):
        if end is None:
            break
        member = text[start:end].strip()
        try:
            (key, value), = _strict_json("{" + member + "}").items()
        except ValueError:  # not JSON, or not one member
            break
        if value != json.loads("{" + member + "}")[key]:  # a number kept as text: written as JSON reads it back
            member = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        members.append(member)
    return "{" + ", ".join(members)


def _members(text: str) -> list[tuple[int, int | None]]:
    """The (start, end) of each member of the JSON object `text` opens ("{"), as far as it is written; the last
    one's end is None while it is unfinished. Only counts brackets and strings: values are not checked."""
    spans: list[tuple[int, int | None]] = []
    member, depth, in_string, escaped = 1, 0, False, False
    for at in range(len(text)):
        ch = text[at]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                if text[member:at].strip():
                    spans.append((member, at))
                return spans
        elif ch == "," and depth == 1:
            spans.append((member, at))
            member = at + 1
    if text[member:].strip():
        spans.append((member, None))
    return spans


def _typed(value: str, schema: dict) -> Any:
    """An XML parameter's text as the JSON value its schema types it: strings stay text, anything else is read as
    strict JSON (the templates write objects and arrays as JSON; Python's True / False / None are accepted too), and
    what does not read stays text."""
    kind = schema.get("type")
    if kind == "string" or (kind is None and "enum" in schema and all(isinstance(e, str) for e in schema["enum"])):
        return value
    literal = {"True": "true", "False": "false", "None": "null"}.get(value, value)
    try:
        return _strict_json(literal)
    except ValueError:
        return value


def _strict_json(text: str) -> Any:
    """`text` read as JSON that every strict parser reads back alike: NaN and Infinity are refused (ValueError), and
    a number too large for a double is kept as the text the model wrote, as vLLM's qwen3_coder parser keeps a value
    it cannot convert (its float() gives inf, whose int() raises)."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_or_text)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite_or_text(text: str) -> float | str:
    value = float(text)
    return value if math.isfinite(value) else text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
