"""The Quart app: OpenAI-compatible routes (chat, completions, /invocations), health, models, tokenize and metrics.

Owns request admission and response shaping only; never computes tokens itself and never lets bad input escape as
anything but a JSON error body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from qwen_jax.llm import EngineDead
from qwen_jax.outputs import RequestOutput, TokenLogprob
from qwen_jax.sampling_params import SamplingParams
from server.chat import ReasoningSplitter, encode_prompt, render_chat
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import (
    APIError,
    ParsedRequest,
    error_body,
    parse_chat,
    parse_completion,
    parse_invocation,
    parse_json,
)

log = logging.getLogger("qwen_jax.server")

PROTECTED_PREFIXES = ("/v1/", "/invocations", "/tokenize")


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str | None = None
    api_key: str | None = None
    max_num_seqs: int = 64  # the engine's batch (all replicas); admission allows this many running plus the queue
    max_queue_len: int = 1024  # engine requests allowed to wait beyond max_num_seqs; more get 503
    max_body_bytes: int = 4 * 1024 * 1024


@dataclasses.dataclass
class _Job:
    index: int  # choice index in the response
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    finished: bool = False


class ServerState:
    """The engine handle, its readiness, the admission counter and the metrics, shared by every route."""

    def __init__(self, engine: Any, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.model_name = config.served_model_name or engine.model_name
        self.tokenizer = engine.tokenizer
        self.in_flight = 0  # engine requests admitted and not yet finished
        self.start_error: str | None = None
        self.start_task: asyncio.Task | None = None
        self.metrics = ServerMetrics(engine.stats, lambda: self.in_flight)
        self._token_text: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}

    def ready(self) -> bool:
        return self.start_error is None and bool(self.engine.is_ready())

    def admit(self, count: int) -> None:
        capacity = self.config.max_num_seqs + self.config.max_queue_len
        if self.in_flight + count > capacity:
            raise APIError(f"the server is at capacity ({self.in_flight} requests in flight, queue limit "
                           f"{self.config.max_queue_len}); retry later", status=503, type="service_unavailable",
                           code="queue_full", headers={"Retry-After": "1"})
        self.in_flight += count

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """(text, utf-8 bytes) of one token, for logprobs."""
        cached = self._token_text.get(token_id)
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
            self._token_text[token_id] = cached
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


# ---- responses ---------------------------------------------------------------------------------------------------

def _json(obj: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status, headers=headers or {},
                    content_type="application/json")


def _error(exc: APIError) -> Response:
    return _json(exc.body(), exc.status, exc.headers)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- engine fan-out ----------------------------------------------------------------------------------------------

class _Choices:
    """Runs one engine request per (prompt, choice) concurrently and merges their outputs in arrival order."""

    def __init__(self, state: ServerState, jobs: list[_Job]):
        self.state = state
        self.jobs = jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.remaining = len(jobs)
        self.tasks = [asyncio.create_task(self._pump(job)) for job in jobs]

    async def _pump(self, job: _Job) -> None:
        start, first, last = time.monotonic(), None, None
        try:
            async for out in self.state.engine.generate(job.prompt_ids, job.params, job.request_id):
                if first is None and out.delta_token_ids:
                    first = time.monotonic()
                last = out
                if out.finished:
                    job.finished = True
                self.queue.put_nowait((job, out))
            if last is not None:
                self.state.metrics.observe_sequence(last.finish_reason or "", len(job.prompt_ids),
                                                    len(last.token_ids), start, first, time.monotonic())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaced to the route by next()
            self.queue.put_nowait((job, exc))
        finally:
            self.state.in_flight -= 1
            self.queue.put_nowait((job, None))

    async def next(self) -> tuple[_Job, RequestOutput] | None:
        """The next output of any choice; None once all are done. Re-raises an engine exception."""
        while self.remaining:
            job, item = await self.queue.get()
            if item is None:
                self.remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            return job, item
        return None

    async def aclose(self) -> None:
        """Cancel whatever still runs (the engine aborts those requests) and wait until it has."""
        live = [t for t in self.tasks if not t.done()]
        for task in live:
            task.cancel()
        if live:
            await asyncio.gather(*live, return_exceptions=True)
        for job in self.jobs:
            if not job.finished:
                await self.state.engine.abort(job.request_id)


class _ClosingStream:
    """An SSE body whose aclose() always releases the engine requests, even if iteration never started."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        self.body = body
        self.on_close = on_close

    def __aiter__(self) -> _ClosingStream:
        return self

    async def __anext__(self) -> str:
        return await self.body.__anext__()

    async def aclose(self) -> None:
        try:
            await self.body.aclose()
        finally:
            await self.on_close()


# ---- request preparation -----------------------------------------------------------------------------------------

def _prepare(state: ServerState, req: ParsedRequest) -> tuple[list[list[int]], list[str], list[_Job]]:
    """Tokenize, check lengths against max_model_len and build one engine job per choice."""
    tok = state.tokenizer
    max_len = state.engine.max_model_len
    if req.kind == "chat":
        text = render_chat(tok, req.messages, req.enable_thinking)
        prompts_ids, texts = [encode_prompt(tok, text)], [text]
        what, param = "messages", "messages"
    else:
        prompts_ids, texts = [], []
        vocab = len(tok)
        for p in req.prompts:
            if isinstance(p, str):
                prompts_ids.append(list(tok.encode(p)))
                texts.append(p)
            else:
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise APIError(f"prompt token id {bad[0]} is out of range [0, {vocab})", param="prompt")
                prompts_ids.append(list(p))
                texts.append(tok.decode(p) if req.echo else "")
        what, param = "prompt", "prompt"
    base = uuid.uuid4().hex
    jobs = []
    for pi, ids in enumerate(prompts_ids):
        if not ids:
            raise APIError(f"the {what} is empty after tokenization", param=param)
        params = req.params
        if req.max_tokens_given:
            if len(ids) + params.max_tokens > max_len:
                raise APIError(f"This model's maximum context length is {max_len} tokens. However, you requested "
                               f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the {what}, "
                               f"{params.max_tokens} in the completion). Please reduce the length of the {what} or "
                               "completion.", param=param, code="context_length_exceeded")
        else:
            room = max_len - len(ids)
            if room < max(1, params.min_tokens):
                raise APIError(f"This model's maximum context length is {max_len} tokens. However, your {what} "
                               f"has {len(ids)} tokens, which leaves no room for the completion.", param=param,
                               code="context_length_exceeded")
            params = dataclasses.replace(params, max_tokens=room)
        for j in range(req.n):
            choice = params
            if params.seed is not None and req.n > 1:
                choice = dataclasses.replace(params, seed=params.seed + j)
            jobs.append(_Job(index=pi * req.n + j, prompt_index=pi, prompt_ids=ids, params=choice,
                             request_id=f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{base}-{pi}-{j}"))
    return prompts_ids, texts, jobs


def _usage(prompts_ids: list[list[int]], jobs: list[_Job], finals: dict[int, RequestOutput]) -> dict:
    prompt = sum(len(ids) for ids in prompts_ids)
    completion = sum(len(finals[j.index].token_ids) for j in jobs if j.index in finals)
    cached = 0
    for pi in range(len(prompts_ids)):
        hits = [finals[j.index].num_cached_tokens for j in jobs if j.prompt_index == pi and j.index in finals]
        cached += min(hits) if hits else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _new_logprobs(out: RequestOutput, already: int) -> list[TokenLogprob]:
    """The logprobs of this output's new tokens (the engine's list is cumulative or per-delta)."""
    if not out.logprobs:
        return []
    if len(out.logprobs) == len(out.token_ids):
        return out.logprobs[already:]
    return out.logprobs[-len(out.delta_token_ids):] if out.delta_token_ids else []


def _chat_logprobs(state: ServerState, items: list[TokenLogprob]) -> dict:
    content = []
    for lp in items:
        text, raw = state.token_text(lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = state.token_text(tid)
            top.append({"token": t, "logprob": value, "bytes": b})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def _completion_logprobs(state: ServerState, items: list[TokenLogprob], offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for lp in items:
        text, _ = state.token_text(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        top = {text: lp.logprob}
        top.update({state.token_text(tid)[0]: value for tid, value in lp.top})
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


# ---- the app -----------------------------------------------------------------------------------------------------

def create_app(engine: Any, config: ServerConfig | None = None) -> Quart:
    """Build the app around an AsyncLLM-like engine. Serving it starts the engine (load + warm-up) in the
    background; /health answers 503 until that is done."""
    config = config or ServerConfig()
    app = Quart("qwen_jax_server")
    app.config.update(MAX_CONTENT_LENGTH=config.max_body_bytes, RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60)
    state = ServerState(engine, config)
    app.extensions["qwen_jax"] = state

    @app.before_serving
    async def _start_engine() -> None:
        async def start() -> None:
            try:
                await engine.start()
                log.info("engine ready: %s (max_model_len %d)", state.model_name, engine.max_model_len)
            except Exception as exc:
                state.start_error = f"{type(exc).__name__}: {exc}"
                log.exception("engine failed to start")

        state.start_task = asyncio.create_task(start())

    @app.after_serving
    async def _stop_engine() -> None:
        if state.start_task is not None and not state.start_task.done():
            state.start_task.cancel()
            await asyncio.gather(state.start_task, return_exceptions=True)
        await engine.shutdown()

    @app.before_request
    async def _auth_and_readiness() -> Response | None:
        path = request.path
        if not path.startswith(PROTECTED_PREFIXES):
            return None
        if config.api_key:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                return _json(error_body("invalid or missing API key", "authentication_error", None,
                                        "invalid_api_key"), 401, {"WWW-Authenticate": "Bearer"})
        if engine.error is not None:  # the core died: refused as the requests it was running were, not "loading"
            raise EngineDead(f"the engine core died: {engine.error}")
        if not state.ready():
            return _json(error_body("the model is still loading" if state.start_error is None else
                                    f"the model failed to load: {state.start_error}", "service_unavailable"),
                         503, {"Retry-After": "5"})
        return None

    @app.after_request
    async def _count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        state.metrics.observe_request(rule, response.status_code)
        return response

    @app.errorhandler(APIError)
    async def _api_error(exc: APIError) -> Response:
        return _error(exc)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 413:
            message = f"request body is larger than the limit of {config.max_body_bytes} bytes"
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _json(error_body(message, kind, None, exc.name.lower().replace(" ", "_")), status)

    @app.errorhandler(EngineDead)
    async def _engine_dead(exc: EngineDead) -> Response:
        return _json(error_body(str(exc), "server_error"), 500)

    @app.errorhandler(Exception)
    async def _internal(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json(error_body(f"internal server error: {type(exc).__name__}", "server_error"), 500)

    # ---- plain routes ----

    async def health() -> Response:
        if state.ready():
            return _json({"status": "ok"})
        if engine.error is not None:  # the engine core died: this process is about to exit non-zero
            return _json({"status": f"engine failed: {engine.error}"}, 500)
        status = "loading" if state.start_error is None else f"failed: {state.start_error}"
        return _json({"status": status}, 503, {"Retry-After": "5"})

    app.add_url_rule("/health", "health", health, methods=["GET"])
    app.add_url_rule("/ping", "ping", health, methods=["GET"])

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "qwen-jax",
            "root": state.model_name, "parent": None, "max_model_len": engine.max_model_len}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = parse_json(await request.get_data())
        if "messages" in body:
            req = parse_chat(body)
            ids = encode_prompt(state.tokenizer, render_chat(state.tokenizer, req.messages, req.enable_thinking))
        else:
            req = parse_completion(body)
            if len(req.prompts) != 1:
                raise APIError("/tokenize takes one prompt", param="prompt")
            p = req.prompts[0]
            ids = list(state.tokenizer.encode(p)) if isinstance(p, str) else list(p)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    # ---- generation ----

    async def generate(req: ParsedRequest) -> Response:
        prompts_ids, texts, jobs = _prepare(state, req)
        state.admit(len(jobs))
        choices = _Choices(state, jobs)
        try:
            first = await choices.next()
        except ValueError as exc:  # the engine's own check of the prompt
            await choices.aclose()
            raise APIError(str(exc), param="messages" if req.kind == "chat" else "prompt") from None
        except BaseException:
            await choices.aclose()
            raise
        rid = jobs[0].request_id.rsplit("-", 2)[0]
        if req.stream:
            body = _stream_chat(state, req, rid, prompts_ids, jobs, choices, first) if req.kind == "chat" else \
                _stream_completion(state, req, rid, prompts_ids, texts, jobs, choices, first)
            return Response(_ClosingStream(body, choices.aclose), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals: dict[int, RequestOutput] = {}
        try:
            item = first
            while item is not None:
                job, out = item
                finals[job.index] = out
                item = await choices.next()
        except ValueError as exc:
            raise APIError(str(exc)) from None
        finally:
            await choices.aclose()
        builder = _chat_response if req.kind == "chat" else _completion_response
        return _json(builder(state, req, rid, prompts_ids, texts, jobs, finals))

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate(parse_chat(parse_json(await request.get_data())))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate(parse_completion(parse_json(await request.get_data())))

    @app.post("/invocations")
    async def invocations() -> Response:
        return await generate(parse_invocation(parse_json(await request.get_data())))

    return app


# ---- response bodies ---------------------------------------------------------------------------------------------

def _chat_response(state: ServerState, req: ParsedRequest, rid: str, prompts_ids: list[list[int]],
                   texts: list[str], jobs: list[_Job], finals: dict[int, RequestOutput]) -> dict:
    choices = []
    for job in jobs:
        out = finals[job.index]
        split = ReasoningSplitter(req.enable_thinking)
        reasoning, content = split.feed(out.text)
        r2, c2 = split.flush()
        message: dict[str, Any] = {"role": "assistant", "content": content + c2}
        if req.enable_thinking:
            message["reasoning_content"] = reasoning + r2
        choice = {"index": job.index, "message": message, "logprobs": None,
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if job.params.logprobs is not None:
            choice["logprobs"] = _chat_logprobs(state, out.logprobs or [])
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": _usage(prompts_ids, jobs, finals)}


def _completion_response(state: ServerState, req: ParsedRequest, rid: str, prompts_ids: list[list[int]],
                         texts: list[str], jobs: list[_Job], finals: dict[int, RequestOutput]) -> dict:
    choices = []
    for job in jobs:
        out = finals[job.index]
        prefix = texts[job.prompt_index] if req.echo else ""
        choice = {"index": job.index, "text": prefix + out.text, "logprobs": None,
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if job.params.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(state, out.logprobs or [], len(prefix))
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": _usage(prompts_ids, jobs, finals)}


def _chunk(head: dict, extra: dict, job: _Job, out: RequestOutput, body: dict) -> str:
    """One streamed choice: its new delta/text and logprobs, plus the finish reason once it has finished."""
    choice = {"index": job.index, **body, "finish_reason": out.finish_reason if out.finished else None}
    if out.finished:
        choice["stop_reason"] = out.stop_reason
    return _sse({**head, "choices": [choice], **extra})


def _stream_end(req: ParsedRequest, head: dict, prompts_ids: list[list[int]], jobs: list[_Job],
                finals: dict[int, RequestOutput]) -> list[str]:
    """The closing events of a stream: the usage chunk when asked for, then [DONE]."""
    end = [_sse({**head, "choices": [], "usage": _usage(prompts_ids, jobs, finals)})] if req.include_usage else []
    return [*end, "data: [DONE]\n\n"]


async def _stream_chat(state: ServerState, req: ParsedRequest, rid: str, prompts_ids: list[list[int]],
                       jobs: list[_Job], choices: _Choices, first: tuple | None) -> AsyncIterator[str]:
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
    extra = {"usage": None} if req.include_usage else {}
    splitters = {job.index: ReasoningSplitter(req.enable_thinking) for job in jobs}
    sent_tokens = {job.index: 0 for job in jobs}
    finals: dict[int, RequestOutput] = {}
    for job in jobs:  # the role comes first, once per choice
        yield _sse({**head, "choices": [{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], **extra})
    item = first
    try:
        while item is not None:
            job, out = item
            finals[job.index] = out
            reasoning, content = splitters[job.index].feed(out.delta_text)
            if out.finished:
                r2, c2 = splitters[job.index].flush()
                reasoning, content = reasoning + r2, content + c2
            delta: dict[str, Any] = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            logprobs = None
            if job.params.logprobs is not None and out.delta_token_ids:
                logprobs = _chat_logprobs(state, _new_logprobs(out, sent_tokens[job.index]))
            sent_tokens[job.index] = len(out.token_ids)
            if delta or logprobs or out.finished:
                yield _chunk(head, extra, job, out, {"delta": delta, "logprobs": logprobs})
            item = await choices.next()
    except ValueError as exc:
        yield _sse(error_body(str(exc)))
    except EngineDead as exc:  # the stream still ends well-formed: an error event, then [DONE]
        yield _sse(error_body(str(exc), "server_error"))
    for line in _stream_end(req, head, prompts_ids, jobs, finals):
        yield line


async def _stream_completion(state: ServerState, req: ParsedRequest, rid: str, prompts_ids: list[list[int]],
                             texts: list[str], jobs: list[_Job], choices: _Choices, first: tuple | None
                             ) -> AsyncIterator[str]:
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    extra = {"usage": None} if req.include_usage else {}
    sent_tokens = {job.index: 0 for job in jobs}
    offsets = {job.index: 0 for job in jobs}
    echoed: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    item = first
    try:
        while item is not None:
            job, out = item
            finals[job.index] = out
            text = out.delta_text
            if req.echo and job.index not in echoed:
                echoed.add(job.index)
                text = texts[job.prompt_index] + text
            logprobs = None
            if job.params.logprobs is not None and out.delta_token_ids:
                logprobs = _completion_logprobs(state, _new_logprobs(out, sent_tokens[job.index]),
                                                offsets[job.index])
            offsets[job.index] += len(text)
            sent_tokens[job.index] = len(out.token_ids)
            if text or logprobs or out.finished:
                yield _chunk(head, extra, job, out, {"text": text, "logprobs": logprobs})
            item = await choices.next()
    except ValueError as exc:
        yield _sse(error_body(str(exc)))
    except EngineDead as exc:  # the stream still ends well-formed: an error event, then [DONE]
        yield _sse(error_body(str(exc), "server_error"))
    for line in _stream_end(req, head, prompts_ids, jobs, finals):
        yield line
