"""OutputProcessor: the front's half of each request, turning the engine core's token outputs into RequestOutputs:
incremental detokenization, stop strings (which end a request here, and are then aborted in the core), logprobs,
and what was already reported.

Host-side only, in the front's process; one RequestState per request, never a dict per field.
"""

from __future__ import annotations

import dataclasses
import time

from qwen_jax.engine.detokenizer import IncrementalDetokenizer, StopChecker
from qwen_jax.engine.sequence import CoreOutput
from qwen_jax.outputs import RequestFailed, RequestOutput, RequestRejected, TokenLogprob
from qwen_jax.sampling_params import SamplingParams


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stops: StopChecker
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # released so far (a matched stop string and what follows it cut)
    logprobs: list[TokenLogprob] | None = None
    sent_tokens: int = 0  # already reported
    sent_chars: int = 0
    num_cached_tokens: int = 0
    queue_seconds: float | None = None
    arrival_time: float = dataclasses.field(default_factory=time.time)
    first_token_time: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detokenizer = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                       if self.tokenizer is not None else None)
        self.requests[request_id] = RequestState(request_id, list(prompt_token_ids), params, detokenizer,
                                                 StopChecker(params.stop),
                                                 logprobs=[] if params.logprobs is not None else None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The RequestOutputs of a step's core outputs (finish_reason "error" with its `error` for a request the
        core refused or failed), and the requests a stop string ended here, which the core must abort."""
        results, ended = [], []
        now = time.time()
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # ended here already (a stop string); the core's later tokens are dropped
                continue
            if out.error is not None:
                error = (RequestRejected if out.rejected else RequestFailed)(out.error)
                results.append(self._output(state, "error", error=error))
                continue
            state.num_cached_tokens = out.num_cached_tokens
            state.queue_seconds = out.queue_seconds
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            stop_string = self._add_tokens(state, out)
            if stop_string is not None:
                ended.append(out.request_id)
                results.append(self._output(state, "stop", stop_string))
            elif out.finish_reason is not None:
                self._flush(state)
                results.append(self._output(state, out.finish_reason, out.stop_reason))
            else:
                results.append(self._output(state))
        return results, ended

    def _add_tokens(self, state: RequestState, out: CoreOutput) -> str | None:
        """Detokenize the new tokens and look for stop strings (once min_tokens are out, as vLLM does); returns the
        stop string that matched."""
        params = state.params
        for n, token in enumerate(out.new_token_ids):
            state.token_ids.append(token)
            if state.logprobs is not None and out.new_logprobs is not None:
                state.logprobs.append(out.new_logprobs[n])
            eos = out.eos and n == len(out.new_token_ids) - 1
            delta = state.detokenizer.add([token]) if state.detokenizer is not None and not eos else ""
            if len(state.token_ids) < params.min_tokens:
                state.text += delta
                continue
            text, stop_string = state.stops.feed(delta)
            state.text += text
            if stop_string is not None:
                return stop_string
        return None

    def _flush(self, state: RequestState) -> None:
        """Release the held-back text of a request that ended without a stop string."""
        tail = state.detokenizer.flush() if state.detokenizer is not None else ""
        text, _ = state.stops.feed(tail)
        state.text += text + state.stops.flush()

    def _output(self, state: RequestState, finish_reason: str | None = None,
                stop_reason: int | str | None = None, error: Exception | None = None) -> RequestOutput:
        finished = finish_reason is not None
        out = RequestOutput(
            request_id=state.request_id, prompt_token_ids=state.prompt_token_ids, token_ids=list(state.token_ids),
            text=state.text, delta_token_ids=state.token_ids[state.sent_tokens:],
            delta_text=state.text[state.sent_chars:], finished=finished, finish_reason=finish_reason,
            stop_reason=stop_reason, logprobs=state.logprobs, num_cached_tokens=state.num_cached_tokens,
            arrival_time=state.arrival_time, first_token_time=state.first_token_time,
            finish_time=time.time() if finished else None, queue_seconds=state.queue_seconds, error=error)
        state.sent_tokens, state.sent_chars = len(state.token_ids), len(state.text)
        if finished:
            del self.requests[state.request_id]
        return out
