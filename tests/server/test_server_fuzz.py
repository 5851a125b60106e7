"""Property: no request body, however wrong, gets a 5xx or hurts the engine. Hypothesis sends random JSON (random
types, huge integers, non-finite floats, text with lone surrogates, deep nesting) into every field of every
endpoint, and whole random bodies; the server must answer each below 500 and serve normally afterwards.
"""

from __future__ import annotations

import http.client
import json

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings
from server_harness import http_json, wait_idle

from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

USER = [{"role": "user", "content": "hi"}]
# (path, a valid body to start from, the request model whose every field is fuzzed, nested places to fuzz)
ENDPOINTS = [
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 2}, ChatCompletionRequest,
     [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0, "content", 0, "text"),
      ("messages", 0, "tool_calls", 0, "function"), ("stream_options", "include_usage"),
      ("tools", 0, "function", "parameters"), ("response_format", "json_schema", "schema"),
      ("chat_template_kwargs", "enable_thinking"), ("chat_template_kwargs", "anything"),
      ("tool_choice", "function", "name")]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, CompletionRequest,
     [("prompt", 0), ("prompt", 0, 0), ("stop", 0), ("logit_bias", "5"), ("stream_options", "include_usage")]),
    ("/invocations", {"prompt": "hi", "max_tokens": 2}, CompletionRequest, [("prompt", 1)]),
    ("/invocations", {"messages": USER, "max_completion_tokens": 2}, ChatCompletionRequest, [("messages", 1)]),
    ("/tokenize", {"prompt": "hi"}, TokenizeCompletionRequest, [("prompt", 0)]),
    ("/tokenize", {"messages": USER}, TokenizeChatRequest, [("messages", 0, "content")]),
    ("/detokenize", {"tokens": [1, 2]}, DetokenizeRequest, [("tokens", 0)]),
]
# Valid values of these make long generations (slow on a CPU, and tested elsewhere): their draws skip them.
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "min_tokens"}

text = st.one_of(st.text(max_size=12),
                 st.text(st.characters(codec=None, categories=["Cs", "Ll", "Lu", "Nd", "Po", "Zs"]), max_size=8))
scalars = st.one_of(
    st.none(), st.booleans(), text,
    st.integers(min_value=-3, max_value=600),
    st.integers(min_value=-(10 ** 400), max_value=10 ** 400),
    st.sampled_from([2 ** 31, 2 ** 31 - 1, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 517, 516]),
    st.floats(allow_nan=True, allow_infinity=True),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=12)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of a JSON schema's type, at and just past its bounds (mostly valid, so they reach the engine), with
    the text half the time holding lone surrogates."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth)
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return st.one_of([from_schema(o, defs, depth) for o in options])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema.get("minimum", -(2 ** 63)), schema.get("maximum", 2 ** 63)
        return st.one_of(st.integers(lo, min(hi, lo + 40)), st.sampled_from([lo - 1, hi, hi + 1]))
    if kind == "number":
        lo, hi = schema.get("minimum", -1e6), schema.get("maximum", 1e6)
        return st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi, hi + 0.5]))
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return text
    if kind == "array" and depth < 3:
        return st.lists(from_schema(schema.get("items", {}), defs, depth + 1), max_size=3)
    if kind == "object" and depth < 3:
        fields = {k: from_schema(v, defs, depth + 1) for k, v in schema.get("properties", {}).items()}
        return st.fixed_dictionaries({k: fields[k] for k in schema.get("required", [])},
                                     optional={k: v for k, v in fields.items() if k not in schema.get("required", [])})
    return json_values


field_values = st.one_of(json_values, st.integers(min_value=30, max_value=300).map(nested))


def quick(value) -> bool:
    return not (isinstance(value, int) and not isinstance(value, bool) and 8 < value < 10 ** 7)


def put(body: dict, path: tuple, value) -> None:
    """Set body[path] = value, making (or replacing) the containers on the way."""
    node = body
    for key, following in zip(path, path[1:]):
        kind = list if isinstance(following, int) else dict
        if isinstance(key, int):
            while len(node) <= key:
                node.append(kind())
            if not isinstance(node[key], kind):
                node[key] = kind()
        elif not isinstance(node.get(key), kind):
            node[key] = kind()
        node = node[key]
    if isinstance(path[-1], int):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def send(server, path: str, body) -> int:
    """POST a JSON body (NaN, infinities and lone surrogates as Python's json writes them); read the whole answer."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status >= 400:
            error = json.loads(raw)["error"]
            assert error["message"] and error["type"], raw
        return resp.status
    finally:
        conn.close()


FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@FUZZ
@given(data=st.data())
def test_random_values_in_any_field_of_any_endpoint_never_get_a_5xx(server, data):
    path, base, model, places = data.draw(st.sampled_from(ENDPOINTS))
    schema = model.model_json_schema()
    fields = [(name,) for name in schema["properties"]] + places + [("not_a_field",)]
    body = json.loads(json.dumps(base))
    for place in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True)):
        values = field_values
        if len(place) == 1 and place[0] in schema["properties"]:
            values = st.one_of(from_schema(schema["properties"][place[0]], schema.get("$defs", {})), field_values)
        put(body, place, data.draw(values.filter(quick) if place[0] in LENGTH_FIELDS else values))
    status = send(server, path, body)
    assert status < 500, (path, body)


@settings(FUZZ, max_examples=100)
@given(path=st.sampled_from(sorted({e[0] for e in ENDPOINTS})), body=json_values)
def test_random_bodies_never_get_a_5xx(server, path, body):
    assert send(server, path, body) < 500, (path, body)


def test_the_engine_serves_normally_after_the_fuzzing(server):
    assert http_json("GET", server.url + "/health")[0] == 200
    status, _, body = http_json("POST", server.url + "/v1/chat/completions",
                                {"messages": USER, "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    stats = wait_idle(server)
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
