"""POST /v1/chat/completions: messages rendered with the model's chat template, replies written as chat choices
(the think block split into `reasoning_content`, logprobs with token bytes).

Builds prompts and choice fields only; the engine requests and the stream are serving.py's.
"""

from __future__ import annotations

from typing import Any

from qwen_jax.outputs import RequestOutput, TokenLogprob
from server.protocol import APIError, ChatCompletionRequest, _ChatPrompt
from server.reasoning import ReasoningSplitter
from server.serving import ChoiceWriter, Prompt, Serving, TokenTexts


def render_chat(tokenizer: Any, req: _ChatPrompt) -> str:
    """The prompt text of a conversation: by default ending with the assistant generation prompt (with an empty,
    closed think block when thinking is off, an open one when it is on). The request's chat_template_kwargs, unknown
    ones included, reach the template as variables."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(req.template_messages(), tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message,
                                             **req.template_kwargs())
    except Exception as exc:  # jinja raise_exception(...) and template errors: the messages do not fit it
        raise APIError(f"the chat template rejected the messages: {str(exc)[:300]}", param="messages") from None


def chat_prompt_ids(tokenizer: Any, req: _ChatPrompt) -> list[int]:
    """The token ids of the rendered conversation (special tokens in the text are parsed)."""
    return list(tokenizer.encode(render_chat(tokenizer, req), add_special_tokens=req.add_special_tokens))


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
    def __init__(self, token_texts: TokenTexts, req: ChatCompletionRequest):
        self.token_texts = token_texts
        self.show_logprobs = req.requested_logprobs is not None
        self.thinking = req.enable_thinking
        self.echo = req.echo_text
        self.splitter = ReasoningSplitter(self.thinking)

    def opening(self) -> dict:
        """The role comes first, once per choice (with the echoed message, if any)."""
        return {"delta": {"role": "assistant", "content": self.echo}, "logprobs": None}

    def piece(self, out: RequestOutput, logprobs: list[TokenLogprob] | None) -> dict:
        reasoning, content = self.splitter.feed(out.delta_text)
        if out.finished:
            r2, c2 = self.splitter.flush()
            reasoning, content = reasoning + r2, content + c2
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return {"delta": delta, "logprobs": chat_logprobs(self.token_texts, logprobs) if logprobs is not None
                else None}

    def whole(self, out: RequestOutput) -> dict:
        split = ReasoningSplitter(self.thinking)
        reasoning, content = split.feed(out.text)
        r2, c2 = split.flush()
        message: dict[str, Any] = {"role": "assistant", "content": self.echo + content + c2}
        if self.thinking:
            message["reasoning_content"] = reasoning + r2
        logprobs = chat_logprobs(self.token_texts, out.logprobs or []) if self.show_logprobs else None
        return {"message": message, "logprobs": logprobs}


class ChatServing(Serving):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def prompts(self, req: ChatCompletionRequest) -> list[Prompt]:
        return [Prompt(chat_prompt_ids(self.state.tokenizer, req), "")]

    def writer(self, req: ChatCompletionRequest, prompt: Prompt) -> ChoiceWriter:
        return ChatChoice(self.state.token_texts, req)
