"""On-device sampling: per-row grammar masks, logit biases, penalties (from per-request token counts kept on the
device), EOS bans, temperature, top-k, top-p, min-p, seeded draws and raw logprobs.

Never reads device values back to the host, never branches on a device value (a GPU conditional waits for its
predicate on the host), and never lets one row's parameters or position change another row's draw.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.engine.grammar import mask_words
from qwen_jax.sampling_params import SamplingParams

# Rows whose top-k is at most this (and rows without any cut) are served by the k largest logits (`largest`) instead
# of a full [B, V] sort; top-p is then computed inside those k candidates, which is exact because top-k is applied
# first.
TOP_K_FAST_MAX = 64
# `largest` looks for the k largest of a row among the k chunks of this many entries with the largest maxima.
CHUNK = 128

_U32 = 0xFFFFFFFF


class SamplingTables(NamedTuple):
    """What the sampler reads of each state slot on the device, beside a step's SamplingTensors: written when a request
    enters the batch (its penalty counts, logit bias and the tokens banned before min_tokens) or, for a constrained
    request, before each of its steps (its grammar mask). A step's row names its slot's row of a table, or the row one
    past the end, which reads as nothing: no counts, no bias, no ban, every token allowed. Fixed shapes, so one
    compiled program serves every mix of sampling settings."""

    counts: jax.Array  # [S, V] i32 penalty counts: 0 never seen; 1 + its occurrences in the output once seen
    bias: jax.Array  # [S, V] f32 logit_bias
    banned: jax.Array  # [S, V] bool the tokens that would end the request: banned until min_tokens
    masks: jax.Array  # [S, W] i32 grammar bitmask (bit v % 32 of word v // 32: token v allowed)


def table_shapes(num_slots: int, vocab_size: int) -> SamplingTables:
    """The tables' shapes and dtypes (jax.ShapeDtypeStruct) for `num_slots` slots."""
    return SamplingTables(jax.ShapeDtypeStruct((num_slots, vocab_size), jnp.int32),
                          jax.ShapeDtypeStruct((num_slots, vocab_size), jnp.float32),
                          jax.ShapeDtypeStruct((num_slots, vocab_size), jnp.bool_),
                          jax.ShapeDtypeStruct((num_slots, mask_words(vocab_size)), jnp.int32))


def table_bytes_per_slot(vocab_size: int) -> int:
    """A slot's bytes in the sampling tables (one row of each)."""
    return sum(math.prod(t.shape[1:]) * t.dtype.itemsize for t in table_shapes(1, vocab_size))


def bias_row(params: SamplingParams, vocab_size: int) -> np.ndarray:
    """A request's row of the logit-bias table [V] f32."""
    row = np.zeros(vocab_size, np.float32)
    for token, value in (params.logit_bias or {}).items():
        row[token] = value
    return row


def ending_tokens(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would end a request (its stop token ids, and EOS unless ignore_eos): banned before min_tokens,
    as vLLM does."""
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))


def banned_row(params: SamplingParams, eos_token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """A request's row of the banned table [V] bool."""
    row = np.zeros(vocab_size, np.bool_)
    row[ending_tokens(params, eos_token_ids)] = True
    return row


def bans(params: SamplingParams, eos_token_ids: Sequence[int]) -> bool:
    """Whether a request has a row in the banned table: it has min_tokens and a token that would end it."""
    return params.min_tokens > 0 and bool(ending_tokens(params, eos_token_ids))


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters of a step, padded to a batch bucket B (padding rows are greedy, no cuts, and name no
    table row): device arrays from `build`, numpy from `build_host`. Their shapes depend on B alone."""

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
    penalty_rows: jax.Array  # [B] i32 the row's row of tables.counts; S (none) without penalties
    bias_rows: jax.Array  # [B] i32 its row of tables.bias; S without logit_bias
    ban_rows: jax.Array  # [B] i32 its row of tables.banned; S without min_tokens
    ban_until: jax.Array  # [B] i32 tokens it still bans the ending tokens for (min_tokens - output tokens so far)
    mask_rows: jax.Array  # [B] i32 its row of tables.masks; S when unconstrained

    @classmethod
    def build(cls, *args, sharding: jax.sharding.Sharding | None = None, **kwargs) -> SamplingTensors:
        """build_host(*args, **kwargs)'s arrays on the devices of `sharding` (default: the default device)."""
        return cls(*jax.device_put(tuple(cls.build_host(*args, **kwargs)), sharding))  # one batched transfer

    @classmethod
    def build_host(
        cls,
        params_list: Sequence[SamplingParams],
        num_generated: Sequence[int],
        slots: Sequence[int] | None = None,
        *,
        vocab_size: int,
        batch_size: int,
        num_slots: int,
        eos_token_ids: Sequence[int] = (),
        step_seed: int = 0,
        constrained_rows: Sequence[int] = (),
    ) -> SamplingTensors:
        """Host-side assembly for one step, as numpy arrays (the runner moves them to its mesh itself).

        num_generated[i]: output tokens row i already has (its seed counter and its min_tokens clock), in-flight ones
        included. slots[i]: the state slot whose table rows hold request i's counts, bias, bans and mask; each is
        named only where the request has one (penalties, logit_bias, min_tokens with an ending token, a grammar
        among `constrained_rows`); num_slots: the tables' rows, the index that names none. step_seed: an engine
        counter that advances by one every decode step; unseeded row r draws with key (step_seed, r). A seeded row
        draws with key (seed, num_generated), so its tokens do not depend on the rest of the batch.
        """
        n = len(params_list)
        slots = list(slots) if slots is not None else [num_slots] * n
        if not n <= batch_size or len(num_generated) != n or len(slots) != n:
            raise ValueError(f"{n} params, {len(num_generated)} counters and {len(slots)} slots for a bucket of "
                             f"{batch_size}")
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
        penalty_rows, bias_rows, ban_rows, mask_rows = np.full((4, batch_size), num_slots, np.int32)
        ban_until = np.zeros(batch_size, np.int32)
        constrained = set(constrained_rows)
        for i, (p, done, slot) in enumerate(zip(params_list, num_generated, slots, strict=True)):
            temperature[i] = p.temperature
            top_k[i] = p.top_k if 0 < p.top_k < vocab_size else 0
            top_p[i], min_p[i] = p.top_p, p.min_p
            rep[i], presence[i], frequency[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            if p.seed is not None:
                rng[i] = (p.seed & _U32, (p.seed >> 32) & _U32, done & _U32)
                rng_step[i] = (0, 0, 1)
            if p.has_penalties:
                penalty_rows[i] = slot
            if p.logit_bias:
                bias_rows[i] = slot
            if done < p.min_tokens and bans(p, eos_token_ids):
                ban_rows[i], ban_until[i] = slot, p.min_tokens - done
            if i in constrained:
                mask_rows[i] = slot
        return cls(temperature, top_k, top_p, min_p, rep, presence, frequency, rng, rng_step, penalty_rows, bias_rows,
                   ban_rows, ban_until, mask_rows)


def cut_path(params_list: Sequence[SamplingParams], vocab_size: int) -> int:
    """Which top-k / top-p path a batch needs, chosen on the host (a branch on a device value would make the GPU
    wait for the host): 0 when no sampled row cuts; 1 when every cutting row has 0 < top_k <= TOP_K_FAST_MAX
    (the batch's TOP_K_FAST_MAX largest logits: `largest`); 2 otherwise (a full descending sort)."""
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


def apply_penalties(logits: jax.Array, t: SamplingTensors, seen: jax.Array) -> jax.Array:
    """[B, V] logits -> penalised logits, from each row's penalty counts `seen` [B, V] (its row of tables.counts;
    zeros for a row without a penalty, which leaves its logits exactly as they were). Repetition first (tokens of
    prompt+output, as HF/vLLM: positive logits are divided by it, negative ones multiplied), then frequency and
    presence (output tokens only, as OpenAI/vLLM: subtract frequency * count, and presence once)."""
    occurrences = jnp.maximum(seen - 1, 0).astype(jnp.float32)
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen > 0, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * occurrences
    return logits - t.presence_penalty[:, None] * (occurrences > 0)


def seen_counts(tables: SamplingTables, t: SamplingTensors) -> jax.Array:
    """Each row's penalty counts [B, V] (zeros for a row without penalties)."""
    return tables.counts.at[t.penalty_rows].get(mode="fill", fill_value=0)


def count_tokens(counts: jax.Array, t: SamplingTensors, tokens: jax.Array) -> jax.Array:
    """The penalty counts after each penalised row's new token (rows without penalties name no row: dropped)."""
    old = counts.at[t.penalty_rows, tokens].get(mode="fill", fill_value=0)
    return counts.at[t.penalty_rows, tokens].set(jnp.maximum(old, 1) + 1, mode="drop")


def largest(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of each row of x [B, V] and their ids, as lax.top_k gives them (descending, ties by
    the lower id), without sorting whole rows (on a GPU lax.top_k sorts them: H100, 248,320 entries, 64 rows: 2.0 ms;
    scripts/sampler_cost.py). Exact: every entry above the k-th largest value lies in a chunk whose maximum is above
    it, and there are fewer than k such chunks, so the k chunks of the largest maxima hold the k largest values."""
    b, v = x.shape
    if v <= 4 * k * CHUNK:
        return jax.lax.top_k(x, k)
    chunks = jnp.pad(x, ((0, 0), (0, -v % CHUNK)), constant_values=-jnp.inf).reshape(b, -1, CHUNK)
    _, best = jax.lax.top_k(jnp.max(chunks, axis=-1), k)  # [B, k] the chunks of the largest maxima
    candidates = jnp.take_along_axis(chunks, best[:, :, None], axis=1).reshape(b, k * CHUNK)
    ids = (best[:, :, None] * CHUNK + jnp.arange(CHUNK)).reshape(b, k * CHUNK)
    negated, ids = jax.lax.sort((-candidates, ids), dimension=1, num_keys=2)  # by value, then by id
    return -negated[:, :k], ids[:, :k]


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
    every cutting row has top_k <= TOP_K_FAST_MAX (`largest`); 2 a full descending sort."""
    if path == 0:
        return scaled
    v = scaled.shape[1]
    fast = min(TOP_K_FAST_MAX, v)
    k_on = (t.top_k > 0) & active
    cuts = (k_on | (t.top_p < 1.0)) & active
    small_k = k_on & (t.top_k <= fast)
    if path == 1:
        vals, _ = largest(scaled, fast)
        thr = _cut_threshold(vals, t.top_k, t.top_p)
    else:
        vals = -jnp.sort(-scaled, axis=-1)
        # Rows with a small k use the first `fast` sorted values, the same numbers path 1 sees, so a row's draw does
        # not depend on which path its batch took.
        thr = jnp.where(small_k, _cut_threshold(vals[:, :fast], t.top_k, t.top_p),
                        _cut_threshold(vals, t.top_k, t.top_p))
    return jnp.where(cuts[:, None] & (scaled < thr[:, None]), -jnp.inf, scaled)


def allowed_tokens(words: jax.Array, vocab_size: int) -> jax.Array:
    """Grammar mask words [B, W] -> [B, V] bool: the tokens each row allows next."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab_size] != 0


def target_logits(logits: jax.Array, t: SamplingTensors, tables: SamplingTables, path: int,
                  seen: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """float32 logits [B, V] -> (x, scaled): x the logits a greedy row takes its argmax of (grammar mask, logit bias,
    penalties, bans applied), `scaled` those a sampled row draws from (x / temperature, then top-k, top-p and min-p
    as -inf): the distribution every sampled token follows, speculative or not (engine/speculative.py). `seen`: the
    rows' penalty counts when not their rows of tables.counts (a verify position after its drafts)."""
    v = logits.shape[1]
    words = tables.masks.at[t.mask_rows].get(mode="fill", fill_value=-1)  # every bit set: all allowed
    x = jnp.where(allowed_tokens(words, v), logits, -jnp.inf)
    x = x + tables.bias.at[t.bias_rows].get(mode="fill", fill_value=0.0)
    x = apply_penalties(x, t, seen_counts(tables, t) if seen is None else seen)
    banned = tables.banned.at[t.ban_rows].get(mode="fill", fill_value=False) & (t.ban_until > 0)[:, None]
    x = jnp.where(banned, -jnp.inf, x)
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


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "path"), donate_argnames=("tables",))
def sample(logits: jax.Array, tensors: SamplingTensors, tables: SamplingTables, *, num_top_logprobs: int,
           path: int) -> tuple[SampleOutput, SamplingTables]:
    """logits [B, V] -> (SampleOutput, the tables with the penalised rows' new tokens counted). `path`: a cut path
    at least the batch's (cut_path: a higher one gives the same draws). One compilation per (B, K, path).

    Order: grammar mask -> logit bias -> penalties (as vLLM) -> bans -> (greedy rows: argmax) -> / temperature ->
    top-k -> top-p -> min-p -> categorical draw with the row's key. Logprobs are those of the raw model distribution
    (log-softmax of the unmodified logits, vLLM's default "raw_logprobs"), for the chosen token and for the top
    num_top_logprobs.
    """
    t = tensors
    logits = logits.astype(jnp.float32)
    b = logits.shape[0]
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    x, scaled = target_logits(logits, t, tables, path)
    greedy_tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    keys = jax.vmap(row_key)(t.rng)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    tokens = jnp.where(t.temperature > 0.0, drawn, greedy_tokens)
    tables = tables._replace(counts=count_tokens(tables.counts, t, tokens))

    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_top_logprobs:
        top_logprobs, top_ids = largest(raw_logprobs, num_top_logprobs)
    else:
        top_logprobs, top_ids = jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs), tables


def next_step(t: SamplingTensors, steps: jax.Array | int) -> SamplingTensors:
    """A row's tensors `steps` tokens later (several decode steps in one program, a verify position): its key
    advanced as that many single steps would advance it, its min_tokens clock run down."""
    steps = jnp.asarray(steps)
    return t._replace(rng=t.rng + steps.astype(jnp.uint32)[..., None] * t.rng_step,
                      ban_until=t.ban_until - steps.astype(jnp.int32))


def write_rows(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """table [S, ...] with rows `rows` [N] set to values [N, ...] (rows out of range: dropped)."""
    return table.at[rows].set(values, mode="drop")
