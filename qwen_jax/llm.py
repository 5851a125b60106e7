"""The public API: LLM (offline, batched generate and chat) and AsyncLLM (per-request streams for the server).

Both drive one LLMEngine; AsyncLLM runs it on a dedicated thread so the event loop never blocks on device work.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Sequence

import jax

from qwen_jax.config import ModelConfig
from qwen_jax.engine.llm_engine import (
    ENGINE_ARGS,
    LLMEngine,
    eos_ids,
    load_tokenizer,
    read_model_config,
    resolve_max_model_len,
    resolve_model,
)
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
        self.engine = LLMEngine(model, **engine_args)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching inside); outputs in prompt order."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params_list):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, _prompt_ids(self.tokenizer, prompt), p)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out in self.engine.step():
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


class AsyncLLM:
    """An engine thread plus one asyncio queue per request. Construct with from_engine_args, then `await start()`."""

    def __init__(self, model_path: str, engine_args: dict, warmup: str = "auto"):
        """warmup: "minimal" compiles a one-row prefill and decode before serving; "full" every padded shape a step
        can take (runner.step_shapes: decode batch sizes up to max_num_seqs, prefill rows x lengths up to the token
        budget), since a shape first met while serving stalls every running request while it compiles; "auto" is
        "full" on accelerators and "minimal" on the CPU."""
        if warmup not in ("auto", "minimal", "full"):
            raise ValueError(f"warmup must be 'auto', 'minimal' or 'full', not {warmup!r}")
        self.model_path = model_path
        self.engine_args = engine_args
        self.warmup = warmup
        self.tokenizer = load_tokenizer(model_path)
        # Known before start() (the server validates requests with them): the engine computes the same values.
        self._config = read_model_config(model_path, engine_args.get("dtype", ENGINE_ARGS["dtype"]))
        self._max_model_len = resolve_max_model_len(self._config, engine_args.get("max_model_len"))
        self._eos_token_ids = eos_ids(model_path, self._config, self.tokenizer)
        self.model_name = model_path.rstrip("/").split("/")[-1]
        self.engine: LLMEngine | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._ready = False
        self._stats: dict = {}
        self.error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, model: str | None = None, warmup: str = "auto", **engine_args) -> AsyncLLM:
        unknown = set(engine_args) - set(ENGINE_ARGS)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(resolve_model(model), engine_args, warmup)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len if self.engine else self._max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self.engine.eos_token_ids if self.engine else self._eos_token_ids

    @property
    def config(self) -> ModelConfig:
        return self.engine.cfg if self.engine else self._config

    async def start(self) -> None:
        """Load the model and compile the common step shapes off the event loop, then start the engine thread."""
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(self._build)
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="qwen-jax-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def _build(self) -> LLMEngine:
        engine = LLMEngine(self.model_path, **self.engine_args)
        engine.warmup(full=self.warmup == "full" or (self.warmup == "auto" and jax.default_backend() != "cpu"))
        return engine

    def is_ready(self) -> bool:
        return self._ready and self.error is None

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                while True:
                    try:
                        kind, rid, payload = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if kind == "add":
                        try:
                            engine.add_request(rid, *payload)
                        except ValueError as exc:  # this request's problem only: the engine state is untouched
                            self._emit_to(rid, exc)
                    else:
                        out = engine.abort(rid)
                        if out is not None:
                            self._emit(out)
                self._stats = engine.stats()
                if not engine.has_unfinished:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for out in engine.step():
                    self._emit(out)
        except BaseException as exc:  # surface engine failures to every waiting request instead of hanging
            self.error = exc
            for rid in list(self._streams):
                self._loop.call_soon_threadsafe(self._streams[rid].put_nowait, exc)
            raise

    def _emit(self, out: RequestOutput) -> None:
        self._emit_to(out.request_id, out)

    def _emit_to(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        if not self.is_ready():
            raise RuntimeError(f"engine is not running: {self.error!r}" if self.error else "engine is not started")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.engine.validate(prompt_token_ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, (list(prompt_token_ids), params)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, ValueError):  # the request was refused; nothing else is affected
                    finished = True
                    raise item
                if isinstance(item, BaseException):
                    raise RuntimeError(f"engine failed: {item!r}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id, None))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    def stats(self) -> dict:
        """The engine's counters as of its last loop iteration (taken on the engine thread, so never torn)."""
        return self._stats

    async def shutdown(self) -> None:
        """Abort what is still running, then stop the engine thread (and, on several hosts, the followers)."""
        for rid in list(self._streams):
            await self.abort(rid)
        await asyncio.sleep(0.1)
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        if self.engine is not None:
            self.engine.shutdown()
        self._ready = False
