"""Multi-host serving: host 0's engine alone schedules; each step's device work, which the runner describes as plain
host data (an op list of numpy arrays and ints), goes to the other hosts of the replica it runs on, which issue the
same jitted calls. A replica on hosts without host 0 (data parallelism over hosts) also sends its sampled tokens
back to host 0.

Used only when jax.process_count() > 1. Never schedules, never looks inside an op, never touches a device array.

Why the distributed key-value store and not multihost_utils.broadcast_one_to_all: the store is jax.distributed's
coordinator service (gRPC, run by host 0), so a message is one host-side RPC per follower and costs no device
program. broadcast_one_to_all is a jitted all-reduce over every device: one compile per payload shape, a device
round trip on every host, and a follower of an idle server would sit inside a collective for hours (where the
collective library's timeout ends it, or nothing does). With the store a follower waits for the next step with
a timeout it controls, and when host 0 dies its coordinator goes with it: the JAX runtime then ends every follower
("Terminating process because the JAX distributed service detected fatal errors"). The client is private API
(jax._src.distributed.global_state.client); key_value_set_bytes, blocking_key_value_get_bytes and key_value_delete
are in jax 0.10.2 and 0.11.2.
"""

from __future__ import annotations

import atexit
import itertools
import json
import math
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from qwen_jax.engine import step

# A follower's wait for the next step is cut into polls this long (an idle server sends nothing for hours; a
# short poll keeps the follower responsive to signals).
POLL_MS = 1000
_STOP = b""  # a packed op list is never empty (it starts with its header's length)
# The k-th engine of every process talks to the k-th engine of the others (each host builds the same engines in
# the same order).
_engine_ids = itertools.count()


def pack(tree) -> bytes:
    """Nested lists/tuples/dicts of numpy arrays, ints, floats, strings and None (a step's ops as step.to_wire
    tuples, or a step's outputs) as bytes: a JSON header in which each array is {"a": i}, then the arrays' raw
    bytes. No pickle: a follower runs no received code."""
    arrays: list[np.ndarray] = []

    def encode(x):
        if isinstance(x, np.ndarray):
            arrays.append(np.ascontiguousarray(x))
            return {"a": len(arrays) - 1}
        if isinstance(x, dict):
            return {"d": {k: encode(v) for k, v in x.items()}}
        if isinstance(x, list | tuple):
            return [encode(v) for v in x]
        if isinstance(x, np.generic):
            return x.item()
        return x

    header = json.dumps({"tree": encode(tree), "arrays": [(a.dtype.str, a.shape) for a in arrays]}).encode()
    return b"".join([struct.pack("<I", len(header)), header, *(a.tobytes() for a in arrays)])


def unpack(payload: bytes):
    """pack's inverse (tuples come back as lists; arrays are read-only views of `payload`)."""
    (size,) = struct.unpack_from("<I", payload)
    header = json.loads(payload[4:4 + size])
    arrays, offset = [], 4 + size
    for dtype, shape in header["arrays"]:
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        arrays.append(np.frombuffer(payload, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize

    def decode(x):
        if isinstance(x, list):
            return [decode(v) for v in x]
        if isinstance(x, dict):
            return arrays[x["a"]] if "a" in x else {k: decode(v) for k, v in x["d"].items()}
        return x

    return decode(header["tree"])


class StepChannel:
    """Host 0 -> the `followers` of one replica (default: every other host), one message per step, in order.
    Message n for host h is the key "qwen_jax/engine<k>/host<h>/<n>"; host h deletes it after running it, so the
    store holds about one step per follower. A replica without host 0 answers message n with its sampled outputs
    under ".../reply/<n>" (`reply`, `wait_reply`). Every host must create its channels in the same order."""

    def __init__(self, client=None, process_index: int | None = None, process_count: int | None = None,
                 followers: list[int] | None = None):
        import jax
        from jax._src.distributed import global_state

        self._client = client if client is not None else global_state.client
        self.host = jax.process_index() if process_index is None else process_index
        count = jax.process_count() if process_count is None else process_count
        self._followers = [h for h in (followers if followers is not None else range(count)) if h != 0]
        self._prefix = f"qwen_jax/engine{next(_engine_ids)}"
        self._next = 0
        self._stopped = False
        self._lock = threading.Lock()  # the engine thread publishes; shutdown (another thread) stops
        self.messages = 0  # sent (host 0) or received (followers), the stop message not counted
        self.bytes = 0  # of those messages, per follower
        self.seconds = 0.0  # host 0: time spent sending
        if self.host == 0:
            atexit.register(self.stop)  # a leader that exits without shutting its engine down still frees them

    def _key(self, host: int, n: int) -> str:
        return f"{self._prefix}/host{host}/{n}"

    def publish(self, ops: list[step.Op]) -> None:
        """Host 0: send one step's ops to every follower (before running them itself)."""
        payload = pack([step.to_wire(op) for op in ops])
        with self._lock:
            if self._stopped:
                raise RuntimeError("this multi-host engine was shut down: its followers have left")
            self._send(payload)
            self.messages += 1
            self.bytes += len(payload)

    def stop(self) -> None:
        """Host 0: end the followers' loops. Idempotent; later publishes raise."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._send(_STOP)

    def _send(self, payload: bytes) -> None:
        start = time.perf_counter()
        for host in self._followers:
            self._client.key_value_set_bytes(self._key(host, self._next), payload)
        self._next += 1
        self.seconds += time.perf_counter() - start

    def _get(self, key: str) -> bytes:
        """The value at `key`, waiting for as long as its sender lives."""
        while True:
            try:
                return self._client.blocking_key_value_get_bytes(key, POLL_MS)
            except Exception as exc:  # jax.errors.JaxRuntimeError; only a timeout means "nothing yet"
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise

    def receive(self) -> list[step.Op] | None:
        """Host > 0: the next step's ops, waiting for as long as host 0 lives; None once host 0 stopped."""
        if self._next:  # the previous step's key, now that its work is dispatched (off the critical path)
            self._client.key_value_delete(self._key(self.host, self._next - 1))
        key = self._key(self.host, self._next)
        payload = self._get(key)
        self._next += 1
        if payload == _STOP:
            self._client.key_value_delete(key)
            return None
        self.messages += 1
        self.bytes += len(payload)
        return [step.from_wire(item) for item in unpack(payload)]

    def reply(self, outputs: list) -> None:
        """The replying follower: the outputs (host data) of the step it received last."""
        self._client.key_value_set_bytes(f"{self._prefix}/reply/{self._next - 1}", pack(outputs))

    def wait_reply(self) -> list:
        """Host 0: the reply to the step it published last."""
        key = f"{self._prefix}/reply/{self._next - 1}"
        payload = self._get(key)
        self._client.key_value_delete(key)
        return unpack(payload)


def leader_executor(channel: StepChannel, execute: Callable[[list], list]) -> Callable[[list], list]:
    """Host 0's executor: send the ops to the followers, then run them here."""

    def run(ops: list) -> list:
        channel.publish(ops)
        return execute(ops)

    return run


def remote_executor(channel: StepChannel) -> Callable[[list], list]:
    """Host 0's executor for a replica on other hosts only: send the ops, wait for the replica's sampled outputs."""

    def run(ops: list) -> list:
        channel.publish(ops)
        return channel.wait_reply()

    return run


def follow(channel: StepChannel, execute: Callable[[list], list], reply: bool = False) -> int:
    """Host > 0: run host 0's steps until it stops; returns how many ran. With `reply` (one host of a replica that
    host 0 is not part of) `execute` must return host data, which goes back to host 0; otherwise the outputs are
    dropped (host 0 holds the replica's devices too and reads them itself)."""
    steps = 0
    while (ops := channel.receive()) is not None:
        outputs = execute(ops)
        if reply:
            channel.reply(outputs)
        steps += 1
    return steps
