"""Helpers of the GDN kernel tests (no fixtures): ragged batches laid out by hand (requests in a shuffled order,
padding tokens and padding requests between them), their inputs with NaN where nothing may be read, and the check of
pallas_kernels.gdn.delta_rule against qwen_jax.layers.gated_deltanet.delta_rule.

Imported by name from the test modules, so they never depend on which directory's conftest was imported last.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gdn import delta_rule
from qwen_jax.layers.batch import Ragged, ragged
from qwen_jax.layers.gated_deltanet import delta_rule as reference

# max |kernel - reference| / max |reference|. float32: IEEE dots, only the sums' order differs; bf16: the kernel's dot
# operands (and u between its launches) are bf16 where the reference computes in float32 from the same bf16 inputs.
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def shuffled_batch(lens: list[int], starts: list[int], slots: list[int], num_tokens: int, num_requests: int,
                   seed: int = 0) -> Ragged:
    """Request i runs lens[i] tokens from position starts[i] of its sequence (fresh where 0) on slot slots[i]. The
    requests sit on the token axis in a random order, zero or one padding token before each, padding tokens after
    them; their request indices are a random subset of num_requests, the rest padding requests (no tokens, slot 0)."""
    rng = np.random.default_rng(seed)
    count = len(lens)
    index = rng.permutation(num_requests)[:count]  # padding requests land between real ones
    query_start, t = np.zeros(count, np.int32), 0
    for i in rng.permutation(count):
        t += int(rng.integers(0, 2))
        query_start[i], t = t, t + lens[i]
    return ragged(starts, lens, slots, [[]] * count, num_tokens, num_requests, 1, query_start, index)


def make_inputs(seed: int, tokens: int, nk: int, nv: int, dk: int, dv: int, num_slots: int,
                dtype=jnp.float32) -> dict:
    """The op's arguments but the batch: activations in `dtype`, gates' parameters and ssm in float32."""
    rng = np.random.default_rng(seed)
    normal = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype)
    return dict(q=normal((tokens, nk, dk), 2.0), k=normal((tokens, nk, dk), 2.0), v=normal((tokens, nv, dv)),
                a=normal((tokens, nv)), b=normal((tokens, nv), 2.0),
                A_log=normal(nv, 0.7).astype(jnp.float32) - 1.0, dt_bias=normal(nv).astype(jnp.float32),
                ssm=jnp.asarray(rng.standard_normal((num_slots, nv, dk, dv), np.float32)))


def poison(inputs: dict, batch: Ragged) -> dict:
    """NaN in q, k, v, a, b at every padding token and in the slots of fresh requests (a previous owner's state):
    one read of them would show in the results."""
    padding = ~np.asarray(batch.token_valid)
    nan_at = lambda x: jnp.where(padding.reshape(padding.shape + (1,) * (x.ndim - 1)), jnp.nan, x)
    fresh_slots = np.asarray(batch.state_slot)[np.asarray(batch.fresh)]
    return dict(inputs, **{name: nan_at(inputs[name]) for name in ("q", "k", "v", "a", "b")},
                ssm=inputs["ssm"].at[fresh_slots].set(jnp.nan))


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def device_batch(batch: Ragged) -> Ragged:
    return Ragged(*map(jnp.asarray, batch))


@jax.jit
def run_reference(inputs: dict, batch: Ragged) -> tuple[jax.Array, jax.Array]:
    return reference(**inputs, batch=batch)


@functools.partial(jax.jit, static_argnames="options")
def _run_kernel(inputs: dict, batch: Ragged, options: tuple) -> tuple[jax.Array, jax.Array]:
    return delta_rule(**inputs, batch=batch, **dict(options))


def run_kernel(inputs: dict, batch: Ragged, **options) -> tuple[jax.Array, jax.Array]:
    return _run_kernel(inputs, device_batch(batch), tuple(sorted(options.items())))


def check_against_reference(inputs: dict, batch: Ragged, state_rtol: float | None = None, **options) -> None:
    """The kernels on `poison`ed inputs against the reference on the finite ones (float32 throughout: on a GPU,
    XLA's default would take float32 dots as TF32): every real token's output and every addressed slot's state
    match, padding tokens' outputs are exactly 0, every slot no real request names (the padding requests' sink 0
    included) keeps its bits."""
    with jax.default_matmul_precision("highest"):
        want_o, want_ssm = map(np.asarray, run_reference(inputs, device_batch(batch)))
    got_o, got_ssm = map(np.asarray, run_kernel(poison(inputs, batch), batch, **options))
    rtol = RTOL[inputs["v"].dtype.type]
    valid = np.asarray(batch.token_valid)
    real = np.asarray(batch.query_len) > 0
    addressed = np.asarray(batch.state_slot)[real]
    untouched = np.setdiff1d(np.arange(got_ssm.shape[0]), addressed)
    assert len(set(addressed.tolist())) == len(addressed) and 0 in untouched

    assert got_o.shape == want_o.shape and got_o.dtype == inputs["v"].dtype and got_ssm.dtype == np.float32
    assert np.isfinite(got_o).all() and np.isfinite(got_ssm[addressed]).all()  # nothing read where NaN sits
    assert rel_err(got_o[valid], want_o[valid]) < rtol
    assert not got_o[~valid].any()
    assert rel_err(got_ssm[addressed], want_ssm[addressed]) < (state_rtol or rtol)
    np.testing.assert_array_equal(got_ssm[untouched], np.asarray(inputs["ssm"])[untouched])
