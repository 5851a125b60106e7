"""SamplingParams: what a request asks of the sampler, the stop checks and the grammar, validated on construction.

Field names and defaults follow vLLM's, so OpenAI-style request fields map onto them one to one.
"""

from __future__ import annotations

import dataclasses
import json

# JSON output (json, json_object): the longest run of whitespace allowed between two tokens by default. Unbounded,
# a model can follow "{" with whitespace up to max_tokens (vLLM issue 38696: about 1 in 3 requests of Qwen3.5-9B); 16
# still lets it print an indented object (a newline and a few levels of indentation).
JSON_WHITESPACE_RUN = 16


@dataclasses.dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's structured outputs): exactly one of a JSON schema (`json`, a dict
    or its text), any JSON object (`json_object`), a regular expression, one of the strings in `choice`, a
    `grammar` (GBNF, or llguidance's Lark) or a `structural_tag` (vLLM's: JSON values in free text, each begun by a
    trigger). Its grammar is checked by engine/grammar.py. `begins_after`: a token (e.g. `</think>`, closing a think
    block the prompt opened) up to which anything goes; the grammar applies from the token after it."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict | str | None = None
    # JSON's whitespace between tokens: at most JSON_WHITESPACE_RUN characters a run (the default), none
    # (disable_any_whitespace, vLLM's field) or any (any_whitespace)
    disable_any_whitespace: bool = False
    any_whitespace: bool = False
    begins_after: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(self.KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict | str):
                raise ValueError(f"structured_outputs.{name} must be an object or its JSON text")
        for name in ("regex", "grammar", "begins_after"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("json_object", "disable_any_whitespace", "any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a boolean")
        if self.disable_any_whitespace and self.any_whitespace:
            raise ValueError("structured_outputs: give disable_any_whitespace or any_whitespace, not both")

    @property
    def json_whitespace_run(self) -> int | None:
        """The longest run of whitespace between JSON tokens: 0 (none), JSON_WHITESPACE_RUN, or None (any)."""
        if self.disable_any_whitespace:
            return 0
        return None if self.any_whitespace else JSON_WHITESPACE_RUN

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The grammar's text for the compiler: a JSON schema (json, json_object), a regex, a grammar (GBNF or Lark;
        choice: Lark) or a structural tag's JSON."""
        kind = self.kind
        if kind == "json_object":
            return '{"type": "object"}'
        if kind == "choice":  # each choice a quoted Lark literal (JSON's escapes are Lark's)
            return "start: " + " | ".join(json.dumps(c) for c in self.choice)
        value = getattr(self, kind)
        return value if isinstance(value, str) else json.dumps(value)


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; 0: the chosen token's logprob; n: also the top n
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    structured_outputs: StructuredOutputsParams | None = None

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 300  # entries per request
    LOGIT_BIAS_LIMIT = 100.0  # |bias|: +100 all but forces a token, -100 bans it

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            fail(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not 0.0 < float(self.repetition_penalty) <= 10.0:
            fail(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                fail(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            fail(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative integers")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            fail(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or
                                          not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            fail(f"logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logit_bias is not None:
            self._check_logit_bias(fail)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    def _check_logit_bias(self, fail) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            fail(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
        if len(bias) > self.MAX_LOGIT_BIAS:
            fail(f"logit_bias may hold at most {self.MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for token, value in bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                fail(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not -self.LOGIT_BIAS_LIMIT <= value <= self.LOGIT_BIAS_LIMIT):
                fail(f"logit_bias values must be numbers in [-{self.LOGIT_BIAS_LIMIT:g}, {self.LOGIT_BIAS_LIMIT:g}], "
                     f"got {value!r} for token {token}")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0
