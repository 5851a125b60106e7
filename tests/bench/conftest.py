"""A tiny fake OpenAI-compatible server (Quart on hypercorn, in the test's own event loop), the real tokenizer, and
the tiny hybrid model with an MTP head.

The fake streams one known token per chunk at a fixed pace, so client timings and counts can be asserted exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config
from quart import Quart, Response, request
from support import shared_data
from tiny_models import add_copy_mtp_head, build_hybrid

from qwen_jax.bench.serve import load_tokenizer

TOKENIZER_DIR = str(shared_data("qwen3_5_tokenizer"))
WORDS = (" hello", " world", " the", " cat")  # each one Qwen3.5 token, and they never merge with each other


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(TOKENIZER_DIR)


def arithmetic_reply(messages: list[dict]) -> str:
    """Answers the serve benchmark's spot checks correctly."""
    a, b = re.search(r"What is (\d+) \+ (\d+)\?", messages[-1]["content"]).groups()
    return str(int(a) + int(b))


def make_app(tokenizer, behaviour: dict) -> Quart:
    """behaviour: first_delay and token_delay (s), completion_usage_offset (lie in usage), fail_every (HTTP 500
    for every n-th completion), chat (messages -> reply); `behaviour["log"]` collects request bodies."""
    app = Quart(__name__)
    counter = {"n": 0}

    @app.post("/v1/completions")
    async def completions():
        body = await request.get_json()
        behaviour.setdefault("log", []).append(body)
        counter["n"] += 1
        if behaviour.get("fail_every") and counter["n"] % behaviour["fail_every"] == 0:
            return {"error": {"message": "injected failure"}}, 500
        prompt_tokens = len(tokenizer.encode(body["prompt"], add_special_tokens=False))
        n = body["max_tokens"]

        async def stream() -> AsyncIterator[bytes]:
            behaviour["in_flight"] = behaviour.get("in_flight", 0) + 1
            behaviour["max_in_flight"] = max(behaviour.get("max_in_flight", 0), behaviour["in_flight"])
            try:
                await asyncio.sleep(behaviour.get("first_delay", 0.0))
                for i in range(n):
                    if i:
                        await asyncio.sleep(behaviour.get("token_delay", 0.0))
                    choice = {"index": 0, "text": WORDS[i % 4]}
                    yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n".encode()
                completion = n + behaviour.get("completion_usage_offset", 0)
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                behaviour["in_flight"] -= 1

        return Response(stream(), content_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat():
        body = await request.get_json()
        behaviour.setdefault("chat_log", []).append(body)
        reply = behaviour.get("chat", arithmetic_reply)(body["messages"])
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}

    return app


@contextlib.asynccontextmanager
async def running_fake_server(tokenizer, **behaviour) -> AsyncIterator[tuple[str, dict]]:
    """Serve the fake on a free 127.0.0.1 port inside the running loop; yields (base_url, behaviour)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    config.errorlog = None
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(make_app(tokenizer, behaviour), config, shutdown_trigger=shutdown.wait))
    deadline = time.monotonic() + 10
    while True:  # wait until hypercorn accepts connections
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            if time.monotonic() > deadline or task.done():
                raise
            await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", behaviour
    finally:
        shutdown.set()
        await asyncio.wait_for(task, 10)
        sock.detach()  # hypercorn adopted the descriptor and has closed it


@contextlib.contextmanager
def threaded_fake_server(tokenizer, **behaviour) -> Iterator[tuple[str, dict]]:
    """The same server on its own event loop in a background thread, for synchronous clients."""
    ready: queue.Queue = queue.Queue()
    stop = threading.Event()

    async def run() -> None:
        async with running_fake_server(tokenizer, **behaviour) as served:
            ready.put(served)
            while not stop.is_set():
                await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    try:
        yield ready.get(timeout=30)
    finally:
        stop.set()
        thread.join(30)


@pytest.fixture
def fake_server() -> Callable:
    """An async context manager: `async with fake_server(tokenizer, **behaviour) as (base_url, behaviour)`."""
    return running_fake_server


@pytest.fixture
def threaded_server() -> Callable:
    """A context manager: `with threaded_server(tokenizer, **behaviour) as (base_url, behaviour)`."""
    return threaded_fake_server


@pytest.fixture(scope="session")
def hybrid_mtp_dir(tmp_path_factory) -> str:
    """The engine tests' tiny hybrid Qwen3.5-MoE (float32, the default model's tokenizer) with a head that drafts
    often right (tests/tiny_models.py)."""
    root = tmp_path_factory.mktemp("bench_models")
    build_hybrid(root / "hybrid")
    return add_copy_mtp_head(root / "hybrid", root / "hybrid_mtp")
