"""Sequence: one request's state inside the engine core (tokens, memory it holds, progress, tokens in flight), and
CoreOutput: what one step did for it, as the core sends it to the front.

Plain host-side data that only the scheduler writes once it is made (but for sample_row, which the runner sets as it
lays a step out); nothing here touches devices.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

from qwen_jax.outputs import TokenLogprob
from qwen_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qwen_jax.engine.grammar import RequestGrammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 grammar: RequestGrammar | None = None):
        """`grammar`: a structured output's matcher (engine/grammar.py), fed each token read back."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.slot: int | None = None  # recurrent-state slot (hybrid models)
        self.num_computed_tokens = 0  # tokens whose KV / state is in the cache, or will be once the steps issued run
        self.num_pending = 0  # tokens sampled by steps issued but not read back yet (their ids still on the device)
        # Drafts that verify programs not read back yet booked as computed, past one token a round: some of them
        # are emitted too, the rest rejected (the scheduler takes those back from num_computed_tokens).
        self.num_unverified = 0
        self.sample_row = 0  # the row of this sequence's last sampled token in the last step that sampled for it
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (last admission)
        self.block_hashes: list[int] = []  # hash chain of the full prompt blocks
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.arrival_time = time.time()
        self.scheduled_time: float | None = None  # first admitted to the running batch
        self.grammar = grammar

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) of prompt + output (pending ones are not known yet), without building the whole
        list (the runner reads one token per decode row)."""
        split = len(self.prompt_token_ids)
        if start >= split:
            return self.output_token_ids[start - split:end - split]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - split)]

    @property
    def num_tokens(self) -> int:
        """Prompt, output, pending and unverified tokens: where the sequence's next token goes, as far as the host
        knows (the device moves it back by the drafts rejected: step.stage_behind)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending + self.num_unverified

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_requested(self) -> int:
        """Output tokens produced or surely on their way (unverified drafts not counted): at least this many."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def queue_seconds(self) -> float | None:
        """How long it waited for its first admission (None while it has never run)."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclasses.dataclass
class CoreOutput:
    """What one step did for one request: its new tokens (and their logprobs), and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the EOS / stop token id that ended it
    eos: bool = False  # the last new token is an EOS that ended the request: it is not part of the text
    num_cached_tokens: int = 0
    error: str | None = None  # finish_reason "error": what went wrong with this request alone
    rejected: bool = False  # the error is the request's own (refused on arrival), not a failure while it ran
    queue_seconds: float | None = None  # how long it waited to be first scheduled
