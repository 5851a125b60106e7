"""Multi-host serving: two processes x 4 CPU devices (gloo) serve one TP 8 model; host 0 alone schedules and sends
each step's ops to host 1, which runs them until host 0 stops. The greedy tokens equal one process on one device.
Also the real server entry point on two hosts: host 0 answers HTTP, host 1 listens nowhere and exits with host 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from sharding_hosts import HERE, ROOT, free_port, host_env
from sharding_serving_worker import DRIVE_ISSUED, DRIVE_STEPS, ENGINE_ARGS, drive, drive_replicas

from qwen_jax.engine import multihost, step
from qwen_jax.engine.core import EngineCore

TIMEOUT_S = 240


def _start(args: list[str], devices: int, log) -> subprocess.Popen:
    """A host process writing its output to the file `log` (a pipe nobody reads while it runs could fill up)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=host_env(devices), stdout=out,
                                stderr=subprocess.STDOUT)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process; those still running `timeout` seconds from now are killed."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _failure(procs: list[subprocess.Popen], logs: list) -> str:
    return f"exit codes {[p.returncode for p in procs]}\n" + "\n".join(
        f"--- host {i}:\n{log.read_text(errors='replace')[-2500:]}" for i, log in enumerate(logs))


def test_a_steps_ops_round_trip_through_the_wire():
    """A step's ops (as ModelRunner.prepare writes them) go to the other hosts as (kind, *fields) tuples packed into
    bytes, and come back as the same typed ops: their arrays, values and layouts (JSON lists on the wire)."""
    buffer, layout = step.pack({"tokens": np.arange(6, dtype=np.int32), "valid": np.array([True, False])})
    sampling, sampling_layout = step.pack({"temperature": np.array([0.5, 0.0], np.float32),
                                           "seeds": np.array([7, 1], np.uint32)})
    ops = [step.RestoreSnapshots(np.array([3, 0], np.int32), np.array([1, 0], np.int32)),
           step.Forward(buffer, layout, sampling, sampling_layout, 1, 20, head=True, behind=False),
           step.SaveSnapshots(np.array([1], np.int32), np.array([2], np.int32)),
           step.CompileBuckets([1, 64])]
    wire = [step.to_wire(op) for op in ops]
    assert [item[0] for item in wire] == ["restore", "step", "save", "compile"]
    assert wire[1][5:] == (1, 20, True, False)  # kind, inputs, layout, sampling, sampling layout, then these
    back = [step.from_wire(item) for item in multihost.unpack(multihost.pack(wire))]
    assert [type(op) for op in back] == [type(op) for op in ops]
    forward = back[1]
    assert (forward.layout, forward.sampling_layout) == (layout, sampling_layout)
    assert (forward.path, forward.top, forward.head, forward.behind) == (1, 20, True, False)
    assert back[3].sizes == [1, 64]
    for got, want in zip(_leaves(wire), _leaves([step.to_wire(op) for op in back]), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    with pytest.raises(ValueError, match="unknown step op 'jump'"):
        step.from_wire(["jump", 1])


def _leaves(tree) -> list[np.ndarray]:
    if isinstance(tree, np.ndarray):
        return [tree]
    if isinstance(tree, dict):
        return [a for v in tree.values() for a in _leaves(v)]
    if isinstance(tree, list | tuple):
        return [a for v in tree for a in _leaves(v)]
    return []


def _write_tiny_checkpoint(directory) -> str:
    """The tiny hybrid MoE as an HF directory: its config and random weights under the HF names."""
    from safetensors.numpy import save_file
    from sharding_tiny_models import TINY_CONFIGS

    from qwen_jax.default_model import hf_tensors

    directory.mkdir()
    config = TINY_CONFIGS["qwen3_5_moe"]
    (directory / "config.json").write_text(json.dumps(config))
    save_file(hf_tensors(config["text_config"], seed=0), str(directory / "model.safetensors"))
    return str(directory)


def test_two_hosts_serve_the_single_host_greedy_tokens(tmp_path):
    model_dir = _write_tiny_checkpoint(tmp_path / "tiny_moe")
    port = free_port()
    outs = [tmp_path / f"host{i}.json" for i in range(2)]
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    start = time.perf_counter()
    procs = [_start([os.path.join(HERE, "sharding_serving_worker.py"), str(i), str(port), model_dir, str(outs[i]),
                     "1"], 4, logs[i]) for i in range(2)]
    _wait_all(procs, TIMEOUT_S)
    assert [p.returncode for p in procs] == [0, 0], _failure(procs, logs)
    leader, follower = (json.loads(o.read_text()) for o in outs)
    print(f"2 hosts: {time.perf_counter() - start:.1f} s; {leader['messages']} messages, {leader['bytes']} bytes, "
          f"{1e3 * leader['send_seconds'] / leader['messages']:.2f} ms to send one")
    # One message per step issued, received and run by host 1; step() calls that only read a step back send none.
    assert leader["messages"] == follower["steps"] == DRIVE_ISSUED and leader["steps"] == DRIVE_STEPS

    reference, steps = drive(EngineCore(model_dir, **ENGINE_ARGS))
    assert steps == leader["steps"]
    assert leader["tokens"] == reference


def test_data_parallel_replicas_on_two_hosts_give_the_single_host_greedy_tokens(tmp_path):
    """DP 4 x TP 2 over 2 processes x 4 CPU devices: replicas 0 and 1 on host 0, 2 and 3 on host 1. Host 0 schedules
    all four; it runs 0 and 1 itself and sends the steps of 2 and 3 to host 1, which runs them on two threads and
    sends their sampled tokens back. Each replica serves one of 4 concurrent requests, with the one-process tokens."""
    model_dir = _write_tiny_checkpoint(tmp_path / "tiny_moe")
    port = free_port()
    outs = [tmp_path / f"host{i}.json" for i in range(2)]
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    procs = [_start([os.path.join(HERE, "sharding_serving_worker.py"), str(i), str(port), model_dir, str(outs[i]),
                     "4"], 4, logs[i]) for i in range(2)]
    _wait_all(procs, TIMEOUT_S)
    assert [p.returncode for p in procs] == [0, 0], _failure(procs, logs)
    leader, follower = (json.loads(o.read_text()) for o in outs)
    assert leader["replica_hosts"] == [[0], [0], [1], [1]]
    assert leader["replica"] == {"r0": 0, "r1": 1, "r2": 2, "r3": 3}  # one request per replica
    assert set(leader["messages"]) == {"2", "3"} and min(leader["messages"].values()) > 0  # host 0's own: no message
    assert follower["steps"] == sum(leader["messages"].values())
    assert leader["tokens"] == drive_replicas(EngineCore(model_dir, **ENGINE_ARGS))[0]


def test_server_on_two_hosts_answers_on_host_0_only(tmp_path):
    """`python -m server` on two hosts (TP 2, one CPU device each): host 0 warms up and answers /v1/completions
    while host 1 runs its steps and listens nowhere; SIGTERM to host 0 ends both, with exit code 0."""
    from qwen_jax.default_model import ensure_default_model

    model_dir = ensure_default_model(str(tmp_path / "cache"))
    coordinator, ports = free_port(), [free_port(), free_port()]
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    procs = [_start(["-m", "server", "--model", model_dir, "--num-hosts", "2", "--host-index", str(i),
                     "--coordinator-address", f"127.0.0.1:{coordinator}", "--host", "127.0.0.1", "--port",
                     str(ports[i]), "--tensor-parallel-size", "2", "--max-model-len", "256", "--max-num-seqs", "2",
                     "--warmup", "minimal", "--compilation-cache-dir", "none"], 1, logs[i]) for i in range(2)]
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not _healthy(url):
            assert all(p.poll() is None for p in procs), "a host exited during start-up\n" + _failure(procs, logs)
            assert time.monotonic() < deadline, "host 0 not healthy in time\n" + _failure(procs, logs)
            time.sleep(0.5)
        body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 4
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", ports[1])) != 0, "host 1 must not serve HTTP"
        procs[0].send_signal(signal.SIGTERM)
        _wait_all(procs, 60)
    finally:
        _wait_all(procs, 0)
    assert [p.returncode for p in procs] == [0, 0], _failure(procs, logs)
    assert "following host 0" in logs[1].read_text()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:  # not listening yet, or 503 while loading (HTTPError is an OSError)
        return False
