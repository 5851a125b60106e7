"""On-device sampling: per-row grammar masks, logit biases, penalties (from per-request token counts kept on the
device), EOS bans, temperature, top-k, top-p, min-p, seeded draws and raw logprobs.

Never reads device values back to the host, never branches on a device value (a GPU conditional waits for its
predicate on the host), and never lets one row's parameters or position change another row's draw.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.engine.buckets import bucket
from qwen_jax.sampling_params import SamplingParams

# Rows whose top-k is at most this (and rows without any cut) are served by lax.top_k over the whole batch instead of a
# full [B, V] sort; top-p is then computed inside those k candidates, which is exact because top-k is applied first.
TOP_K_FAST_MAX = 64

_U32 = 0xFFFFFFFF
# A batch without a constrained row: no mask rows (the sampler does not even trace the mask).
_NO_MASK_ROWS = np.zeros(0, np.int32)
_NO_MASKS = np.zeros((0, 0), np.int32)


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
    rng_step: jax.Array  # [B, 3] u32 what one more decode step adds to rng: the counter of a seeded row, the seed of
    # an unseeded one (so a row draws the same numbers whether its steps run one program each or several in one)
    penalty_rows: jax.Array  # [B] i32 the row's row of the penalty counts; the counts' size (dropped) without penalties
    banned_ids: jax.Array  # [B, NB] i32 ids forced to -inf this step, padded with V; NB = 0: none in the batch
    bias_ids: jax.Array  # [B, NL] i32 ids whose logit gets bias_values added, padded with V; NL = 0: no logit_bias
    bias_values: jax.Array  # [B, NL] f32
    mask_rows: jax.Array  # [B] i32 each row's row of `masks` (G: unconstrained); [0] when no row is constrained
    masks: jax.Array  # [G, W] i32 token bitmask of the constrained rows (bit v % 32 of word v // 32: v allowed)

    @classmethod
    def build(cls, *args, sharding: jax.sharding.Sharding | None = None, **kwargs) -> SamplingTensors:
        """build_host(*args, **kwargs)'s arrays on the devices of `sharding` (default: the default device)."""
        return cls(*jax.device_put(tuple(cls.build_host(*args, **kwargs)), sharding))  # one batched transfer

    @classmethod
    def build_host(
        cls,
        params_list: Sequence[SamplingParams],
        num_generated: Sequence[int],
        penalty_rows: Sequence[int] | None = None,
        *,
        vocab_size: int,
        batch_size: int,
        eos_token_ids: Sequence[int] = (),
        step_seed: int = 0,
        num_penalty_rows: int = 0,
        constrained_rows: Sequence[int] = (),
        token_masks: np.ndarray | None = None,
    ) -> SamplingTensors:
        """Host-side assembly for one step, as numpy arrays (the runner moves them to its mesh itself).

        num_generated[i]: output tokens row i already has (its seed counter and its min_tokens clock), in-flight ones
        included. penalty_rows[i]: the row of the device's penalty counts (`init_penalty_rows`) that holds request
        i's token counts; used only by rows with a penalty. num_penalty_rows: the counts' rows (the drop index).
        step_seed: an engine counter that advances by one every decode step; unseeded row r draws with key
        (step_seed, r). constrained_rows: the rows under a grammar, token_masks [len(constrained_rows), W] their
        allowed tokens (engine/grammar.py fills them).
        A seeded row draws with key (seed, num_generated), so its tokens do not depend on the rest of the batch.
        """
        n = len(params_list)
        penalty_rows = list(penalty_rows) if penalty_rows is not None else [0] * n
        if not n <= batch_size or len(num_generated) != n or len(penalty_rows) != n:
            raise ValueError(f"{n} params, {len(num_generated)} counters and {len(penalty_rows)} penalty rows "
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
        rng_step = np.zeros((batch_size, 3), np.uint32)
        rng_step[:, 0] = 1
        rows = np.full(batch_size, num_penalty_rows, np.int32)
        banned: dict[int, list[int]] = {}
        for i, (p, done) in enumerate(zip(params_list, num_generated, strict=True)):
            temperature[i] = p.temperature
            top_k[i] = p.top_k if 0 < p.top_k < vocab_size else 0
            top_p[i], min_p[i] = p.top_p, p.min_p
            rep[i], presence[i], frequency[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            if p.seed is not None:
                rng[i] = (p.seed & _U32, (p.seed >> 32) & _U32, done & _U32)
                rng_step[i] = (0, 0, 1)
            if p.has_penalties:
                rows[i] = penalty_rows[i]
            if done < p.min_tokens:
                # vLLM semantics: before min_tokens, every token that would end the request is banned.
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                if ids:
                    banned[i] = sorted(ids)
        most_banned = max(map(len, banned.values()), default=0)  # 0: no bans, not even traced
        banned_ids = np.full((batch_size, bucket(most_banned, 4) if most_banned else 0), vocab_size, np.int32)
        for i, ids in banned.items():
            banned_ids[i, : len(ids)] = ids
        most_biased = max((len(p.logit_bias or ()) for p in params_list), default=0)
        width = bucket(most_biased, 4) if most_biased else 0
        bias_ids = np.full((batch_size, width), vocab_size, np.int32)
        bias_values = np.zeros((batch_size, width), f32)
        for i, p in enumerate(params_list):
            if p.logit_bias:
                bias_ids[i, :len(p.logit_bias)] = list(p.logit_bias)
                bias_values[i, :len(p.logit_bias)] = list(p.logit_bias.values())
        mask_rows, masks = _NO_MASK_ROWS, _NO_MASKS
        if constrained_rows:
            count = len(constrained_rows)
            masks = np.zeros((bucket(count), token_masks.shape[1]), np.int32)
            masks[:count] = token_masks
            mask_rows = np.full(batch_size, len(masks), np.int32)
            mask_rows[list(constrained_rows)] = np.arange(count)
        return cls(temperature, top_k, top_p, min_p, rep, presence, frequency, rng, rng_step, rows, banned_ids,
                   bias_ids, bias_values, mask_rows, masks)


def cut_path(params_list: Sequence[SamplingParams], vocab_size: int) -> int:
    """Which top-k / top-p path a batch needs, chosen on the host (a branch on a device value would make the GPU
    wait for the host): 0 when no sampled row cuts; 1 when every cutting row has 0 < top_k <= TOP_K_FAST_MAX
    (lax.top_k over the batch); 2 otherwise (a full descending sort)."""
    fast = min(TOP_K_FAST_MAX, vocab_size)
    cutting = [p for p in params_list
               if p.temperature > 0 and ((0 < p.top_k < vocab_size) or p.top_p < 1.0)]
    if not cutting:
        return 0
    return 1 if all(0 < p.top_k <= fast for p in cutting) else 2


class SampleOutput(NamedTuple):
    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, log-softmax of the raw logits at the chosen token
    top_ids: jax.Array  # [B, K] i32, best first
    top_logprobs: jax.Array  # [B, K] f32, raw log-softmax, descending


def init_penalty_rows(counts: jax.Array, rows: jax.Array, token_ids: jax.Array, num_prompt: jax.Array,
                      num_tokens: jax.Array) -> jax.Array:
    """Reset rows `rows` [N] of the penalty counts [S, V] (S: out of range, dropped) from each request's tokens so far:
    token_ids [N, L] (prompt then output, num_tokens [N] of them real, the first num_prompt [N] the prompt).
    Entry (row, v): 0 when v was never seen, 1 + its number of occurrences in the output once seen."""
    n, length = token_ids.shape
    vocab = counts.shape[1]
    at = jnp.arange(length)[None, :]
    real = at < num_tokens[:, None]
    every = jnp.zeros((n, vocab + 1), jnp.int32).at[jnp.arange(n)[:, None], jnp.where(real, token_ids, vocab)].set(1)
    output = real & (at >= num_prompt[:, None])
    every = every.at[jnp.arange(n)[:, None], jnp.where(output, token_ids, vocab)].add(1)
    return counts.at[rows].set(every[:, :vocab], mode="drop")


def apply_penalties(logits: jax.Array, t: SamplingTensors, counts: jax.Array) -> jax.Array:
    """[B, V] logits -> penalised logits, from each row's penalty counts (init_penalty_rows; rows without a penalty
    name no row and read zeros). Repetition first (tokens of prompt+output, as HF/vLLM: positive logits are divided by
    it, negative ones multiplied), then frequency and presence (output tokens only, as OpenAI/vLLM: subtract
    frequency * count, and presence once)."""
    seen = counts.at[t.penalty_rows].get(mode="fill", fill_value=0)  # [B, V]
    occurrences = jnp.maximum(seen - 1, 0).astype(jnp.float32)
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen > 0, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * occurrences
    return logits - t.presence_penalty[:, None] * (occurrences > 0)


def count_tokens(counts: jax.Array, t: SamplingTensors, tokens: jax.Array) -> jax.Array:
    """The penalty counts after each penalised row's new token: seen, and one more output occurrence."""
    old = counts.at[t.penalty_rows, tokens].get(mode="fill", fill_value=0)
    return counts.at[t.penalty_rows, tokens].set(jnp.maximum(old, 1) + 1, mode="drop")


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


def _truncate(scaled: jax.Array, t: SamplingTensors, active: jax.Array, path: int) -> jax.Array:
    """Top-k then top-p on temperature-scaled logits by the path `cut_path` chose for the batch: 0 nobody cuts; 1
    every cutting row has top_k <= TOP_K_FAST_MAX (lax.top_k); 2 a full descending sort."""
    if path == 0:
        return scaled
    v = scaled.shape[1]
    fast = min(TOP_K_FAST_MAX, v)
    k_on = (t.top_k > 0) & active
    cuts = (k_on | (t.top_p < 1.0)) & active
    small_k = k_on & (t.top_k <= fast)
    if path == 1:
        vals, _ = jax.lax.top_k(scaled, fast)
        thr = _cut_threshold(vals, t.top_k, t.top_p)
    else:
        vals = -jnp.sort(-scaled, axis=-1)
        # Rows with a small k use the first `fast` sorted values, the same numbers path 1 sees, so a row's draw does
        # not depend on which path its batch took.
        thr = jnp.where(small_k, _cut_threshold(vals[:, :fast], t.top_k, t.top_p),
                        _cut_threshold(vals, t.top_k, t.top_p))
    return jnp.where(cuts[:, None] & (scaled < thr[:, None]), -jnp.inf, scaled)


def allowed_tokens(t: SamplingTensors, vocab_size: int) -> jax.Array:
    """[B, V] bool: the tokens each row's grammar allows next (every token for an unconstrained row)."""
    words = t.masks.at[t.mask_rows].get(mode="fill", fill_value=-1)  # [B, W]; all bits set past the masks
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab_size] != 0


def target_logits(logits: jax.Array, t: SamplingTensors, counts: jax.Array | None, path: int
                  ) -> tuple[jax.Array, jax.Array]:
    """float32 logits [B, V] -> (x, scaled): x the logits a greedy row takes its argmax of (grammar mask, logit bias,
    penalties, bans applied), `scaled` those a sampled row draws from (x / temperature, then top-k, top-p and min-p
    as -inf): the distribution every sampled token follows, speculative or not (engine/speculative.py)."""
    v = logits.shape[1]
    x = logits
    if t.mask_rows.shape[0]:
        x = jnp.where(allowed_tokens(t, v), x, -jnp.inf)
    if t.bias_ids.shape[1]:
        x = x.at[jnp.arange(x.shape[0])[:, None], t.bias_ids].add(t.bias_values, mode="drop")
    if counts is not None:
        x = apply_penalties(x, t, counts)
    if t.banned_ids.shape[1]:
        x = x.at[jnp.arange(x.shape[0])[:, None], t.banned_ids].set(-jnp.inf, mode="drop")
    active = t.temperature > 0.0
    scaled = x / jnp.where(active, t.temperature, 1.0)[:, None]
    scaled = _truncate(scaled, t, active, path)
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    # min-p on the (renormalised) cut distribution: p / p_max is unchanged by renormalisation, so compare logits.
    below_min_p = (t.min_p[:, None] > 0.0) & (scaled < row_max + jnp.log(jnp.maximum(t.min_p, 1e-30))[:, None])
    return x, jnp.where(below_min_p, -jnp.inf, scaled)


def row_key(rng: jax.Array) -> jax.Array:
    """(lo, hi, counter) -> fold_in(key(seed), counter): key data [hi, lo] is exactly what jax.random.key(seed) holds
    for a 64-bit seed (and [0, seed] for a 32-bit one), without tracing the seeding."""
    key = jax.random.wrap_key_data(jnp.stack([rng[1], rng[0]]), impl="threefry2x32")
    return jax.random.fold_in(key, rng[2])


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "path"), donate_argnames=("counts",))
def sample(logits: jax.Array, tensors: SamplingTensors, counts: jax.Array | None = None, *, num_top_logprobs: int,
           path: int) -> tuple[SampleOutput, jax.Array | None]:
    """logits [B, V] -> (SampleOutput, the penalty counts with the penalised rows' new tokens counted). `counts`:
    None when no row of the batch has a penalty; `path`: cut_path of the batch. One compilation per (B, K, path,
    NB, NL, G, penalties or not).

    Order: grammar mask -> logit bias -> penalties (as vLLM) -> bans -> (greedy rows: argmax) -> / temperature ->
    top-k -> top-p -> min-p -> categorical draw with the row's key. Logprobs are those of the raw model distribution
    (log-softmax of the unmodified logits, vLLM's default "raw_logprobs"), for the chosen token and for the top
    num_top_logprobs.
    """
    t = tensors
    logits = logits.astype(jnp.float32)
    b = logits.shape[0]
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    x, scaled = target_logits(logits, t, counts, path)
    greedy_tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    keys = jax.vmap(row_key)(t.rng)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    tokens = jnp.where(t.temperature > 0.0, drawn, greedy_tokens)
    if counts is not None:
        counts = count_tokens(counts, t, tokens)

    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_top_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, num_top_logprobs)
    else:
        top_logprobs, top_ids = jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs), counts
