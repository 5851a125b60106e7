"""The Pallas MoE grouped GEMM (interpret mode on CPU) against its jnp reference (ragged_dot), both layouts (the
expert-major few-token kernels and the sorted blocks), over ragged routings: empty experts, one expert taking every
token, experts held elsewhere (expert parallel), odd token counts; the kernels' `moe` op with the shared expert
inside the few-token launches against the reference MoE block; plus their lowering to Triton for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.extend.core import jaxprs_in_params

from pallas_kernels.moe_gemm import FEW_TOKENS, few_token_moe, plan, routed_experts
from qwen_jax.layers.hot_ops import ops_for
from qwen_jax.layers.mlp import route, sparse_moe
from qwen_jax.layers.mlp import routed_experts_f32 as reference


def make_inputs(seed: int, tokens: int, experts: int, hidden: int, inter: int, top_k: int, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    normal = lambda shape, scale: jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype)
    x = normal((tokens, hidden), 1.0)
    weights, ids = route(x, normal((hidden, experts), 0.3), top_k, True)
    return x, weights, ids, normal((experts, hidden, inter), 0.1), normal((experts, hidden, inter), 0.1), \
        normal((experts, inter, hidden), 0.1)


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


LAYOUTS = pytest.mark.parametrize("few_tokens", [True, False], ids=["few_tokens", "sorted"])


@LAYOUTS
@pytest.mark.parametrize("seed,tokens,experts,hidden,inter,top_k,block_m", [
    (0, 1, 16, 64, 32, 4, None),    # one decode token: 4 of 16 experts used, 12 empty
    (1, 7, 8, 64, 32, 2, None),     # odd token count
    (2, 40, 8, 128, 64, 2, 16),     # several full blocks per expert
    (3, 33, 4, 64, 48, 3, 32),      # intermediate size 48: column tile falls back to 16; top_k 3 pads to 4
    (4, 66, 8, 64, 32, 2, None),    # past FEW_TOKENS: the few-token layout forced (its largest size's tiles)
])
def test_kernel_matches_reference(seed, tokens, experts, hidden, inter, top_k, block_m, few_tokens):
    x, weights, ids, wg, wu, wd = make_inputs(seed, tokens, experts, hidden, inter, top_k)
    want = reference(x, weights, ids, wg, wu, wd)
    got = routed_experts(x, weights, ids, wg, wu, wd, block_m=block_m, block_n=32, block_k=32,
                         few_tokens=few_tokens)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert rel_err(got, want) < 1e-2  # bf16: same rounding points, only the summation order may differ


@LAYOUTS
@pytest.mark.parametrize("tokens,experts", [(20, 8), (3, 16)])  # few tokens: programs per expert, then per pair
def test_all_tokens_to_one_expert(tokens, experts, few_tokens):
    x, weights, _, wg, wu, wd = make_inputs(4, tokens, experts, 64, 32, 2)
    ids = jnp.tile(jnp.array([[5, 2]], jnp.int32), (tokens, 1))  # experts 5 and 2 get every token, the rest none
    want = reference(x, weights, ids, wg, wu, wd)
    got = routed_experts(x, weights, ids, wg, wu, wd, block_n=32, block_k=32, few_tokens=few_tokens)
    assert rel_err(got, want) < 1e-2


@LAYOUTS
@pytest.mark.parametrize("tokens,experts", [(9, 8), (2, 32)])  # few tokens: programs per expert, then per pair
def test_experts_held_elsewhere_add_nothing(tokens, experts, few_tokens):
    """A device holding the upper half of the experts returns only their share; the two shares sum to the whole."""
    x, weights, ids, wg, wu, wd = make_inputs(5, tokens, experts, 64, 32, 3)
    half = experts // 2
    halves = [routed_experts(x, weights, ids, wg[s:s + half], wu[s:s + half], wd[s:s + half], s, block_n=32,
                             block_k=32, few_tokens=few_tokens) for s in (0, half)]
    want_half = reference(x, weights, ids, wg[half:], wu[half:], wd[half:], half)
    assert rel_err(halves[1], want_half) < 1e-2
    assert rel_err(halves[0] + halves[1], reference(x, weights, ids, wg, wu, wd)) < 1e-2


@pytest.mark.parametrize("tokens,experts,split_k", [(1, 16, 4), (3, 4, 2)])  # programs per pair (a repeat), expert
def test_few_token_split_contraction(tokens, experts, split_k):
    """gate_up's contraction in split_k slices (float32 partial sums the down kernel adds before SwiGLU) gives the
    unsplit result, also where two pairs share an expert and under expert parallelism (upper half held here)."""
    x, weights, ids, wg, wu, wd = make_inputs(7 + split_k, tokens, experts, 256, 32, 4)
    ids = ids.at[0, 1].set(ids[-1, 0]) if tokens > 1 else ids
    half = experts // 2
    got = routed_experts(x, weights, ids, wg[half:], wu[half:], wd[half:], half, block_n=32, block_k=64,
                         few_tokens=True, split_k=split_k)
    assert rel_err(got, reference(x, weights, ids, wg[half:], wu[half:], wd[half:], half)) < 1e-2


def test_few_token_down_tiles_of_its_own():
    """The down kernel's own tiles (down=) give the same result as gate_up's; the sorted Pallas kernels refuse them."""
    x, weights, ids, wg, wu, wd = make_inputs(11, 3, 16, 64, 64, 4)
    got = routed_experts(x, weights, ids, wg, wu, wd, block_n=32, block_k=32, few_tokens=True, down=(16, 64, 2, 2))
    assert rel_err(got, reference(x, weights, ids, wg, wu, wd)) < 1e-2
    with pytest.raises(ValueError, match="down applies to"):
        routed_experts(x, weights, ids, wg, wu, wd, few_tokens=False, triton=False, down=(16, 64, 2, 2))


def test_split_k_is_checked():
    x, weights, ids, wg, wu, wd = make_inputs(0, 2, 8, 64, 32, 2)
    with pytest.raises(ValueError, match="split_k 4 does not divide the 2 steps"):
        routed_experts(x, weights, ids, wg, wu, wd, block_n=32, block_k=32, few_tokens=True, split_k=4)
    with pytest.raises(ValueError, match="few-token kernels only"):
        routed_experts(x, weights, ids, wg, wu, wd, few_tokens=False, split_k=2)


def test_plan_puts_each_pair_in_a_block_of_its_expert():
    ids = jnp.array([[3, 0], [3, 1], [0, 3], [5, 3]], jnp.int32)  # expert 3: 4 pairs, 0: 2, 1: 1, 5: 1
    pair_of_row, row_of_pair, block_expert, num_blocks = map(np.asarray, plan(ids, 4, 0, 2))
    flat = np.asarray(ids).reshape(-1)
    local = flat < 4
    assert (row_of_pair[~local] == len(pair_of_row)).all()  # expert 5 lives elsewhere
    for pair in np.flatnonzero(local):
        row = row_of_pair[pair]
        assert pair_of_row[row] == pair and block_expert[row // 2] == flat[pair]
    # groups of 2, 1, 0, 4 pairs pad to 2 + 2 + 0 + 4 rows: 4 blocks of 2
    assert int(num_blocks[0]) == 4
    assert sorted(pair_of_row[pair_of_row < len(flat)].tolist()) == np.flatnonzero(local).tolist()


@LAYOUTS
def test_under_jit_with_traced_first_expert(few_tokens):
    x, weights, ids, wg, wu, wd = make_inputs(6, 5, 8, 64, 32, 2)
    fn = jax.jit(lambda first: routed_experts(x, weights, ids, wg[4:], wu[4:], wd[4:], first, block_n=32,
                                              block_k=32, few_tokens=few_tokens),
                 compiler_options={"xla_allow_excess_precision": False})  # keep the reference's bf16 roundings
    assert rel_err(fn(jnp.int32(4)), reference(x, weights, ids, wg[4:], wu[4:], wd[4:], 4)) < 1e-2


@pytest.mark.parametrize("tokens,kernels,grids", [
    # 64-column tiles: I 512 -> 8, H 2,048 -> 32
    # one token: a program per pair (8), not per expert (256); gate_up's contraction in 4 slices (256 programs)
    (1, ("moe_few_gate_up", "moe_few_down"), ("grid_x = 8 : i32, grid_y = 8 : i32, grid_z = 4",
                                               "grid_x = 8 : i32, grid_y = 32 : i32, grid_z = 1")),
    # a verify row's 2-4 tokens: 128-column tiles, no split (moe_gemm.FEW_TOKEN_TILES)
    (4, ("moe_few_gate_up", "moe_few_down"), ("grid_x = 32 : i32, grid_y = 4 : i32, grid_z = 1",
                                               "grid_x = 32 : i32, grid_y = 16 : i32, grid_z = 1", "num_warps = 2")),
    (31, ("moe_few_gate_up", "moe_few_down"), ("grid_x = 248 : i32, grid_y = 8 ",)),  # 248 pairs < 256 experts
    (FEW_TOKENS, ("moe_few_gate_up", "moe_few_down"), ("grid_x = 256 : i32, grid_y = 8 ",)),
    (FEW_TOKENS + 1, ("moe_gate_up", "moe_down"), ("grid_x = 289 : i32, grid_y = 8 ",)),  # 520 pairs / 16 + 256
    (512, ("moe_gate_up", "moe_down"), ("grid_x = 288 : i32, grid_y = 4 ", "num_warps = 8")),  # 4,096 / 128 + 256
])
def test_lowers_to_two_triton_calls_for_cuda(tokens, kernels, grids):
    """Lowered (not compiled) for CUDA on this CPU at the 35B-A3B shapes (256 experts, H 2,048, I 512, top 8): up
    to FEW_TOKENS tokens the expert-major kernels with no sort anywhere in the program; above, the sorted blocks."""
    s = jax.ShapeDtypeStruct
    e, h, i, k = 256, 2048, 512, 8
    args = (s((tokens, h), jnp.bfloat16), s((tokens, k), jnp.bfloat16), s((tokens, k), jnp.int32),
            s((e, h, i), jnp.bfloat16), s((e, h, i), jnp.bfloat16), s((e, i, h), jnp.bfloat16))
    fn = jax.jit(lambda *a: routed_experts(*a, interpret=False))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2
    assert all(f'name = "{name}"' in text for name in kernels)
    assert all(grid in text for grid in grids)
    assert ("stablehlo.sort" in text) == (tokens > FEW_TOKENS)


def moe_params(seed: int, experts: int, hidden: int, inter: int, shared_inter: int) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(0.2 * rng.standard_normal(shape, np.float32), jnp.bfloat16)
    return dict(router=normal(hidden, experts), w_gate=normal(experts, hidden, inter),
                w_up=normal(experts, hidden, inter), w_down=normal(experts, inter, hidden),
                shared_gate=normal(hidden, shared_inter), shared_up=normal(hidden, shared_inter),
                shared_down=normal(shared_inter, hidden), shared_expert_gate=normal(hidden, 1))


@pytest.mark.parametrize("tokens,experts,top_k,shared_inter", [
    (1, 16, 4, 32),  # a program per pair, plus the shared expert's
    (3, 16, 4, 32),  # a verify row's tokens
    (9, 8, 2, 32),   # a program per expert (18 pairs >= 8 experts), plus the shared expert's
    (3, 16, 4, 64),  # a shared expert wider than the routed ones: sparse_moe over the kernels
])
def test_moe_op_runs_the_shared_expert_with_the_routed_ones(tokens, experts, top_k, shared_inter):
    """The kernels' `moe` op (the shared expert inside the few-token launches where it is as wide as the routed
    experts) gives the reference's block output, padding tokens included (they skip the routed experts only)."""
    p = moe_params(tokens, experts, 64, 32, shared_inter)
    x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, 64), np.float32), jnp.bfloat16)
    valid = jnp.arange(tokens) < max(tokens - 1, 1)
    got = ops_for("gpu").moe(x, p, top_k, True, valid)
    assert got.dtype == x.dtype
    assert rel_err(got, sparse_moe(x, p, top_k, True, valid)) < 1e-2


@pytest.mark.parametrize("split_k", [1, 2])
def test_few_token_moe_splits_the_shared_contraction_too(split_k):
    """The shared expert's gate_up row splits its contraction like the routed ones (float32 partial sums)."""
    p = moe_params(5, 16, 256, 32, 32)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 256), np.float32), jnp.bfloat16)
    weights, ids = route(x, p["router"], 4, True)
    scale = jax.nn.sigmoid((x @ p["shared_expert_gate"]).astype(jnp.float32)).astype(x.dtype)[:, 0]
    got = few_token_moe(x, weights, ids, p["w_gate"], p["w_up"], p["w_down"],
                        (p["shared_gate"], p["shared_up"], p["shared_down"]), scale, block_n=32, block_k=64,
                        split_k=split_k)
    assert rel_err(got, sparse_moe(x, p, 4, True)) < 1e-2
    with pytest.raises(ValueError, match="is not \\[H, I\\]"):
        few_token_moe(x, weights, ids, p["w_gate"], p["w_up"], p["w_down"],
                      (p["shared_up"], p["shared_up"], p["shared_down"][:16]), scale)


def outer_eqns(jaxpr):
    """The equations of jaxpr and of the jaxprs it calls, but not those inside kernels (pallas_call)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name != "pallas_call":
            for sub in jaxprs_in_params(eqn.params):
                yield from outer_eqns(sub)


def test_moe_op_runs_the_shared_expert_in_the_routed_launches_for_cuda():
    """At a verify row's 3 tokens (35B-A3B shapes) the kernels' `moe` op runs the router and the two expert
    kernels, and no GEMM but the router's and the shared expert gate's: the shared expert's projections are no
    XLA dots. Lowered for CUDA, each expert kernel has one more program row than the 24 pairs: the shared
    expert's."""
    s = jax.ShapeDtypeStruct
    e, h, i = 256, 2048, 512
    p = dict(router=s((h, e), jnp.bfloat16), w_gate=s((e, h, i), jnp.bfloat16), w_up=s((e, h, i), jnp.bfloat16),
             w_down=s((e, i, h), jnp.bfloat16), shared_gate=s((h, i), jnp.bfloat16),
             shared_up=s((h, i), jnp.bfloat16), shared_down=s((i, h), jnp.bfloat16),
             shared_expert_gate=s((h, 1), jnp.bfloat16))
    moe = ops_for("gpu").moe
    jaxpr = jax.make_jaxpr(lambda x, p: moe(x, p, 8, True))(s((3, h), jnp.bfloat16), p).jaxpr
    assert [e.params["name"] for e in outer_eqns(jaxpr) if e.primitive.name == "pallas_call"] == \
        ["moe_router", "moe_few_gate_up", "moe_few_down"]
    assert sum(e.primitive.name == "dot_general" for e in outer_eqns(jaxpr)) == 2

    args = (s((3, h), jnp.bfloat16), s((3, 8), jnp.bfloat16), s((3, 8), jnp.int32), p["w_gate"], p["w_up"],
            p["w_down"], (p["shared_gate"], p["shared_up"], p["shared_down"]), s((3,), jnp.bfloat16))
    fn = jax.jit(lambda *a: few_token_moe(*a, interpret=False))  # default tiles: few_token_tiles(3)
    text = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2
    assert "grid_x = 25 : i32, grid_y = 4 : i32, grid_z = 1" in text  # gate_up: 128-column tiles, no split
    assert "grid_x = 25 : i32, grid_y = 16 : i32, grid_z = 1" in text  # down
