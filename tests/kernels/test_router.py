"""The one-launch MoE router (interpret mode on CPU) against its jnp reference (the model's route_logits): the same
expert ids in the same order, weights to float32 rounding, ties broken as lax.top_k breaks them; plus its lowering
to one Triton call for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.router import route_logits
from qwen_jax.layers.mlp import route_logits as reference


def logits(seed: int, shape: tuple, dtype=jnp.bfloat16) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 2, dtype)


@pytest.mark.parametrize("tokens,experts,top_k,renormalize,dtype,block_t", [
    (1, 256, 8, True, jnp.bfloat16, 1),    # 35B-A3B decode of one sequence
    (37, 256, 8, True, jnp.bfloat16, 16),  # blocks of 16 tokens: the last one runs past the tokens
    (5, 60, 4, False, jnp.float32, 1),     # expert count not a power of two (padded), no renormalisation
    (3, 8, 3, True, jnp.float32, 2),       # top_k not a power of two
    (2, 4, 4, True, jnp.bfloat16, 1),      # every expert picked
])
def test_matches_reference(tokens, experts, top_k, renormalize, dtype, block_t):
    x = logits(tokens * experts + top_k, (tokens, experts), dtype)
    weights, ids = route_logits(x, top_k, renormalize, block_t=block_t)
    want_weights, want_ids = reference(x, top_k, renormalize)
    assert ids.dtype == jnp.int32 and weights.dtype == dtype and weights.shape == (tokens, top_k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights, np.float32), np.asarray(want_weights, np.float32),
                               rtol=1e-6 if dtype == jnp.float32 else 1e-2)


def test_ties_pick_the_lower_expert_first():
    """bf16 logits tie often (256 values, 8 significant bits); equal probabilities go in id order, as in top_k."""
    x = jnp.asarray([[0.5, 1.0, 0.25, 1.0, 1.0, 0.25, -3.0, 0.5]], jnp.bfloat16)
    _, ids = route_logits(x, 5, True)
    assert ids.tolist() == [[1, 3, 4, 0, 7]] == reference(x, 5, True)[1].tolist()


def test_refuses_more_picks_than_experts():
    with pytest.raises(ValueError, match="top_k 9 is not in 1..8"):
        route_logits(jnp.zeros((1, 8), jnp.bfloat16), 9, True)


def test_lowers_to_one_triton_call_for_cuda():
    """35B-A3B at 64 tokens: one program a token."""
    fn = jax.jit(lambda x: route_logits(x, 8, True, interpret=False))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert 'name = "moe_router"' in text and "grid_x = 64 : i32" in text
