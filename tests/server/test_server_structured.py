"""Structured outputs and logit_bias over real HTTP (the session's server, default model): response_format and vLLM's
structured_outputs constrain chat and completion replies, a bad grammar is a 400 naming its parameter, and
logit_bias forces or bans tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_harness import http_json, wait_idle

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"enum": ["ann", "bo"]}, "ok": {"type": "boolean"}}}
USER = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_json_schema_replies_validate_for_several_seeds(client, server):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="m", messages=USER, max_tokens=60, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    reply = client.chat.completions.create(
        model="m", messages=USER, max_tokens=60, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":  # any whitespace is allowed here: the reply may run out first
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert text.lstrip().startswith("{")
    wait_idle(server)


def test_regex_and_choice_constrain_completions_streamed_or_not(client):
    for seed in range(2):
        reply = client.completions.create(model="m", prompt="Code:", max_tokens=20, temperature=1.0, seed=seed,
                                          extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", reply.choices[0].text) and reply.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="m", prompt="Pick:", max_tokens=20, temperature=1.0, seed=3,
                                       stream=True, extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("left", "right")


def test_with_thinking_on_the_constraint_starts_after_the_think_block(client, tokenizer):
    close = tokenizer.convert_tokens_to_ids("</think>")
    for kind, check in (({"regex": "[a-c]{3}"}, lambda text: re.fullmatch("[a-c]{3}", text)),
                        ({"json": SCHEMA, "disable_any_whitespace": True},
                         lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None)):
        reply = client.chat.completions.create(
            model="m", messages=USER, max_tokens=60, temperature=1.0, seed=0,
            logit_bias={str(close): 6},  # the random model closes its think block soon
            extra_body={"chat_template_kwargs": {"enable_thinking": True}, "structured_outputs": kind})
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop" and check(message.content), message
        assert isinstance(message.model_extra["reasoning_content"], str)


def test_logit_bias_forces_and_bans_tokens(client, tokenizer):
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    forced = client.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=1.0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "a" * 4
    greedy = client.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    biased = client.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=0.0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == "a" * 4  # greedy rows are biased too
    banned = client.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=1.0,
                                       logit_bias={str(token): -100, str(token + 1): 100},
                                       extra_body={"ignore_eos": True})
    assert banned.choices[0].text == tokenizer.decode([token + 1] * 4)  # a ban beside a forced token
    assert greedy.choices[0].text != biased.choices[0].text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ("/v1/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required"}, "tool_choice"),  # this template renders no tools
    ("/v1/completions", {"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
])
def test_constraints_that_cannot_be_served_are_400_naming_the_parameter(server, path, body, param):
    base = {"messages": USER} if path.endswith("chat/completions") else {"prompt": "x"}
    status, _, reply = http_json("POST", server.url + path, {**base, "max_tokens": 4, **body})
    assert status == 400 and reply["error"]["param"] == param, reply
