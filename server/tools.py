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

_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
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
    """Splits a reply's content into text and tool calls, whole (`parse`) or streamed (`feed`, then `flush`): the
    text before the first call, then every call in order; text after a call is dropped, as the formats allow none
    (`keep_text_after_calls`: kept, for a think block), and a block that does not parse is text. `tools` (the
    request's, OpenAI shape) give each argument its JSON type in the XML format, whose values are bare text.

    A call is streamed as it is generated: its id and name once its name is complete, then its arguments' JSON text
    as it grows (in the XML format a parameter at a time, in the JSON format as written), so the pieces add up to
    the arguments a whole parse gives. Once its name is out a call stays a call: a reply cut short inside it ends with
    the arguments generated so far. `next_index` numbers the calls (shared by a choice's parsers)."""

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
        content, _ = parser.feed(text)
        return content + parser.flush(), parser.calls

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """A streamed piece: (the text that is surely no part of a call, the tool-call deltas it makes: OpenAI's
        stream entries, one per call index)."""
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
            end = self.pending.find(CALL_CLOSE, start)
            body = self.pending[start + len(CALL_OPEN):end if end >= 0 else len(self.pending)]
            if end < 0:  # open: stream what of it is certain
                self._stream(body, deltas, final=False)
                break
            if not self._stream(body, deltas, final=True):  # not a call after all: text
                self._text(text, self.pending[:end + len(CALL_CLOSE)])
            self.pending = self.pending[end + len(CALL_CLOSE):]
        return "".join(text), list(deltas.values())

    def flush(self) -> str:
        """What is still held back when the reply ends: text, unless a call was cut short (it ends as generated)."""
        rest, self.pending = self.pending, ""
        if self._open is not None:
            self._open = None
            return ""
        return "" if self.calls and not self.keep_text_after_calls else rest

    def _text(self, out: list[str], text: str) -> None:
        """Release text, with the whitespace held back before it (none once a call came: the rest is dropped)."""
        if text and (self.keep_text_after_calls or not self.calls):
            out.append(text)

    def _stream(self, body: str, deltas: dict[int, dict], final: bool) -> bool:
        """Send what is new of the call whose body (so far) is `body`; `final`: the body is whole. Whether it is a
        call: one whose name reads is, even if the rest does not parse (it keeps the arguments that do, as a stream
        that sent its name must)."""
        name, arguments = self._read(body, final)
        if final and name is None:  # a whole call that does not parse: as far as it reads, as if streamed
            name, arguments = self._read(body, False)
        if self._open is None:
            if name is None:
                return False
            call = ToolCall(name, "")
            index = self.next_index()
            self._open = (index, call)
            self.calls.append(call)
            deltas[index] = {"index": index, "id": call.id, "type": "function",
                             "function": {"name": name, "arguments": ""}}
        index, call = self._open
        if arguments is not None and arguments.startswith(call.arguments) and len(arguments) > len(call.arguments):
            entry = deltas.setdefault(index, {"index": index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += arguments[len(call.arguments):]
            call.arguments = arguments
        if final:
            self._open = None
        return True

    def _read(self, body: str, final: bool) -> tuple[str | None, str | None]:
        """(the call's name, its arguments' JSON text) as far as `body` makes them certain: a prefix of the whole
        call's arguments text while it is open; the whole text once `final` (None where it does not parse)."""
        stripped = body.lstrip()
        if stripped.startswith("<function="):
            return self._read_xml(stripped, final)
        if stripped.startswith("{"):
            return _read_json(stripped, final)
        return None, None

    def _read_xml(self, body: str, final: bool) -> tuple[str | None, str | None]:
        head = re.match(r"<function=([^>\n]+)>", body)
        if head is None:
            return None, None
        name = head.group(1).strip()
        rest = body[head.end():]
        if final and _XML_FUNCTION.fullmatch(body.strip()) is None:
            return None, None
        params = self.schemas.get(name, {}).get("properties", {})
        pairs = [f"{json.dumps(key.strip(), ensure_ascii=False)}: "
                 f"{json.dumps(_typed(value.strip(), params.get(key.strip(), {})), ensure_ascii=False)}"
                 for key, value in _XML_PARAMETER.findall(rest)]
        return name, "{" + ", ".join(pairs) + ("}" if final else "")


def _read_json(body: str, final: bool) -> tuple[str | None, str | None]:
    """A JSON-format call's name and arguments text: the arguments object as written (a string of JSON: its
    content, once whole)."""
    if final:
        try:
            data = json.loads(body.strip())
        except ValueError:
            return None, None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None, None
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                return (data["name"], arguments) if isinstance(json.loads(arguments), dict) else (None, None)
            except ValueError:
                return None, None
        if not isinstance(arguments, dict):
            return None, None
        written = _json_value_text(body, ("arguments", "parameters"))
        return data["name"], written if written is not None and json.loads(written) == arguments else json.dumps(
            arguments, ensure_ascii=False)
    name = re.search(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body)
    if name is None:
        return None, None
    return json.loads(f'"{name.group(1)}"'), _json_value_text(body, ("arguments", "parameters"), whole=False)


def _json_value_text(body: str, keys: tuple[str, ...], whole: bool = True) -> str | None:
    """The text of the object value of the first of `keys` in `body` as written, up to its closing brace (`whole`
    False: as much of it as is there); None when there is no such object value (yet)."""
    found = re.search(r'"(?:' + "|".join(keys) + r')"\s*:\s*', body)
    if found is None or body[found.end():found.end() + 1] != "{":
        return None
    start, depth, in_string, escaped = found.end(), 0, False, False
    for at in range(start, len(body)):
        ch = body[at]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return body[start:at + 1]
    return None if whole else body[start:]


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
