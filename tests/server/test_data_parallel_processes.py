"""Data-parallel replicas as processes: with data_parallel_size 2 on one host the front runs one engine core process
per replica, each seeing only its own device, and routes each request to the least busy one. Greedy tokens are the
single-replica server's; requests spread over both; a replica whose process dies turns into errors for the requests
in flight, an unhealthy server and a non-zero exit, never a hang.
"""

from __future__ import annotations

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_harness import (
    ENGINE_ARGS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    START_TIMEOUT_S,
    ServerThread,
    free_port,
    http_json,
    server_command,
    stream_events,
    wait_for,
    wait_until_healthy,
)
from test_engine_death import DEATH_TIMEOUT_S, core_children, kill_and_watch_the_server_end

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "def f(x):", "Hello", "a b c d"]


@pytest.fixture(scope="module")
def two_replicas(default_model_dir, compilation_cache_dir):
    from qwen_jax.llm import AsyncLLM
    from server.app import ServerConfig, create_app

    engine = AsyncLLM.from_engine_args(default_model_dir, **ENGINE_ARGS, data_parallel_size=2,
                                       tensor_parallel_size=1)
    app = create_app(engine, ServerConfig(served_model_names=("dp2",), max_num_seqs=2 * MAX_NUM_SEQS))
    srv = ServerThread(app, "127.0.0.1", free_port())
    srv.engine = engine
    srv.start(START_TIMEOUT_S)
    yield srv
    srv.stop()


def completions(url: str, prompts: list[str], max_tokens: int = 12) -> list[str]:
    def one(prompt: str) -> str:
        status, _, body = http_json("POST", url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                                       "temperature": 0, "ignore_eos": True},
                                    timeout=120)
        assert status == 200, body
        return body["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_two_replica_processes_give_the_single_replica_tokens_and_share_the_requests(two_replicas, server):
    engine = two_replicas.engine
    assert len(engine._cores) == 2 and len({core.process.pid for core in engine._cores}) == 2
    # each core process sees one device (on the CPU: the host-platform device count the front sets for it)
    assert all(core.env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=1") for core in engine._cores)
    expected = completions(server.url, PROMPTS)
    assert completions(two_replicas.url, PROMPTS) == expected
    per_core = two_replicas.call(lambda: [dict(s) for s in engine._stats])
    assert all(s["generation_tokens_total"] >= 12 for s in per_core), per_core  # both replicas served requests
    total = two_replicas.call(engine.stats)
    assert total["generation_tokens_total"] == sum(s["generation_tokens_total"] for s in per_core)
    assert total["generation_tokens_total"] >= 12 * len(PROMPTS)
    assert two_replicas.call(lambda: engine._load) == [0, 0]


def test_a_dead_replica_process_fails_the_requests_and_the_server_exits_non_zero(tmp_path, default_model_dir,
                                                                               compilation_cache_dir):
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(server_command(port, default_model_dir, compilation_cache_dir, "-dp", "2", "-tp", "1",
                                                 "--graceful-timeout", str(2 * DEATH_TIMEOUT_S)),
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(server, f"http://127.0.0.1:{port}", log_path)
        cores = core_children(server.pid)
        assert len(cores) == 2, cores
        streams = []
        for prompt in ("a", "b"):  # one on each replica (the least busy takes the next request)
            events: list[str] = []
            first = threading.Event()
            body = {"prompt": prompt, "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "temperature": 0}
            thread = threading.Thread(target=stream_events, args=(f"http://127.0.0.1:{port}/v1/completions", body,
                                                                  events, first))
            thread.start()
            wait_for(first.is_set, 120, "the stream's first token")
            streams.append((thread, events))
        kill_and_watch_the_server_end(server, cores[1], streams, log_path)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
