"""Speculative decoding's acceptance: from the target model's logits at a verify row's k+1 positions (its last token
and k draft tokens) and the drafts, the tokens the row emits: the longest accepted prefix of the drafts, then one
token of the target's own (the correction at the first mismatch, or the bonus after k acceptances).

Every position draws its token exactly as the plain sampler (engine/sampler.py) would draw it there: greedy rows take
the argmax, sampled rows draw from the sampler's distribution (`target_logits`: temperature, top-k, top-p, min-p,
logit bias, penalties, bans) with the key the sampler would use for that output token (the row's rng advanced by
rng_step per position, as several decode steps in one program advance it). Where that distribution depends on the
tokens before the position (penalties, the min_tokens clock), it is taken after the drafts before it, which are those
tokens whenever the position is reached. A draft is accepted when it equals that token. With one-hot drafts (the
drafter's argmax) a draft d is then accepted with probability p(d), as rejection sampling would accept it, and every
emitted token is the very token plain decoding would have drawn, so a seeded request's output does not depend on
whether, or how much, it speculated. Rows under a grammar are not verified: their masks come from the host, one
token at a time.
Never reads a device value back and never branches on one.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qwen_jax.engine.sampler import (
    SamplingTables,
    SamplingTensors,
    count_tokens,
    largest,
    next_step,
    row_key,
    seen_counts,
    target_logits,
)

METHODS = ("mtp",)
MAX_DRAFTS = 3  # the most drafts a row verifies (the verify kernels are built for up to this many)


class Speculation(NamedTuple):
    """What the engine's speculative_config asks for."""

    num_drafts: int  # the most drafts a row verifies a step; 0: no speculation
    fixed: bool  # the config set num_speculative_tokens: every step that can verify does, with that many drafts


def parse_speculative_config(config: dict | str | None, has_mtp: bool = True) -> Speculation:
    """vLLM's speculative config -> Speculation. None (the default) or {"method": "mtp"}: the MTP head's drafts where
    they pay (DraftPolicy), when the model has the head; {"method": "mtp", "num_speculative_tokens": k} (k in
    1..MAX_DRAFTS): k drafts on every step that can verify them; "off" or num_speculative_tokens 0: none. A dict or
    its JSON text. Raises ValueError naming what is wrong, or when the config asks for the head and the model
    (has_mtp False) has none."""
    if config is None:
        return Speculation(MAX_DRAFTS if has_mtp else 0, False)
    if config == "off":
        return Speculation(0, False)
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not JSON or 'off': {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be an object, got {type(config).__name__}")
    unknown = set(config) - {"method", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)}")
    k = config.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFTS):
        raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in 0..{MAX_DRAFTS}, got {k!r}")
    if k == 0:
        return Speculation(0, False)
    if config.get("method") not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {METHODS}, got {config.get('method')!r}")
    if not has_mtp:
        raise ValueError("speculative_config: method 'mtp' needs the model's MTP head, and this model has none (its "
                         "config's mtp_num_hidden_layers is 0, or its checkpoint lacks the mtp.* tensors)")
    return Speculation(MAX_DRAFTS, False) if k is None else Speculation(k, True)


# A verify round's wall time over a plain decode token's, by the step's rows, for k = 1, 2, 3 drafts a row (None: not
# measured, never chosen): one round of step.verify_step (verification, commit, the head's next drafts; eight rounds
# a program for up to 8 rows, as the engine runs them) over the plain decode step's time a token (four steps a program
# for up to 8 rows), each program issued before the one before it is read back, as the engine core runs them. One
# H200, Qwen3.5-35B-A3B with random weights, context 1,536, `python -m qwen_jax.bench.step_profile --kernels gpu
# --batches 1,4,16,64 --verify 0,1,2,3 --context 1536` at 6824139 (RESULTS.json). Rows between two entries take the
# larger's; past the last entry nothing is measured and no step speculates. 128 rows: the same command with
# `--batches 128 --steps 4` (plain 27.12 ms a step). A verify step holds every GDN layer's state after each of its
# tokens until its commit (~61 MB a token for 35B-A3B: 256 rows of k = 3 ran out of memory), so the memory plan caps
# its tokens to what the caches leave (replica.max_verify_tokens; ~300 on an H200 by default): at 128 rows, only the
# k that fit are chosen from.
VERIFY_COST = {1: (1.37, 1.68, 1.92), 4: (1.46, 1.90, 2.25), 16: (1.63, 1.97, 2.18), 64: (1.37, 1.46, 1.56),
               128: (1.32, 1.52, 1.69)}
# A fresh engine expects each draft accepted with this probability, held as PRIOR_ROWS verified rows' worth of
# evidence: below what Qwen3.5's published acceptance lengths imply (~1.9 / 2.7 / 3.4 for k = 1 / 2 / 3, about 0.9 a
# draft; 0.8 gives 1.8 / 2.4 / 3.0), so a fresh engine does not overrate speculation.
PRIOR_ACCEPTANCE, PRIOR_ROWS = 0.8, 8.0
# The estimate forgets a verified row's evidence with this weight a row (~256 rows of memory).
DECAY = 1.0 - 1.0 / 256
# While the estimate keeps speculation off, one step in PROBE_EVERY that could verify does, to measure again.
PROBE_EVERY = 128


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a verify row emits on average with k drafts each accepted with probability `acceptance` (until the
    first rejection): 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** j for j in range(k + 1))


def verify_cost(rows: int, k: int) -> float | None:
    """VERIFY_COST of a step of `rows` rows with k drafts a row (None: not measured)."""
    measured = [size for size in VERIFY_COST if size >= rows]
    return VERIFY_COST[min(measured)][k - 1] if measured else None


class DraftPolicy:
    """How many drafts a step's decoding rows verify. Speculation's fixed k: that many, always. By default: the k
    that a step of that many rows would gain most from at the prior acceptance (`drafts_at`, so one verify program
    serves each row count), on a step only while it pays at the acceptance measured so far: expected tokens a row
    over the step's cost (VERIFY_COST) above one plain step's token. Host-side; the core records every verified
    row."""

    def __init__(self, spec: Speculation, max_verify_tokens: int | None = None):
        self.spec = spec
        self.max_verify_tokens = max_verify_tokens  # a verify step's most tokens (None: any)
        self.accepted = PRIOR_ACCEPTANCE * PRIOR_ROWS  # decayed sums: drafts accepted,
        self.rejected = (1.0 - PRIOR_ACCEPTANCE) * PRIOR_ROWS  # and rounds that rejected one
        self.plain_steps = 0  # steps that could have verified and did not, since the last verify step

    @property
    def acceptance(self) -> float:
        """The estimated probability that a draft is accepted (given the ones before it were)."""
        return self.accepted / (self.accepted + self.rejected)

    def drafts_at(self, rows: int) -> int:
        """The drafts a row verifies when a step of `rows` decoding rows speculates (0: such a step never does). A
        step of more than max_verify_tokens tokens never verifies: a fixed k past it gives plain steps, and the
        default policy picks among the k that fit."""
        fits = [k for k in range(1, self.spec.num_drafts + 1)
                if self.max_verify_tokens is None or rows * (k + 1) <= self.max_verify_tokens]
        if self.spec.fixed:
            return self.spec.num_drafts if self.spec.num_drafts in fits else 0
        gains = {0: 1.0} | {k: expected_tokens(k, PRIOR_ACCEPTANCE) / (verify_cost(rows, k) or float("inf"))
                            for k in fits}
        return max(gains, key=gains.__getitem__)

    def _pays(self, rows: int, k: int) -> bool:
        return self.spec.fixed or expected_tokens(k, self.acceptance) > verify_cost(rows, k)

    def drafts_for(self, rows: int) -> int:
        """The drafts each of `rows` decoding rows verifies in the next step (0: a plain step). Counts the plain
        steps that could have verified: while the measured acceptance keeps speculation off, every PROBE_EVERY-th
        verifies anyway, so the estimate can recover."""
        k = self.drafts_at(rows)
        if self._verifies(rows, k):
            self.plain_steps = 0
            return k
        self.plain_steps += bool(k)
        return 0

    def wants_drafts(self, rows: int) -> bool:
        """Whether a plain step of `rows` decoding rows leaves drafts for the next step (the MTP head runs after
        it): whether the next may verify."""
        return self._verifies(rows, self.drafts_at(rows))

    def _verifies(self, rows: int, k: int) -> bool:
        """Whether the next step of `rows` rows verifies its k drafts: it pays, or a probe is due."""
        return bool(k) and (self._pays(rows, k) or self.plain_steps + 1 >= PROBE_EVERY)

    def record(self, draft_len: int, emitted: list[int]) -> None:
        """One verify row's rounds: round i emitted emitted[i] tokens, so it accepted emitted[i] - 1 of its
        draft_len drafts and rejected the next one if one was left."""
        for count in emitted:
            self.accepted = self.accepted * DECAY + (count - 1)
            self.rejected = self.rejected * DECAY + (count - 1 < draft_len)


class VerifyOutput(NamedTuple):
    """What `verify` emits for each verify row ([R, k+1] a row); step.verify_step's has several rounds' emitted
    tokens one after another in a row's positions and num_emitted [R, rounds], each round's count."""

    tokens: jax.Array  # [R, k+1] i32: the emitted tokens first, then -1
    num_emitted: jax.Array  # [R] i32 in 1..k+1: accepted drafts + the target's own token
    logprobs: jax.Array  # [R, k+1] f32, raw log-softmax at each emitted token (0 past num_emitted)
    top_ids: jax.Array  # [R, k+1, K] i32, best first
    top_logprobs: jax.Array  # [R, k+1, K] f32


def _per_position(t: SamplingTensors, positions: int) -> SamplingTensors:
    """Each row's sampling tensors at its `positions` positions (row-major: row r's at r*positions + j), each as the
    plain sampler would see it j tokens later (sampler.next_step: its key, its min_tokens clock)."""
    rows = t.temperature.shape[0]
    repeated = SamplingTensors(*(jnp.repeat(value, positions, axis=0) for value in t))
    return next_step(repeated, jnp.tile(jnp.arange(positions), rows))


def _seen_after_drafts(seen: jax.Array, drafts: jax.Array, penalised: jax.Array) -> jax.Array:
    """Penalty counts at each verify position: seen [R, V] (the row's counts before the step), then each draft before
    the position counted as an output token, as it is once accepted (a position is only reached after its drafts
    are). Returns [R, k+1, V]; rows without penalties (`penalised` False) keep zeros."""
    rows, k = drafts.shape
    at = jnp.arange(rows)
    out = jnp.broadcast_to(seen[:, None, :], (rows, k + 1, seen.shape[1]))
    for i in range(k):  # in order: a token drafted twice is counted twice
        old = out[at, :, drafts[:, i]]  # [R, k+1]
        later = (jnp.arange(k + 1)[None, :] > i) & penalised[:, None]
        out = out.at[at, :, drafts[:, i]].set(jnp.where(later, jnp.maximum(old, 1) + 1, old))
    return out


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "path"))
def verify(logits: jax.Array, drafts: jax.Array, tensors: SamplingTensors, tables: SamplingTables, *,
           num_top_logprobs: int, path: int) -> tuple[VerifyOutput, jax.Array]:
    """logits [R, k+1, V] (float32 or bf16) of each verify row's positions, drafts [R, k] i32 -> (VerifyOutput, the
    penalty counts with each penalised row's emitted tokens counted).

    Position j of a row draws as the plain sampler would for the row's j-th token from now: with
    row_key(rng + j * rng_step), its min_tokens clock j tokens on, and its penalty counts with the drafts before j
    counted (the tokens it follows once they are accepted). `path`: at least cut_path of the rows.
    """
    rows, positions, vocab = logits.shape
    k = positions - 1
    if drafts.shape != (rows, k):
        raise ValueError(f"verify: drafts {drafts.shape} for logits {logits.shape}: want ({rows}, {k})")
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    penalised = tensors.penalty_rows < tables.counts.shape[0]
    seen = _seen_after_drafts(seen_counts(tables, tensors), drafts, penalised)
    per_position = _per_position(tensors, positions)
    x, scaled = target_logits(logits.reshape(rows * positions, vocab), per_position, tables, path,
                              seen=seen.reshape(rows * positions, vocab))
    x, scaled = x.reshape(logits.shape), scaled.reshape(logits.shape)
    keys = jax.vmap(row_key)(per_position.rng).reshape(rows, positions)
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys, scaled).astype(jnp.int32)
    own = jnp.where(tensors.temperature[:, None] > 0.0, drawn, jnp.argmax(x, axis=-1).astype(jnp.int32))
    num_accepted = jnp.sum(jnp.cumprod((drafts == own[:, :k]).astype(jnp.int32), axis=-1), axis=-1)  # [R] 0..k
    at = jnp.arange(positions)
    emitted = at[None, :] <= num_accepted[:, None]
    tokens = jnp.where(emitted, own, -1)
    counts = tables.counts
    for j in range(positions):  # each emitted token counted in order (rows without penalties name no row: dropped)
        counts = count_tokens(counts, tensors, jnp.where(emitted[:, j], own[:, j], vocab))
    chosen = jnp.take_along_axis(raw_logprobs, own[..., None], axis=-1)[..., 0]
    if num_top_logprobs:
        top_logprobs, top_ids = (a.reshape(rows, positions, num_top_logprobs) for a in largest(
            raw_logprobs.reshape(rows * positions, vocab), num_top_logprobs))
    else:
        top_logprobs = jnp.zeros((rows, positions, 0), jnp.float32)
        top_ids = jnp.zeros((rows, positions, 0), jnp.int32)
    return VerifyOutput(tokens, num_accepted + 1, jnp.where(emitted, chosen, 0.0), top_ids.astype(jnp.int32),
                        top_logprobs), counts
