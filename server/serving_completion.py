"""POST /v1/completions: text or token-id prompts (several per request), replies written as completion choices
(`echo` repeats the prompt, logprobs with text offsets).

Builds prompts and choice fields only; the engine requests and the stream are serving.py's.
"""

from __future__ import annotations

from qwen_jax import RequestOutput, TokenLogprob
from server.protocol import CompletionRequest
from server.serving import ChoiceWriter, Prompt, Serving, TokenTexts


def completion_logprobs(token_texts: TokenTexts, items: list[TokenLogprob], offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for lp in items:
        text, _ = token_texts(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        top = {text: lp.logprob}
        top.update({token_texts(tid)[0]: value for tid, value in lp.top})
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class CompletionChoice(ChoiceWriter):
    def __init__(self, token_texts: TokenTexts, req: CompletionRequest, echo: str):
        self.token_texts = token_texts
        self.show_logprobs = req.requested_logprobs is not None
        self.echo = echo  # the prompt text repeated before the completion ("" without echo)
        self.echoed = False
        self.offset = 0  # characters of this choice's text streamed so far

    def piece(self, out: RequestOutput, logprobs: list[TokenLogprob] | None) -> dict:
        text = out.delta_text
        if not self.echoed:
            self.echoed = True
            text = self.echo + text
            self.offset = len(self.echo)
        formatted = None
        if logprobs is not None:
            formatted = completion_logprobs(self.token_texts, logprobs, self.offset)
        self.offset += len(out.delta_text)
        return {"text": text, "logprobs": formatted}

    def whole(self, out: RequestOutput) -> dict:
        logprobs = None
        if self.show_logprobs:
            logprobs = completion_logprobs(self.token_texts, out.logprobs or [], len(self.echo))
        return {"text": self.echo + out.text, "logprobs": logprobs}


class CompletionServing(Serving):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def prompts(self, req: CompletionRequest) -> list[Prompt]:
        tok = self.state.tokenizer
        prompts = []
        for p in req.prompts:
            if isinstance(p, str):
                prompts.append(Prompt(list(tok.encode(p, add_special_tokens=req.add_special_tokens)), p))
            else:
                prompts.append(Prompt(list(p), tok.decode(p) if req.echo else ""))
        return prompts

    def writer(self, req: CompletionRequest, prompt: Prompt) -> ChoiceWriter:
        return CompletionChoice(self.state.token_texts, req, prompt.text if req.echo else "")
