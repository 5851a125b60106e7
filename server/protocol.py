"""The OpenAI-compatible request models (pydantic v2, vLLM's field names), JSON decoding, and the error body.

Pure functions and models over a request body: never touches the engine or the network. Every field is typed and
bounded; anything invalid becomes an APIError (HTTP 4xx) that names the parameter, never an exception of the caller.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from qwen_jax import SamplingParams, StructuredOutputsParams

MAX_N = 16  # choices (n, best_of) per prompt
MAX_STOP = 16
MAX_PROMPTS = 64
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_LIST = 4096  # stop_token_ids, logit_bias entries, bad words
MAX_JSON_DEPTH = 64  # nesting of any JSON value: deeper is no sane request, and templates recurse over it
MAX_INT_DIGITS = 40  # longer integer literals fit no field (the widest, seed, is 64 bits)
INT32_MAX = 2 ** 31 - 1
# apply_chat_template's own arguments: in chat_template_kwargs they would change what the call returns, not what the
# template sees (the request has fields for the ones that make sense).
RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"))


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


def unsupported(name: str, why: str) -> APIError:
    return APIError(f"'{name}' is not supported: {why}", param=name, code="unsupported_parameter")


# ---- JSON decoding -----------------------------------------------------------------------------------------------

class _Rejected:
    """A JSON literal no field accepts (NaN, an infinity, an integer of hundreds of digits), kept in place by the
    decoder so that the check below can name the parameter it was sent for."""

    def __init__(self, literal: str):
        self.literal = literal if len(literal) <= 20 else f"an integer of {len(literal)} digits"


def _parse_int(literal: str) -> int | _Rejected:
    digits = len(literal) - literal.startswith("-")
    return int(literal) if digits <= MAX_INT_DIGITS else _Rejected(literal)


def _parse_float(literal: str) -> float | _Rejected:
    value = float(literal)
    return value if math.isfinite(value) else _Rejected(literal)


def parse_json(raw: bytes) -> dict:
    """Decode a request body into a JSON object whose every string is valid Unicode (no lone UTF-16 surrogates),
    every number finite and of sane size, nested at most MAX_JSON_DEPTH deep; anything else is a 400 naming where."""
    if not raw:
        raise APIError("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_Rejected)
    except (ValueError, RecursionError) as exc:
        raise APIError(f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(f"request body must be a JSON object, got {type(body).__name__}")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            shown = path if len(path) <= 80 else path[:77] + "..."
            raise APIError(f"'{shown}' is nested more than {MAX_JSON_DEPTH} levels deep", param=shown)
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, _Rejected):
            raise APIError(f"'{path}' must be a finite number of sane size, got {value.literal}", param=path)
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                _check_text(key, child if _is_unicode(key) else path or "(top level)")
                stack.append((item, child, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _check_text(text: str, path: str) -> None:
    if not text.isascii() and not _is_unicode(text):
        raise APIError(f"'{path}' holds a lone UTF-16 surrogate (not valid Unicode)", param=path)


# ---- validation --------------------------------------------------------------------------------------------------

def validate(model: type[BaseModel], body: dict, vocab_size: int | None = None,
             max_logprobs: int = SamplingParams.MAX_LOGPROBS) -> Any:
    """`model` from a decoded body; a ValidationError becomes an APIError naming the first bad parameter. Token ids
    are checked against `vocab_size` (the model's), logprobs counts against `max_logprobs`."""
    try:
        return model.model_validate(body, context={"vocab_size": vocab_size, "max_logprobs": max_logprobs})
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = _param(body, error["loc"], error["type"] == "missing")
        message = error["msg"]
        if error["type"] not in ("missing", "token_id", "one_of") and "input" in error:
            message += f", got {_shown(error['input'])}"
        raise APIError(f"'{param}': {message}" if param else message, param=param or None) from None


def _param(body: Any, loc: tuple, missing: bool) -> str:
    """The request path of an error location (`messages[0].content`): a location also names the union branch it
    tried, which is not in the body and is left out."""
    path, value = "", body
    for n, part in enumerate(loc):
        if isinstance(value, dict) and isinstance(part, str) and (part in value or (missing and n == len(loc) - 1)):
            path, value = f"{path}.{part}" if path else part, value.get(part)
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            path, value = f"{path}[{part}]", value[part]
    return path


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _context(info: ValidationInfo, key: str) -> Any:
    return (info.context or {}).get(key)


def _token_id(value: int, info: ValidationInfo) -> int:
    vocab = _context(info, "vocab_size")
    if value < 0 or value >= (vocab or INT32_MAX + 1):
        raise PydanticCustomError("token_id", "token id {token_id} is outside the vocabulary [0, {vocab})",
                                  {"token_id": value, "vocab": vocab or INT32_MAX + 1})
    return value


def _logprobs_count(value: int | None, info: ValidationInfo) -> int | None:
    limit = _context(info, "max_logprobs") or SamplingParams.MAX_LOGPROBS
    if value is not None and value > limit:
        raise PydanticCustomError("max_logprobs", "at most {limit} logprobs per token (--max-logprobs)",
                                  {"limit": limit})
    return value


def _one_of(shapes: dict[str, Any], expected: str) -> Any:
    """A union picked by the shape of the value (so errors come from that branch alone), with one clear message when
    the value has none of the shapes."""
    def shape(value: Any) -> str | None:
        return next((tag for tag, test in shapes.items() if test(value)), None)

    return Discriminator(shape, custom_error_type="one_of", custom_error_message=f"must be {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


TokenId = Annotated[int, AfterValidator(_token_id), Field(json_schema_extra={"minimum": 0})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PositiveInt32 = Annotated[int, Field(ge=1, le=INT32_MAX)]
LogprobsCount = Annotated[int, Field(ge=0, le=SamplingParams.MAX_LOGPROBS), AfterValidator(_logprobs_count)]
Text = Annotated[str, Field(min_length=1)]
Stop = Annotated[
    Annotated[Text, Tag("one")] | Annotated[list[Text], Field(max_length=MAX_STOP), Tag("many")],
    _one_of({"one": lambda v: isinstance(v, str), "many": lambda v: isinstance(v, list)},
            "a non-empty string or a list of them"),
]
Prompt = Annotated[
    Annotated[Text, Tag("text")] | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS), Tag("texts")]
    | Annotated[TokenIds, Tag("ids")]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS), Tag("id_lists")],
    _one_of({"text": lambda v: isinstance(v, str),
             "texts": lambda v: isinstance(v, list) and v != [] and all(isinstance(p, str) for p in v),
             "ids": lambda v: isinstance(v, list) and v != [] and all(_is_int(t) for t in v),
             "id_lists": lambda v: isinstance(v, list) and v != [] and all(isinstance(p, list) for p in v)},
            "a non-empty string, a list of them, a list of token ids or a list of token-id lists"),
]


class _Model(BaseModel):
    """Strict types (no "10" for 10, no 1.5 for an integer); unknown fields are kept, for the log (ignored_fields)."""

    model_config = ConfigDict(extra="allow", strict=True)


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The paths of every unknown field in a validated request (list indices left out), for the log."""
    found = [f"{prefix}{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                found += ignored_fields(item, f"{prefix}{name}.")
    return found


# ---- parts of requests -------------------------------------------------------------------------------------------

class StreamOptions(_Model):
    include_usage: bool = Field(False, description="send a last chunk with the usage of the whole request")


class TextPart(_Model):
    type: Literal["text"] = Field("text", description="only text parts are supported")
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES), Tag("parts")],
    _one_of({"text": lambda v: isinstance(v, str), "parts": lambda v: isinstance(v, list)},
            "a string or a list of text parts"),
]


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "Field required (only an assistant message may omit 'content')")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Model):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")] | Annotated[NamedToolChoice, Tag("named")],
    _one_of({"mode": lambda v: isinstance(v, str), "named": lambda v: isinstance(v, dict)},
            "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"),
]


class JsonSchemaFormat(_Model):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise APIError("'response_format' of type json_schema needs 'json_schema.schema'",
                           param="response_format.json_schema")
        return self


ONE_KIND = f"'structured_outputs' needs exactly one of {', '.join(StructuredOutputsParams.KINDS)}"


class StructuredOutputs(_Model):
    """vLLM's structured outputs: exactly one of these constrains the output. Beside `response_format` it may give
    only the JSON whitespace options."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (or its text)")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_LIST)] | None = None
    grammar: Text | None = Field(None, description="a grammar: GBNF, or llguidance's Lark")
    json_object: bool = False
    structural_tag: dict[str, Any] | str | None = Field(
        None, description='vLLM\'s structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}')
    disable_any_whitespace: bool = Field(False, description="JSON: no whitespace between tokens")
    any_whitespace: bool = Field(False, description="JSON: whitespace runs of any length between tokens (by default "
                                                    "at most 16 characters, or the server's --json-whitespace)")

    @model_validator(mode="after")
    def _at_most_one_kind(self) -> StructuredOutputs:
        if len(self.kinds) > 1:
            raise APIError(f"{ONE_KIND}; got {', '.join(self.kinds)}", param="structured_outputs")
        if self.disable_any_whitespace and self.any_whitespace:
            raise APIError("give 'disable_any_whitespace' or 'any_whitespace', not both",
                           param="structured_outputs.any_whitespace")
        return self

    @property
    def kinds(self) -> list[str]:
        return [name for name in StructuredOutputsParams.KINDS
                if getattr(self, "json_" if name == "json" else name) not in (None, False)]

    @property
    def whitespace(self) -> dict[str, bool]:
        """The JSON whitespace options given (none: the server's default)."""
        return {name: True for name in ("disable_any_whitespace", "any_whitespace") if getattr(self, name)}

    def params(self, **whitespace: bool) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object, structural_tag=self.structural_tag,
                                       **(self.whitespace or whitespace))


def _arguments(text: str, param: str) -> dict:
    """A tool call's arguments (JSON text in the API) as the object the chat templates iterate over."""
    try:
        value = json.loads(text)
    except ValueError:
        raise APIError(f"'{param}.function.arguments' must be a JSON object's text, got {_shown(text)}",
                       param=f"{param}.function.arguments") from None
    if not isinstance(value, dict):
        raise APIError(f"'{param}.function.arguments' must be a JSON object's text, got {_shown(text)}",
                       param=f"{param}.function.arguments")
    return value


# ---- requests ----------------------------------------------------------------------------------------------------

class _ChatPrompt(_Model):
    """What renders a conversation into a prompt: the messages and the chat template's options."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant turn's opening")
    continue_final_message: bool = Field(False, description="leave the last (assistant) message open to continue "
                                                            "it (instead of add_generation_prompt)")
    add_special_tokens: bool = Field(False, description="add the tokenizer's special tokens on top of the template's")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=64, description="extra variables for the chat template (enable_thinking among them)")
    thinking: bool | None = Field(None, description="the thinking toggle (as chat_template_kwargs.enable_thinking)")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    chat_template: str | None = Field(None, description="not accepted: the server's template (--chat-template) is "
                                                        "used")

    @model_validator(mode="after")
    def _check_prompt(self) -> _ChatPrompt:
        if not any(m.role == "user" for m in self.messages):
            raise APIError("'messages' must contain at least one user message", param="messages")
        if self.chat_template is not None:
            raise unsupported("chat_template", "a request may not bring its own template (the server's is used)")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError("'continue_final_message' needs 'add_generation_prompt': false",
                           param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError("'continue_final_message' needs an assistant message last", param="continue_final_message")
        for key, value in (self.chat_template_kwargs or {}).items():
            if key in RESERVED_TEMPLATE_KWARGS:
                raise APIError(f"'chat_template_kwargs.{key}' is an argument of the template call, not a template "
                               "variable (use the request field of that name where there is one)",
                               param=f"chat_template_kwargs.{key}")
            if key == "enable_thinking" and not isinstance(value, bool):
                raise APIError(f"'chat_template_kwargs.enable_thinking' must be a boolean, got {_shown(value)}",
                               param="chat_template_kwargs.enable_thinking")
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not self.tools:
            raise APIError("'tool_choice' other than 'none' or 'auto' needs 'tools'", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise APIError(f"'tool_choice' names function {_shown(choice.function.name)}, which is not in 'tools'",
                           param="tool_choice.function.name")
        return self

    @property
    def enable_thinking(self) -> bool:
        """Off unless asked: chat_template_kwargs.enable_thinking, else `thinking`."""
        kwargs = self.chat_template_kwargs or {}
        return bool(kwargs["enable_thinking"] if "enable_thinking" in kwargs else self.thinking)

    @property
    def tools_on(self) -> bool:
        """The tools reach the template and the reply is parsed for calls (tool_choice "none" turns both off)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_messages(self) -> list[dict]:
        """The messages as the chat template reads them: developer messages are system messages to it, and an
        assistant's tool calls carry their arguments as objects (the templates iterate over them)."""
        out = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
            if m.tool_calls:
                message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                    "name": call.function.name, "arguments": _arguments(call.function.arguments,
                                                                        f"messages[{i}].tool_calls[{j}]")}}
                                         for j, call in enumerate(m.tool_calls)]
            for name in ("name", "tool_call_id", "reasoning_content"):
                if getattr(m, name) is not None:
                    message[name] = getattr(m, name)
            out.append(message)
        return out

    def template_kwargs(self) -> dict:
        kwargs = {**(self.chat_template_kwargs or {}), "enable_thinking": self.enable_thinking}
        if self.tools_on:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return kwargs


class _Sampling(_Model):
    """The fields every generation request shares: the sampler's and the stop rules' (vLLM's SamplingParams)."""

    model: str | None = Field(None, description="one of the served names (none: the first)")
    max_tokens: PositiveInt32 | None = Field(None, description="default: the room left in the context")
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = Field(0, description="0 or -1: no top-k cut")
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=2, allow_inf_nan=False)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    seed: Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)] | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    skip_special_tokens: bool = True
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(
        None, description="candidates per prompt; the n with the highest cumulative logprob are returned")
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: PositiveInt32 | None = Field(None, description="keep only the prompt's last tokens")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]],
                          Field(max_length=SamplingParams.MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id -> a bias added to its logit before sampling (+100 forces, -100 bans)")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's structured outputs (instead of response_format)")
    user: str | None = None
    # vLLM's fields that change the output and that this server does not implement: rejected unless left as is
    use_beam_search: bool = False
    prompt_logprobs: LogprobsCount | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_LIST)] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        vocab = _context(info, "vocab_size") or INT32_MAX + 1
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab):
                raise APIError(f"'logit_bias' keys must be token ids in [0, {vocab}), got {_shown(key)}",
                               param=f"logit_bias.{key}")
        return value

    @model_validator(mode="after")
    def _check_sampling(self) -> _Sampling:
        limit = self.max_tokens_given
        if limit is not None and self.min_tokens > limit:
            raise APIError(f"'min_tokens' ({self.min_tokens}) must not exceed max_tokens ({limit})",
                           param="min_tokens")
        if self.stream_options is not None and not self.stream:
            raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(f"'best_of' ({self.best_of}) must be at least n ({self.n})", param="best_of")
        so, fmt = self.structured_outputs, self.response_format
        if so is not None and not so.kinds and (fmt is None or fmt.type == "text"):
            raise APIError(f"{ONE_KIND} (only its whitespace options go beside a JSON 'response_format')",
                           param="structured_outputs")
        if fmt is not None and fmt.type != "text" and so is not None and so.kinds:
            raise APIError("give 'response_format' or 'structured_outputs', not both", param="structured_outputs")
        if self.stream and self.candidates > self.n:
            raise APIError("'best_of' larger than n needs every candidate finished before choosing: not with "
                           "'stream'", param="best_of")
        for name, why in (("use_beam_search", "no beam search"), ("prompt_logprobs", "no prompt logprobs"),
                          ("include_stop_str_in_output", "stop strings are always cut"),
                          ("allowed_token_ids", "no allow-lists"), ("bad_words", "no bad-word lists")):
            if getattr(self, name) not in (None, False):
                raise unsupported(name, why)
        return self

    @property
    def candidates(self) -> int:
        """Engine requests per prompt: best_of when given, else n."""
        return self.best_of or self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_logprobs(self) -> int | None:
        """Logprobs the response shows per token: None (none), 0 (the chosen token's) or the top-n count."""
        raise NotImplementedError

    @property
    def max_tokens_given(self) -> int | None:
        return self.max_tokens

    def constraint(self, **whitespace: bool) -> tuple[StructuredOutputsParams, str] | None:
        """What the output must match, from response_format or structured_outputs, and the parameter that asked.
        `whitespace`: the JSON whitespace option (StructuredOutputsParams' field) when the request gives none."""
        so, fmt = self.structured_outputs, self.response_format
        if so is not None and so.kinds:
            return so.params(**whitespace), "structured_outputs"
        if so is not None:
            whitespace = so.whitespace
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, **whitespace), "response_format"
        return (StructuredOutputsParams(json=fmt.json_schema.json_schema, **whitespace),
                "response_format.json_schema.schema")

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """The engine's parameters; max_tokens is a placeholder when not given (the room left fills it per prompt).
        best_of above n asks the engine for logprobs, which choose the candidates. `defaults`: the server's sampling
        defaults (the model's generation config), for the fields this request does not set."""
        sampling = {name: getattr(self, name) for name in DEFAULTED}
        sampling.update({name: value for name, value in (defaults or {}).items()
                         if name in DEFAULTED and name not in self.model_fields_set})
        logprobs = self.requested_logprobs
        if logprobs is None and self.candidates > self.n:
            logprobs = 0
        given = self.max_tokens_given
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=given if given is not None else max(1, self.min_tokens), **sampling,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None)


# The sampling fields a server's defaults (the model's generation config) fill when a request does not set them.
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ChatCompletionRequest(_Sampling, _ChatPrompt):
    """POST /v1/chat/completions."""

    max_completion_tokens: PositiveInt32 | None = Field(None, description="max_tokens under its newer name")
    logprobs: bool = False
    top_logprobs: LogprobsCount | None = None
    echo: bool = Field(False, description="start the reply with the last message's content when it is the "
                                          "assistant's")
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
        return self

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_given(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def echo_text(self) -> str:
        """What `echo` puts before the reply: the last message's content when it is an assistant's."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else ""


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Prompt
    logprobs: LogprobsCount | None = Field(None, description="the top-n logprobs per token (0: the chosen token's)")
    echo: bool = Field(False, description="repeat the prompt before the completion")
    suffix: str | None = Field(None, description="not supported (no insertion)")
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens to text prompts")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix is not None:
            raise unsupported("suffix", "this server does not insert text (no fill-in-the-middle)")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "with 'logprobs' it needs the prompt's logprobs, which the engine does not "
                                      "compute")
        return self

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and _is_int(p[0])) else list(p)


class TokenizeCompletionRequest(_Model):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: Annotated[Annotated[str, Tag("text")] | Annotated[list[TokenId], Tag("ids")],
                      _one_of({"text": lambda v: isinstance(v, str), "ids": lambda v: isinstance(v, list)},
                              "a string or a list of token ids")]
    add_special_tokens: bool = True
    return_token_strs: bool = Field(False, description="also return each token's text")


class TokenizeChatRequest(_ChatPrompt):
    """POST /tokenize with messages: the prompt a chat request would run."""

    model: str | None = None
    return_token_strs: bool = Field(False, description="also return each token's text")


class DetokenizeRequest(_Model):
    """POST /detokenize."""

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


GenerationRequest = ChatCompletionRequest | CompletionRequest
