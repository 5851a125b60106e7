"""Speculative decoding's acceptance: from the target model's logits at a verify row's k+1 positions (its last token
and k draft tokens) and the drafts, the tokens the row emits: the longest accepted prefix of the drafts, then one
token of the target's own (the correction at the first rejection, or the bonus after k acceptances).

Greedy rows accept a draft when it is the target's argmax. Sampled rows use rejection sampling against the drafts as
one-hot proposals (the drafter takes its argmax): draft d at position j is accepted with probability p_j(d), and at
the first rejection the token is drawn from p_j without d, renormalised. Every emitted token then follows exactly the
distribution the plain sampler (engine/sampler.py) would draw it from, p_j being that sampler's distribution
(`target_logits`: temperature, top-k, top-p, min-p, logit bias, bans). Rows with penalties or a grammar, whose
distribution at j depends on the tokens before j, are not verified here (the engine does not speculate for them).
Never reads a device value back and never branches on one.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qwen_jax.engine.sampler import SamplingTensors, row_key, target_logits

METHODS = ("mtp",)
MAX_DRAFTS = 3  # the most drafts a row verifies (the verify kernels are built for up to this many)


def num_speculative_tokens(config: dict | str | None) -> int:
    """vLLM's speculative config, {"method": "mtp", "num_speculative_tokens": k} (a dict or its JSON text) -> k;
    None -> 0 (no speculation). Raises ValueError naming what is wrong."""
    if config is None:
        return 0
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be an object, got {type(config).__name__}")
    unknown = set(config) - {"method", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)}")
    if config.get("method") not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {METHODS}, got {config.get('method')!r}")
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFTS:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in 1..{MAX_DRAFTS}, got {k!r}")
    return k


class VerifyOutput(NamedTuple):
    tokens: jax.Array  # [R, k+1] i32: the emitted tokens first, then -1
    num_emitted: jax.Array  # [R] i32 in 1..k+1: accepted drafts + the target's own token
    logprobs: jax.Array  # [R, k+1] f32, raw log-softmax at each emitted token (0 past num_emitted)
    top_ids: jax.Array  # [R, k+1, K] i32, best first
    top_logprobs: jax.Array  # [R, k+1, K] f32


def _per_position(t: SamplingTensors, positions: int) -> SamplingTensors:
    """Each row's sampling tensors repeated for its `positions` positions (row-major: row r's at r*positions + j)."""
    rows = t.temperature.shape[0]
    fields = {name: jnp.repeat(value, positions, axis=0) if value.shape[:1] == (rows,) else value
              for name, value in t._asdict().items()}
    return SamplingTensors(**fields)


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "path"))
def verify(logits: jax.Array, drafts: jax.Array, tensors: SamplingTensors, *, num_top_logprobs: int,
           path: int) -> VerifyOutput:
    """logits [R, k+1, V] (float32 or bf16) of each verify row's positions, drafts [R, k] i32 -> VerifyOutput.

    tensors: the rows' SamplingTensors for this step (no penalty counts, no grammar masks); a row draws its numbers
    from its usual key (row_key of its rng), folded with 2j for the acceptance test at position j and 2j+1 for the
    token drawn there. `path`: cut_path of the rows.
    """
    rows, positions, vocab = logits.shape
    k = positions - 1
    if drafts.shape != (rows, k):
        raise ValueError(f"verify: drafts {drafts.shape} for logits {logits.shape}: want ({rows}, {k})")
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    x, scaled = target_logits(logits.reshape(rows * positions, vocab), _per_position(tensors, positions), None, path)
    x, scaled = x.reshape(logits.shape), scaled.reshape(logits.shape)
    sampled = tensors.temperature > 0.0  # [R]
    keys = jax.vmap(row_key)(tensors.rng)
    at = jnp.arange(positions)

    def draws(key):  # per position: a uniform for the acceptance test, a key for the position's own token
        return (jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, 2 * j)))(at),
                jax.vmap(lambda j: jax.random.fold_in(key, 2 * j + 1))(at))

    uniforms, token_keys = jax.vmap(draws)(keys)  # [R, k+1], [R, k+1] keys
    probs = jax.nn.softmax(scaled, axis=-1)  # [R, k+1, V]
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)  # [R, k+1]
    draft_prob = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]  # [R, k]
    accepted = jnp.where(sampled[:, None], uniforms[:, :k] < draft_prob, drafts == greedy[:, :k])
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)  # [R] in 0..k

    # The target's own token at every position: a rejected draft is excluded from the draw there (the residual
    # distribution); past the drafts (the bonus position) nothing is excluded.
    excluded = jnp.concatenate([drafts, jnp.full((rows, 1), vocab, jnp.int32)], axis=1)  # vocab: no token
    residual = jnp.where(jnp.arange(vocab) == excluded[..., None], -jnp.inf, scaled)
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(token_keys, residual).astype(jnp.int32)
    own = jnp.where(sampled[:, None], drawn, greedy)  # [R, k+1]
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((rows, 1), jnp.int32)], axis=1)
    tokens = jnp.where(at < num_accepted[:, None], padded_drafts, own)
    emitted = at <= num_accepted[:, None]
    tokens = jnp.where(emitted, tokens, -1)
    chosen = jnp.take_along_axis(raw_logprobs, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    if num_top_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, num_top_logprobs)
    else:
        top_logprobs = jnp.zeros((rows, positions, 0), jnp.float32)
        top_ids = jnp.zeros((rows, positions, 0), jnp.int32)
    return VerifyOutput(tokens, num_accepted + 1, jnp.where(emitted, chosen, 0.0), top_ids.astype(jnp.int32),
                        top_logprobs)
