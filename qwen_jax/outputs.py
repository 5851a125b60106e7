"""What the engine hands back per request: RequestOutput (streamed as it grows) and its per-token logprobs.

Plain data only; built by the engine, read by the offline API and the server.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token id, logprob), best first; empty when n = 0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # all detokenized so far (stop string removed once matched)
    delta_token_ids: list[int]  # new since the previous output of this request
    delta_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprob] | None = None  # one per generated token when requested
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    queue_seconds: float | None = None  # how long it waited in the engine's queue before it first ran
    error: Exception | None = None  # finish_reason "error": RequestRejected (the request's own fault) or RequestFailed


class RequestFailed(RuntimeError):
    """The engine failed while serving one request; the others go on."""


class RequestRejected(ValueError):
    """The engine refused one request on arrival (it cannot be served as asked); the others go on."""
