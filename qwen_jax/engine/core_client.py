"""The engine core in its own process: `CoreProcess` starts it (spawned, so it owns the devices and a GIL of its
own) and talks to it over two ZeroMQ pipes of pickled messages: requests and aborts in, token outputs out.

Front -> core messages: ("add", request_id, prompt_token_ids, SamplingParams), ("abort", [request_id, ...]),
("shutdown",). Core -> front: ("ready", info), ("outputs", [CoreOutput, ...], stats), ("failed", reason) when the
core cannot start or dies. Nothing here detokenizes or schedules.

Data-parallel replicas on one host run one core process each (the front starts them: llm.AsyncLLM), each seeing only
its own devices, so every replica compiles the very same programs: core i of n compiles every n-th program (`part`)
and loads the others as the other cores store them (engine/compilation.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

import zmq

from qwen_jax.engine.processes import CORE, INHERITED_CONFIG, set_process_name
from qwen_jax.engine.sequence import CoreOutput

log = logging.getLogger("qwen_jax")

# How often an idle core wakes to check its pipe, and how often it sends its counters while busy.
IDLE_POLL_MS = 50
STATS_EVERY_S = 0.5


def run_core(model_path: str, engine_args: dict, warmup: str, inputs: str, outputs: str, jax_config: dict,
             env: dict[str, str], part: tuple[int, int] | None) -> None:
    """The core process: build the engine, compile, then serve the pipes until "shutdown" or the front's death.
    `env`: environment variables set before JAX starts (the devices this core sees); `part`: its share of a compile
    shared with the other cores (see above)."""
    os.environ.update(env)
    set_process_name(CORE)
    name = "core" if part is None else f"core {part[0]}"
    logging.basicConfig(level=os.environ.get("QWEN_JAX_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s %(name)s[{name}]: %(message)s")
    import jax

    for name, value in jax_config.items():
        jax.config.update(name, value)
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(inputs)
    push.connect(outputs)
    push.setsockopt(zmq.LINGER, 2000)

    def send(message) -> None:
        push.send(pickle.dumps(message, protocol=5))

    try:
        from qwen_jax.engine.core import EngineCore

        # auto: every program on an accelerator (a server is ready when it serves at full speed), the smallest and
        # largest step's elsewhere
        full = warmup == "full" or (warmup == "auto" and jax.default_backend() != "cpu")
        core = EngineCore(model_path, compile_ahead=(part or (0, 1)) if full else None, **engine_args)
        core.warmup(full, part or (0, 1))
    except BaseException:
        send(("failed", traceback.format_exc()))
        raise
    if not core.is_leader:
        raise RuntimeError("the core process runs host 0; other hosts follow it in their own main process")
    send(("ready", {"stats": core.stats()}))
    try:
        _serve(core, pull, send)
    except BaseException:
        send(("failed", traceback.format_exc()))
        raise
    finally:
        core.shutdown()


def _serve(core, pull, send: Callable) -> None:
    last_stats = 0.0
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while True:
        timeout = 0 if core.has_unfinished else IDLE_POLL_MS
        outputs = []
        while poller.poll(timeout):
            message = pickle.loads(pull.recv())
            kind = message[0]
            if kind == "add":
                _, rid, prompt, params = message
                try:
                    core.add_request(rid, prompt, params)
                except ValueError as exc:  # this request's problem only: the engine is untouched
                    outputs.append(CoreOutput(rid, [], finish_reason="error", error=str(exc), rejected=True))
                except Exception as exc:  # a failure on this request alone (add_request changes nothing first)
                    log.exception("request %s failed on arrival in the engine core", rid)
                    outputs.append(CoreOutput(rid, [], finish_reason="error",
                                              error=f"the engine failed on this request: {type(exc).__name__}: "
                                                    f"{exc}"))
            elif kind == "abort":
                outputs += core.abort(message[1])
            elif kind == "shutdown":
                return
            timeout = 0
        if core.has_unfinished:
            outputs += core.step()
        now = time.monotonic()
        if outputs or now - last_stats > STATS_EVERY_S:
            send(("outputs", outputs, core.stats()))
            last_stats = now


class CoreProcess:
    """The front's handle on a core process. `on_message` runs on a reader thread of its own for every message the
    core sends, and once with ("failed", reason) if the core dies without saying why."""

    def __init__(self, model_path: str, engine_args: dict, warmup: str, on_message: Callable[[tuple], None],
                 env: dict[str, str] | None = None, part: tuple[int, int] | None = None):
        """`env`: environment variables the core process sets before JAX starts (its devices); `part`: (i, n) for
        core i of n data-parallel cores that share their compile (see above)."""
        self._dir = tempfile.mkdtemp(prefix="qwen-jax-core-")
        inputs, outputs = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._context = zmq.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)  # no queue limit: a send fails only when no core is on the pipe
        self._push.bind(inputs)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(outputs)
        self._on_message = on_message
        self.env = env or {}
        self._closing = False
        self._lock = threading.Lock()  # sends come from the event loop and from the reader thread
        import jax

        jax_config = {name: getattr(jax.config, name) for name in INHERITED_CONFIG}
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_core,
                                     args=(model_path, engine_args, warmup, inputs, outputs, jax_config, self.env,
                                           part),
                                     name=CORE, daemon=True)
        self.process.start()
        self._reader = threading.Thread(target=self._read, name="qwen-jax-core-reader", daemon=True)
        self._reader.start()

    def send(self, message: tuple) -> None:
        """Queue a message for the core without waiting. A core that is gone has left no reader on the pipe: the
        message is dropped (a blocking send would wait forever, holding up the event loop before the reader thread
        reports the death)."""
        with self._lock:
            try:
                self._push.send(pickle.dumps(message, protocol=5), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("the engine core is gone: %r not sent", message[0])

    def _read(self) -> None:
        while True:
            if self._pull.poll(200):
                message = pickle.loads(self._pull.recv())
                try:
                    self._on_message(message)
                except Exception:  # a front that cannot take the core's messages serves nothing: fail, never hang
                    log.exception("the front failed on the engine core's %r message", message[0])
                    self._on_message(("failed", traceback.format_exc()))
                    return
                if message[0] == "failed":
                    return
            elif not self.process.is_alive():
                if not self._closing:
                    self._on_message(("failed", f"the engine core process exited with code {self.process.exitcode}"))
                return

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop; kill it if it does not within `timeout` seconds."""
        self._closing = True
        if self.process.is_alive():
            try:
                self.send(("shutdown",))
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._reader.join(2)
        self._push.close(0)
        self._pull.close(0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
