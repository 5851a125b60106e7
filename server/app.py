"""The Quart app: the routes (chat, completions, /invocations, health, models, tokenize, metrics), authentication,
readiness and the error handlers that turn every failure into an OpenAI error body.

Owns HTTP only: request bodies are parsed by protocol.py and served by serving_chat.py / serving_completion.py;
never computes tokens itself and never lets bad input escape as anything but a JSON error body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from qwen_jax import EngineDead
from server.access_log import AccessLog
from server.body_limit import BodyLimit
from server.cors import Cors
from server.metrics import CONTENT_TYPE
from server.openapi import openapi_document
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    ignored_fields,
    parse_json,
    validate,
)
from server.serving import ClosingStream, ServerConfig, ServerState, ShuttingDown
from server.serving_chat import ChatServing, chat_prompt_ids
from server.serving_completion import CompletionServing
from server.version import version

log = logging.getLogger("qwen_jax.server")

PROTECTED_PREFIXES = ("/v1/", "/invocations", "/tokenize", "/detokenize")


def _json(obj: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status, headers=headers or {},
                    content_type="application/json")


def _error_json(body: dict, status: int, headers: dict | None = None) -> Response:
    """An error body in ASCII JSON: whatever a message quotes from the request, it encodes."""
    return Response(json.dumps(body), status=status, headers=headers or {}, content_type="application/json")


def create_app(engine: Any, config: ServerConfig | None = None) -> Quart:
    """Build the app around an AsyncLLM-like engine. Serving it starts the engine (load + warm-up) in the
    background; /health answers 503 until that is done."""
    config = config or ServerConfig()
    app = Quart("qwen_jax_server")
    app.config.update(MAX_CONTENT_LENGTH=config.max_body_bytes, RESPONSE_TIMEOUT=None, BODY_TIMEOUT=60)
    app.asgi_app = BodyLimit(app.asgi_app, config.max_body_bytes)
    app.asgi_app = Cors(app.asgi_app, config.allowed_origins, config.allowed_methods, config.allowed_headers,
                        config.allow_credentials)
    if config.access_log:
        app.asgi_app = AccessLog(app.asgi_app)
    state = ServerState(engine, config)
    app.extensions["qwen_jax"] = state
    chat = ChatServing(state)
    completion = CompletionServing(state)

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
                return _error_json(error_body("invalid or missing API key", "authentication_error", None,
                                              "invalid_api_key"), 401, {"WWW-Authenticate": "Bearer"})
        if engine.error is not None:  # the core died: refused as the requests it was running were, not "loading"
            raise EngineDead(f"the engine core died: {engine.error}")
        if state.draining:
            raise ShuttingDown("the server is shutting down; send the request to another replica")
        if not state.ready():
            return _error_json(error_body("the model is still loading" if state.start_error is None else
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
        return _error_json(exc.body(), exc.status, exc.headers)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 413:
            message = f"request body is larger than the limit of {config.max_body_bytes} bytes"
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _error_json(error_body(message, kind, None, exc.name.lower().replace(" ", "_")), status)

    @app.errorhandler(EngineDead)
    async def _engine_dead(exc: EngineDead) -> Response:
        return _error_json(error_body(str(exc), "server_error"), 500)

    @app.errorhandler(Exception)
    async def _internal(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_json(error_body(f"internal server error: {type(exc).__name__}", "server_error"), 500)

    # ---- plain routes ----

    async def health() -> Response:
        if state.draining:
            return _json({"status": "shutting down"}, 503)
        if state.ready():
            return _json({"status": "ok"})
        if engine.error is not None:  # the engine core died: this process is about to exit non-zero
            return _json({"status": f"engine failed: {engine.error}"}, 500)
        status = "loading" if state.start_error is None else f"failed: {state.start_error}"
        return _json({"status": status}, 503, {"Retry-After": "5"})

    app.add_url_rule("/health", "health", health, methods=["GET"])
    app.add_url_rule("/ping", "ping", health, methods=["GET"])

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "qwen-jax",
                "root": state.model_name, "parent": None, "max_model_len": engine.max_model_len}

    def check_model(name: str | None) -> None:
        """A request may name any of the served names, or none (vLLM's rule); another name is a 404."""
        if name and name not in state.model_names:
            raise APIError(f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found")

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [model_card(name) for name in state.model_names]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        check_model(model_id)
        return _json(model_card(model_id))

    @app.get("/version")
    async def server_version() -> Response:
        return _json({"version": version()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return _json(openapi_document("qwen-jax OpenAI-compatible API", version()))

    def typed(model: type, body: dict) -> Any:
        """A decoded body as `model`, its unknown fields logged (once per field and route), its `model` served."""
        req = validate(model, body, state.vocab_size, config.max_logprobs)
        state.note_ignored(request.path, ignored_fields(req))
        check_model(req.model)
        return req

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = parse_json(await request.get_data())
        req = typed(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
        if isinstance(req, TokenizeChatRequest):
            ids = chat_prompt_ids(state.tokenizer, req, config.chat_template)
        elif isinstance(req.prompt, str):
            ids = list(state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            ids = list(req.prompt)
        result: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if req.return_token_strs:
            result["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return _json(result)

    @app.post("/detokenize")
    async def detokenize() -> Response:
        req = typed(DetokenizeRequest, parse_json(await request.get_data()))
        return _json({"prompt": state.tokenizer.decode(req.tokens)})

    # ---- generation ----

    async def generate(req: GenerationRequest) -> Response:
        result = await (chat if isinstance(req, ChatCompletionRequest) else completion).generate(req)
        if isinstance(result, ClosingStream):
            return Response(result, content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return _json(result)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate(typed(ChatCompletionRequest, parse_json(await request.get_data())))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate(typed(CompletionRequest, parse_json(await request.get_data())))

    @app.post("/invocations")
    async def invocations() -> Response:
        """A chat body (has `messages`) or a completion body (has `prompt`)."""
        body = parse_json(await request.get_data())
        if "messages" in body:
            model: type = ChatCompletionRequest
        elif "prompt" in body:
            model = CompletionRequest
        else:
            raise APIError("an /invocations body needs 'messages' (chat) or 'prompt' (completion)",
                           param="messages")
        return await generate(typed(model, body))

    return app
