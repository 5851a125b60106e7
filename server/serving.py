"""What the generation endpoints share: the server's state and admission, one engine request per (prompt, choice)
run concurrently, the response body, and the one SSE stream generator both endpoints use.

Endpoint specifics (how the prompts are built, how a choice is written) come from serving_chat.py and
serving_completion.py; this module never parses a request body and never builds an HTTP response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from qwen_jax import (
    EngineDead,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
    TokenLogprob,
    check_structured_outputs,
)
from server.metrics import ServerMetrics
from server.protocol import APIError, GenerationRequest, error_body

log = logging.getLogger("qwen_jax.server")

# How long a shutdown waits for the requests it ended to have their answers written.
WRITE_SECONDS = 5.0


# --json-whitespace -> the StructuredOutputsParams field that asks for it
JSON_WHITESPACE = {"bounded": {}, "any": {"any_whitespace": True}, "none": {"disable_any_whitespace": True}}


@dataclasses.dataclass
class ServerConfig:
    # the names a request's `model` may give (any other is a 404); the first is the one responses and metrics carry
    # (none: the model directory's name)
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_num_seqs: int = 64  # the engine's batch (all replicas); admission allows this many running plus the queue
    max_queue_len: int = 1024  # engine requests allowed to wait beyond max_num_seqs; more get 503
    max_body_bytes: int = 4 * 1024 * 1024
    max_logprobs: int = 20  # the most logprobs per token a request may ask for (the sampler's limit)
    chat_template: str | None = None  # None: the tokenizer's
    # JSON output's whitespace between tokens when a request does not say: "bounded" (runs of at most
    # JSON_WHITESPACE_RUN characters), "any" or "none"
    json_whitespace: str = "bounded"
    # the format a forced tool call is written in (server/tools.py QWEN_XML or HERMES_JSON; None: the template's)
    tool_call_format: str | None = None
    access_log: bool = True  # a log line per request
    response_role: str = "assistant"  # the role of a chat completion's message
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" instead of their text
    # cross-origin requests (server/cors.py): vLLM's defaults allow every origin, method and header
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class ServerState:
    """The engine handle, its readiness, admission (and its end, drain), the metrics and the token texts, shared by
    every route."""

    def __init__(self, engine: Any, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.model_names = config.served_model_names or (engine.model_name,)
        self.model_name = self.model_names[0]
        self.tokenizer = engine.tokenizer
        self.in_flight = 0  # engine requests admitted and not yet finished
        self.start_error: str | None = None
        self.start_task: asyncio.Task | None = None
        self.metrics = ServerMetrics(engine.stats, lambda: self.in_flight, self.model_name, engine.max_model_len)
        self.token_texts = TokenTexts(engine.tokenizer, config.return_tokens_as_token_ids)
        self.vocab_size = engine.config.vocab_size  # every token id a request sends is checked against it
        self._ignored: set[tuple[str, str]] = set()
        self.draining = False  # set by drain(): nothing new is admitted
        self.active: set[ChoiceFanout] = set()  # the requests whose engine work is not closed yet

    def ready(self) -> bool:
        return self.start_error is None and bool(self.engine.is_ready())

    def note_ignored(self, route: str, fields: list[str]) -> None:
        """Log the unknown fields of a request the first time each is seen on a route: they are accepted (clients
        send many) and change nothing."""
        new = [f for f in fields if (route, f) not in self._ignored]
        if new:
            self._ignored.update((route, f) for f in new)
            log.info("ignoring unknown request field(s) on %s: %s", route, ", ".join(sorted(new)))

    def admit(self, count: int) -> None:
        """Count `count` engine requests in, or refuse: 400 when the server could never hold them at once, 503 (retry
        later) when it is too busy now."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; send the request to another replica")
        capacity = self.config.max_num_seqs + self.config.max_queue_len
        if count > capacity:
            raise APIError(f"the request needs {count} sequences (prompts x choices), more than the server runs and "
                           f"queues at once ({capacity})", param="n")
        if self.in_flight + count > capacity:
            raise APIError(f"the server is at capacity ({self.in_flight} requests in flight, queue limit "
                           f"{self.config.max_queue_len}); retry later", status=503, type="service_unavailable",
                           code="queue_full", headers={"Retry-After": "1"})
        self.in_flight += count

    async def drain(self, graceful_timeout: float, hurry: asyncio.Event) -> None:
        """Shut down cleanly: admit nothing more; answer the requests that have no token yet 503; give the running
        ones until `graceful_timeout` (or `hurry`) to finish, then end each one (a 503 error body, or an SSE error
        event then [DONE]); return once every answer is written (or a few seconds later)."""
        self.draining = True
        waiting = [f for f in self.active if not f.started]
        for fanout in waiting:
            fanout.stop(ShuttingDown("the server is shutting down before this request started; retry it on "
                                     "another replica"))
        log.info("shutting down: %d request(s) not started refused; waiting up to %g s for %d running",
                 len(waiting), graceful_timeout, len(self.active) - len(waiting))
        deadline = time.monotonic() + graceful_timeout
        while self.active and time.monotonic() < deadline and not hurry.is_set():
            await asyncio.sleep(0.05)
        if self.active:
            log.info("shutting down: ending %d request(s) still running", len(self.active))
        for fanout in list(self.active):
            fanout.stop(ShuttingDown(f"the server shut down before this request finished (graceful timeout "
                                     f"{graceful_timeout:g} s)"))
        deadline = time.monotonic() + WRITE_SECONDS
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


class ShuttingDown(APIError):
    """A request the server refuses or ends because it is shutting down (503: retry elsewhere)."""

    def __init__(self, message: str):
        super().__init__(message, status=503, type="service_unavailable", code="shutting_down")


class TokenTexts:
    """The text and UTF-8 bytes of single tokens, as logprobs show them (cached per token id); `as_ids`: the text is
    "token_id:<id>" (vLLM's --return-tokens-as-token-ids, for tokens that are not valid UTF-8 alone)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            if token is None:
                cached = ("", [])
            elif all(ch in self._byte_decoder for ch in token):
                raw = bytes(self._byte_decoder[ch] for ch in token)
                cached = (raw.decode("utf-8", errors="replace"), list(raw))
            else:
                text = self.tokenizer.convert_tokens_to_string([token])
                cached = (text, list(text.encode()))
            if self.as_ids:
                cached = (f"token_id:{token_id}", cached[1])
            self._cache[token_id] = cached
        return cached


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character map used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- one engine request per choice -------------------------------------------------------------------------------

@dataclasses.dataclass
class Prompt:
    token_ids: list[int]
    text: str  # what `echo` repeats ("" when nothing will)


@dataclasses.dataclass
class Job:
    """One engine request: one choice of one prompt."""

    index: int  # choice index in the response
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    finished: bool = False


class ChoiceFanout:
    """Runs one engine request per job concurrently and merges their outputs in arrival order. Listed in the
    state's `active` from its start until aclose()."""

    def __init__(self, state: ServerState, jobs: list[Job]):
        self.state = state
        self.jobs = jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.remaining = len(jobs)
        self.started = False  # an output came (the engine runs it): a shutdown lets it finish
        self.stopped: APIError | None = None
        self.tasks = [asyncio.create_task(self._pump(job)) for job in jobs]
        state.active.add(self)

    async def _pump(self, job: Job) -> None:
        metrics = self.state.metrics
        start, first, previous, last = time.monotonic(), None, None, None
        reason = "abort"  # unless it finishes: the client went away, or the request was cancelled
        try:
            async for out in self.state.engine.generate(job.prompt_ids, job.params, job.request_id):
                now = time.monotonic()
                if out.delta_token_ids:
                    if first is None:  # tokens that came with the first came with no interval
                        first = now
                        metrics.observe_tokens(len(out.delta_token_ids) - 1, 0.0)
                    else:
                        metrics.observe_tokens(len(out.delta_token_ids), now - previous)
                    previous = now
                last = out
                if out.finished:
                    job.finished = True
                    reason = out.finish_reason or "unknown"
                self.queue.put_nowait((job, out))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaced to the route by next()
            reason = "error"
            self.queue.put_nowait((job, exc))
        finally:
            metrics.observe_sequence(reason, len(job.prompt_ids), len(last.token_ids) if last is not None else 0,
                                     job.params.max_tokens, start, first, time.monotonic(),
                                     last.queue_seconds if last is not None else None)
            self.state.in_flight -= 1
            self.queue.put_nowait((job, None))

    async def next(self) -> tuple[Job, RequestOutput] | None:
        """The next output of any choice; None once all are done. Re-raises an engine exception, and the error of
        stop()."""
        while self.remaining:
            if self.stopped is not None:
                raise self.stopped
            job, item = await self.queue.get()
            if item is None:
                self.remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            self.started = True
            return job, item
        return None

    def stop(self, error: APIError) -> None:
        """End the request: its reader gets `error` from next() (then closes it, which aborts the engine work)."""
        self.stopped = error
        self.queue.put_nowait((None, None))  # wakes a reader waiting in next()
        self.remaining += 1  # for that wake-up item, which counts as no choice

    async def aclose(self) -> None:
        """Cancel whatever still runs (the engine aborts those requests) and wait until it has."""
        self.state.active.discard(self)
        live = [t for t in self.tasks if not t.done()]
        for task in live:
            task.cancel()
        if live:
            await asyncio.gather(*live, return_exceptions=True)
        for job in self.jobs:
            if not job.finished:
                await self.state.engine.abort(job.request_id)


class ClosingStream:
    """An SSE body whose aclose() always releases the engine requests, even if iteration never started."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        self.body = body
        self.on_close = on_close

    def __aiter__(self) -> ClosingStream:
        return self

    async def __anext__(self) -> str:
        return await self.body.__anext__()

    async def aclose(self) -> None:
        try:
            await self.body.aclose()
        finally:
            await self.on_close()


# ---- the endpoints' common shape ---------------------------------------------------------------------------------

class ChoiceWriter:
    """How one choice of one endpoint is written, in a stream (piece by piece) and whole."""

    def opening(self) -> dict | None:
        """The fields of the choice's first stream chunk, sent before any token (None: no such chunk)."""
        return None

    def piece(self, out: RequestOutput, logprobs: list[TokenLogprob] | None) -> dict:
        """The fields of the stream chunk for this output's new tokens (`logprobs`: theirs, when the request shows
        logprobs); all values empty when there is nothing new to send."""
        raise NotImplementedError

    def whole(self, out: RequestOutput) -> dict:
        """The fields of the finished choice in a non-streamed response."""
        raise NotImplementedError

    def finish_reason(self, out: RequestOutput) -> str | None:
        """The finished choice's finish_reason (after `whole` or the last `piece`)."""
        return out.finish_reason


class Serving:
    """One generation endpoint: subclasses build the prompts and the choice writers; this runs the engine requests
    and writes the response body or the stream."""

    object_name = ""  # the response's "object"
    chunk_object_name = ""  # a stream chunk's "object"
    id_prefix = ""
    prompt_param = ""  # the request field that errors about the prompt name

    def __init__(self, state: ServerState):
        self.state = state

    def prompts(self, req: GenerationRequest) -> list[Prompt]:
        raise NotImplementedError

    def writer(self, req: GenerationRequest, prompt: Prompt) -> ChoiceWriter:
        raise NotImplementedError

    def constrained(self, req: GenerationRequest) -> bool:
        """Whether the request's output must match a grammar (cheap: no grammar is built)."""
        return req.constraint() is not None

    def constraint(self, req: GenerationRequest) -> tuple[StructuredOutputsParams, str] | None:
        """What the request's output must match and the parameter that asked for it (None: free text)."""
        return req.constraint(**JSON_WHITESPACE[self.state.config.json_whitespace])

    def _checked_constraint(self, req: GenerationRequest) -> StructuredOutputsParams | None:
        """The constraint with its grammar parsed: a 400 naming the parameter when it does not parse. Runs on a
        worker thread: a large schema takes milliseconds."""
        found = self.constraint(req)
        if found is None:
            return None
        spec, param = found
        try:
            check_structured_outputs(spec)
        except ValueError as exc:
            raise APIError(str(exc), param=param) from None
        return spec

    def jobs(self, req: GenerationRequest, prompts: list[Prompt],
             constraint: StructuredOutputsParams | None = None) -> list[Job]:
        """One engine job per (prompt, candidate), with max_tokens checked against, or filled from, the context left,
        and the output constrained by `constraint`; prompts longer than truncate_prompt_tokens lose their beginning
        first."""
        max_len = self.state.engine.max_model_len
        what = self.prompt_param
        base = uuid.uuid4().hex
        defaults = self.state.engine.sampling_defaults
        given, cap = req.max_tokens_given, defaults.get("max_tokens")  # (max_new_tokens caps every request)
        if given is not None and cap is not None:
            given = min(given, cap)
        jobs = []
        for pi, prompt in enumerate(prompts):
            if req.truncate_prompt_tokens is not None and len(prompt.token_ids) > req.truncate_prompt_tokens:
                prompt.token_ids = prompt.token_ids[-req.truncate_prompt_tokens:]
                if prompt.text:  # echo repeats what the model was given
                    prompt.text = self.state.tokenizer.decode(prompt.token_ids)
            ids = prompt.token_ids
            if not ids:
                raise APIError(f"the {what} is empty after tokenization", param=what)
            try:
                params = dataclasses.replace(req.sampling_params(defaults), structured_outputs=constraint)
            except ValueError as exc:  # SamplingParams' own checks (the protocol's bounds are tighter)
                raise APIError(str(exc)) from None
            if given is not None:
                params = dataclasses.replace(params, max_tokens=given)
                if len(ids) + given > max_len:
                    raise APIError(f"This model's maximum context length is {max_len} tokens. However, you "
                                   f"requested {len(ids) + given} tokens ({len(ids)} in the {what}, {given} in the "
                                   f"completion). Please reduce the length of the {what} or completion.", param=what,
                                   code="context_length_exceeded")
            else:
                room = max_len - len(ids)
                if room < max(1, params.min_tokens):
                    raise APIError(f"This model's maximum context length is {max_len} tokens. However, your {what} "
                                   f"has {len(ids)} tokens, which leaves no room for the completion.", param=what,
                                   code="context_length_exceeded")
                params = dataclasses.replace(params, max_tokens=room if cap is None else min(room, cap))
            for j in range(req.candidates):
                choice = params
                if params.seed is not None and req.candidates > 1:
                    choice = dataclasses.replace(params, seed=params.seed + j)
                jobs.append(Job(index=pi * req.candidates + j, prompt_index=pi, prompt_ids=ids, params=choice,
                                request_id=f"{self.id_prefix}-{base}-{pi}-{j}"))
        return jobs

    async def generate(self, req: GenerationRequest) -> dict | ClosingStream:
        """The response body, or the SSE stream when the request asks for one."""
        prompts = self.prompts(req)
        constraint = await asyncio.to_thread(self._checked_constraint, req) if self.constrained(req) else None
        jobs = self.jobs(req, prompts, constraint)
        self.state.admit(len(jobs))
        fanout = ChoiceFanout(self.state, jobs)
        try:
            first = await fanout.next()
        except ValueError as exc:  # the engine's own check of the prompt
            await fanout.aclose()
            raise APIError(str(exc), param=self.prompt_param) from None
        except RequestFailed as exc:
            await fanout.aclose()
            raise failed(exc) from None
        except BaseException:
            await fanout.aclose()
            raise
        rid = jobs[0].request_id.rsplit("-", 2)[0]
        if req.stream:
            writers = {job.index: self.writer(req, prompts[job.prompt_index]) for job in jobs}
            return ClosingStream(self._stream(req, rid, prompts, jobs, writers, fanout, first), fanout.aclose)
        finals: dict[int, RequestOutput] = {}
        try:
            item = first
            while item is not None:
                job, out = item
                finals[job.index] = out
                item = await fanout.next()
        except ValueError as exc:
            raise APIError(str(exc)) from None
        except RequestFailed as exc:
            raise failed(exc) from None
        finally:
            await fanout.aclose()
        choices = []
        for index, job in enumerate(self._best(req, jobs, finals)):
            out = finals[job.index]
            writer = self.writer(req, prompts[job.prompt_index])
            choices.append({"index": index, **writer.whole(out), "finish_reason": writer.finish_reason(out),
                            "stop_reason": out.stop_reason})
        return {"id": rid, "object": self.object_name, "created": int(time.time()), "model": self.state.model_name,
                "choices": choices, "usage": usage(prompts, jobs, finals)}

    @staticmethod
    def _best(req: GenerationRequest, jobs: list[Job], finals: dict[int, RequestOutput]) -> list[Job]:
        """Each prompt's n returned choices, in order: with best_of candidates, the n of the highest cumulative
        logprob (as vLLM chooses them)."""
        if req.candidates == req.n:
            return jobs
        chosen = []
        for pi in range(len(jobs) // req.candidates):
            own = [job for job in jobs if job.prompt_index == pi]
            own.sort(key=lambda job: -sum(lp.logprob for lp in finals[job.index].logprobs or []))
            chosen += own[:req.n]
        return chosen

    async def _stream(self, req: GenerationRequest, rid: str, prompts: list[Prompt], jobs: list[Job],
                      writers: dict[int, ChoiceWriter], fanout: ChoiceFanout, first: tuple | None
                      ) -> AsyncIterator[str]:
        head = {"id": rid, "object": self.chunk_object_name, "created": int(time.time()),
                "model": self.state.model_name}
        extra = {"usage": None} if req.include_usage else {}
        for job in jobs:
            opening = writers[job.index].opening()
            if opening is not None:
                yield sse({**head, "choices": [{"index": job.index, **opening, "finish_reason": None}], **extra})
        sent_tokens = {job.index: 0 for job in jobs}
        finals: dict[int, RequestOutput] = {}
        item = first
        try:
            while item is not None:
                job, out = item
                finals[job.index] = out
                logprobs = None
                if req.requested_logprobs is not None and out.delta_token_ids:
                    logprobs = new_logprobs(out, sent_tokens[job.index])
                sent_tokens[job.index] = len(out.token_ids)
                fields = writers[job.index].piece(out, logprobs)
                if any(fields.values()) or out.finished:
                    choice = {"index": job.index, **fields,
                              "finish_reason": writers[job.index].finish_reason(out) if out.finished else None}
                    if out.finished:
                        choice["stop_reason"] = out.stop_reason
                    yield sse({**head, "choices": [choice], **extra})
                item = await fanout.next()
        except ValueError as exc:
            yield sse(error_body(str(exc)))
        except (EngineDead, RequestFailed) as exc:  # the stream still ends well-formed: an error event, then [DONE]
            yield sse(error_body(str(exc), "server_error"))
        except APIError as exc:  # the server is shutting down
            yield sse(exc.body())
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompts, jobs, finals)})
        yield "data: [DONE]\n\n"


def failed(exc: RequestFailed) -> APIError:
    """A request the engine failed on alone (the others go on): a 500 that says what went wrong."""
    return APIError(str(exc), status=500, type="server_error")


def usage(prompts: list[Prompt], jobs: list[Job], finals: dict[int, RequestOutput]) -> dict:
    prompt = sum(len(p.token_ids) for p in prompts)
    completion = sum(len(finals[j.index].token_ids) for j in jobs if j.index in finals)
    cached = 0
    for pi in range(len(prompts)):
        hits = [finals[j.index].num_cached_tokens for j in jobs if j.prompt_index == pi and j.index in finals]
        cached += min(hits) if hits else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_logprobs(out: RequestOutput, already: int) -> list[TokenLogprob]:
    """The logprobs of this output's new tokens (the engine's list is cumulative or per-delta)."""
    if not out.logprobs:
        return []
    if len(out.logprobs) == len(out.token_ids):
        return out.logprobs[already:]
    return out.logprobs[-len(out.delta_token_ids):] if out.delta_token_ids else []
