"""Concurrency and resource release: 64 concurrent OpenAI-client requests with exact usage, 256 concurrent
connections, a bounded queue answering 503, and client disconnects that free the engine's slots.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import openai
from server_harness import MAX_NUM_SEQS, http_json, scrape, wait_idle


def test_64_concurrent_requests_all_answered_with_exact_usage(server, tokenizer):
    prompts = [f"Request number {i}: tell me about rivers" for i in range(64)]

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", timeout=180, max_retries=0)
        calls = []
        for i, prompt in enumerate(prompts):
            if i % 2:
                calls.append(client.completions.create(model="m", prompt=prompt, max_tokens=1 + i % 3,
                                                       temperature=0.5, seed=i, extra_body={"ignore_eos": True}))
            else:
                calls.append(client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": prompt}], max_tokens=1 + i % 3,
                    extra_body={"ignore_eos": True}))
        try:
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    results = asyncio.run(main())
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        if i % 2:
            expected_prompt = len(tokenizer.encode(prompt))
        else:
            expected_prompt = len(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                                add_generation_prompt=True, enable_thinking=False,
                                                                return_dict=True)["input_ids"])
        assert r.usage.prompt_tokens == expected_prompt, i
        assert r.usage.completion_tokens == 1 + i % 3, i
        assert r.choices[0].finish_reason == "length"
    wait_idle(server)


async def _raw_request(host: str, port: int, method: str, path: str, body: dict | None, timeout: float
                       ) -> tuple[int, bytes]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    data = json.dumps(body).encode() if body is not None else b""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout)
    writer.close()
    return int(raw.split(b" ", 2)[1]), raw


def test_256_concurrent_connections(server):
    host, port = server.url.removeprefix("http://").split(":")

    async def main() -> list:
        calls = []
        for i in range(256):
            if i % 8 == 0:
                calls.append(_raw_request(host, int(port), "POST", "/v1/completions",
                                          {"prompt": [1 + i % 50, 2, 3], "max_tokens": 2, "ignore_eos": True}, 180))
            elif i % 8 == 1:
                calls.append(_raw_request(host, int(port), "GET", "/v1/models", None, 180))
            else:
                calls.append(_raw_request(host, int(port), "GET", "/health", None, 180))
        return await asyncio.gather(*calls)

    results = asyncio.run(main())
    assert [status for status, _ in results] == [200] * 256
    completions = [json.loads(raw.split(b"\r\n\r\n", 1)[1]) for i, (_, raw) in enumerate(results) if i % 8 == 0]
    assert all(c["usage"]["completion_tokens"] == 2 for c in completions)
    wait_idle(server)


def _open_stream(server, body: dict) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _read_until(sock: socket.socket, marker: bytes, count: int) -> bytes:
    buf = b""
    while buf.count(marker) < count:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed early: {buf[-500:]!r}")
        buf += chunk
    return buf


def test_disconnect_mid_stream_aborts_and_frees_the_slot(server):
    wait_idle(server)
    before = server.call(server.engine.stats)
    aborts = ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "qwen-jax-test")))
    aborted_before = scrape(server.url).get(aborts, 0.0)
    body = {"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    socks = [_open_stream(server, body) for _ in range(3)]
    for sock in socks:
        head = _read_until(sock, b"data: ", 3)  # headers, the role chunk and some tokens
        assert b" 200 " in head.split(b"\r\n", 1)[0]
    for sock in socks:
        sock.close()
    stats = wait_idle(server)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["state_slots_used"] == 0 and stats["kv_blocks_used"] == 0
    generated = stats["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 3 * 200, "aborted requests ran to completion"
    assert scrape(server.url)[aborts] - aborted_before == 3  # counted as vLLM counts them
    code, _, data = http_json("POST", server.url + "/v1/completions",
                              {"prompt": "still alive", "max_tokens": 2, "ignore_eos": True})
    assert code == 200 and data["usage"]["completion_tokens"] == 2


def test_full_queue_answers_503_with_retry_after(server):
    wait_idle(server)
    config = server.state.config
    saved = config.max_queue_len
    config.max_queue_len = 0
    socks = []
    try:
        body = {"messages": [{"role": "user", "content": "hold"}], "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        socks = [_open_stream(server, body) for _ in range(MAX_NUM_SEQS)]
        for sock in socks:
            _read_until(sock, b"data: ", 1)
        code, headers, data = http_json("POST", server.url + "/v1/completions", {"prompt": "one more"})
        assert code == 503 and headers["retry-after"] == "1"
        assert data["error"]["code"] == "queue_full"
    finally:
        config.max_queue_len = saved
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 30
    while server.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    wait_idle(server)
    code, _, _ = http_json("POST", server.url + "/v1/completions", {"prompt": "after", "max_tokens": 1})
    assert code == 200
