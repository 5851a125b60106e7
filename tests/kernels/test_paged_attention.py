"""The Pallas paged-attention kernel (interpret mode on CPU) against its jnp reference: decode with ragged contexts and
key splits, chunked prefill against a cached prefix, GQA groups 1, 2, 3 and 8, padding rows, shuffled page tables, and
NaN in every cache slot past the context (never used); plus its lowering to Triton for CUDA. Never needs a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.paged_attention import paged_attention, reference

RTOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}  # max |kernel - reference| / max |reference|; bf16: the reference
# rounds its scores to bf16 and the kernel does not


def make_inputs(seed: int, batch: int, seq: int, heads: int, kv_heads: int, dim: int, block_size: int, width: int,
                context_lens: list[int], dtype) -> dict:
    """Each row's query block ends at its context (prefill chunk or decode token); pages shuffled over the cache,
    padding table entries 0 (page 0 is the padding sink)."""
    rng = np.random.default_rng(seed)
    num_blocks = batch * width + 1
    normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    tables = np.zeros((batch, width), np.int32)
    pages = rng.permutation(num_blocks - 1) + 1
    for b, n in enumerate(context_lens):
        used = -(-n // block_size)
        tables[b, :used] = pages[b * width:b * width + used]
    start = np.maximum(np.asarray(context_lens) - seq, 0)
    return dict(q=normal((batch, seq, heads, dim)), k_cache=normal((num_blocks, block_size, kv_heads, dim)),
                v_cache=normal((num_blocks, block_size, kv_heads, dim)),
                positions=jnp.asarray(start[:, None] + np.arange(seq)[None], jnp.int32),
                context_lens=jnp.asarray(context_lens, jnp.int32), block_tables=jnp.asarray(tables))


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def scale(inputs: dict) -> float:
    return inputs["q"].shape[-1] ** -0.5


def poison_past_context(inputs: dict, value: float) -> dict:
    """`value` in every cache slot past each row's context: the rest of its last page, the padding page 0, pages no
    row holds."""
    block_size = inputs["k_cache"].shape[1]
    live = np.zeros(inputs["k_cache"].shape[:2], bool)
    for b, n in enumerate(np.asarray(inputs["context_lens"])):
        for t in range(n):
            live[inputs["block_tables"][b, t // block_size], t % block_size] = True
    fill = lambda c: jnp.where(jnp.asarray(live)[:, :, None, None], c, jnp.asarray(value, c.dtype))
    return dict(inputs, k_cache=fill(inputs["k_cache"]), v_cache=fill(inputs["v_cache"]))


def check(inputs: dict, **config) -> None:
    """The kernel on a cache with NaN past every context (a key it must never use) against the reference with zeros
    there (which it multiplies by zero probabilities)."""
    got = jax.jit(lambda x: paged_attention(**x, scale=scale(inputs), **config))(poison_past_context(inputs, np.nan))
    want = jax.jit(lambda x: reference(**x, scale=scale(inputs)))(poison_past_context(inputs, 0.0))
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()  # every output element written, no NaN key read
    assert rel_err(got, want) < RTOL[inputs["q"].dtype.type]
    got = np.asarray(got, np.float32)
    for b, n in enumerate(np.asarray(inputs["context_lens"])):
        if n == 0:  # a padding row sees no key: exactly zero, as in the reference
            assert not got[b].any()


@pytest.mark.parametrize("seed, batch, heads, kv_heads, dim, block_size, width, context_lens, dtype, config", [
    # ragged contexts, a padding row, two decode rows of one token; 16 keys a step over 4-token pages
    (0, 5, 4, 2, 16, 4, 12, [5, 47, 0, 1, 30], jnp.float32, dict(block_k=16)),
    # the keys split over 3 programs and merged; GQA group 8 (padded to 16 rows); bf16
    (1, 3, 8, 1, 32, 8, 10, [80, 9, 33], jnp.bfloat16, dict(block_k=16, num_splits=3)),
    # group 1 (no GQA), head_dim 64, 16-token pages, the default key splits
    (2, 2, 2, 2, 64, 16, 4, [64, 17], jnp.float32, dict(block_k=32)),
])
def test_decode_matches_reference(seed, batch, heads, kv_heads, dim, block_size, width, context_lens, dtype, config):
    check(make_inputs(seed, batch, 1, heads, kv_heads, dim, block_size, width, context_lens, dtype), **config)


@pytest.mark.parametrize("seed, heads, dtype, config", [
    (10, 4, jnp.float32, dict(block_m=8, block_k=16)),  # group 2: 4 queries x 4 (2 padded) heads a tile, 2 tiles
    (11, 6, jnp.bfloat16, dict(block_m=16, block_k=16, num_splits=2)),  # group 3 (padded to 4); keys split in two
])
def test_prefill_chunk_against_a_cached_prefix_matches_reference(seed, heads, dtype, config):
    """7 new tokens per row: after a 12-token cached prefix, at the start of a sequence (context 7), a padding row."""
    check(make_inputs(seed, 3, 7, heads, 2, 32, 4, 6, [19, 7, 0], dtype), **config)


def test_rejects_head_dims_triton_cannot_tile():
    inputs = make_inputs(0, 1, 1, 2, 1, 24, 4, 2, [3], jnp.float32)
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(**inputs, scale=scale(inputs))


@pytest.mark.parametrize("batch, seq, width, calls, grid", [
    (64, 1, 128, 1, "grid_x = 2 : i32, grid_y = 2 : i32, grid_z = 64 : i32"),  # decode: 2 key splits per row
    (4, 512, 32, 1, "grid_x = 32 : i32, grid_y = 2 : i32, grid_z = 4 : i32"),  # prefill: 16 queries x 8 heads a tile
])
def test_lowers_to_one_triton_call_for_cuda(batch, seq, width, calls, grid):
    """Lowered (not compiled) for CUDA on this CPU machine at the 35B-A3B shapes (16 heads, 2 KV heads, D 256, bf16)."""
    s = jax.ShapeDtypeStruct
    args = (s((batch, seq, 16, 256), jnp.bfloat16), s((4096, 16, 2, 256), jnp.bfloat16),
            s((4096, 16, 2, 256), jnp.bfloat16), s((batch, seq), jnp.int32), s((batch,), jnp.int32),
            s((batch, width), jnp.int32))
    fn = jax.jit(lambda *x: paged_attention(*x, scale=256 ** -0.5, interpret=False))
    exported = export.export(fn, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == calls
    assert grid in text
