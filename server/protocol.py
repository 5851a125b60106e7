"""OpenAI-style request parsing and validation (chat, completions, /invocations) into SamplingParams and a prompt.

Pure functions over decoded JSON: never touches the engine or the network; every rejection is an APIError (4xx).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from qwen_jax.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP = 16
MAX_PROMPTS = 64
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error fields."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass
class ParsedRequest:
    """A validated chat or completion request. Exactly one of `messages` / `prompts` is set."""

    kind: str  # "chat" or "completion"
    model: str | None
    params: SamplingParams  # max_tokens may still be filled in per prompt (see `max_tokens_given`)
    max_tokens_given: bool
    n: int
    stream: bool
    include_usage: bool
    messages: list[dict] | None = None
    enable_thinking: bool = False
    prompts: list[str | list[int]] | None = None  # completion: text or token ids, one entry per prompt
    echo: bool = False


def parse_json(raw: bytes) -> dict:
    """Decode a request body; anything but a JSON object is a 400."""
    if not raw:
        raise APIError("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- typed field readers --------------------------------------------------------------------------------------

def _bad(param: str, expected: str, value: Any) -> APIError:
    shown = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
    return APIError(f"'{param}' must be {expected}, got {shown}", param=param)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _int(body: dict, name: str, default: int | None = None, lo: int | None = None, hi: int | None = None
         ) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise APIError(f"'{name}' must be {bounds}, got {value}", param=name)
    return value


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise _bad(name, "a finite number", value)
    if value > hi or value < lo or (lo_open and value == lo):
        raise APIError(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param=name)
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, "a boolean", value)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("stop", "a string or a list of strings", value)
    if len(value) > MAX_STOP:
        raise APIError(f"'stop' may hold at most {MAX_STOP} sequences, got {len(value)}", param="stop")
    if any(not s for s in value):
        raise APIError("'stop' sequences must be non-empty strings", param="stop")
    return value


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


# ---- the common sampling fields ---------------------------------------------------------------------------------

def _sampling(body: dict, logprobs: int | None) -> tuple[SamplingParams, bool]:
    max_tokens = _int(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", lo=1)
    elif body.get("max_tokens") is not None:
        _int(body, "max_tokens", lo=1)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not (_token_list(stop_token_ids) and all(t >= 0 for t in stop_token_ids)):
        raise _bad("stop_token_ids", "a list of non-negative integers", stop_token_ids)
    top_k = _int(body, "top_k", default=0, lo=-1)
    min_tokens = _int(body, "min_tokens", default=0, lo=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max(1, min_tokens),
            temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            top_k=top_k,
            min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
            repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
            presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
            seed=_int(body, "seed", lo=-(2 ** 63), hi=2 ** 63 - 1),
            stop=_stop(body),
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=_bool(body, "ignore_eos"),
            min_tokens=min_tokens,
            logprobs=logprobs,
            skip_special_tokens=_bool(body, "skip_special_tokens", True),
        )
    except ValueError as exc:
        raise APIError(str(exc)) from None
    return params, max_tokens is not None


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _bad("stream_options", "an object", options)
    if not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return stream, _bool(options, "include_usage")


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    return model


# ---- chat ------------------------------------------------------------------------------------------------------

def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "a non-empty list of message objects", value)
    out = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(param, "an object with 'role' and 'content'", message)
        role = message.get("role")
        if role not in ROLES:
            raise APIError(f"'{param}.role' must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                           param=f"{param}.role")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type", "text") == "text"
                        and isinstance(part.get("text"), str)):
                    raise APIError(f"'{param}.content' parts must be {{\"type\": \"text\", \"text\": string}} "
                                   "(only text is supported)", param=f"{param}.content")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"{param}.content", "a string or a list of text parts", content)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise APIError("'messages' must contain at least one user message", param="messages")
    return out


def parse_chat(body: dict, default_thinking: bool = False) -> ParsedRequest:
    """POST /v1/chat/completions (and /invocations with `messages`)."""
    messages = _messages(body.get("messages"))
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", lo=0, hi=SamplingParams.MAX_LOGPROBS)
    if top is not None and not want:
        raise APIError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    params, given = _sampling(body, (top or 0) if want else None)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "an object", kwargs)
    thinking = _bool(body, "thinking", default_thinking)
    if kwargs and "enable_thinking" in kwargs:
        thinking = _bool(kwargs, "enable_thinking")
    stream, include_usage = _stream(body)
    return ParsedRequest(kind="chat", model=_model(body), params=params, max_tokens_given=given,
                         n=_int(body, "n", 1, lo=1, hi=MAX_N), stream=stream, include_usage=include_usage,
                         messages=messages, enable_thinking=thinking)


# ---- completions -----------------------------------------------------------------------------------------------

def _prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        prompts = [value]
    elif _token_list(value) and value:
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(_token_list(p) for p in value):
        prompts = list(value)
    else:
        raise _bad("prompt", "a string, a list of strings, a list of token ids or a list of token-id lists",
                   value)
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    for p in prompts:
        if len(p) == 0:
            raise APIError("'prompt' must not be empty", param="prompt")
    return prompts


def parse_completion(body: dict) -> ParsedRequest:
    """POST /v1/completions (and /invocations with `prompt`)."""
    prompts = _prompts(body.get("prompt"))
    logprobs = _int(body, "logprobs", lo=0, hi=SamplingParams.MAX_LOGPROBS)
    params, given = _sampling(body, logprobs)
    stream, include_usage = _stream(body)
    return ParsedRequest(kind="completion", model=_model(body), params=params, max_tokens_given=given,
                         n=_int(body, "n", 1, lo=1, hi=MAX_N), stream=stream, include_usage=include_usage,
                         prompts=prompts, echo=_bool(body, "echo"))


def parse_invocation(body: dict) -> ParsedRequest:
    """POST /invocations: a chat body (has `messages`) or a completion body (has `prompt`)."""
    if "messages" in body:
        return parse_chat(body)
    if "prompt" in body:
        return parse_completion(body)
    raise APIError("an /invocations body needs 'messages' (chat) or 'prompt' (completion)", param="messages")
