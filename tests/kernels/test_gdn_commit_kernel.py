"""The speculative commit kernel (pallas_kernels/gdn_commit.py, through pallas_kernels.gdn.commit_verified; Pallas,
interpret mode on CPU) against the jnp reference qwen_jax.layers.gated_deltanet.commit_verified: bitwise the same
four cache arrays (only copies and selects), every slot no accepting row names keeping its bits; plus its lowering
to one Triton call for CUDA with the four caches updated in place. Never needs a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_batches import device_batch, shuffled_batch
from support import cuda_mlir

from pallas_kernels.gdn import commit_verified
from pallas_kernels.gdn_commit import commit
from qwen_jax.layers.batch import ragged
from qwen_jax.layers.gated_deltanet import commit_verified as reference

KERNEL, SLOTS, REQUESTS = 4, 12, 9
STARTS = [5, 0, 3, 9, 2, 0, 7]  # each row's first position: rows 1 and 5 fresh
ROW_SLOTS = [7, 2, 11, 4, 1, 9, 5]  # shuffled; slots 3, 6, 8, 10 and the sink 0 belong to no row

run_kernel = jax.jit(commit_verified, static_argnames="block_v")
run_reference = jax.jit(reference)


def bits(x: np.ndarray) -> np.ndarray:
    """x's bit patterns (NaN included), as unsigned integers of its width."""
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def accepted_counts(batch, draft_len: int, seed: int) -> np.ndarray:
    """Rows: 1..draft_len + 1 (both ends), one count past the row's tokens, one 0; padding requests 0 and 2 (both
    clipped to their 0 tokens)."""
    rng = np.random.default_rng(seed)
    real = np.flatnonzero(np.asarray(batch.query_len) > 0)
    counts = [1, draft_len + 1, draft_len + 4, 0, *rng.integers(1, draft_len + 2, len(real) - 4)]
    accepted = np.zeros(REQUESTS, np.int32)
    accepted[rng.permutation(real)] = counts
    padding = np.flatnonzero(np.asarray(batch.query_len) == 0)
    accepted[padding] = [0, 2]
    return accepted


def random_states(seed: int, batch, nk: int, nv: int, dk: int, dv: int, dtype) -> tuple[dict, dict]:
    """(cache, pending): random; NaN in the sink slot 0 and the fresh rows' slots (a previous owner's state, read as
    zeros), and at padding tokens of pending (nothing may copy them)."""
    rng = np.random.default_rng(seed)
    tokens = batch.token_valid.shape[0]
    normal = lambda shape, dt: jnp.asarray(rng.standard_normal(shape, np.float32), dt)
    cache = dict(ssm=normal((SLOTS, nv, dk, dv), jnp.float32), conv_q=normal((SLOTS, KERNEL - 1, nk, dk), dtype),
                 conv_k=normal((SLOTS, KERNEL - 1, nk, dk), dtype), conv_v=normal((SLOTS, KERNEL - 1, nv, dv), dtype))
    pending = dict(ssm=normal((tokens, nv, dk, dv), jnp.float32), conv_q=normal((tokens, nk, dk), dtype),
                   conv_k=normal((tokens, nk, dk), dtype), conv_v=normal((tokens, nv, dv), dtype))
    poisoned = np.concatenate([[0], np.asarray(batch.state_slot)[np.asarray(batch.fresh)]])
    padding = ~np.asarray(batch.token_valid)
    cache = {n: x.at[poisoned].set(jnp.nan) for n, x in cache.items()}
    pending = {n: x.at[padding].set(jnp.nan) for n, x in pending.items()}
    return cache, pending


@pytest.mark.parametrize("draft_len", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4), (4, 2)], ids=["nk2-nv4", "nk4-nv2"])
def test_commit_kernel_is_bitwise_the_reference(draft_len, dtype, heads):
    """Shuffled rows and slots between padding tokens and requests, fresh rows, every accepted count of
    `accepted_counts`. nk 4 > nv 2 is a device's share where a mesh splits the value heads and replicates the key
    heads (each program then writes several key heads' windows)."""
    nk, nv = heads
    batch = shuffled_batch([draft_len + 1] * len(STARTS), STARTS, ROW_SLOTS, len(STARTS) * (draft_len + 2) + 2,
                           REQUESTS, seed=draft_len)
    cache, pending = random_states(draft_len, batch, nk, nv, 16, 32, dtype)
    accepted = jnp.asarray(accepted_counts(batch, draft_len, seed=draft_len))
    want = jax.tree.map(np.asarray, run_reference(cache, pending, device_batch(batch), accepted))
    got = jax.tree.map(np.asarray, run_kernel(cache, pending, device_batch(batch), accepted, block_v=16))

    clipped = np.minimum(np.asarray(accepted), np.asarray(batch.query_len))
    written = np.asarray(batch.state_slot)[clipped > 0]
    untouched = np.setdiff1d(np.arange(SLOTS), written)
    assert len(written) == len(STARTS) - 1 and 0 in untouched and len(untouched) == SLOTS - len(written)
    for name, x in cache.items():
        assert got[name].dtype == x.dtype and got[name].shape == x.shape
        np.testing.assert_array_equal(bits(got[name]), bits(want[name]))
        np.testing.assert_array_equal(bits(got[name][untouched]), bits(np.asarray(x)[untouched]))
        assert np.isfinite(got[name][written].astype(np.float32)).all()  # no padding token, no fresh slot's NaN
        assert (got[name][written] != np.asarray(x)[written]).any()


def test_commit_rejects_mismatched_states():
    batch = device_batch(ragged([3], [2], [1], [[0]], 2, 1, 1))
    cache = dict(ssm=jnp.zeros((2, 4, 16, 16)), conv_q=jnp.zeros((2, 3, 2, 16)), conv_k=jnp.zeros((2, 3, 2, 16)),
                 conv_v=jnp.zeros((2, 3, 4, 16)))
    pending = dict(ssm=jnp.zeros((2, 4, 16, 16)), conv_q=jnp.zeros((2, 2, 16)), conv_k=jnp.zeros((2, 2, 16)),
                   conv_v=jnp.zeros((2, 4, 16)))
    accepted = jnp.ones(1, jnp.int32)
    with pytest.raises(ValueError, match="block_v 12"):
        commit(cache, pending, batch, accepted, block_v=12)
    with pytest.raises(ValueError, match="gdn_commit"):
        commit(cache, dict(pending, conv_v=jnp.zeros((2, 2, 16))), batch, accepted)
    with pytest.raises(ValueError, match="bfloat16"):
        commit(dict(cache, ssm=cache["ssm"].astype(jnp.bfloat16)), pending, batch, accepted)


def test_commit_lowers_to_one_triton_call_for_cuda():
    """Lowered (not compiled) for CUDA on this CPU machine at the 35B-A3B shapes (nk 16, nv 32, dk = dv = 128, K 4,
    bf16 convs), 64 rows of 4 tokens: one Triton call over (request, value head, value block), the four caches
    (operands 9-12) updated in place."""
    s = jax.ShapeDtypeStruct
    rows, draft_len, nk, nv, dk, dv = 64, 3, 16, 32, 128, 128
    tokens, slots = rows * (draft_len + 1), rows + 1
    cache = dict(ssm=s((slots, nv, dk, dv), jnp.float32), conv_q=s((slots, KERNEL - 1, nk, dk), jnp.bfloat16),
                 conv_k=s((slots, KERNEL - 1, nk, dk), jnp.bfloat16),
                 conv_v=s((slots, KERNEL - 1, nv, dv), jnp.bfloat16))
    pending = dict(ssm=s((tokens, nv, dk, dv), jnp.float32), conv_q=s((tokens, nk, dk), jnp.bfloat16),
                   conv_k=s((tokens, nk, dk), jnp.bfloat16), conv_v=s((tokens, nv, dv), jnp.bfloat16))
    batch = jax.tree.map(lambda x: s(x.shape, x.dtype), ragged([5] * rows, [draft_len + 1] * rows,
                                                               list(range(1, rows + 1)), [[0]] * rows, tokens, rows, 1))
    fn = jax.jit(lambda c, p, b, n: commit(c, p, b, n, block_v=64, interpret=False), donate_argnums=0)
    text = cuda_mlir(fn, cache, pending, batch, s((rows,), jnp.int32))
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert "grid_x = 64 : i32, grid_y = 32 : i32, grid_z = 2 : i32" in text
    for output, operand in enumerate(range(9, 13)):
        assert (f"#stablehlo.output_operand_alias<output_tuple_indices = [{output}], operand_index = {operand}, "
                "operand_tuple_indices = []>") in text
