"""POST /v1/chat/completions: messages rendered with the model's chat template, replies written as chat choices
(the think block split into `reasoning_content`, logprobs with token bytes).

Builds prompts and choice fields only; the engine requests and the stream are serving.py's.
"""

from __future__ import annotations

from typing import Any

from qwen_jax.outputs import RequestOutput, TokenLogprob
from server.protocol import APIError, ParsedRequest
from server.reasoning import ReasoningSplitter
from server.serving import ChoiceWriter, Job, Prompt, Serving, TokenTexts


def render_chat(tokenizer: Any, messages: list[dict], enable_thinking: bool = False) -> str:
    """The prompt text for `messages`, ending with the assistant generation prompt (with an empty, closed think
    block when thinking is off, an open one when it is on)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=enable_thinking)
    except Exception as exc:  # jinja raise_exception(...) and template errors: the messages do not fit it
        raise APIError(f"the chat template rejected the messages: {str(exc)[:300]}", param="messages") from None


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of an already rendered prompt (special tokens in the text are parsed; nothing is added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt_ids(tokenizer: Any, req: ParsedRequest) -> list[int]:
    return encode_prompt(tokenizer, render_chat(tokenizer, req.messages, req.enable_thinking))


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
    def __init__(self, token_texts: TokenTexts, job: Job, thinking: bool):
        self.token_texts = token_texts
        self.job = job
        self.thinking = thinking
        self.splitter = ReasoningSplitter(thinking)

    def opening(self) -> dict:
        """The role comes first, once per choice."""
        return {"delta": {"role": "assistant", "content": ""}, "logprobs": None}

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
        message: dict[str, Any] = {"role": "assistant", "content": content + c2}
        if self.thinking:
            message["reasoning_content"] = reasoning + r2
        logprobs = None
        if self.job.params.logprobs is not None:
            logprobs = chat_logprobs(self.token_texts, out.logprobs or [])
        return {"message": message, "logprobs": logprobs}


class ChatServing(Serving):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def prompts(self, req: ParsedRequest) -> list[Prompt]:
        return [Prompt(chat_prompt_ids(self.state.tokenizer, req), "")]

    def writer(self, req: ParsedRequest, job: Job, prompt: Prompt) -> ChoiceWriter:
        return ChatChoice(self.state.token_texts, job, req.enable_thinking)
