"""The OpenAPI 3.1 document served at /openapi.json, built from the request models of protocol.py.

Describes the routes; never validates anything itself (protocol.py does).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer (OpenAI's error body): `param` names the offending request field."""

    error: ErrorDetail


_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _body(*models: type[BaseModel]) -> dict:
    schema = _ref(models[0]) if len(models) == 1 else {"oneOf": [_ref(m) for m in models]}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _answers(description: str, content_type: str = "application/json", errors: bool = True) -> dict:
    answers: dict[str, Any] = {"200": {"description": description, "content": {content_type: {"schema": {}}}}}
    if errors:
        error = {"content": {"application/json": {"schema": _ref(ErrorResponse)}}}
        answers["4XX"] = {"description": "the request is invalid (param names the field)", **error}
        answers["5XX"] = {"description": "the server cannot serve it now (loading, at capacity, shutting down)",
                          **error}
    return answers


def openapi_document(title: str, version: str) -> dict:
    models = (ChatCompletionRequest, CompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
              DetokenizeRequest, ErrorResponse)
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    generation = "a completion, or with \"stream\": true an SSE stream of chunks ending with data: [DONE]"
    paths = {
        "/v1/chat/completions": {"post": {"summary": "Chat completion", "requestBody": _body(ChatCompletionRequest),
                                          "responses": _answers(generation)}},
        "/v1/completions": {"post": {"summary": "Text completion", "requestBody": _body(CompletionRequest),
                                     "responses": _answers(generation)}},
        "/invocations": {"post": {"summary": "A chat (with messages) or completion (with prompt) request",
                                  "requestBody": _body(ChatCompletionRequest, CompletionRequest),
                                  "responses": _answers(generation)}},
        "/tokenize": {"post": {"summary": "The prompt's token ids",
                               "requestBody": _body(TokenizeCompletionRequest, TokenizeChatRequest),
                               "responses": _answers("tokens, count, max_model_len")}},
        "/detokenize": {"post": {"summary": "The text of token ids", "requestBody": _body(DetokenizeRequest),
                                 "responses": _answers("prompt")}},
        "/v1/models": {"get": {"summary": "The served model", "responses": _answers("a list of one model")}},
        "/v1/models/{model}": {"get": {"summary": "The served model by its name (404 for any other)",
                                       "parameters": [{"name": "model", "in": "path", "required": True,
                                                       "schema": {"type": "string"}}],
                                       "responses": _answers("the model")}},
        "/version": {"get": {"summary": "The server's version", "responses": _answers("version", errors=False)}},
        "/health": {"get": {"summary": "200 once the model serves; 503 while loading; 500 once the engine died",
                            "responses": _answers("status")}},
        "/ping": {"get": {"summary": "as /health", "responses": _answers("status")}},
        "/metrics": {"get": {"summary": "Prometheus metrics",
                             "responses": _answers("Prometheus text", "text/plain", errors=False)}},
        "/openapi.json": {"get": {"summary": "This document", "responses": _answers("OpenAPI 3.1", errors=False)}},
    }
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": schemas.get("$defs", {})}}
