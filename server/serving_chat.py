"""POST /v1/chat/completions: messages (tool calls and results included) rendered with the model's chat template and
its tools, replies written as chat choices (the think block split into `reasoning_content`, tool calls parsed into
`tool_calls`, logprobs with token bytes).

Builds prompts and choice fields only; the engine requests and the stream are serving.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from qwen_jax import RequestOutput, StructuredOutputsParams, TokenLogprob
from server.protocol import APIError, ChatCompletionRequest, _ChatPrompt
from server.reasoning import THINK_CLOSE, ReasoningSplitter
from server.serving import ChoiceWriter, Prompt, Serving, TokenTexts
from server.tools import ToolCall, ToolParser, call_format, forcing_grammar


def render_chat(tokenizer: Any, req: _ChatPrompt, template: str | None = None) -> str:
    """The prompt text of a conversation, by `template` (None: the tokenizer's): by default ending with the assistant
    generation prompt (with an empty, closed think block when thinking is off, an open one when it is on). The
    request's chat_template_kwargs, unknown ones included, reach the template as variables."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template (--chat-template gives one); use /v1/completions",
                       param="messages")
    messages, kwargs = req.template_messages(), req.template_kwargs()
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message, **kwargs)
    except Exception as exc:  # jinja raise_exception(...) and template errors: the messages do not fit it
        raise APIError(f"the chat template rejected the messages: {str(exc)[:300]}", param="messages") from None


def chat_prompt_ids(tokenizer: Any, req: _ChatPrompt, template: str | None = None) -> list[int]:
    """The token ids of the rendered conversation (special tokens in the text are parsed)."""
    return list(tokenizer.encode(render_chat(tokenizer, req, template), add_special_tokens=req.add_special_tokens))


def chat_logprobs(token_texts: TokenTexts, items: list[TokenLogprob]) -> dict:
    content = []
    for lp in items:
        text, raw = token_texts(lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = token_texts(tid)
            top.append({"token": t, "logprob": value, "bytes": b})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


class ChatChoice(ChoiceWriter):
    def __init__(self, token_texts: TokenTexts, req: ChatCompletionRequest, role: str = "assistant"):
        self.token_texts = token_texts
        self.role = role
        self.show_logprobs = req.requested_logprobs is not None
        self.thinking = req.enable_thinking
        self.echo = req.echo_text
        self.splitter = ReasoningSplitter(self.thinking)
        # with tools on, the reply's content and its think block are parsed for tool calls (numbered in one order)
        self.tools = self.think_tools = None
        if req.tools_on:
            tools, index = [t.model_dump(exclude_none=True) for t in req.tools], itertools.count().__next__
            self.tools = ToolParser(tools, next_index=index)
            self.think_tools = ToolParser(tools, keep_text_after_calls=True, next_index=index)
        self.num_calls = 0

    def opening(self) -> dict:
        """The role comes first, once per choice (with the echoed message, if any)."""
        return {"delta": {"role": self.role, "content": self.echo}, "logprobs": None}

    def piece(self, out: RequestOutput, logprobs: list[TokenLogprob] | None) -> dict:
        reasoning, content = self.splitter.feed(out.delta_text)
        if out.finished:
            r2, c2 = self.splitter.flush()
            reasoning, content = reasoning + r2, content + c2
        calls: list[dict] = []
        if self.tools is not None:
            reasoning, found = self.think_tools.feed(reasoning, end=out.finished)
            calls += found
            content, found = self.tools.feed(content, end=out.finished)
            calls += found
            self.num_calls = len(self.think_tools.calls) + len(self.tools.calls)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return {"delta": delta, "logprobs": chat_logprobs(self.token_texts, logprobs) if logprobs is not None
                else None}

    def whole(self, out: RequestOutput) -> dict:
        split = ReasoningSplitter(self.thinking)
        reasoning, content = split.feed(out.text)
        r2, c2 = split.flush()
        content = self.echo + content + c2
        reasoning += r2
        calls: list[ToolCall] = []
        if self.tools is not None:
            reasoning, calls = self.think_tools.parse(reasoning)
            content, found = self.tools.parse(content)
            calls += found
            self.num_calls = len(calls)
        message: dict[str, Any] = {"role": self.role, "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        if self.thinking:
            message["reasoning_content"] = reasoning
        logprobs = chat_logprobs(self.token_texts, out.logprobs or []) if self.show_logprobs else None
        return {"message": message, "logprobs": logprobs}

    def finish_reason(self, out: RequestOutput) -> str | None:
        """"tool_calls" when the reply called a tool and ended by itself (as OpenAI and vLLM say), else the engine's
        reason: a reply cut by max_tokens is "length", even inside a call."""
        return "tool_calls" if self.num_calls and out.finish_reason == "stop" else out.finish_reason


class ChatServing(Serving):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def prompts(self, req: ChatCompletionRequest) -> list[Prompt]:
        return [Prompt(chat_prompt_ids(self.state.tokenizer, req, self.state.config.chat_template), "")]

    def writer(self, req: ChatCompletionRequest, prompt: Prompt) -> ChoiceWriter:
        return ChatChoice(self.state.token_texts, req, self.state.config.response_role)

    def constrained(self, req: ChatCompletionRequest) -> bool:
        return forces_tool(req) or super().constrained(req)

    def constraint(self, req: ChatCompletionRequest) -> tuple[StructuredOutputsParams, str] | None:
        """response_format / structured_outputs, or for tool_choice "required" or a named function the grammar of
        a reply that is only calls, in the format the chat template teaches. With thinking on, the constraint starts
        once the think block the prompt opened is closed."""
        thinking = {"begins_after": THINK_CLOSE} if req.enable_thinking else {}
        if not forces_tool(req):
            found = super().constraint(req)
            return found if found is None else (dataclasses.replace(found[0], **thinking), found[1])
        if req.constraint() is not None:
            raise APIError("a forced tool call ('tool_choice' 'required' or a named function) cannot be combined "
                           "with 'response_format' or 'structured_outputs'", param="tool_choice")
        fmt = call_format(self.state.config.chat_template or getattr(self.state.tokenizer, "chat_template", None))
        if fmt is not None and self.state.config.tool_call_format is not None:  # --tool-call-parser
            fmt = self.state.config.tool_call_format
        if fmt is None:
            raise APIError("this model's chat template renders no tools, so no tool call can be forced: use "
                           "'tool_choice' 'auto' or 'none'", param="tool_choice")
        choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
        try:
            grammar = forcing_grammar(fmt, [t.model_dump(exclude_none=True) for t in req.tools], choice,
                                      req.parallel_tool_calls is not False, self.state.tokenizer.get_added_vocab())
        except (ValueError, TypeError, AttributeError) as exc:  # tools whose schemas make no grammar
            raise APIError(f"the tools cannot be made into a grammar: {str(exc).strip().splitlines()[0][:300]}",
                           param="tools") from None
        return StructuredOutputsParams(grammar=grammar, **thinking), "tools"


def forces_tool(req: ChatCompletionRequest) -> bool:
    """tool_choice "required" or a named function: the reply must be a tool call."""
    return req.tools_on and req.tool_choice not in (None, "auto")
