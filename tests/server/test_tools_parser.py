"""The tool-call parser on its own: Qwen3.5's XML calls and Qwen3 / Hermes JSON calls become OpenAI tool calls with
typed arguments, the text before them stays content, and streaming the reply in any pieces gives exactly the
whole reply's content and calls."""

from __future__ import annotations

import json

import pytest

from server.tools import HERMES_JSON, QWEN_XML, ToolParser, call_format

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "opts": {"type": "object"}, "code": {"type": "string"}, "ratio": {"type": "number"}}}}},
         {"type": "function", "function": {"name": "noop"}}]

XML_REPLY = ("Let me look that up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=opts>\n"
             "{\"unit\": \"C\", \"hours\": [1, 2]}\n</parameter>\n<parameter=code>\n042\n</parameter>\n"
             "<parameter=ratio>\n2.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n"
             "</function>\n</tool_call>")
XML_CALLS = [("get_weather", {"city": "New York", "days": 3, "metric": True, "opts": {"unit": "C", "hours": [1, 2]},
                              "code": "042", "ratio": 2.5}), ("noop", {})]
JSON_REPLY = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
JSON_CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]


def calls_of(calls):
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("reply, content, calls", [
    (XML_REPLY, "Let me look that up.", XML_CALLS),
    (JSON_REPLY, "", JSON_CALLS),
    ("no call here <tool", "no call here <tool", []),
    ("<tool_call>\n{broken json}\n</tool_call> and text", "<tool_call>\n{broken json}\n</tool_call> and text", []),
    ("cut short <tool_call>\n<function=noop>\n", "cut short <tool_call>\n<function=noop>\n", []),
    ("before <tool_call>\n{\"name\": \"noop\", \"arguments\": {}}\n</tool_call> after", "before",
     [("noop", {})]),
])
def test_a_whole_reply_splits_into_content_and_typed_calls(reply, content, calls):
    got_content, got_calls = ToolParser(TOOLS).parse(reply)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    for call in got_calls:  # OpenAI's shape: arguments as JSON text, an id per call
        openai = call.openai()
        assert openai["type"] == "function" and openai["id"].startswith("call_")
        assert json.loads(openai["function"]["arguments"]) == call.arguments


@pytest.mark.parametrize("reply", [XML_REPLY, JSON_REPLY, "plain text, trailing space  ", "x <tool_call>\n{bad}"])
@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streaming_in_any_pieces_gives_the_whole_replys_content_and_calls(reply, piece):
    whole_content, whole_calls = ToolParser(TOOLS).parse(reply)
    parser = ToolParser(TOOLS)
    content, calls = "", []
    for at in range(0, len(reply), piece):
        text, new = parser.feed(reply[at:at + piece])
        content += text
        calls += new
    content += parser.flush()
    assert content == whole_content
    assert calls_of(calls) == calls_of(whole_calls)


def test_calls_are_streamed_as_soon_as_they_close():
    parser = ToolParser(TOOLS)
    first_end = JSON_REPLY.index("</tool_call>") + len("</tool_call>")
    assert calls_of(parser.feed(JSON_REPLY[:first_end - 1])[1]) == []
    assert calls_of(parser.feed(JSON_REPLY[first_end - 1:first_end])[1]) == JSON_CALLS[:1]
    assert calls_of(parser.feed(JSON_REPLY[first_end:])[1]) == JSON_CALLS[1:]


def test_the_chat_templates_tool_call_format_is_recognised(default_model_dir, shared_data):
    with open(shared_data / "qwen3_5_tokenizer" / "chat_template.jinja") as f:
        assert call_format(f.read()) == QWEN_XML
    assert call_format("{{ '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}") == HERMES_JSON
    with open(f"{default_model_dir}/chat_template.jinja") as f:
        assert call_format(f.read()) is None  # the default model's template renders no tools
