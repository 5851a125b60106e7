"""The public API: LLM (offline, batched generate and chat) and AsyncLLM (per-request streams for the server).

LLM runs the engine core in the caller's process; AsyncLLM runs it in a process of its own (engine/core_client.py)
and keeps the front here: tokenizer, validation, detokenization, stop strings and one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
from collections.abc import AsyncIterator, Sequence

import jax

from qwen_jax.config import ModelConfig
from qwen_jax.engine.core import ENGINE_ARGS, EngineCore, check_request, engine_args
from qwen_jax.engine.core_client import CoreProcess
from qwen_jax.engine.model_files import (
    eos_ids,
    load_tokenizer,
    read_model_config,
    resolve_max_model_len,
    resolve_model,
    resolve_path,
    sampling_defaults,
)
from qwen_jax.engine.output_processor import OutputProcessor
from qwen_jax.models.decoder import param_shapes
from qwen_jax.outputs import RequestOutput
from qwen_jax.sampling_params import SamplingParams
from sharding.devices import auto_layout, gpu_memory_bytes, parse_layout, replica_environments, visible_gpus
from sharding.distributed import host_settings

Prompt = str | list[int] | dict
# The engine arguments that set where the model runs (AsyncLLM.from_engine_args' `layout` sets them all).
LAYOUT_ARGS = ("data_parallel_size", "tensor_parallel_size", "enable_expert_parallel")


def _prompt_ids(engine_tokenizer, prompt: Prompt) -> list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if engine_tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return engine_tokenizer.encode(prompt, add_special_tokens=True)
    return [int(t) for t in prompt]


class LLM:
    """Offline generation: `LLM(model_dir, **engine_args).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **engine_args):
        path = resolve_model(model)
        if engine_args.get("tokenizer") is not None:
            engine_args["tokenizer"] = resolve_path(engine_args["tokenizer"])
        self.engine = EngineCore(path, **engine_args)
        self.tokenizer = load_tokenizer(engine_args.get("tokenizer") or path)
        # the sampling a generate() without SamplingParams gets (the model's generation_config.json, as vLLM's)
        self.sampling_defaults = sampling_defaults(path, engine_args.get("generation_config", "auto"),
                                                   engine_args.get("override_generation_config"))
        self.output = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching inside); outputs in prompt order. A request the engine
        failed on ends with finish_reason "error" and its `error`; the others are unaffected."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams(**self.sampling_defaults)
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params_list, strict=True):
            rid = f"offline-{next(self._ids)}"
            prompt_ids = _prompt_ids(self.tokenizer, prompt)
            self.engine.add_request(rid, prompt_ids, p)
            self.output.add(rid, prompt_ids, p)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            results, ended = self.output.process(self.engine.step())
            self.engine.abort(ended)
            for out in results:
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             enable_thinking: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (thinking off unless asked) and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        kwargs = {"enable_thinking": enable_thinking, **(chat_template_kwargs or {})}
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **kwargs)
                   for c in conversations]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, sampling_params)


class EngineDead(RuntimeError):
    """The engine core process failed: no request can be served any more."""


class AsyncLLM:
    """The server's engine: the core in a process of its own (one per data-parallel replica on one host), one asyncio
    queue per request here. Construct with from_engine_args, then `await start()`."""

    def __init__(self, model_path: str, engine_args: dict, warmup: str = "auto", launch: bool = False):
        """warmup: "minimal" compiles the smallest and largest step before serving; "full" every program serving
        can run (a shape first met while serving would stall every running request while it compiles); "auto" is
        "full" on accelerators and "minimal" on the CPU. `launch`: start the core process(es) at once, before this
        front reads the tokenizer and config (they load and compile meanwhile; start() then waits for them)."""
        if warmup not in ("auto", "minimal", "full"):
            raise ValueError(f"warmup must be 'auto', 'minimal' or 'full', not {warmup!r}")
        self.model_path = model_path
        self.engine_args = engine_args
        self.warmup = warmup
        self.error: str | None = None
        self._cores: list[CoreProcess] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # what the cores' reader threads hand the event loop before start() has one: (callback, args)
        self._before_loop: list[tuple] = []
        self._loop_lock = threading.Lock()
        self._ready: asyncio.Future | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, int] = {}  # request -> the core it runs on
        self._load: list[int] = []  # requests running on each core
        self._stats: list[dict] = []  # each core's counters as of its last message
        self._started: list[asyncio.Future] = []  # each core's "ready"
        self._serving: set[int] = set()  # the cores that said "ready"
        self._on_dead = None
        if launch:
            self.launch()
        try:
            self._read_model(model_path, engine_args)
        except BaseException:
            for core in self._cores:  # still starting: stopped at once
                core.close(0.0)
            raise

    def _read_model(self, model_path: str, engine_args: dict) -> None:
        tokenizer_path = engine_args.get("tokenizer") or model_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        # Read from the model files here, without a device: the core computes the same values.
        self.config: ModelConfig = read_model_config(model_path, engine_args.get("dtype", ENGINE_ARGS["dtype"]),
                                                     engine_args.get("hf_overrides"))
        self.max_model_len = resolve_max_model_len(self.config, engine_args.get("max_model_len"))
        self.eos_token_ids = eos_ids(model_path, self.config, tokenizer_path)
        # what a request that does not set them samples with (SamplingParams fields)
        self.sampling_defaults = sampling_defaults(model_path, engine_args.get("generation_config", "auto"),
                                                   engine_args.get("override_generation_config"))
        self.model_name = model_path.rstrip("/").split("/")[-1]
        self.output = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, model: str | None = None, warmup: str = "auto", layout: str | None = None,
                         launch: bool = False, **given) -> AsyncLLM:
        """`layout`: "auto" puts the model on every visible GPU of this host in the best measured layout
        (sharding/devices.py AUTO_LAYOUTS) unless a layout engine argument is given; "DP=2,TP=2"-style text sets
        data_parallel_size, tensor_parallel_size and enable_expert_parallel; None: the engine arguments alone.
        `launch`: as in the constructor."""
        engine_args(given)  # unknown names fail here, not in the core process
        if given.get("tokenizer") is not None:
            given["tokenizer"] = resolve_path(given["tokenizer"])
        path = resolve_model(model)
        explicit = [name for name in LAYOUT_ARGS if given.get(name)]
        if layout not in (None, "auto"):
            if explicit:
                raise ValueError(f"layout {layout!r} and {', '.join(explicit)} both set the layout: give one")
            dp, tp, ep = parse_layout(layout)
            given.update(data_parallel_size=dp, tensor_parallel_size=tp, enable_expert_parallel=ep)
        elif layout == "auto" and not explicit and host_settings(given.get("num_hosts"))[0] == 1:
            gpus = visible_gpus()
            if len(gpus) > 1:
                cfg = read_model_config(path, given.get("dtype", ENGINE_ARGS["dtype"]), given.get("hf_overrides"))
                weights = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(param_shapes(cfg)))
                dp, tp, ep = auto_layout(len(gpus), weights, gpu_memory_bytes())
                given.update(data_parallel_size=dp, tensor_parallel_size=tp, enable_expert_parallel=ep)
        return cls(path, given, warmup, launch)

    def on_dead(self, callback) -> None:
        """`callback(reason)` runs on the event loop once if an engine core dies while serving."""
        self._on_dead = callback

    def core_plans(self) -> list[tuple[dict, dict[str, str]]]:
        """(engine arguments, environment) of each core process: one for the whole engine, or on one host with
        data_parallel_size D > 1, one per replica (data_parallel_rank i) that sees only its own devices."""
        dp = int(self.engine_args.get("data_parallel_size") or 1)
        if dp == 1 or host_settings(self.engine_args.get("num_hosts"))[0] > 1:
            return [(self.engine_args, {})]
        envs = replica_environments(dp, self.engine_args.get("tensor_parallel_size"))
        # each core compiles on its share of the host's cores
        threads = os.environ.get("QWEN_JAX_COMPILE_THREADS") or str(max(2, (os.cpu_count() or 2) // dp))
        return [({**self.engine_args, "data_parallel_rank": i}, {**env, "QWEN_JAX_COMPILE_THREADS": threads})
                for i, env in enumerate(envs)]

    def launch(self) -> None:
        """Start the core process(es): each loads the model and compiles (a no-op once started)."""
        if self._cores:
            return
        plans = self.core_plans()
        n = len(plans)
        self._load, self._stats = [0] * n, [{}] * n
        for i, (args, env) in enumerate(plans):
            self._cores.append(CoreProcess(self.model_path, args, self.warmup, functools.partial(self._on_message, i),
                                           env=env, part=(i, n) if n > 1 else None))

    async def start(self) -> None:
        """Start the core process(es) (load, compile) unless launched, and wait until every one serves."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self.launch()
        self._started = [loop.create_future() for _ in self._cores]
        with self._loop_lock:  # from here the reader threads hand their messages to the loop themselves
            self._loop = loop
            before, self._before_loop = self._before_loop, []
        for callback, args in before:
            callback(*args)
        try:
            await asyncio.gather(*self._started)
        except EngineDead as exc:
            await asyncio.gather(*(asyncio.to_thread(core.close) for core in self._cores))
            if not self._ready.done():
                self._ready.set_exception(exc)
        if not self._ready.done():
            self._ready.set_result(None)
        await self._ready

    def _on_message(self, core: int, message: tuple) -> None:
        """On a core's reader thread: turn outputs into RequestOutputs here (detokenizing off the event loop), then
        hand them to the loop in one callback."""
        kind = message[0]
        if kind == "outputs":
            _, outputs, stats = message
            # a launched core sends its counters before start(), while this front may still be reading the
            # tokenizer (no OutputProcessor yet); no request can run before start(), so those carry no outputs
            results, ended = self.output.process(outputs) if outputs else ([], [])
            self._on_loop(self._deliver, core, results, ended, stats)
        elif kind == "ready":
            self._on_loop(self._core_started, core, message[1])
        elif kind == "failed":
            self._on_loop(self._fail, message[1])

    def _on_loop(self, callback, *args) -> None:
        """Run `callback(*args)` on the event loop; before start() has one (a launched core's early "ready" or
        "failed"), once start() has it."""
        with self._loop_lock:
            if self._loop is None:
                self._before_loop.append((callback, args))
                return
        self._loop.call_soon_threadsafe(callback, *args)

    def _core_started(self, core: int, info: dict) -> None:
        self._serving.add(core)
        self._stats[core] = info["stats"]
        if not self._started[core].done():
            self._started[core].set_result(None)

    def _deliver(self, core: int, results: list, ended: list[str], stats: dict) -> None:
        self._stats[core] = stats
        if ended:
            self._cores[core].send(("abort", ended))
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail(self, reason: str) -> None:
        """A core died (or failed to start): every request in flight fails, on every core (the server then exits)."""
        first = self.error is None
        if first:
            lines = reason.strip().splitlines()
            self.error = lines[-1] if lines else "the engine core failed"
        if not self._ready.done():
            dead = EngineDead(f"the engine core failed to start: {self.error}")
            for started in self._started:
                if not started.done():
                    started.set_exception(dead)
            return
        for stream in self._streams.values():
            stream.put_nowait(EngineDead(f"the engine core died: {self.error}"))
        if first and self._on_dead is not None:
            self._on_dead(self.error)

    def is_ready(self) -> bool:
        return self._ready is not None and self._ready.done() and not self._ready.exception() and self.error is None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.config.vocab_size, self.max_model_len)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        if not self.is_ready():
            raise EngineDead(f"the engine core died: {self.error}" if self.error else "the engine is not started")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate(prompt_token_ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self.output.add(request_id, prompt_token_ids, params)
        core = min(range(len(self._cores)), key=self._load.__getitem__)  # the least busy (ties: the lowest index)
        self._owner[request_id] = core
        self._load[core] += 1
        self._cores[core].send(("add", request_id, prompt_token_ids, params))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, RequestOutput) and item.error is not None:  # this request alone: refused
                    finished = True  # (RequestRejected, a ValueError) or failed (RequestFailed)
                    raise item.error
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await self.abort(request_id)
            self._load[self._owner.pop(request_id)] -= 1

    async def abort(self, request_id: str) -> None:
        core = self._owner.get(request_id)
        if core is not None and self.error is None:
            self._cores[core].send(("abort", [request_id]))

    def stats(self) -> dict:
        """The engine's counters as of each core's last message (sent with every step's outputs, or twice a
        second), summed over the cores."""
        return sum_stats(self._stats)

    async def shutdown(self) -> None:
        """Abort what is still running, then stop the core processes (and, on several hosts, the followers). A core
        still loading or compiling reads no message: it is stopped at once."""
        for rid in list(self._streams):
            await self.abort(rid)
        await asyncio.gather(*(asyncio.to_thread(core.close, 10.0 if i in self._serving else 0.0)
                               for i, core in enumerate(self._cores)))


def sum_stats(stats: list[dict]) -> dict:
    """Counters of several cores summed (lists element by element)."""
    if len(stats) == 1:
        return stats[0]
    total: dict = {}
    for one in stats:
        for key, value in one.items():
            if isinstance(value, list):
                have = total.get(key, [0] * len(value))
                total[key] = [a + b for a, b in zip(have, value, strict=True)]
            else:
                total[key] = total.get(key, 0) + value
    return total
