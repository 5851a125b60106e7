"""The public API: LLM (offline, batched generate and chat) and AsyncLLM (per-request streams for the server).

LLM runs the engine core in the caller's process; AsyncLLM runs it in a process of its own (engine/core_client.py)
and keeps the front here: tokenizer, validation, detokenization, stop strings and one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence

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
)
from qwen_jax.engine.output import OutputProcessor
from qwen_jax.outputs import RequestOutput
from qwen_jax.sampling_params import SamplingParams

Prompt = str | list[int] | dict


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
        self.output = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching inside); outputs in prompt order. A request the engine
        failed on ends with finish_reason "error" and its `error`; the others are unaffected."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
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
    """The server's engine: the core in its own process, one asyncio queue per request here. Construct with
    from_engine_args, then `await start()`."""

    def __init__(self, model_path: str, engine_args: dict, warmup: str = "auto"):
        """warmup: "minimal" compiles the smallest and largest step before serving; "full" every token bucket (a
        shape first met while serving stalls every running request while it compiles); "auto" is "full" on
        accelerators and "minimal" on the CPU."""
        if warmup not in ("auto", "minimal", "full"):
            raise ValueError(f"warmup must be 'auto', 'minimal' or 'full', not {warmup!r}")
        self.model_path = model_path
        self.engine_args = engine_args
        self.warmup = warmup
        self.tokenizer = load_tokenizer(engine_args.get("tokenizer") or model_path)
        # Read from the model files here, without a device: the core computes the same values.
        self.config: ModelConfig = read_model_config(model_path, engine_args.get("dtype", ENGINE_ARGS["dtype"]))
        self.max_model_len = resolve_max_model_len(self.config, engine_args.get("max_model_len"))
        self.eos_token_ids = eos_ids(model_path, self.config, self.tokenizer)
        self.model_name = model_path.rstrip("/").split("/")[-1]
        self.output = OutputProcessor(self.tokenizer)
        self.error: str | None = None
        self._core: CoreProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._stats: dict = {}
        self._on_dead = None

    @classmethod
    def from_engine_args(cls, model: str | None = None, warmup: str = "auto", **given) -> AsyncLLM:
        engine_args(given)  # unknown names fail here, not in the core process
        if given.get("tokenizer") is not None:
            given["tokenizer"] = resolve_path(given["tokenizer"])
        return cls(resolve_model(model), given, warmup)

    def on_dead(self, callback) -> None:
        """`callback(reason)` runs on the event loop once if the engine core dies while serving."""
        self._on_dead = callback

    async def start(self) -> None:
        """Start the core process (load, compile) and wait until it serves."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._core = CoreProcess(self.model_path, self.engine_args, self.warmup, self._on_message)
        info = await self._ready
        self._stats = info["stats"]

    def _on_message(self, message: tuple) -> None:
        """On the core reader thread: turn outputs into RequestOutputs here (detokenizing off the event loop), then
        hand them to the loop in one callback."""
        kind = message[0]
        if kind == "outputs":
            _, outputs, stats = message
            results, ended = self.output.process(outputs)
            self._loop.call_soon_threadsafe(self._deliver, results, ended, stats)
        elif kind == "ready":
            self._loop.call_soon_threadsafe(self._ready.set_result, message[1])
        elif kind == "failed":
            self._loop.call_soon_threadsafe(self._fail, message[1])

    def _deliver(self, results: list, ended: list[str], stats: dict) -> None:
        self._stats = stats
        if ended:
            self._core.send(("abort", ended))
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail(self, reason: str) -> None:
        first = self.error is None
        if first:
            lines = reason.strip().splitlines()
            self.error = lines[-1] if lines else "the engine core failed"
        if not self._ready.done():
            self._ready.set_exception(EngineDead(f"the engine core failed to start: {self.error}"))
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
        self._core.send(("add", request_id, prompt_token_ids, params))
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

    async def abort(self, request_id: str) -> None:
        if self._core is not None and self.error is None:
            self._core.send(("abort", [request_id]))

    def stats(self) -> dict:
        """The engine's counters as of its last message (sent with every step's outputs, or twice a second)."""
        return self._stats

    async def shutdown(self) -> None:
        """Abort what is still running, then stop the core process (and, on several hosts, the followers)."""
        for rid in list(self._streams):
            await self.abort(rid)
        if self._core is not None:
            await asyncio.to_thread(self._core.close)
