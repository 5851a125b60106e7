"""The Pallas paged-attention kernels (interpret mode on CPU) against the jnp reference on flat ragged batches: decode
rows and prefill chunks (from the start of a sequence and after a cached prefix) mixed, requests shuffled on the token
axis with padding tokens between them and padding requests among them, GQA groups 1, 2 and 8, a device's one KV head
of a replicated cache, decode key splits, NaN in every cache slot past a context (never used), the cache left as it
was; plus the lowering to Triton for CUDA. Never needs a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.paged_attention import paged_attention
from qwen_jax.layers.attention import paged_attention as reference
from qwen_jax.layers.batch import Ragged, ragged

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max |kernel - reference| / max |reference|; bf16: the reference
# rounds its scores to bf16 and the kernel does not


def shuffled(batch: Ragged, rng: np.random.Generator) -> tuple[Ragged, np.ndarray]:
    """The same requests at random request indices (the padding requests among them), laid on the token axis in a
    random order with the padding tokens spread between them. Returns the batch and, per new token, the old token
    it carries (-1: padding)."""
    tokens, requests = batch.positions.shape[0], batch.query_len.shape[0]
    real = np.flatnonzero(batch.query_len)
    index = rng.permutation(requests)  # old request r -> new request index[r]
    cuts = np.sort(rng.integers(0, tokens - int(batch.query_len.sum()) + 1, len(real)))
    gaps = np.diff(cuts, prepend=0)  # padding tokens before each request
    query_start, source, t = np.zeros(requests, np.int32), np.full(tokens, -1), 0
    for r, gap in zip(rng.permutation(real), gaps):
        n, old = batch.query_len[r], batch.query_start[r]
        query_start[r], source[t + gap:t + gap + n], t = t + gap, np.arange(old, old + n), t + gap + n
    new = ragged(batch.context_len[real] - batch.query_len[real], batch.query_len[real], batch.state_slot[real],
                 batch.block_table[real], tokens, requests, batch.block_table.shape[1], query_start[real], index[real])
    return new, source


def make_inputs(seed: int, requests: list[tuple[int, int]], num_tokens: int, num_requests: int, heads: int,
                kv_heads: int, dim: int, block_size: int, width: int, dtype, shuffle: bool) -> dict:
    """requests: (start position, new tokens) each; their pages shuffled over the cache (page 0, the padding sink,
    unused), every key below a request's context in the cache (this step's written before attention runs)."""
    rng = np.random.default_rng(seed)
    num_blocks = len(requests) * width + 1
    normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    pages = rng.permutation(num_blocks - 1) + 1
    tables = [pages[i * width:i * width + -(-(start + n) // block_size)] for i, (start, n) in enumerate(requests)]
    batch = ragged([s for s, _ in requests], [n for _, n in requests], [0] * len(requests), tables, num_tokens,
                   num_requests, width)
    if shuffle:
        batch, _ = shuffled(batch, rng)
    return dict(q=normal((num_tokens, heads, dim)), k_cache=normal((num_blocks, block_size, kv_heads, dim)),
                v_cache=normal((num_blocks, block_size, kv_heads, dim)), batch=batch)


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def poison_past_context(inputs: dict, value: float) -> dict:
    """`value` in every cache slot past each request's context: the rest of its last page, the padding page 0, pages
    no request holds."""
    batch, block_size = inputs["batch"], inputs["k_cache"].shape[1]
    live = np.zeros(inputs["k_cache"].shape[:2], bool)
    for r, n in enumerate(batch.context_len):
        for t in range(n):
            live[batch.block_table[r, t // block_size], t % block_size] = True
    fill = lambda c: jnp.where(jnp.asarray(live)[:, :, None, None], c, jnp.asarray(value, c.dtype))
    return dict(inputs, k_cache=fill(inputs["k_cache"]), v_cache=fill(inputs["v_cache"]))


def check(inputs: dict, kv_head_start=0, num_kv_heads=None, **config) -> None:
    """The kernel on a cache with NaN past every context (a key it must never use) against the reference with zeros
    there (which it multiplies by zero probabilities); the cache as it was after the call, padding tokens exactly 0."""
    scale = inputs["q"].shape[-1] ** -0.5
    heads = dict(kv_head_start=kv_head_start, num_kv_heads=num_kv_heads)
    poisoned = poison_past_context(inputs, np.nan)
    cache_before = [np.asarray(poisoned[name]).tobytes() for name in ("k_cache", "v_cache")]
    got = jax.jit(lambda x: paged_attention(**x, scale=scale, **heads, **config))(poisoned)
    want = jax.jit(lambda x: reference(**x, scale=scale, **heads))(poison_past_context(inputs, 0.0))
    for name, before in zip(("k_cache", "v_cache"), cache_before):
        assert np.asarray(poisoned[name]).tobytes() == before  # bit for bit (NaN included)
    assert got.shape == want.shape and got.dtype == want.dtype
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()  # every output element written, no NaN key read
    assert rel_err(got, want) < RTOL[inputs["q"].dtype.type]
    assert not got[~inputs["batch"].token_valid].any()


# (start position, new tokens) per request: decode rows of ragged contexts (one at position 0: a 1-token prompt),
# prefill chunks from the start of a sequence and after a cached prefix
MIXED = [(5, 1), (0, 7), (12, 6), (0, 1), (40, 1), (29, 9)]


@pytest.mark.parametrize("seed, requests, num_tokens, num_requests, heads, kv_heads, dim, block_size, width, dtype, "
                         "shuffle, config", [
    # group 2: 4 queries x 2 heads a prefill tile, chunks of 2 and 3 tiles; 16 keys a step over 4-token pages
    (0, MIXED, 40, 9, 4, 2, 16, 4, 12, jnp.float32, True, dict(block_m=8, block_k=16)),
    # group 8 (decode: padded to 16 rows; prefill: 2 queries a tile); the decode keys split over 3 programs; bf16
    (1, [(79, 1), (8, 1), (20, 13), (0, 3)], 24, 6, 8, 1, 32, 8, 10, jnp.bfloat16, True,
     dict(block_m=16, block_k=16, num_splits=3)),
    # group 1, head_dim 64, 16-token pages, the requests in order and the padding at the end, default tiles
    (2, [(63, 1), (16, 1), (0, 20)], 24, 4, 2, 2, 64, 16, 4, jnp.float32, False, dict(block_k=32)),
    # decode only, the keys split in two; the prefill launch has no tile (it only zeroes the padding tokens)
    (3, [(10, 1), (30, 1), (0, 1)], 5, 4, 4, 2, 16, 4, 8, jnp.float32, True, dict(num_splits=2)),
    # prefill only, the default tiles (one tile a request)
    (4, [(0, 16), (3, 5)], 24, 2, 4, 2, 16, 4, 6, jnp.bfloat16, True, {}),
    # speculative verify rows (max_query_len: every request in the decode launch, all its queries in one program),
    # one at position 0; group 8 (4 queries x 8 heads a program), the keys split over 3 programs; bf16
    (8, [(70, 3), (9, 3), (0, 3), (33, 2)], 16, 6, 8, 1, 32, 8, 10, jnp.bfloat16, True,
     dict(block_k=16, num_splits=3, max_query_len=3)),
    # verify rows of 4 tokens and a decode row, group 2 (4 queries x 4 padded heads), one split, float32
    (9, [(21, 4), (50, 1), (3, 4)], 12, 4, 4, 2, 16, 4, 16, jnp.float32, True, dict(block_k=16, max_query_len=4)),
])
def test_ragged_batch_matches_reference(seed, requests, num_tokens, num_requests, heads, kv_heads, dim, block_size,
                                        width, dtype, shuffle, config):
    check(make_inputs(seed, requests, num_tokens, num_requests, heads, kv_heads, dim, block_size, width, dtype,
                      shuffle), **config)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_one_kv_head_of_a_replicated_cache_matches_reference(num_splits):
    """A device holding 2 query heads of KV head 2 (of 3): kv_head_start traced, as inside a shard_map."""
    inputs = make_inputs(5, MIXED[:4], 20, 5, 2, 3, 16, 4, 6, jnp.float32, True)
    check(inputs, kv_head_start=jnp.int32(2), num_kv_heads=1, block_m=8, block_k=16, num_splits=num_splits)


def test_shuffled_batch_gives_the_in_order_batch_outputs_per_token():
    """The token order is the batch's business only: the kernel's outputs follow their tokens."""
    inputs = make_inputs(6, MIXED, 32, 8, 4, 2, 16, 4, 12, jnp.float32, False)
    batch, source = shuffled(inputs["batch"], np.random.default_rng(7))
    q = jnp.where(jnp.asarray(source >= 0)[:, None, None], inputs["q"][np.maximum(source, 0)], 0.0)
    run = jax.jit(lambda x: paged_attention(**x, scale=0.25, block_m=8, block_k=16))
    in_order = np.asarray(run(inputs))
    out = np.asarray(run(dict(inputs, q=q, batch=batch)))
    np.testing.assert_allclose(out[source >= 0], in_order[source[source >= 0]], rtol=1e-6, atol=1e-6)
    assert not out[source < 0].any()


def test_rejects_head_dims_triton_cannot_tile():
    inputs = make_inputs(0, [(2, 1)], 1, 1, 2, 1, 24, 4, 2, jnp.float32, False)
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(**inputs, scale=0.2)


@pytest.mark.parametrize("tokens, requests, width, grids", [
    # 64 tokens of up to 64 requests: prefill (64 + 32 x 15) / 16 slots of 16 queries x 8 heads (at most 32 requests
    # of two or more tokens); decode 2 key splits a request
    (64, 64, 128, [(34, 2, 1), (2, 2, 64)]),
    # 2,048 tokens of up to 4 requests: prefill (2,048 + 4 x 15) / 16 slots; decode 2 key splits a request
    (2048, 4, 32, [(131, 2, 1), (2, 2, 4)]),
])
def test_lowers_to_two_triton_calls_for_cuda(tokens, requests, width, grids):
    """Lowered (not compiled) for CUDA on this CPU machine at the 35B-A3B shapes (16 heads, 2 KV heads, D 256, bf16)."""
    text = cuda_lowering(tokens, requests, width)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2
    for x, y, z in grids:  # prefill, decode
        assert f"grid_x = {x} : i32, grid_y = {y} : i32, grid_z = {z} : i32" in text


def test_verify_rows_lower_to_the_decode_launch_alone():
    """max_query_len 3 (k = 2 verify rows) at the 35B-A3B shapes: one Triton call, 8 key splits a request of 2 KV
    heads at 16 requests (264 programs wanted), no prefill launch."""
    text = cuda_lowering(64, 16, 128, max_query_len=3)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert "grid_x = 8 : i32, grid_y = 2 : i32, grid_z = 16 : i32" in text


def cuda_lowering(tokens: int, requests: int, width: int, **options) -> str:
    s = jax.ShapeDtypeStruct
    i32 = lambda *shape: s(shape, jnp.int32)
    batch = Ragged(positions=i32(tokens), token_request=i32(tokens), token_valid=s((tokens,), jnp.bool_),
                   query_start=i32(requests), query_len=i32(requests), context_len=i32(requests),
                   state_slot=i32(requests), fresh=s((requests,), jnp.bool_), block_table=i32(requests, width))
    args = (s((tokens, 16, 256), jnp.bfloat16), s((4096, 16, 2, 256), jnp.bfloat16),
            s((4096, 16, 2, 256), jnp.bfloat16), batch)
    fn = jax.jit(lambda q, k, v, b: paged_attention(q, k, v, b, scale=256 ** -0.5, interpret=False, **options))
    exported = export.export(fn, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return exported.mlir_module()
