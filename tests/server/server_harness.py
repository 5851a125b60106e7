"""Helpers of the server tests (no fixtures): constants, a tiny HTTP client, and a Hypercorn server thread.

Imported by name from the test modules, so they never depend on which directory's conftest was imported last.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import urllib.request

# 512 makes the smallest KV block-table bucket (max_model_len / block_size / 8 = 4 blocks) cover every sequence the
# tests run (< 64 tokens), so the engine compiles one table width: compilation is most of this suite's time.
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 4
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512,
                   enable_prefix_caching=True, dtype="float32", seed=0)
START_TIMEOUT_S = 180


def server_command(port: int, model_dir: str, compilation_cache_dir: str, *extra: str) -> list[str]:
    """`python -m server` on 127.0.0.1:port with the tests' engine arguments (run from the repository root)."""
    return [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--model", model_dir,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-num-batched-tokens", "512", "--dtype", "float32", "--seed", "0",
            "--compilation-cache-dir", compilation_cache_dir, *extra]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(method: str, url: str, body: object = None, headers: dict | None = None, timeout: float = 60
              ) -> tuple[int, dict, dict]:
    """(status, headers, decoded JSON body) of one request; 4xx/5xx are returned, not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, hdrs = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw, status, hdrs = exc.read(), exc.code, dict(exc.headers)
    return status, hdrs, json.loads(raw) if raw else {}


class ServerThread:
    """Hypercorn serving an app on its own event loop in a daemon thread."""

    def __init__(self, app, host: str, port: int):
        self.app = app
        self.url = f"http://{host}:{port}"
        self.bind = f"{host}:{port}"
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def _run(self) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        asyncio.set_event_loop(self.loop)
        config = Config()
        config.bind = [self.bind]
        config.backlog = 2048
        config.graceful_timeout = 5
        config.accesslog = None

        async def main() -> None:
            self.stop_event = asyncio.Event()
            await serve(self.app, config, shutdown_trigger=self.stop_event.wait)

        try:
            self.loop.run_until_complete(main())
        except BaseException as exc:  # reported by the fixture
            self.error = exc

    def start(self, timeout: float) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError(f"server thread died: {self.error!r}")
            try:
                status, _, body = http_json("GET", self.url + "/health", timeout=5)
                if status == 200:
                    return
                if "failed" in str(body.get("status")):
                    raise RuntimeError(f"engine failed to start: {body}")
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout} s")

    def call(self, fn, timeout: float = 30):
        """Run fn() on the server's loop (thread-safe access to the engine) and return its result."""
        async def wrap():
            return fn()
        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def stop(self) -> None:
        if self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(60)


def make_engine(model_dir: str):
    from qwen_jax.llm import AsyncLLM

    return AsyncLLM.from_engine_args(model_dir, launch=True, **ENGINE_ARGS)  # as the server builds it


def scrape(url: str) -> dict:
    """GET /metrics, parsed: (sample name, sorted label items) -> value (the `_created` timestamps left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if not s.name.endswith("_created")}


def wait_idle(srv: ServerThread, timeout: float = 30) -> dict:
    """Poll the engine until nothing runs or waits and no server request is in flight; returns the stats."""
    deadline = time.monotonic() + timeout
    stats = {}
    while time.monotonic() < deadline:
        stats = srv.call(srv.engine.stats)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and srv.state.in_flight == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine not idle after {timeout} s: {stats}, in flight {srv.state.in_flight}")


def stream_events(url: str, body: dict, events: list[str], first: threading.Event) -> None:
    """POST a streaming request and collect its SSE events as they come (`first` is set at the first text)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        for event in _events(resp):
            events.append(event)
            if event.startswith("data: {") and json.loads(event[6:]).get("choices", [{}])[0].get("text"):
                first.set()


def _events(resp):
    """The SSE events of a response, each as soon as it has arrived whole."""
    buffer = b""
    while chunk := resp.read1(65536):
        *done, buffer = (buffer + chunk).split(b"\n\n")
        yield from (e.decode() for e in done if e)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def wait_until_healthy(server, url: str, log_path) -> None:
    """Wait for a `python -m server` subprocess to answer /health 200; its log is the error if it exits first."""

    def healthy() -> bool:
        assert server.poll() is None, log_path.read_text()
        try:
            return http_json("GET", url + "/health", timeout=5)[0] == 200
        except OSError:
            return False

    wait_for(healthy, START_TIMEOUT_S, "the server to start")
