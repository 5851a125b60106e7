"""Tool calling over real HTTP with the `openai` client, on a tiny random model that has Qwen3.5's tokenizer and chat
template: the tools and the tool history reach the template, a forced call (a named function, or "required") comes
back as message.tool_calls with finish_reason "tool_calls" ("length" when max_tokens cuts it), streamed as tool-call
deltas, with arguments of strict JSON, and a round trip feeds its result back; tool_choice "none" keeps the tools out
of the prompt.

The model's weights are random: the grammar engine forces the call's shape and its argument values' types.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_harness import START_TIMEOUT_S, ServerThread, free_port, http_json
from support import shared_data

from qwen_jax.default_model import TEXT_CONFIG

SHARED_TOKENIZER = shared_data("qwen3_5_tokenizer")
VOCAB = 248320  # Qwen3.5's embedding rows
ENGINE_ARGS = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=512, load_format="dummy",
                   dtype="float32", seed=0)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over the next days.",
    "parameters": {"type": "object", "required": ["city", "days"], "additionalProperties": False,
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                          "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def qwen_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen3.5-MoE config (random weights at load) beside Qwen3.5's own tokenizer and chat template."""
    directory = tmp_path_factory.mktemp("qwen3_5_tools")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja"):
        shutil.copy(SHARED_TOKENIZER / name, directory / name)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": dict(TEXT_CONFIG, vocab_size=VOCAB, eos_token_id=248044), "tie_word_embeddings": False}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    return str(directory)


@pytest.fixture(scope="module")
def tools_server(qwen_model_dir, compilation_cache_dir):
    from qwen_jax.llm import AsyncLLM
    from server.app import ServerConfig, create_app

    engine = AsyncLLM.from_engine_args(qwen_model_dir, **ENGINE_ARGS)
    app = create_app(engine, ServerConfig(served_model_names=("tools",), max_num_seqs=4))
    srv = ServerThread(app, "127.0.0.1", free_port())
    srv.start(START_TIMEOUT_S)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def rendered(tools_server, qwen_model_dir):
    """The prompt text a chat request body renders on the server (its /tokenize ids, decoded here)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_model_dir)

    def render(body: dict) -> str:
        status, _, reply = http_json("POST", tools_server.url + "/tokenize", body)
        assert status == 200, reply
        return tokenizer.decode(reply["tokens"])

    return render


def assert_weather_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Tokyo", "Lima") and 1 <= arguments["days"] <= 7
    assert isinstance(arguments["days"], int)
    return arguments


def test_named_tool_choice_round_trip(client, tools_server, rendered):
    first = client.chat.completions.create(
        model="tools", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=150, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(choice.message.tool_calls) == 1
    arguments = assert_weather_call(choice.message.tool_calls[0])

    call = choice.message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    prompt = rendered({"messages": history, "tools": [WEATHER, CLOCK]})
    assert f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{arguments['city']}\n</parameter>" in prompt
    assert "<tool_response>\nSunny, 21 C.\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt  # the tools are in the system turn

    second = client.chat.completions.create(model="tools", messages=history, tools=[WEATHER, CLOCK], max_tokens=5,
                                            temperature=0.0, tool_choice="none", extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.tool_calls is None
    _, _, no_tools = http_json("POST", tools_server.url + "/tokenize", {"messages": history})
    assert second.usage.prompt_tokens == len(no_tools["tokens"])  # "none": the tools are not rendered


def test_required_tool_choice_streams_tool_call_deltas(client):
    """The call's name comes first, then its arguments in pieces as they are generated; the openai client's stream
    helper accumulates them into exactly the non-streamed call's arguments."""
    kwargs = dict(model="tools", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=150,
                  temperature=1.0, seed=4, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [call for d in deltas for call in d.tool_calls or []]
    assert {c.index for c in streamed} == {0} and len(streamed) > 2  # a name, then several argument pieces
    assert streamed[0].function.name == "get_weather" and streamed[0].id.startswith("call_")
    assert all(c.id is None and c.function.name is None for c in streamed[1:])
    arguments = "".join(c.function.arguments or "" for c in streamed)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(arguments) == assert_weather_call(whole.choices[0].message.tool_calls[0])
    assert not "".join(d.content or "" for d in deltas)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert whole.choices[0].finish_reason == "tool_calls"


SCALE = {"type": "function", "function": {
    "name": "scale", "description": "Scale a distance.",
    "parameters": {"type": "object", "required": ["unit", "factor"],
                   "properties": {"unit": {"type": "string", "enum": ["km"]}, "factor": {"type": "number"}}}}}


def strict_json(text: str):
    """JSON as a strict parser reads it: NaN, Infinity and -Infinity are errors."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def forced_scale_calls(client, seed: int, max_tokens: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """A forced call of SCALE, whole and streamed at once (the same tokens): (finish_reason, [(name, arguments)])
    of each, the stream's as the openai client accumulates it."""
    kwargs = dict(model="tools", messages=[{"role": "user", "content": "Scale it."}], tools=[SCALE],
                  tool_choice="required", parallel_tool_calls=False, max_tokens=max_tokens, temperature=1.0,
                  seed=seed)

    def whole():
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.finish_reason, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]

    def streamed():
        finish, calls = None, {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for call in chunk.choices[0].delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
            finish = chunk.choices[0].finish_reason or finish
        return finish, [calls[i] for i in sorted(calls)]

    with ThreadPoolExecutor(2) as pool:
        return [future.result() for future in [pool.submit(whole), pool.submit(streamed)]]


def test_forced_call_arguments_are_strict_json_when_a_number_overflows(client):
    """The random model writes numbers like 2e815575 in 3 of these 6 replies: too large for a double, they are kept
    as the text written (as vLLM's qwen3_coder parser keeps them), never read as inf and written as Infinity."""
    overflowed = 0
    for seed in range(6):
        whole, streamed = forced_scale_calls(client, seed, max_tokens=80)
        assert whole == streamed and whole[0] in ("tool_calls", "length")
        finish, calls = whole
        assert [name for name, _ in calls] == ["scale"]
        arguments = strict_json(calls[0][1])
        if finish == "tool_calls":
            assert arguments["unit"] == "km" and isinstance(arguments["factor"], int | float | str)
            if isinstance(arguments["factor"], str):
                assert float(arguments["factor"]) in (float("inf"), float("-inf")), arguments
                overflowed += 1
    assert overflowed > 0


def test_a_forced_call_cut_by_max_tokens_finishes_length_with_the_complete_arguments(client):
    """The call's name is out, its arguments are not: finish_reason "length" (as vLLM says), and the arguments
    complete when it was cut, as a JSON object."""
    for seed in range(2):
        whole, streamed = forced_scale_calls(client, seed, max_tokens=28)  # inside the factor's value, at best
        assert whole == streamed
        finish, calls = whole
        assert finish == "length" and [name for name, _ in calls] == ["scale"]
        assert strict_json(calls[0][1]) in ({}, {"unit": "km"})


def test_tool_choice_none_leaves_the_tools_out_and_auto_puts_them_in(rendered):
    plain = rendered({"messages": ASK})
    assert rendered({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}) == plain
    with_tools = rendered({"messages": ASK, "tools": [WEATHER]})
    assert "# Tools" in with_tools and '"name": "get_weather"' in with_tools and "# Tools" not in plain


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}, {"role": "user", "content": "?"}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_tool_requests_that_cannot_be_served_are_400(tools_server, body, param):
    status, _, reply = http_json("POST", tools_server.url + "/v1/chat/completions",
                                 {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


# ---- JSON output on the same server (Qwen3.5's 248k-token vocabulary holds hundreds of whitespace tokens) ----------
WEATHER_SCHEMA = WEATHER["function"]["parameters"]
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|"[^"]*$')  # JSON strings (and one left open by max_tokens)
_WHITESPACE_RUN = re.compile(r"[ \t\n\r]+")


def longest_whitespace_run(text: str) -> int:
    """The longest whitespace run between JSON tokens (string contents set aside: spaces are text there)."""
    return max((len(m) for m in _WHITESPACE_RUN.findall(_STRINGS.sub('""', text))), default=0)


def json_replies(client, response_format: dict, seeds: int = 12, **extra) -> list[str]:
    def one(seed: int) -> str:
        return client.chat.completions.create(model="tools", messages=ASK, max_tokens=64, temperature=1.0, seed=seed,
                                              response_format=response_format, **extra).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(seeds)))


def test_json_schema_output_finishes_and_matches_at_every_seed(client):
    """Unbounded whitespace let the random model fill max_tokens with it after "{" (0 of 12 parsed); runs of at most
    16 characters (the default) leave it room to finish."""
    replies = json_replies(client, {"type": "json_schema", "json_schema": {"name": "weather",
                                                                            "schema": WEATHER_SCHEMA}})
    for reply in replies:
        value = json.loads(reply)
        assert set(value) == {"city", "days"} and value["city"] in ("Paris", "Tokyo", "Lima")
        assert isinstance(value["days"], int) and 1 <= value["days"] <= 7


def test_json_object_whitespace_is_bounded_unless_a_request_asks_for_any(client):
    bounded = json_replies(client, {"type": "json_object"}, seeds=4)
    assert max(longest_whitespace_run(r) for r in bounded) <= 16, bounded
    # structured_outputs' whitespace option beside response_format (vLLM's response_format path cannot reach it)
    free = json_replies(client, {"type": "json_object"}, seeds=4,
                        extra_body={"structured_outputs": {"any_whitespace": True}})
    assert max(longest_whitespace_run(r) for r in free) > 16, free


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"any_whitespace": True}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"},
      "structured_outputs": {"any_whitespace": True, "disable_any_whitespace": True}},
     "structured_outputs.any_whitespace"),
])
def test_whitespace_options_without_json_or_both_at_once_are_400(tools_server, body, param):
    status, _, reply = http_json("POST", tools_server.url + "/v1/chat/completions",
                                 {"model": "tools", "messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


@pytest.mark.parametrize("server_default,request_options,run", [
    ("bounded", {}, 16), ("any", {}, None), ("none", {}, 0),
    ("none", {"any_whitespace": True}, None), ("any", {"disable_any_whitespace": True}, 0),
])
def test_the_servers_json_whitespace_applies_where_a_request_gives_none(server_default, request_options, run):
    from server.protocol import ChatCompletionRequest, validate
    from server.serving import JSON_WHITESPACE

    body = {"messages": ASK, "response_format": {"type": "json_object"}}
    if request_options:
        body["structured_outputs"] = request_options
    spec, _ = validate(ChatCompletionRequest, body).constraint(**JSON_WHITESPACE[server_default])
    assert spec.json_whitespace_run == run


def test_the_tool_call_parser_flag_chooses_the_format_of_a_forced_call(tools_server):
    """--tool-call-parser hermes on a template that teaches Qwen3.5's XML: a forced call is written as Hermes JSON."""
    from server.protocol import ChatCompletionRequest, validate
    from server.serving_chat import ChatServing
    from server.tools import HERMES_JSON, QWEN_XML, forcing_grammar

    state = tools_server.app.extensions["qwen_jax"]
    req = validate(ChatCompletionRequest, {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    added = state.tokenizer.get_added_vocab()
    serving = ChatServing(state)
    assert serving.constraint(req)[0].grammar == forcing_grammar(QWEN_XML, tools, "required", True, added)
    state.config.tool_call_format = HERMES_JSON
    try:
        forced = serving.constraint(req)[0].grammar
    finally:
        state.config.tool_call_format = None
    assert forced == forcing_grammar(HERMES_JSON, tools, "required", True, added)
