"""SIGTERM drains `python -m server`: requests not started yet, and new ones, get 503 with an error body; running
requests finish within --graceful-timeout or are ended properly (a 503 error body, or an SSE error event then
[DONE]); the process exits 0 with no traceback in its log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from server_harness import (
    MAX_NUM_SEQS,
    free_port,
    http_json,
    server_command,
    wait_for,
    wait_until_healthy,
)

REPO = Path(__file__).resolve().parents[2]
# The short requests' dozen steps, counted from their first token, end well within it on a loaded 2-core machine
# (4 rows took up to 0.5 s a step on an idle one; 2 CPU-bound processes beside it can triple that).
GRACE_S = 30
# This test's sequences may be this long: thousands of decode steps, still running at the graceful timeout on a fast
# idle CPU (20 ms a step there: 80 s).
LONG_MODEL_LEN = 4096
LONG = {"max_tokens": LONG_MODEL_LEN - 16, "ignore_eos": True, "temperature": 0}
SHORT = {"max_tokens": 12, "ignore_eos": True}


def post(url: str, body: dict, answers: dict, name: str, started: threading.Event | None = None) -> None:
    """POST and keep (status, JSON body) or, for a stream, (status, its SSE events). `started` is set once the
    answer begins: a stream's begins with its first token."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            if started is not None:
                started.set()
            raw = resp.read().decode()
            events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
            answers[name] = (resp.status, events if body.get("stream") else json.loads(raw))
    except urllib.error.HTTPError as exc:
        answers[name] = (exc.code, json.loads(exc.read()))


def engine_counts(url: str) -> tuple[float, float]:
    """(running, waiting) engine requests, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return found["vllm:num_requests_running"], found["vllm:num_requests_waiting"]


def assert_shutdown_error(status: int, body: dict) -> None:
    assert status == 503, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "shutting_down" and body["error"]["type"] == "service_unavailable"


def test_sigterm_refuses_queued_requests_and_finishes_or_ends_running_ones_cleanly(
        tmp_path, default_model_dir, compilation_cache_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(server_command(port, default_model_dir, compilation_cache_dir,
                                                 "--graceful-timeout", str(GRACE_S),
                                                 "--max-model-len", str(LONG_MODEL_LEN)),
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    answers: dict[str, tuple] = {}
    threads: list[threading.Thread] = []

    def send(name: str, path: str, body: dict, started: threading.Event | None = None) -> None:
        thread = threading.Thread(target=post, args=(url + path, body, answers, name, started))
        thread.start()
        threads.append(thread)

    try:
        wait_until_healthy(server, url, log_path)
        comp, chat = "/v1/completions", "/v1/chat/completions"
        send("long stream", comp, {"prompt": "a", "stream": True, **LONG})
        send("long", comp, {"prompt": "b", **LONG})
        send("short", comp, {"prompt": "d", **SHORT})
        wait_for(lambda: engine_counts(url)[0] == 3, 120, "three requests running")
        # The last one in is the last to start: once its first token is out, all four run (none is refused as not
        # started), however slowly this machine runs them.
        short_stream_started = threading.Event()
        send("short stream", chat, {"messages": [{"role": "user", "content": "c"}], "stream": True, **SHORT},
             short_stream_started)
        assert short_stream_started.wait(120), "the short stream's first token did not come"
        wait_for(lambda: engine_counts(url)[0] == MAX_NUM_SEQS, 60, "four requests running")
        send("queued stream", comp, {"prompt": "e", "stream": True, **SHORT})
        send("queued", comp, {"prompt": "f", **SHORT})
        send("queued chat", chat, {"messages": [{"role": "user", "content": "g"}], **SHORT})
        wait_for(lambda: engine_counts(url)[1] == 3, 60, "three requests queued")

        server.send_signal(signal.SIGTERM)
        wait_for(lambda: http_json("GET", url + "/health", timeout=5)[0] == 503, 10, "/health to turn 503")
        status, _, body = http_json("POST", url + comp, {"prompt": "late", **SHORT})
        assert_shutdown_error(status, body)
        assert server.wait(GRACE_S + 60) == 0
        for thread in threads:
            thread.join(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()

    for name in ("queued stream", "queued", "queued chat"):  # never started: refused before any byte of an answer
        assert_shutdown_error(*answers[name])
    status, body = answers["short"]
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    status, events = answers["short stream"]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert_shutdown_error(*answers["long"])  # running past the graceful timeout: ended with an error body
    status, events = answers["long stream"]
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "graceful timeout" in error["message"]
    tokens = [json.loads(e) for e in events[:-2]]
    assert tokens and all(t["choices"][0]["finish_reason"] is None for t in tokens)
    text = log_path.read_text()
    assert "Traceback" not in text, text
    assert "SIGTERM: draining" in text and "server stopped" in text
    assert not os.path.exists(f"/proc/{server.pid}") or open(f"/proc/{server.pid}/stat").read().split()[2] == "Z"
