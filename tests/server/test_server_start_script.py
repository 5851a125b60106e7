"""start.sh end to end on the default model: starts the server in the background, returns once /health is 200,
enforces --api-key, drains a running stream on `--stop` (SIGTERM), reports a failed start with the log tail and keeps
the previous start's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.request

from server_harness import MAX_MODEL_LEN, MAX_NUM_SEQS, free_port, http_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "start.sh")


def script_env(tmp_path, cache_root: str) -> dict:
    return dict(os.environ, QWEN_JAX_LOG=str(tmp_path / "server.log"), QWEN_JAX_PID_FILE=str(tmp_path / "server.pid"),
                QWEN_JAX_CACHE_DIR=cache_root, QWEN_JAX_START_TIMEOUT="240", QWEN_JAX_STOP_TIMEOUT="30")


def test_start_script_serves_the_default_model_with_an_api_key_and_stops_gracefully(
        tmp_path, default_model_dir, compilation_cache_dir):
    port = free_port()
    env = script_env(tmp_path, os.path.dirname(default_model_dir))
    args = [SCRIPT, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", "512", "--enable-prefix-caching",
            "--dtype", "float32", "--seed", "0", "--api-key", "s3cret", "--served-model-name", "tiny",
            "--compilation-cache-dir", compilation_cache_dir, "--graceful-timeout", "20"]
    started = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    log = (tmp_path / "server.log").read_text() if (tmp_path / "server.log").exists() else ""
    assert started.returncode == 0, started.stdout + started.stderr + log
    pid = int((tmp_path / "server.pid").read_text())
    url = f"http://127.0.0.1:{port}"
    try:
        assert http_json("GET", url + "/health")[0] == 200
        code, _, data = http_json("GET", url + "/v1/models")
        assert code == 401 and data["error"]["type"] == "authentication_error"
        code, _, _ = http_json("GET", url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert code == 401
        auth = {"Authorization": "Bearer s3cret"}
        code, _, data = http_json("GET", url + "/v1/models", headers=auth)
        assert code == 200 and data["data"][0]["id"] == "tiny"
        code, _, data = http_json("POST", url + "/v1/chat/completions", headers=auth, body={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True})
        assert code == 200 and data["usage"]["completion_tokens"] == 3 and data["model"] == "tiny"
        assert "no --model given" in (tmp_path / "server.log").read_text()

        # A stream running when --stop sends SIGTERM is finished (or ended at the graceful timeout) and closed
        # with [DONE].
        events: list[str] = []
        first = threading.Event()

        def consume() -> None:
            req = urllib.request.Request(url + "/v1/completions", method="POST", headers={
                **auth, "Content-Type": "application/json"}, data=json.dumps({
                    "prompt": "long", "max_tokens": 40, "ignore_eos": True, "stream": True}).encode())
            with urllib.request.urlopen(req, timeout=120) as resp:
                raw = resp.read1(65536)  # the answer starts once the request runs
                first.set()
                raw += resp.read()
            events.extend(e for e in raw.decode().split("\n\n") if e)

        reader = threading.Thread(target=consume)
        reader.start()
        assert first.wait(60)
    finally:
        stopped = subprocess.run([SCRIPT, "--stop"], env=env, capture_output=True, text=True, timeout=120)
    reader.join(60)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert events and events[-1] == "data: [DONE]"
    assert "server stopped" in (tmp_path / "server.log").read_text()
    assert not (tmp_path / "server.pid").exists()


def test_start_script_reports_a_failed_start_with_the_log_tail_and_keeps_the_last_log(tmp_path, default_model_dir):
    env = script_env(tmp_path, os.path.dirname(default_model_dir))
    for name in ("no-such-model", "nor-this-one"):
        result = subprocess.run([SCRIPT, "--host", "127.0.0.1", "--port", str(free_port()), "--model",
                                 str(tmp_path / name), "--compilation-cache-dir", "none"], env=env, capture_output=True,
                                text=True, timeout=240)
        assert result.returncode == 1
        assert "exited during start-up" in result.stderr and name in result.stderr
        assert not (tmp_path / "server.pid").exists()
    # each start writes a new log; the one before is kept as server.log.1
    assert "nor-this-one" in (tmp_path / "server.log").read_text()
    kept = (tmp_path / "server.log.1").read_text()
    assert "no-such-model" in kept and "nor-this-one" not in kept
    stop = subprocess.run([SCRIPT, "--stop"], env=env, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and "no running server" in stop.stdout
