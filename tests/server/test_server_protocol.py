"""The typed request models over real HTTP: every invalid field (token ids out of the vocabulary, lone surrogates,
huge integers, NaN, wrong nesting) is a 400 that names it and leaves the server serving; too-large bodies get 413
however they are sent; unknown fields are accepted and logged once; best_of, echo, suffix, the template options and
the OpenAPI document.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time

import pytest
from server_harness import http_json, wait_idle

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
VOCAB = 517  # the default model's vocabulary


def raw_post(server, path: str, raw: bytes) -> tuple[int, dict]:
    status, _, body = http_json("POST", server.url + path, raw)
    return status, body


def assert_400_naming(status: int, body: dict, param: str) -> None:
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body


def assert_still_serving(server) -> None:
    assert http_json("GET", server.url + "/health")[0] == 200
    status, _, body = http_json("POST", server.url + COMP, {"prompt": "still", "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    wait_idle(server)


def test_the_request_that_bricked_the_engine_is_a_400_and_the_server_serves_on(server):
    status, _, body = http_json("POST", server.url + COMP, {"prompt": "hi", "max_tokens": 3, "min_tokens": 1,
                                                           "stop_token_ids": [2 ** 31]})
    assert_400_naming(status, body, "stop_token_ids[0]")
    assert "outside the vocabulary [0, 517)" in body["error"]["message"]
    assert_still_serving(server)


TOKEN_ID_FIELDS = [
    (COMP, lambda t: {"prompt": [1, t]}, "prompt[1]"),
    (COMP, lambda t: {"prompt": [[1], [2, t]]}, "prompt[1][1]"),
    (COMP, lambda t: {"prompt": "x", "stop_token_ids": [t]}, "stop_token_ids[0]"),
    (CHAT, lambda t: {"messages": USER, "stop_token_ids": [3, t]}, "stop_token_ids[1]"),
    (CHAT, lambda t: {"messages": USER, "logit_bias": {str(t): 1}}, "logit_bias.{t}"),
    (COMP, lambda t: {"prompt": "x", "allowed_token_ids": [t]}, "allowed_token_ids[0]"),
    ("/tokenize", lambda t: {"prompt": [t]}, "prompt[0]"),
    ("/invocations", lambda t: {"prompt": [t]}, "prompt[0]"),
]


@pytest.mark.parametrize("token", [2 ** 31, -1, VOCAB])
@pytest.mark.parametrize("path,body,param", TOKEN_ID_FIELDS, ids=[f"{p}:{n}" for p, _, n in TOKEN_ID_FIELDS])
def test_every_token_id_field_rejects_ids_outside_the_vocabulary(server, token, path, body, param):
    status, _, answer = http_json("POST", server.url + path, {"max_tokens": 2, **body(token)})
    assert_400_naming(status, answer, param.format(t=token))


def test_a_token_id_just_inside_the_vocabulary_is_served(server):
    status, _, body = http_json("POST", server.url + COMP, {"prompt": [VOCAB - 1, 0], "max_tokens": 2,
                                                           "stop_token_ids": [VOCAB - 1]})
    assert status == 200, body


SURROGATE = '"\\ud800x"'  # a lone UTF-16 surrogate, as JSON spells it
BAD_TEXT = [
    (COMP, '{"prompt": %s}', "prompt"),
    (COMP, '{"prompt": ["ok", %s]}', "prompt[1]"),
    (COMP, '{"prompt": "x", "stop": [%s]}', "stop[0]"),
    (COMP, '{"prompt": "x", "user": %s}', "user"),
    (CHAT, '{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
     "messages[0].content[0].text"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "model": %s}', "model"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"k": [%s]}}',
     "chat_template_kwargs.k[0]"),
    ("/tokenize", '{"prompt": %s}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
]


@pytest.mark.parametrize("path,template,param", BAD_TEXT, ids=[f"{p}:{n}" for p, _, n in BAD_TEXT])
def test_lone_surrogates_are_a_400_naming_the_field(server, path, template, param):
    status, body = raw_post(server, path, (template % SURROGATE).encode())
    assert_400_naming(status, body, param)
    assert "surrogate" in body["error"]["message"]


def test_a_lone_surrogate_in_a_key_is_a_400(server):
    status, body = raw_post(server, COMP, b'{"prompt": "x", "chat_template_kwargs": {"\\udfffk": 1}}')
    assert_400_naming(status, body, "chat_template_kwargs")


HUGE = "9" * 400
BAD_NUMBERS = [
    (CHAT, f'"temperature": {HUGE}', "temperature"),
    (CHAT, f'"max_tokens": {HUGE}', "max_tokens"),
    (COMP, f'"seed": -{HUGE}', "seed"),
    (COMP, f'"n": {HUGE}', "n"),
    (COMP, f'"top_k": {HUGE}', "top_k"),
    (COMP, f'"logprobs": {HUGE}', "logprobs"),
    (CHAT, '"top_p": NaN', "top_p"),
    (CHAT, '"presence_penalty": -Infinity', "presence_penalty"),
    (COMP, '"min_p": 1e999', "min_p"),
    (COMP, '"logit_bias": {"5": NaN}', "logit_bias.5"),
    (COMP, '"max_tokens": 2147483648', "max_tokens"),
    (COMP, '"min_tokens": 2147483648', "min_tokens"),
    (CHAT, '"top_k": 2147483648', "top_k"),
    (CHAT, '"seed": 18446744073709551616', "seed"),
]


@pytest.mark.parametrize("path,field,param", BAD_NUMBERS, ids=[f"{p}:{n}" for p, _, n in BAD_NUMBERS])
def test_huge_and_non_finite_numbers_are_a_400_naming_the_field(server, path, field, param):
    head = '"messages": [{"role": "user", "content": "x"}]' if path == CHAT else '"prompt": "x"'
    status, body = raw_post(server, path, f"{{{head}, {field}}}".encode())
    assert_400_naming(status, body, param)


DEEP: list = [1]
for _ in range(80):
    DEEP = [DEEP]
BAD_NESTING = [
    (CHAT, {"messages": {"role": "user", "content": "x"}}, "messages"),
    (CHAT, {"messages": [[{"role": "user", "content": "x"}]]}, "messages[0]"),
    (CHAT, {"messages": [{"role": "user", "content": [["x"]]}]}, "messages[0].content[0]"),
    (CHAT, {"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    (CHAT, {"messages": USER, "stream_options": {"include_usage": {"a": 1}}, "stream": True},
     "stream_options.include_usage"),
    (CHAT, {"messages": USER, "tools": {"type": "function"}}, "tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": ["f"]}}]},
     "tools[0].function.name"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format.json_schema"),
    (CHAT, {"messages": USER, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice.function"),
    (COMP, {"prompt": [[["x"]]]}, "prompt[0][0]"),
    (COMP, {"prompt": [[1, [2]]]}, "prompt[0][1]"),
    (COMP, {"prompt": "x", "stop": [["a"]]}, "stop[0]"),
    (COMP, {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
    (COMP, {"prompt": "x", "extra": {"a": DEEP}}, None),
    ("/tokenize", {"prompt": {"text": "x"}}, "prompt"),
]


@pytest.mark.parametrize("path,body,param", BAD_NESTING, ids=[f"{p}:{n}" for p, _, n in BAD_NESTING])
def test_wrong_nesting_is_a_400_naming_the_field(server, path, body, param):
    status, _, answer = http_json("POST", server.url + path, body)
    if param is None:  # too deep: the error names the path into the field, cut short
        assert status == 400 and answer["error"]["param"].startswith("extra.a[0][0]")
    else:
        assert_400_naming(status, answer, param)


def test_the_server_serves_on_after_every_kind_of_invalid_field(server):
    assert_still_serving(server)


def _chunked_post(url: str, path: str, chunks) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", path, body=chunks, headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    status, body = resp.status, json.loads(resp.read())
    conn.close()
    return status, body


def test_a_64_mib_body_gets_413_with_an_error_body_whether_its_length_is_declared_or_chunked(server):
    limit = server.state.config.max_body_bytes
    big = b'{"prompt": "' + b"x" * (64 << 20) + b'"}'
    status, _, body = http_json("POST", server.url + COMP, big, timeout=120)
    assert status == 413 and f"limit of {limit} bytes" in body["error"]["message"]
    status, body = _chunked_post(server.url, COMP, (b"x" * (1 << 20) for _ in range(64)))
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    # a chunked body under the limit is read whole and served
    status, body = _chunked_post(server.url, COMP, iter([b'{"prompt": "chunked", ', b'"max_tokens": 2}']))
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert_still_serving(server)


def test_unknown_fields_are_accepted_and_logged_once(server, caplog):
    body = {"prompt": "x", "max_tokens": 1, "mystery_knob": 3, "stream_options": None,
            "nested": {"deeper": 1}}
    with caplog.at_level(logging.INFO, logger="qwen_jax.server"):
        for _ in range(2):
            status, _, _ = http_json("POST", server.url + COMP, body)
            assert status == 200
        status, _, _ = http_json("POST", server.url + CHAT, {"messages": [{"role": "user", "content": "x",
                                                                           "mood": "calm"}], "max_tokens": 1})
        assert status == 200
    lines = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert lines == ["ignoring unknown request field(s) on /v1/completions: mystery_knob, nested",
                     "ignoring unknown request field(s) on /v1/chat/completions: messages.mood"]


def test_openapi_document_describes_every_route_and_field(server):
    status, _, doc = http_json("GET", server.url + "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for path in ("/v1/chat/completions", "/v1/completions", "/invocations", "/tokenize", "/v1/models", "/health",
                 "/metrics"):
        assert path in doc["paths"], path
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    temperature = chat["properties"]["temperature"]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    assert chat["properties"]["n"]["maximum"] == 16
    assert set(schemas["CompletionRequest"]["properties"]) >= {"prompt", "echo", "best_of", "suffix", "logprobs",
                                                              "logit_bias", "stop_token_ids"}

    def refs(node):
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    for ref in refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def test_suffix_and_echo_with_logprobs_are_400s_naming_them(server):
    status, _, body = http_json("POST", server.url + COMP, {"prompt": "x", "suffix": "y"})
    assert_400_naming(status, body, "suffix")
    status, _, body = http_json("POST", server.url + COMP, {"prompt": "x", "echo": True, "logprobs": 1})
    assert_400_naming(status, body, "echo")
    for name, value in (("use_beam_search", True), ("prompt_logprobs", 1), ("include_stop_str_in_output", True),
                        ("bad_words", ["x"])):
        status, _, body = http_json("POST", server.url + COMP, {"prompt": "x", name: value})
        assert_400_naming(status, body, name)
        assert body["error"]["code"] == "unsupported_parameter"


def test_best_of_returns_the_candidates_of_highest_cumulative_logprob(server):
    base = {"prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "seed": 21, "ignore_eos": True}
    # the candidates best_of runs are the choices n runs (candidate j draws with seed + j)
    status, _, every = http_json("POST", server.url + COMP, {**base, "n": 4, "logprobs": 0})
    assert status == 200
    scored = sorted(every["choices"], key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    status, _, best = http_json("POST", server.url + COMP, {**base, "n": 2, "best_of": 4})
    assert status == 200
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in scored[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for: not shown
    assert best["usage"]["completion_tokens"] == 4 * 6  # every candidate ran
    status, _, body = http_json("POST", server.url + COMP, {**base, "best_of": 2, "stream": True})
    assert_400_naming(status, body, "best_of")
    status, _, body = http_json("POST", server.url + COMP, {**base, "best_of": 1, "n": 2})
    assert_400_naming(status, body, "best_of")


def _stream_text(server, path: str, body: dict) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(server.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [e.removeprefix("data: ") for e in resp.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_echo_repeats_the_prompt_streamed_or_not(server, tokenizer):
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True}
    status, _, plain = http_json("POST", server.url + COMP, {**base, "prompt": "The river", "echo": False})
    completion = plain["choices"][0]["text"]
    status, _, echoed = http_json("POST", server.url + COMP, {**base, "prompt": "The river"})
    assert status == 200 and echoed["choices"][0]["text"] == "The river" + completion
    ids = tokenizer.encode("The river")
    status, _, from_ids = http_json("POST", server.url + COMP, {**base, "prompt": ids})
    assert from_ids["choices"][0]["text"] == tokenizer.decode(ids) + completion
    chunks = _stream_text(server, COMP, {**base, "prompt": "The river"})
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The river" + completion


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, tokenizer):
    ids = tokenizer.encode("one two three four five six")
    base = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    status, _, cut = http_json("POST", server.url + COMP, {**base, "prompt": ids, "truncate_prompt_tokens": 3})
    status, _, tail = http_json("POST", server.url + COMP, {**base, "prompt": ids[-3:]})
    assert status == 200 and cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]


def test_chat_continue_final_message_and_echo(server, tokenizer):
    messages = [*USER, {"role": "assistant", "content": "Well, the"}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    status, _, tokens = http_json("POST", server.url + "/tokenize", {"messages": messages,
                                                                     "add_generation_prompt": False,
                                                                     "continue_final_message": True})
    assert status == 200 and tokenizer.decode(tokens["tokens"]).endswith("Well, the")
    status, _, plain = http_json("POST", server.url + CHAT, body)
    assert status == 200
    status, _, echoed = http_json("POST", server.url + CHAT, {**body, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == "Well, the" + plain["choices"][0]["message"]["content"]
    chunks = _stream_text(server, CHAT, {**body, "echo": True})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        echoed["choices"][0]["message"]["content"]
    status, _, answer = http_json("POST", server.url + CHAT, {**body, "add_generation_prompt": True})
    assert_400_naming(status, answer, "continue_final_message")


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(server, tokenizer):
    from server.protocol import TokenizeChatRequest, validate
    from server.serving_chat import render_chat

    template = "{{ greeting }}{% for m in messages %}|{{ m.content }}{% endfor %}"
    req = validate(TokenizeChatRequest, {"messages": USER, "chat_template_kwargs": {"greeting": "hello"}})
    assert render_chat(tokenizer, req, template) == "hello|hi"  # a variable no request field has
    status, _, body = http_json("POST", server.url + CHAT, {"messages": USER,
                                                           "chat_template_kwargs": {"tokenize": True}})
    assert_400_naming(status, body, "chat_template_kwargs.tokenize")
    status, _, body = http_json("POST", server.url + CHAT, {"messages": USER, "chat_template": "{{ 1 }}"})
    assert_400_naming(status, body, "chat_template")


def test_a_declared_length_over_the_limit_gets_413_at_once_though_no_body_comes(server):
    """A client that declares 10^12 bytes and sends none is answered from its header, not held until a timeout."""
    host, port = server.url.removeprefix("http://").split(":")
    began = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {COMP} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {10**12}\r\n\r\n".encode())
        head = sock.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413") and time.monotonic() - began < 5, head[:200]
    assert_still_serving(server)


def test_the_generation_configs_sampling_defaults_fill_what_a_request_leaves_out(server):
    """(vLLM's --generation-config: the model's generation_config.json, or --override-generation-config, as here.)
    A request that sets no temperature samples with the default's; one that sets it keeps its own; max_new_tokens
    caps every request's max_tokens."""
    engine = server.engine
    assert engine.sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}  # the default model's file

    def text(**fields) -> tuple[str, str, int]:
        status, _, body = http_json("POST", server.url + COMP, {"prompt": "Once upon", "ignore_eos": True, **fields})
        assert status == 200, body
        return body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]

    saved = engine.sampling_defaults
    try:
        greedy = text(max_tokens=8, temperature=0.0)
        engine.sampling_defaults = {"temperature": 0.0, "max_tokens": 3}
        defaulted = text(max_tokens=8, seed=1)[0]  # greedy by default, cut to 3 tokens
        assert defaulted == text(max_tokens=8, seed=2)[0] and greedy[0].startswith(defaulted) and defaulted
        sampled = {text(max_tokens=3, temperature=1.0, seed=seed)[0] for seed in range(4)}
        assert len(sampled) > 1  # the request's own temperature
        assert text(max_tokens=8, temperature=0.0)[1:] == ("length", 3)
        assert text()[1:] == ("length", 3)  # no max_tokens: the room left, capped
    finally:
        engine.sampling_defaults = saved
    wait_idle(server)
