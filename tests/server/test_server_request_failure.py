"""A request the engine fails on alone (RequestFailed, as the engine core reports a step that raised for it) gets an
HTTP 500 with an OpenAI error body, or an SSE error event then [DONE], while a request beside it is answered and the
server goes on serving. The failure is injected in the front's engine handle, for requests with a marked seed."""

from __future__ import annotations

import json
import threading
import urllib.request

from server_harness import http_json, wait_idle

from qwen_jax.outputs import RequestFailed

MARK = 424242


def sse_events(url: str, body: dict) -> list[str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return [e for e in resp.read().decode().split("\n\n") if e]


def test_a_request_failing_in_the_engine_gets_a_500_and_the_others_go_on(server, monkeypatch):
    generate = server.engine.generate

    async def failing_on_mark(prompt_ids, params, request_id):
        async for out in generate(prompt_ids, params, request_id):
            if params.seed == MARK and len(out.token_ids) >= 3:  # after the stream has begun
                raise RequestFailed("the engine failed on this request: OverflowError: injected")
            yield out

    monkeypatch.setattr(server.engine, "generate", failing_on_mark)
    url = server.url + "/v1/completions"
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    beside: list = []
    thread = threading.Thread(target=lambda: beside.append(http_json("POST", url, body)))
    thread.start()
    status, _, reply = http_json("POST", url, {**body, "seed": MARK})
    thread.join(120)
    assert status == 500 and reply["error"]["type"] == "server_error"
    assert "OverflowError: injected" in reply["error"]["message"]
    assert beside[0][0] == 200 and beside[0][2]["choices"][0]["finish_reason"] == "length"

    events = sse_events(url, {**body, "seed": MARK, "stream": True})
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])
    assert error["error"]["type"] == "server_error" and "injected" in error["error"]["message"]

    monkeypatch.undo()
    wait_idle(server)
    assert http_json("POST", url, body)[0] == 200
