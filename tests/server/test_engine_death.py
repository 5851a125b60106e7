"""A dead engine core turns into errors and an unhealthy server, never a hang: the requests in flight fail (HTTP 500
with an OpenAI error body, or an SSE error event then [DONE]), /health answers 500 with the cause, new requests are
refused at once, and `python -m server` exits non-zero so that a supervisor restarts it.

Each test starts a server of its own on the default model (the session's server must outlive them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from server_harness import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    START_TIMEOUT_S,
    ServerThread,
    free_port,
    http_json,
    make_engine,
    server_command,
    stream_events,
    wait_for,
    wait_until_healthy,
)

REPO = Path(__file__).resolve().parents[2]
DEATH_TIMEOUT_S = 30  # from the kill to every request answered and the server process gone
# Tens of seconds of decoding on the CPU: still running when the core is killed.
LONG = dict(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True, temperature=0)


@pytest.fixture
def doomed(default_model_dir, compilation_cache_dir):
    """A server whose engine core the test kills."""
    from server.app import ServerConfig, create_app

    engine = make_engine(default_model_dir)
    app = create_app(engine, ServerConfig(served_model_names=("doomed",), max_num_seqs=MAX_NUM_SEQS))
    srv = ServerThread(app, "127.0.0.1", free_port())
    srv.engine = engine
    srv.start(START_TIMEOUT_S)
    yield srv
    srv.stop()


def test_killed_core_fails_requests_in_flight_and_new_ones_and_health_turns_500(doomed):
    url = doomed.url + "/v1/completions"
    events: list[str] = []
    first = threading.Event()
    replies: list[tuple] = []
    streamer = threading.Thread(target=stream_events, args=(url, {"prompt": "a", **LONG}, events, first))
    waiter = threading.Thread(target=lambda: replies.append(http_json("POST", url, {"prompt": "b", **LONG},
                                                                      timeout=120)))
    streamer.start()
    wait_for(first.is_set, 120, "the stream's first token")
    waiter.start()
    wait_for(lambda: doomed.call(doomed.engine.stats)["num_running"] == 2, 120, "both requests running")

    killed = time.monotonic()
    doomed.engine._cores[0].process.kill()
    # At once, before the front has noticed: refused or failed, never left waiting on the dead core.
    cause = "the engine core process exited with code -9"
    dead = {"message": f"the engine core died: {cause}", "type": "server_error", "param": None, "code": None}
    status, _, body = http_json("POST", url, {"prompt": "c", **LONG}, timeout=DEATH_TIMEOUT_S)
    assert (status, body) == (500, {"error": dead})
    streamer.join(DEATH_TIMEOUT_S)
    waiter.join(DEATH_TIMEOUT_S)
    assert not streamer.is_alive() and not waiter.is_alive()
    assert time.monotonic() - killed < DEATH_TIMEOUT_S

    status, _, body = replies[0]
    assert (status, body) == (500, {"error": dead})
    # The stream had tokens, then one error event, then [DONE].
    assert first.is_set() and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):]) == {"error": dead}
    assert all("error" not in json.loads(e[6:]) for e in events[:-2])

    status, _, body = http_json("GET", doomed.url + "/health")
    assert (status, body) == (500, {"status": f"engine failed: {cause}"})
    status, _, body = http_json("POST", url, {"prompt": "d", "max_tokens": 4}, timeout=DEATH_TIMEOUT_S)
    assert (status, body) == (500, {"error": dead})


def test_message_to_a_dead_core_returns_at_once(tmp_path):
    """The front's pipe to a core that is gone has no reader: a send must not wait for one (it would block the event
    loop before the front has noticed the death, and with it the failure of every request)."""
    from qwen_jax.engine.core_client import CoreProcess

    messages: list[tuple] = []
    core = CoreProcess(str(tmp_path / "no-such-model"), {}, "minimal", messages.append)
    core.process.join(120)
    wait_for(lambda: messages, 10, "the core's last message")
    assert messages[0][0] == "failed" and "no-such-model" in messages[0][1]
    time.sleep(0.5)  # the pipe's I/O thread drops the dead peer
    sender = threading.Thread(target=core.send, args=(("abort", ["r"]),), daemon=True)
    sender.start()
    sender.join(5)
    assert not sender.is_alive()
    core.close()


def core_children(pid: int) -> list[int]:
    """The multiprocessing spawn children of process `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().decode()
        except (OSError, ValueError):
            continue
        if ppid == pid and "spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def kill_and_watch_the_server_end(server: subprocess.Popen, core: int, streams: list, log_path: Path) -> str:
    """Kill engine core process `core` of `python -m server` process `server`: the server exits 1 within
    DEATH_TIMEOUT_S, every stream (thread, its SSE events) ends with an error event and [DONE], and the log says why
    it stopped (returned)."""
    os.kill(core, signal.SIGKILL)
    assert server.wait(DEATH_TIMEOUT_S) == 1
    for thread, events in streams:
        thread.join(DEATH_TIMEOUT_S)
        assert not thread.is_alive()
        assert json.loads(events[-2][len("data: "):])["error"]["type"] == "server_error"
        assert events[-1] == "data: [DONE]"
    text = log_path.read_text()
    assert "shutting down: the engine core died" in text and "server stopped" in text, text
    return text


def test_server_process_exits_non_zero_when_its_engine_core_is_killed(tmp_path, default_model_dir,
                                                                       compilation_cache_dir):
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            # A request left hanging would hold the exit past DEATH_TIMEOUT_S.
            server_command(port, default_model_dir, compilation_cache_dir, "--graceful-timeout",
                           str(2 * DEATH_TIMEOUT_S)), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(server, f"http://127.0.0.1:{port}", log_path)
        events: list[str] = []
        first = threading.Event()
        streamer = threading.Thread(target=stream_events, args=(
            f"http://127.0.0.1:{port}/v1/completions", {"prompt": "a", **LONG}, events, first))
        streamer.start()
        wait_for(first.is_set, 120, "the stream's first token")
        cores = core_children(server.pid)
        assert len(cores) == 1, cores
        text = kill_and_watch_the_server_end(server, cores[0], [(streamer, events)], log_path)
        assert "shutting down: the engine core died (the engine core process exited with code -9)" in text, text
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
