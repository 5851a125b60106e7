"""POST /v1/completions: text or token-id prompts (several per request), replies written as completion choices
(`echo` repeats the prompt, logprobs with text offsets).

Builds prompts and choice fields only; the engine requests and the stream are serving.py's.
"""

from __future__ import annotations

from qwen_jax.outputs import RequestOutput, TokenLogprob
from server.protocol import APIError, ParsedRequest
from server.serving import ChoiceWriter, Job, Prompt, Serving, TokenTexts


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
    def __init__(self, token_texts: TokenTexts, job: Job, echo: str):
        self.token_texts = token_texts
        self.job = job
        self.echo = echo  # the prompt text repeated before the completion ("" without echo)
        self.echoed = False
        self.offset = 0  # characters of this choice's text streamed so far

    def piece(self, out: RequestOutput, logprobs: list[TokenLogprob] | None) -> dict:
        text = out.delta_text
        if not self.echoed:
            self.echoed = True
            text = self.echo + text
        formatted = None
        if logprobs is not None:
            formatted = completion_logprobs(self.token_texts, logprobs, self.offset)
        self.offset += len(text)
        return {"text": text, "logprobs": formatted}

    def whole(self, out: RequestOutput) -> dict:
        logprobs = None
        if self.job.params.logprobs is not None:
            logprobs = completion_logprobs(self.token_texts, out.logprobs or [], len(self.echo))
        return {"text": self.echo + out.text, "logprobs": logprobs}


class CompletionServing(Serving):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def prompts(self, req: ParsedRequest) -> list[Prompt]:
        tok = self.state.tokenizer
        prompts = []
        vocab = len(tok)
        for p in req.prompts:
            if isinstance(p, str):
                prompts.append(Prompt(list(tok.encode(p)), p))
                continue
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise APIError(f"prompt token id {bad[0]} is out of range [0, {vocab})", param="prompt")
            prompts.append(Prompt(list(p), tok.decode(p) if req.echo else ""))
        return prompts

    def writer(self, req: ParsedRequest, job: Job, prompt: Prompt) -> ChoiceWriter:
        return CompletionChoice(self.state.token_texts, job, prompt.text if req.echo else "")
