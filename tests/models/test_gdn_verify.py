"""Speculative verify of the Gated DeltaNet (qwen_jax.layers.gated_deltanet: verify_causal_convs, verify_delta_rule,
gdn_layer_verify, commit_verified): a verify row's outputs and, once its accepted count n is known, its committed
conv and recurrent states must be bitwise those of n one-token decode steps, rejected tokens leaving no trace.

Float32 on random states, draft lengths 1..3, random accepted counts; rows shuffled on the token axis between
padding tokens (NaN, so a read of one shows) and padding requests, whose sink slot 0 must keep its bits.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax.config import from_hf_dict
from qwen_jax.layers.batch import Ragged, ragged
from qwen_jax.layers.gated_deltanet import (
    CONVS,
    causal_convs,
    commit_verified,
    delta_rule,
    gdn_layer,
    gdn_layer_verify,
    verify_causal_convs,
    verify_delta_rule,
)
from qwen_jax.models.decoder import param_shapes, random_params

NK, NV, DK, DV, KERNEL, SLOTS = 2, 4, 16, 16, 4, 9
STARTS = [7, 3, 12, 1, 30]  # each row's first position (its last accepted token): none fresh; 1 is the shortest
ROW_SLOTS = [5, 2, 8, 3, 6]  # out of order, with unused slots between; padding requests sink into slot 0
REQUESTS = 7  # two padding requests
# Prefill of the same tokens against token-by-token steps: the chunked WY form solves a triangular system over the
# row's tokens, another summation order than the recurrence (tests/models/test_gdn_chunked_vs_recurrent.py: 2e-5).
PREFILL_RTOL = 2e-5


def verify_rows(draft_len: int, seed: int) -> Ragged:
    """Every row draft_len + 1 tokens at STARTS on ROW_SLOTS, in a random order on the token axis with a padding
    token or none before each and padding after; the rows are a random subset of the REQUESTS request indices."""
    rng = np.random.default_rng(seed)
    count, length = len(STARTS), draft_len + 1
    query_start, t = np.zeros(count, np.int32), 0
    for i in rng.permutation(count):
        t += int(rng.integers(0, 2))
        query_start[i], t = t, t + length
    return ragged(STARTS, [length] * count, ROW_SLOTS, [[]] * count, t + 2, REQUESTS, 1, query_start,
                  rng.permutation(REQUESTS)[:count])


def decode_rows(batch: Ragged, step: int) -> tuple[Ragged, np.ndarray]:
    """The one-token decode batch of each verify row's token `step` (same request indices and slots), and where
    those tokens sit in the verify batch."""
    real = np.flatnonzero(np.asarray(batch.query_len) > 0)
    order = real[np.argsort(np.asarray(batch.query_start)[real])]
    at = np.asarray(batch.query_start)[order] + step
    starts = np.asarray(batch.context_len - batch.query_len)[order] + step
    decode = ragged(starts.tolist(), [1] * len(order), np.asarray(batch.state_slot)[order].tolist(),
                    [[]] * len(order), len(order), REQUESTS, 1, request_index=order.tolist())
    return decode, at


def inputs(seed: int, tokens: int) -> tuple[dict, dict]:
    """The mixer's inputs before the conv (x_q, x_k, x_v, a, b) and its weights (conv weights, A_log, dt_bias)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    xs = dict(conv_q=normal(tokens, NK, DK), conv_k=normal(tokens, NK, DK), conv_v=normal(tokens, NV, DV),
              a=normal(tokens, NV), b=normal(tokens, NV, scale=2.0))
    weights = dict(conv_q=normal(KERNEL, NK, DK, scale=0.5), conv_k=normal(KERNEL, NK, DK, scale=0.5),
                   conv_v=normal(KERNEL, NV, DV, scale=0.5), A_log=normal(NV, scale=0.7) - 1.0, dt_bias=normal(NV))
    return xs, weights


def random_cache(seed: int) -> dict:
    rng = np.random.default_rng(seed + 100)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return dict(conv_q=normal(SLOTS, KERNEL - 1, NK, DK), conv_k=normal(SLOTS, KERNEL - 1, NK, DK),
                conv_v=normal(SLOTS, KERNEL - 1, NV, DV), ssm=normal(SLOTS, NV, DK, DV))


def nan_at_padding(xs: dict, batch: Ragged) -> dict:
    padding = ~np.asarray(batch.token_valid)
    return {name: jnp.where(padding.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.nan, x) for name, x in xs.items()}


@jax.jit
def mixer_step(xs: dict, weights: dict, cache: dict, batch: Ragged) -> tuple[jax.Array, dict]:
    """The recurrent part of gdn_layer as it runs today: the convs, then the delta rule, slots advanced."""
    (q, k, v), convs = causal_convs(tuple(xs[n] for n in CONVS), tuple(cache[n] for n in CONVS),
                                    tuple(weights[n] for n in CONVS), batch)
    out, ssm = delta_rule(q, k, v, xs["a"], xs["b"], weights["A_log"], weights["dt_bias"], cache["ssm"], batch)
    return out, dict(zip(CONVS, convs), ssm=ssm)


@functools.partial(jax.jit, static_argnames="draft_len")
def mixer_verify(xs: dict, weights: dict, cache: dict, batch: Ragged, draft_len: int) -> tuple[jax.Array, dict]:
    """The same through the verify ops: outputs and gdn_layer_verify's `pending`."""
    q, k, v = verify_causal_convs(tuple(xs[n] for n in CONVS), tuple(cache[n] for n in CONVS),
                                  tuple(weights[n] for n in CONVS), batch)
    out, states = verify_delta_rule(q, k, v, xs["a"], xs["b"], weights["A_log"], weights["dt_bias"], cache["ssm"],
                                    batch, draft_len)
    return out, dict({n: xs[n] for n in CONVS}, ssm=states)


commit = jax.jit(commit_verified)


def accepted_counts(batch: Ragged, draft_len: int, seed: int) -> np.ndarray:
    """Random 1..draft_len + 1 per row, the extremes included; 0 for padding requests."""
    rng = np.random.default_rng(seed + 200)
    real = np.flatnonzero(np.asarray(batch.query_len) > 0)
    counts = rng.integers(1, draft_len + 2, len(real))
    counts[:2] = 1, draft_len + 1
    accepted = np.zeros(REQUESTS, np.int32)
    accepted[rng.permutation(real)] = counts
    return accepted


@pytest.mark.parametrize("draft_len", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_committed_states_are_bitwise_those_of_one_token_decode_steps(draft_len, seed):
    batch = verify_rows(draft_len, seed)
    xs, weights = inputs(seed, batch.token_valid.shape[0])
    cache = random_cache(seed)
    accepted = accepted_counts(batch, draft_len, seed)

    out, pending = mixer_verify(nan_at_padding(xs, batch), weights, cache, batch, draft_len)
    committed = jax.tree.map(np.asarray, commit(cache, pending, batch, jnp.asarray(accepted)))

    # plain decoding: the rows' tokens one step at a time, the cache after each step kept
    after = [jax.tree.map(np.asarray, cache)]
    decoded = cache
    for step in range(draft_len + 1):
        decode, at = decode_rows(batch, step)
        step_out, decoded = mixer_step({n: x[at] for n, x in xs.items()}, weights, decoded, decode)
        after.append(jax.tree.map(np.asarray, decoded))
        np.testing.assert_array_equal(np.asarray(out)[at], np.asarray(step_out))  # each token's output, bitwise

    valid = np.asarray(batch.token_valid)
    assert np.isfinite(np.asarray(out)[valid]).all() and not np.asarray(out)[~valid].any()
    real = np.flatnonzero(accepted)
    slots = np.asarray(batch.state_slot)[real]
    for name in (*CONVS, "ssm"):
        for r, slot in zip(real, slots, strict=True):  # the state after the row's accepted tokens, bitwise
            np.testing.assert_array_equal(committed[name][slot], after[accepted[r]][name][slot], err_msg=name)
        others = np.setdiff1d(np.arange(SLOTS), slots)  # the sink 0 and unused slots keep their bits
        assert 0 in others
        np.testing.assert_array_equal(committed[name][others], np.asarray(cache[name])[others], err_msg=name)


def test_a_rejected_draft_leaves_no_trace_in_the_states():
    """Two verify steps from one state whose drafts differ after the accepted ones commit the same states."""
    draft_len = 3
    batch = verify_rows(draft_len, 3)
    xs, weights = inputs(3, batch.token_valid.shape[0])
    cache = random_cache(3)
    accepted = accepted_counts(batch, draft_len, 3)
    rng = np.random.default_rng(9)
    rejected = np.zeros(batch.token_valid.shape[0], bool)
    for r in np.flatnonzero(accepted):
        rejected[batch.query_start[r] + accepted[r]:batch.query_start[r] + batch.query_len[r]] = True
    other = {n: jnp.where(rejected.reshape((-1,) + (1,) * (x.ndim - 1)),
                          jnp.asarray(rng.standard_normal(x.shape), x.dtype), x) for n, x in xs.items()}
    assert rejected.any()
    states = [commit(cache, mixer_verify(x, weights, cache, batch, draft_len)[1], batch, jnp.asarray(accepted))
              for x in (xs, other)]
    for name in (*CONVS, "ssm"):
        np.testing.assert_array_equal(np.asarray(states[0][name]), np.asarray(states[1][name]), err_msg=name)


TINY_HYBRID = {"model_type": "qwen3_5", "text_config": {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
    "rms_norm_eps": 1e-6, "dtype": "float32", "linear_num_key_heads": NK, "linear_num_value_heads": NV,
    "linear_key_head_dim": DK, "linear_value_head_dim": DV, "linear_conv_kernel_dim": KERNEL}}


@pytest.mark.parametrize("draft_len", [1, 3])
def test_verify_layer_equals_a_prefill_of_the_same_tokens(draft_len):
    """gdn_layer_verify against gdn_layer on the same batch (each row a prefill chunk of its draft_len + 1 tokens):
    outputs within PREFILL_RTOL; committing every token gives the prefill's conv windows bitwise (the same
    projections and windows) and its recurrent states within PREFILL_RTOL."""
    cfg = from_hf_dict(TINY_HYBRID)
    assert param_shapes(cfg)["layers"][0]["mixer"]["conv_v"].shape == (KERNEL, NV, DV)
    p = random_params(cfg, seed=draft_len, scale=0.3)["layers"][0]["mixer"]
    batch = verify_rows(draft_len, 4)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((batch.token_valid.shape[0], 32)), jnp.float32)
    cache = random_cache(4)

    want_out, want_cache = jax.jit(gdn_layer, static_argnums=4)(x, p, cache, batch, cfg)
    out, pending = jax.jit(gdn_layer_verify, static_argnums=(4, 5))(x, p, cache, batch, cfg, draft_len)
    got_cache = commit(cache, pending, batch, jnp.asarray(batch.query_len))

    valid = np.asarray(batch.token_valid)
    scale = np.abs(np.asarray(want_out)[valid]).max()
    assert np.abs(np.asarray(out)[valid] - np.asarray(want_out)[valid]).max() < PREFILL_RTOL * scale
    for name in CONVS:
        np.testing.assert_array_equal(np.asarray(got_cache[name]), np.asarray(want_cache[name]), err_msg=name)
    ssm, want_ssm = np.asarray(got_cache["ssm"]), np.asarray(want_cache["ssm"])
    assert np.abs(ssm - want_ssm).max() < PREFILL_RTOL * np.abs(want_ssm).max()
    assert np.abs(ssm - np.asarray(cache["ssm"])).max() > 0.1  # the rows' tokens did move their states
