"""Speculative decoding's acceptance: from the target model's logits at a verify row's k+1 positions (its last token
and k draft tokens) and the drafts, the tokens the row emits: the longest accepted prefix of the drafts, then one
token of the target's own (the correction at the first mismatch, or the bonus after k acceptances).

Every position draws its token exactly as the plain sampler (engine/sampler.py) would draw it there: greedy rows take
the argmax, sampled rows draw from the sampler's distribution (`target_logits`: temperature, top-k, top-p, min-p,
logit bias, bans) with the key the sampler would use for that output token (the row's rng advanced by rng_step per
position, as several decode steps in one program advance it). A draft is accepted when it equals that token. With
one-hot drafts (the drafter's argmax) a draft d is then accepted with probability p(d), as rejection sampling would
accept it, and every emitted token is the very token plain decoding would have drawn, so a seeded request's output
does not depend on whether, or how much, it speculated. Rows with penalties or a grammar, whose distribution at j
depends on the tokens before j, are not verified here (the engine does not speculate for them).
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

    tensors: the rows' SamplingTensors for this step (no penalty counts, no grammar masks); position j of a row
    draws with row_key(rng + j * rng_step), the key of its output token there. `path`: cut_path of the rows.
    """
    rows, positions, vocab = logits.shape
    k = positions - 1
    if drafts.shape != (rows, k):
        raise ValueError(f"verify: drafts {drafts.shape} for logits {logits.shape}: want ({rows}, {k})")
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    x, scaled = target_logits(logits.reshape(rows * positions, vocab), _per_position(tensors, positions), None, path)
    x, scaled = x.reshape(logits.shape), scaled.reshape(logits.shape)
    at = jnp.arange(positions)
    rng = tensors.rng[:, None, :] + at[None, :, None].astype(jnp.uint32) * tensors.rng_step[:, None, :]
    keys = jax.vmap(jax.vmap(row_key))(rng)  # [R, k+1]
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys, scaled).astype(jnp.int32)
    own = jnp.where(tensors.temperature[:, None] > 0.0, drawn, jnp.argmax(x, axis=-1).astype(jnp.int32))
    num_accepted = jnp.sum(jnp.cumprod((drafts == own[:, :k]).astype(jnp.int32), axis=-1), axis=-1)  # [R] 0..k
    emitted = at[None, :] <= num_accepted[:, None]
    tokens = jnp.where(emitted, own, -1)
    chosen = jnp.take_along_axis(raw_logprobs, own[..., None], axis=-1)[..., 0]
    if num_top_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, num_top_logprobs)
    else:
        top_logprobs = jnp.zeros((rows, positions, 0), jnp.float32)
        top_ids = jnp.zeros((rows, positions, 0), jnp.int32)
    return VerifyOutput(tokens, num_accepted + 1, jnp.where(emitted, chosen, 0.0), top_ids.astype(jnp.int32),
                        top_logprobs)
