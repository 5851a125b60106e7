"""Bad requests: each of 60+ malformed bodies is answered 4xx with the OpenAI error body, and the server stays
healthy and correct afterwards.
"""

from __future__ import annotations

import pytest
from server_harness import MAX_MODEL_LEN, http_json, wait_idle

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": "m", "messages": USER, "max_tokens": 4, **fields}


def comp(**fields) -> dict:
    return {"model": "m", "prompt": "hi", "max_tokens": 4, **fields}


CASES = [
    ("invalid json", CHAT, b"{bad json", 400),
    ("empty body", CHAT, b"", 400),
    ("json array", CHAT, b"[1, 2]", 400),
    ("json string", COMP, b'"hello"', 400),
    ("json null", COMP, b"null", 400),
    ("deeply nested", CHAT, b"[" * 50000 + b"]" * 50000, 400),
    ("nan temperature", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    ("infinite top_p", COMP, b'{"prompt": "hi", "top_p": Infinity}', 400),
    ("not utf-8", CHAT, b'{"messages": "\xff\xfe"}', 400),
    ("missing messages", CHAT, {"model": "m"}, 400),
    ("messages not a list", CHAT, {"messages": "hi"}, 400),
    ("messages empty", CHAT, {"messages": []}, 400),
    ("message not an object", CHAT, {"messages": ["hi"]}, 400),
    ("role missing", CHAT, {"messages": [{"content": "hi"}]}, 400),
    ("role unknown", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("content a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("content image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
    ("no user message", CHAT, {"messages": [{"role": "system", "content": "x"}]}, 400),
    ("system not first", CHAT, {"messages": [*USER, {"role": "system", "content": "x"}]}, 400),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400),
    ("max_tokens negative", COMP, comp(max_tokens=-5), 400),
    ("max_tokens string", CHAT, chat(max_tokens="10"), 400),
    ("max_tokens fractional", COMP, comp(max_tokens=1.5), 400),
    ("max_tokens bool", CHAT, chat(max_tokens=True), 400),
    ("max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), 400),
    ("max_tokens over context", COMP, comp(max_tokens=MAX_MODEL_LEN), 400),
    ("prompt over context", CHAT, chat(messages=[{"role": "user", "content": "word " * 700}]), 400),
    ("prompt fills context", COMP, {"prompt": [5] * MAX_MODEL_LEN}, 400),
    ("temperature negative", CHAT, chat(temperature=-1), 400),
    ("temperature too high", COMP, comp(temperature=3), 400),
    ("temperature string", CHAT, chat(temperature="hot"), 400),
    ("top_p zero", CHAT, chat(top_p=0), 400),
    ("top_p above one", COMP, comp(top_p=1.5), 400),
    ("top_k below -1", CHAT, chat(top_k=-2), 400),
    ("top_k fractional", COMP, comp(top_k=1.5), 400),
    ("min_p above one", CHAT, chat(min_p=2), 400),
    ("presence_penalty too big", CHAT, chat(presence_penalty=5), 400),
    ("frequency_penalty too small", COMP, comp(frequency_penalty=-3), 400),
    ("repetition_penalty zero", CHAT, chat(repetition_penalty=0), 400),
    ("seed string", CHAT, chat(seed="x"), 400),
    ("seed huge", COMP, comp(seed=2 ** 70), 400),
    ("stop a number", CHAT, chat(stop=5), 400),
    ("stop list of numbers", COMP, comp(stop=[1, 2]), 400),
    ("stop empty string", CHAT, chat(stop=[""]), 400),
    ("stop too many", COMP, comp(stop=[f"s{i}" for i in range(17)]), 400),
    ("stop_token_ids negative", CHAT, chat(stop_token_ids=[-1]), 400),
    ("n zero", CHAT, chat(n=0), 400),
    ("n too large", COMP, comp(n=17), 400),
    ("n string", CHAT, chat(n="2"), 400),
    ("logprobs string", CHAT, chat(logprobs="yes"), 400),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=21), 400),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400),
    ("completion logprobs too many", COMP, comp(logprobs=21), 400),
    ("completion logprobs bool", COMP, comp(logprobs=True), 400),
    ("stream string", CHAT, chat(stream="yes"), 400),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400),
    ("stream_options not an object", COMP, comp(stream=True, stream_options=[1]), 400),
    ("include_usage string", COMP, comp(stream=True, stream_options={"include_usage": "y"}), 400),
    ("chat_template_kwargs not an object", CHAT, chat(chat_template_kwargs="x"), 400),
    ("enable_thinking string", CHAT, chat(chat_template_kwargs={"enable_thinking": "yes"}), 400),
    ("min_tokens above max_tokens", CHAT, chat(min_tokens=10), 400),
    ("min_tokens negative", COMP, comp(min_tokens=-1), 400),
    ("ignore_eos string", CHAT, chat(ignore_eos="no"), 400),
    ("model a number", CHAT, chat(model=123), 400),
    ("missing prompt", COMP, {"model": "m"}, 400),
    ("prompt a number", COMP, comp(prompt=123), 400),
    ("prompt empty list", COMP, comp(prompt=[]), 400),
    ("prompt empty string", COMP, comp(prompt=""), 400),
    ("prompt empty token list", COMP, comp(prompt=[[]]), 400),
    ("prompt mixed types", COMP, comp(prompt=["a", 1]), 400),
    ("prompt token id too large", COMP, comp(prompt=[10 ** 9]), 400),
    ("prompt token id negative", COMP, comp(prompt=[-1]), 400),
    ("prompt of objects", COMP, comp(prompt=[{"a": 1}]), 400),
    ("invocations without prompt or messages", "/invocations", {"max_tokens": 3}, 400),
    ("invocations bad thinking", "/invocations", {"messages": USER, "thinking": "on"}, 400),
    ("tokenize bad messages", "/tokenize", {"messages": 3}, 400),
    ("body too large", COMP, comp(prompt="x" * 300_000), 413),
    ("unknown route", "/v1/nothing", {"a": 1}, 404),
]


@pytest.mark.parametrize("name,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_is_a_4xx_with_an_error_body(server, name, path, body, status):
    code, headers, data = http_json("POST", server.url + path, body)
    assert code == status, data
    assert headers["content-type"] == "application/json"
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"


def test_wrong_method_is_405_with_an_error_body(server):
    code, _, data = http_json("GET", server.url + CHAT)
    assert code == 405 and data["error"]["message"]


def test_context_error_names_the_lengths(server):
    code, _, data = http_json("POST", server.url + COMP, comp(prompt=[5] * 10, max_tokens=MAX_MODEL_LEN - 9))
    assert code == 400 and data["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN}" in data["error"]["message"]
    assert "10 in the prompt" in data["error"]["message"]


def test_server_is_healthy_and_correct_after_bad_input(server):
    for body in (b"{", b"[" * 1000, b'{"prompt": "x", "n": 99}'):
        http_json("POST", server.url + COMP, body)
    assert http_json("GET", server.url + "/health")[0] == 200
    code, _, data = http_json("POST", server.url + COMP, comp(max_tokens=3, ignore_eos=True))
    assert code == 200 and data["usage"]["completion_tokens"] == 3
    stats = wait_idle(server)
    assert stats["num_running"] == 0
