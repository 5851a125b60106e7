"""The tool-call parser on its own: Qwen3.5's XML calls and Qwen3 / Hermes JSON calls become OpenAI tool calls with
typed arguments, the text before them stays content, and streaming the reply in any pieces gives exactly the
whole reply's content and calls."""

from __future__ import annotations

import json
import math

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
    return [(c.name, strict_json(c.arguments)) for c in calls]


def streamed(parser: ToolParser, reply: str, piece: int) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed `reply` in pieces of `piece` characters; (the content, each call as the OpenAI client accumulates its
    stream deltas: (id, name, arguments text))."""
    content, calls = "", {}
    for at in range(0, len(reply), piece):
        text, deltas = parser.feed(reply[at:at + piece], end=at + piece >= len(reply))
        content += text
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.get("id", call["id"])
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"].get("arguments", "")
    return content, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def strict_json(text: str):
    """JSON as a strict parser reads it: NaN, Infinity and -Infinity are errors."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("reply, content, calls", [
    (XML_REPLY, "Let me look that up.", XML_CALLS),
    (JSON_REPLY, "", JSON_CALLS),
    ("no call here <tool", "no call here <tool", []),
    ("<tool_call>\n{broken json}\n</tool_call> and text", "<tool_call>\n{broken json}\n</tool_call> and text", []),
    ("cut short <tool_call>\n<function=noop", "cut short <tool_call>\n<function=noop", []),  # no name yet: text
    ("before <tool_call>\n{\"name\": \"noop\", \"arguments\": {}}\n</tool_call> after", "before",
     [("noop", {})]),
])
def test_a_whole_reply_splits_into_content_and_typed_calls(reply, content, calls):
    got_content, got_calls = ToolParser(TOOLS).parse(reply)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    for call in got_calls:  # OpenAI's shape: arguments as JSON text, an id per call
        openai = call.openai()
        assert openai["type"] == "function" and openai["id"].startswith("call_")
        assert openai["function"]["arguments"] == call.arguments


@pytest.mark.parametrize("reply", [
    "cut short <tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n<parameter=da",
    'cut short <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "da',
    'cut short <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": [1, {"x": "}',
])
def test_a_call_cut_short_after_its_name_stays_a_call_with_the_complete_arguments_closed(reply):
    """Once a call's name is out (streamed) it is a call, whole or streamed: a reply that ends inside it ends with
    the arguments complete so far, as a JSON object."""
    content, calls = ToolParser(TOOLS).parse(reply)
    assert content == "cut short" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Lima"}')]
    for piece in (1, 3):
        assert streamed(ToolParser(TOOLS), reply, piece)[1][0][1:] == ("get_weather", '{"city": "Lima"}')
    content, calls = ToolParser(TOOLS).parse("<tool_call>\n<function=noop>\n<parameter=x>\n1")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("noop", "{}")]


NUMBERS = [{"type": "function", "function": {"name": "set", "parameters": {"type": "object", "properties": {
    "x": {"type": "number"}, "n": {"type": "integer"}, "v": {"type": "array", "items": {"type": "number"}},
    "o": {"type": "object"}}}}}]


@pytest.mark.parametrize("reply, arguments", [
    # XML: a value that is not strict JSON, or a number too large for a double, is the text the model wrote
    ("<tool_call>\n<function=set>\n<parameter=x>\n1e999\n</parameter>\n<parameter=n>\n-1E400\n</parameter>\n"
     "<parameter=v>\n[1.5, 2e308]\n</parameter>\n<parameter=o>\n{\"y\": NaN}\n</parameter>\n</function>\n</tool_call>",
     {"x": "1e999", "n": "-1E400", "v": [1.5, "2e308"], "o": '{"y": NaN}'}),
    ("<tool_call>\n<function=set>\n<parameter=x>\nInfinity\n</parameter>\n<parameter=n>\n12\n</parameter>\n"
     "</function>\n</tool_call>", {"x": "Infinity", "n": 12}),
    # JSON: an overflowing number the same; a member that is not JSON ends the arguments
    ('<tool_call>\n{"name": "set", "arguments": {"x": 1e999, "v": [1, -2E+999], "n": 3}}\n</tool_call>',
     {"x": "1e999", "v": [1, "-2E+999"], "n": 3}),
    ('<tool_call>\n{"name": "set", "arguments": {"n": 3, "x": NaN, "o": {}}}\n</tool_call>', {"n": 3}),
    ('<tool_call>\n{"name": "set", "arguments": {"n": 3, "x": -Infinity}}\n</tool_call>', {"n": 3}),
])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_arguments_are_strict_json_whatever_numbers_the_model_writes(reply, arguments, piece):
    """Never Infinity or NaN in `arguments` (json.dumps writes them for inf and nan, which json.loads reads from
    1e999): whole and streamed alike."""
    _, calls = ToolParser(NUMBERS).parse(reply)
    assert [strict_json(c.arguments) for c in calls] == [arguments]
    _, streamed_calls = streamed(ToolParser(NUMBERS), reply, piece)
    assert [a for _, _, a in streamed_calls] == [c.arguments for c in calls]


@pytest.mark.parametrize("reply", [XML_REPLY, JSON_REPLY, "plain text, trailing space  ", "x <tool_call>\n{bad}",
                                   JSON_REPLY.replace('"arguments": {', '"arguments": {"note": "a } and \\" {", ', 1),
                                   JSON_REPLY.replace('"days": 2}', '"days": }')])  # a name, then broken arguments
@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streaming_in_any_pieces_gives_the_whole_replys_content_and_calls(reply, piece):
    """The streamed argument pieces add up to exactly the whole call's arguments text (what the OpenAI client
    accumulates is what a whole reply gives)."""
    whole_content, whole_calls = ToolParser(TOOLS).parse(reply)
    content, calls = streamed(ToolParser(TOOLS), reply, piece)
    assert content == whole_content
    assert [(name, arguments) for _, name, arguments in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)


def test_arguments_are_streamed_as_they_are_generated():
    """A call's name goes out as soon as it is complete, its arguments as they grow: the JSON format's a member at a
    time as written, the XML format's a parameter at a time; the call is not held back until it closes."""
    parser = ToolParser(TOOLS)
    inside = JSON_REPLY.index('"days"')
    _, deltas = parser.feed(JSON_REPLY[:inside])
    assert deltas == [{"index": 0, "id": parser.calls[0].id, "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"'}}]
    _, deltas = parser.feed(JSON_REPLY[inside:JSON_REPLY.index("</tool_call>")])
    assert deltas == [{"index": 0, "function": {"arguments": ', "days": 2'}}]
    _, deltas = parser.feed("</tool_call>")
    assert deltas == [{"index": 0, "function": {"arguments": "}"}}]
    parser = ToolParser(TOOLS)
    first_parameter = XML_REPLY.index("<parameter=days>")
    _, deltas = parser.feed(XML_REPLY[:first_parameter])
    assert [d["function"] for d in deltas] == [{"name": "get_weather", "arguments": '{"city": "New York"'}]
    _, deltas = parser.feed(XML_REPLY[first_parameter:XML_REPLY.index("<parameter=metric>")])
    assert [d["function"] for d in deltas] == [{"arguments": ', "days": 3'}]


def test_calls_inside_a_think_block_are_parsed_and_numbered_with_the_others():
    """vLLM issue 39056: a call made while thinking is a call; the think block keeps its text around it."""
    import itertools

    index = itertools.count().__next__
    think, answer = ToolParser(TOOLS, keep_text_after_calls=True, next_index=index), ToolParser(TOOLS, next_index=index)
    reasoning = 'First the weather. <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call> Then answer.'
    text, deltas = think.feed(reasoning, end=True)
    assert text == "First the weather. Then answer." and deltas[0]["index"] == 0
    _, deltas = answer.feed(JSON_REPLY)
    assert [d["index"] for d in deltas] == [1, 2]
    whole_text, whole_calls = ToolParser(TOOLS, keep_text_after_calls=True).parse(reasoning)
    assert whole_text == "First the weather. Then answer." and calls_of(whole_calls) == [("noop", {})]


def test_the_chat_templates_tool_call_format_is_recognised(default_model_dir, shared_data):
    with open(shared_data / "qwen3_5_tokenizer" / "chat_template.jinja") as f:
        assert call_format(f.read()) == QWEN_XML
    assert call_format("{{ '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}") == HERMES_JSON
    with open(f"{default_model_dir}/chat_template.jinja") as f:
        assert call_format(f.read()) is None  # the default model's template renders no tools


FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7},
                   "note": {"type": "string"}, "opts": {"type": "object", "properties": {"metric": {"type": "boolean"}},
                                                       "required": ["metric"], "additionalProperties": False},
                   "where": {"$ref": "#/$defs/place"}},
    "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"],
                        "additionalProperties": False}}}}},
                {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("fmt", [QWEN_XML, HERMES_JSON])
def test_a_forced_calls_grammar_lets_through_only_calls_the_parser_reads_with_their_schemas_types(fmt, shared_data):
    """Random walks through the masks of the forcing grammar on Qwen3.5's vocabulary (`<tool_call>` is one of its
    added tokens): every reply that ends is only calls, which the parser reads back with arguments of the declared
    types and the enum's values."""
    import llguidance
    import llguidance.numpy
    import numpy as np
    from transformers import AutoTokenizer

    from server.tools import forcing_grammar

    path = shared_data / "qwen3_5_tokenizer"
    hf = AutoTokenizer.from_pretrained(path)
    eos = [hf.convert_tokens_to_ids("<|im_end|>")]
    vocab = llguidance.LLTokenizer((path / "tokenizer.json").read_text(), n_vocab=len(hf), eos_token=eos)
    grammar = forcing_grammar(fmt, FORCED_TOOLS, "required", True, hf.get_added_vocab())
    mask = llguidance.numpy.allocate_token_bitmask(1, len(hf))
    lengths = np.array([len(t) for t in hf.convert_ids_to_tokens(list(range(len(hf))))])
    rng = np.random.default_rng(0)
    ended = 0
    for _ in range(6):
        matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
        tokens: list[int] = []
        while len(tokens) < 200 and not (tokens and tokens[-1] in eos):
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:len(hf)])
            # short replies: the stop token whenever it is allowed, else one of the 16 shortest allowed tokens
            token = eos[0] if eos[0] in allowed else int(rng.choice(
                allowed[np.argsort(lengths[allowed], kind="stable")[:16]]))
            assert matcher.consume_token(token), matcher.get_error()
            tokens.append(token)
        if tokens[-1] not in eos:
            continue
        ended += 1
        content, calls = ToolParser(FORCED_TOOLS).parse(hf.decode(tokens[:-1]))
        assert content == "" and calls
        for name, arguments in calls_of(calls):
            if name == "noop":
                continue
            assert name == "get_weather" and arguments["city"] in ("Paris", "Lima")
            assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7
            assert isinstance(arguments.get("note", ""), str)
            assert isinstance(arguments.get("opts", {"metric": True})["metric"], bool)
            lat = arguments.get("where", {"lat": 0.5})["lat"]  # a $ref to its $defs
            assert isinstance(lat, int | float) or math.isinf(float(lat))  # too large for a double: the text written
    assert ended >= 3


def test_a_named_tool_choice_that_names_no_tool_is_refused():
    from server.tools import forcing_grammar

    with pytest.raises(ValueError, match="'nope', which is not among the tools"):
        forcing_grammar(QWEN_XML, FORCED_TOOLS, {"type": "function", "function": {"name": "nope"}}, False, ())
