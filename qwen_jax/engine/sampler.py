"""On-device sampling: per-row penalties, EOS bans, temperature, top-k, top-p, min-p, seeded draws and raw logprobs.

Never reads device values back to the host and never lets one row's parameters or position change another row's draw.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.sampling_params import SamplingParams

# Rows whose top-k is at most this (and rows without any cut) are served by lax.top_k over the whole batch instead of a
# full [B, V] sort; top-p is then computed inside those k candidates, which is exact because top-k is applied first.
TOP_K_FAST_MAX = 64

_U32 = 0xFFFFFFFF


def _bucket(n: int, minimum: int) -> int:
    """0 stays 0 (the feature is off for the whole batch and is not even traced); else the next power of two."""
    return 0 if n == 0 else max(minimum, 1 << (n - 1).bit_length())


class TokenHistory:
    """What the penalties of one request need, grown in O(new tokens): its unique prompt+output token ids and, for
    each, how often it occurs in the output.

    Why this shape: a dense [B, V] count array sent from the host would be 64 x 248,320 x 4 B = 64 MB per step, and
    rebuilding counts from full token lists would cost O(sequence length) per request per step. Instead the host keeps
    these two growing arrays (a dict maps id -> slot), `SamplingTensors.build` copies them into padded [B, L] arrays
    (L = the largest number of distinct ids, bucketed to a power of two: a few hundred KB), and the jitted sampler
    scatters them into [B, V] on the device, which costs about one more elementwise pass over the logits.
    """

    def __init__(self, prompt_token_ids: Sequence[int]):
        unique = np.unique(np.asarray(prompt_token_ids, dtype=np.int32))
        capacity = max(64, 2 * len(unique))
        self._ids = np.zeros(capacity, np.int32)
        self._counts = np.zeros(capacity, np.int32)
        self._ids[: len(unique)] = unique
        self._slot = {int(t): i for i, t in enumerate(unique)}
        self.num_output_tokens = 0

    def append(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            slot = self._slot.get(int(t))
            if slot is None:
                slot = len(self._slot)
                if slot == len(self._ids):
                    self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                self._slot[int(t)] = slot
                self._ids[slot] = t
            self._counts[slot] += 1
        self.num_output_tokens += len(token_ids)

    @property
    def ids(self) -> np.ndarray:  # [n] int32, distinct ids seen in prompt or output
        return self._ids[: len(self._slot)]

    @property
    def output_counts(self) -> np.ndarray:  # [n] int32, occurrences of ids[i] in the output (0: prompt only)
        return self._counts[: len(self._slot)]


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters, padded to a batch bucket B (padding rows are greedy, no cuts): device arrays from
    `build`, numpy from `build_host`."""

    temperature: jax.Array  # [B] f32; 0 = greedy
    top_k: jax.Array  # [B] i32; 0 = off
    top_p: jax.Array  # [B] f32; 1 = off
    min_p: jax.Array  # [B] f32; 0 = off
    repetition_penalty: jax.Array  # [B] f32; 1 = off
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    rng: jax.Array  # [B, 3] u32: (seed low word, seed high word, counter); key = fold_in(key(seed), counter)
    history_ids: jax.Array  # [B, L] i32 distinct prompt+output ids, padded with V (dropped); L = 0: no penalties
    history_counts: jax.Array  # [B, L] i32 output occurrences of history_ids
    banned_ids: jax.Array  # [B, NB] i32 ids forced to -inf this step, padded with V; NB = 0: none in the batch

    @classmethod
    def build(cls, *args, sharding: jax.sharding.Sharding | None = None, **kwargs) -> SamplingTensors:
        """build_host(*args, **kwargs)'s arrays on the devices of `sharding` (default: the default device)."""
        return cls(*jax.device_put(tuple(cls.build_host(*args, **kwargs)), sharding))  # one batched transfer

    @classmethod
    def build_host(
        cls,
        params_list: Sequence[SamplingParams],
        num_generated: Sequence[int],
        histories: Sequence[TokenHistory | None],
        *,
        vocab_size: int,
        batch_size: int,
        eos_token_ids: Sequence[int] = (),
        step_seed: int = 0,
    ) -> SamplingTensors:
        """Host-side assembly for one step, as numpy arrays (the runner places them on its mesh itself).

        num_generated[i]: output tokens row i already has (its seed counter and its min_tokens clock).
        histories[i]: row i's TokenHistory; may be None when the row uses no penalty.
        step_seed: an engine counter that changes every step; unseeded row r draws with key (step_seed, r).
        A seeded row draws with key (seed, num_generated), so its tokens do not depend on the rest of the batch.
        """
        n = len(params_list)
        if not n <= batch_size or len(num_generated) != n or len(histories) != n:
            raise ValueError(f"{n} params, {len(num_generated)} counters and {len(histories)} histories "
                             f"for a bucket of {batch_size}")
        f32 = np.float32
        temperature = np.zeros(batch_size, f32)
        top_k = np.zeros(batch_size, np.int32)
        top_p = np.ones(batch_size, f32)
        min_p = np.zeros(batch_size, f32)
        rep = np.ones(batch_size, f32)
        presence = np.zeros(batch_size, f32)
        frequency = np.zeros(batch_size, f32)
        rng = np.zeros((batch_size, 3), np.uint32)
        step_seed = int(step_seed)
        rng[:, 0], rng[:, 1], rng[:, 2] = step_seed & _U32, (step_seed >> 32) & _U32, np.arange(batch_size)
        penalised: list[int] = []
        banned: dict[int, list[int]] = {}
        for i, (p, done) in enumerate(zip(params_list, num_generated, strict=True)):
            temperature[i] = p.temperature
            top_k[i] = p.top_k if 0 < p.top_k < vocab_size else 0
            top_p[i], min_p[i] = p.top_p, p.min_p
            rep[i], presence[i], frequency[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            if p.seed is not None:
                rng[i] = (p.seed & _U32, (p.seed >> 32) & _U32, done & _U32)
            if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                if histories[i] is None:
                    raise ValueError(f"row {i} uses penalties but has no TokenHistory")
                penalised.append(i)
            if done < p.min_tokens:
                # vLLM semantics: before min_tokens, every token that would end the request is banned.
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                if ids:
                    banned[i] = sorted(ids)
        hist_len = _bucket(max((len(histories[i].ids) for i in penalised), default=0), 16)
        history_ids = np.full((batch_size, hist_len), vocab_size, np.int32)
        history_counts = np.zeros((batch_size, hist_len), np.int32)
        for i in penalised:
            h = histories[i]
            history_ids[i, : len(h.ids)] = h.ids
            history_counts[i, : len(h.ids)] = h.output_counts
        banned_ids = np.full((batch_size, _bucket(max(map(len, banned.values()), default=0), 4)), vocab_size, np.int32)
        for i, ids in banned.items():
            banned_ids[i, : len(ids)] = ids
        return cls(temperature, top_k, top_p, min_p, rep, presence, frequency, rng, history_ids, history_counts,
                   banned_ids)


class SampleOutput(NamedTuple):
    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, log-softmax of the raw logits at the chosen token
    top_ids: jax.Array  # [B, K] i32, best first
    top_logprobs: jax.Array  # [B, K] f32, raw log-softmax, descending


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """[B, V] logits -> penalised logits. Repetition first (tokens of prompt+output, as HF/vLLM: positive logits are
    divided by it, negative ones multiplied), then frequency and presence (output tokens only, as OpenAI/vLLM:
    subtract frequency * count, and presence once)."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    # 0: never seen; c + 1: seen, c occurrences in the output. Padding ids are V and dropped.
    seen = jnp.zeros((b, v), jnp.int32).at[rows, t.history_ids].set(t.history_counts + 1, mode="drop")
    counts = jnp.maximum(seen - 1, 0).astype(jnp.float32)
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen > 0, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * counts
    return logits - t.presence_penalty[:, None] * (counts > 0)


def _cut_threshold(vals: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """vals [B, N] sorted descending -> [B] the smallest value kept by top-k then top-p (nucleus, at least one)."""
    n = vals.shape[1]
    pos = jnp.arange(n)[None, :]
    k = jnp.where((top_k > 0) & (top_k < n), top_k, n)[:, None]
    in_k = pos < k
    probs = jax.nn.softmax(jnp.where(in_k, vals, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    keep = in_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    last = jnp.maximum(jnp.sum(keep, axis=-1) - 1, 0)
    return jnp.take_along_axis(vals, last[:, None], axis=-1)[:, 0]


def _truncate(scaled: jax.Array, t: SamplingTensors, active: jax.Array) -> jax.Array:
    """Top-k then top-p on temperature-scaled logits, choosing the cheapest path that is exact for the batch:
    0: nobody cuts; 1: every cutting row has top_k <= TOP_K_FAST_MAX (lax.top_k); 2: a full descending sort."""
    v = scaled.shape[1]
    fast = min(TOP_K_FAST_MAX, v)
    k_on = (t.top_k > 0) & active
    cuts = (k_on | (t.top_p < 1.0)) & active
    small_k = k_on & (t.top_k <= fast)
    branch = jnp.where(jnp.any(cuts), jnp.where(jnp.all(~cuts | small_k), 1, 2), 0)

    def mask(thr):
        return jnp.where(cuts[:, None] & (scaled < thr[:, None]), -jnp.inf, scaled)

    def none(x):
        return x

    def top_k_path(x):
        vals, _ = jax.lax.top_k(x, fast)
        return mask(_cut_threshold(vals, t.top_k, t.top_p))

    def sort_path(x):
        vals = -jnp.sort(-x, axis=-1)
        # Rows with a small k use the first `fast` sorted values, the same numbers path 1 sees, so a row's draw does
        # not depend on which path its batch took.
        thr = jnp.where(small_k, _cut_threshold(vals[:, :fast], t.top_k, t.top_p),
                        _cut_threshold(vals, t.top_k, t.top_p))
        return mask(thr)

    return jax.lax.switch(branch, [none, top_k_path, sort_path], scaled)


def _row_key(rng: jax.Array) -> jax.Array:
    """(lo, hi, counter) -> fold_in(key(seed), counter): key data [hi, lo] is exactly what jax.random.key(seed) holds
    for a 64-bit seed (and [0, seed] for a 32-bit one), without tracing the seeding."""
    key = jax.random.wrap_key_data(jnp.stack([rng[1], rng[0]]), impl="threefry2x32")
    return jax.random.fold_in(key, rng[2])


@functools.partial(jax.jit, static_argnames=("num_top_logprobs",))
def sample(logits: jax.Array, tensors: SamplingTensors, num_top_logprobs: int) -> SampleOutput:
    """logits [B, V] -> SampleOutput; one compilation per (B, K) while no row uses penalties or bans (those add the
    bucketed L and NB to the cache key).

    Order: penalties -> bans -> (greedy rows: argmax) -> / temperature -> top-k -> top-p -> min-p -> categorical draw
    with the row's key. Logprobs are those of the raw model distribution (log-softmax of the unmodified logits, vLLM's
    default "raw_logprobs"), for the chosen token and for the top num_top_logprobs.
    """
    t = tensors
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    x = logits
    if t.history_ids.shape[1]:
        x = apply_penalties(x, t)
    if t.banned_ids.shape[1]:
        x = x.at[jnp.arange(b)[:, None], t.banned_ids].set(-jnp.inf, mode="drop")
    greedy_tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)

    active = t.temperature > 0.0
    scaled = x / jnp.where(active, t.temperature, 1.0)[:, None]
    scaled = _truncate(scaled, t, active)
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    # min-p on the (renormalised) cut distribution: p / p_max is unchanged by renormalisation, so compare logits.
    below_min_p = (t.min_p[:, None] > 0.0) & (scaled < row_max + jnp.log(jnp.maximum(t.min_p, 1e-30))[:, None])
    scaled = jnp.where(below_min_p, -jnp.inf, scaled)
    keys = jax.vmap(_row_key)(t.rng)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    tokens = jnp.where(active, drawn, greedy_tokens)

    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_top_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, num_top_logprobs)
    else:
        top_logprobs, top_ids = jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)

