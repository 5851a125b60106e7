"""The OpenAI-compatible routes through the official `openai` client: chat and completions, streaming and not,
every request field, exact usage, /invocations, /v1/models and the health probes.
"""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import MAX_MODEL_LEN, http_json, wait_idle

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def chat_prompt_len(tokenizer, messages, thinking: bool = False) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                             enable_thinking=thinking, return_dict=True)["input_ids"])


def test_health_ping_and_models(server, client):
    for path in ("/health", "/ping"):
        status, headers, _ = http_json("GET", server.url + path)
        assert status == 200 and headers["content-type"] == "application/json"
    models = client.models.list().data
    assert [m.id for m in models] == ["qwen-jax-test", "m"]  # the served names, the first the one responses carry
    assert all(m.model_extra["max_model_len"] == MAX_MODEL_LEN for m in models)


def test_an_unknown_model_name_is_404_and_every_served_name_works(server, client):
    """As vLLM: a request may name any served name (--served-model-name's list) or none; any other name is a 404
    on every route that takes one, with OpenAI's error body."""
    not_found = {"message": "The model `gpt-4o` does not exist.", "type": "invalid_request_error", "param": "model",
                 "code": "model_not_found"}
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/invocations", {"prompt": "Hi", "max_tokens": 2}),
                       ("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        status, _, reply = http_json("POST", server.url + path, {"model": "gpt-4o", **body})
        assert (status, reply) == (404, {"error": not_found}), path
    assert http_json("GET", server.url + "/v1/models/gpt-4o")[2] == {"error": not_found}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    for name in ("qwen-jax-test", "m", ""):  # "": none named
        r = client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert r.model == "qwen-jax-test" and r.usage.completion_tokens >= 1
    status, _, reply = http_json("POST", server.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200 and reply["model"] == "qwen-jax-test"
    status, _, card = http_json("GET", server.url + "/v1/models/m")
    assert status == 200 and card["id"] == "m" and card["root"] == "qwen-jax-test"


def test_chat_non_streaming_usage_is_exact(client, tokenizer):
    r = client.chat.completions.create(model="qwen-jax-test", messages=MESSAGES, max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == "qwen-jax-test" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and "<think>" not in choice.message.content
    assert r.usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens


def test_chat_streaming_matches_non_streaming_greedy(client, tokenizer):
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_prompts(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    r = client.completions.create(model="m", prompt=[ids, ids], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text
    assert r.usage.prompt_tokens == 2 * len(ids) and r.usage.completion_tokens == 10
    text = client.completions.create(model="m", prompt=["Once upon a time"], max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text.choices[0].text == r.choices[0].text  # the same prompt as text and as ids, greedy
    stream = client.completions.create(model="m", prompt=ids, max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 5


def test_every_chat_field_round_trip(client, tokenizer):
    body = dict(model="qwen-jax-test", messages=MESSAGES, max_completion_tokens=10, temperature=0.8, top_p=0.9, seed=7,
                stop=["zzzz", "\n\n\n"], n=3, logprobs=True, top_logprobs=3, presence_penalty=0.5,
                frequency_penalty=0.25,
                extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True,
                            "min_tokens": 2, "chat_template_kwargs": {"enable_thinking": False},
                            "some_unknown_field": {"x": 1}, "user": "tester"})
    first = client.chat.completions.create(**body)
    again = client.chat.completions.create(**body)
    assert len(first.choices) == 3 and sorted(c.index for c in first.choices) == [0, 1, 2]
    for a, b in zip(first.choices, again.choices):
        assert a.message.content == b.message.content  # seeded sampling is reproducible
        assert len(a.logprobs.content) == len(b.logprobs.content) <= 10
        for entry in a.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert "zzzz" not in a.message.content
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    assert first.usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)


def test_every_completion_field_round_trip(client):
    body = dict(model="m", prompt="The river", max_tokens=6, temperature=0.7, top_p=0.95, seed=11, stop="qqq",
                n=2, logprobs=2, presence_penalty=-0.5, frequency_penalty=0.5, echo=False,
                extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "ignore_eos": True,
                            "min_tokens": 6, "stop_token_ids": [0], "skip_special_tokens": True})
    first = client.completions.create(**body)
    again = client.completions.create(**body)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    for c in first.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) <= 6
        assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 1 for t in lp.top_logprobs)
        assert c.finish_reason in ("stop", "length")
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)


def test_stop_string_ends_generation(client):
    probe = client.completions.create(model="m", prompt="Hello", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = probe.choices[0].text
    if len(text) < 4:
        pytest.fail(f"greedy probe produced too little text to choose a stop string: {text!r}")
    stop = text[2:4]
    cut = client.completions.create(model="m", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].model_extra["stop_reason"] == stop


def test_invocations_accepts_chat_and_completion_bodies(server, tokenizer):
    status, headers, chat = http_json("POST", server.url + "/invocations",
                                      {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and headers["content-type"] == "application/json"
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 4
    assert "reasoning_content" not in chat["choices"][0]["message"]
    status, _, think = http_json("POST", server.url + "/invocations",
                                 {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, "thinking": True})
    assert status == 200 and "reasoning_content" in think["choices"][0]["message"]
    assert think["usage"]["prompt_tokens"] == chat_prompt_len(tokenizer, MESSAGES, thinking=True)
    status, _, comp = http_json("POST", server.url + "/invocations",
                                {"prompt": "abc", "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and comp["object"] == "text_completion" and comp["usage"]["completion_tokens"] == 3


def test_streaming_invocation_ends_with_done(server):
    import urllib.request

    req = urllib.request.Request(server.url + "/invocations", method="POST",
                                 data=json.dumps({"prompt": "abc", "max_tokens": 3, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    wait_idle(server)


def test_default_max_tokens_is_the_room_left_in_the_context(server, tokenizer):
    from server.protocol import CompletionRequest, validate
    from server.serving_completion import CompletionServing

    serving = CompletionServing(server.state)
    ids = tokenizer.encode("Once upon a time")
    req = validate(CompletionRequest, {"prompt": ids, "n": 2, "seed": 5})
    jobs = serving.jobs(req, serving.prompts(req))
    assert [j.params.max_tokens for j in jobs] == [MAX_MODEL_LEN - len(ids)] * 2
    assert [j.params.seed for j in jobs] == [5, 6]  # n > 1 fans out into distinct seeded requests
    req = validate(CompletionRequest, {"prompt": ids, "max_tokens": MAX_MODEL_LEN - len(ids)})
    exact = serving.jobs(req, serving.prompts(req))
    assert exact[0].params.max_tokens == MAX_MODEL_LEN - len(ids)
