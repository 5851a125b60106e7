"""The Gated DeltaNet verify kernel (pallas_kernels/gdn_decode.py `verify`, through pallas_kernels.gdn
.verify_delta_rule; Pallas, interpret mode on CPU): speculative verify rows of k + 1 tokens against the jnp reference
qwen_jax.layers.gated_deltanet.verify_delta_rule, each token's state bitwise that of k + 1 decode-kernel launches,
slots only read; the layer's verify through the "gpu" ops; plus its lowering to Triton IR for CUDA. Never needs a
GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_batches import device_batch, make_inputs, poison, rel_err, shuffled_batch
from support import cuda_mlir

from pallas_kernels.gdn import verify_delta_rule
from pallas_kernels.gdn_decode import decode, verify
from qwen_jax.config import from_hf_dict
from qwen_jax.layers.batch import ragged
from qwen_jax.layers.gated_deltanet import gdn_layer_verify
from qwen_jax.layers.gated_deltanet import verify_delta_rule as reference
from qwen_jax.layers.hot_ops import ops_for
from qwen_jax.models.decoder import init_cache, random_params

RTOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-6}  # one token's float32 math at a time, in another order; bf16 inputs
# are rounded alike in both (beta as HF rounds it), the state stays float32

run_kernel = jax.jit(verify_delta_rule, static_argnames=("draft_len", "block_v"))
run_reference = jax.jit(reference, static_argnames="draft_len")


def verify_batch(draft_len: int, slots: list[int], starts: list[int], seed: int):
    """Rows of draft_len + 1 tokens, shuffled between padding tokens, two padding requests (slot 0) among them."""
    tokens = len(slots) * (draft_len + 2) + 2
    return shuffled_batch([draft_len + 1] * len(slots), starts, slots, tokens, len(slots) + 2, seed)


@pytest.mark.parametrize("draft_len", [1, 2, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_verify_kernel_matches_reference(draft_len, dtype):
    """Slots out of order, one fresh row (NaN in its slot: read as zeros), NaN at padding tokens and in the sink
    slot 0 (padding requests read nothing); two value blocks; dk != dv, two value heads a key head."""
    batch = verify_batch(draft_len, [5, 2, 7, 3], [9, 0, 4, 1], seed=draft_len)
    inputs = make_inputs(draft_len, batch.token_valid.shape[0], 2, 4, 16, 32, 8, dtype)
    with jax.default_matmul_precision("highest"):
        want_o, want_states = map(np.asarray, run_reference(**inputs, batch=device_batch(batch), draft_len=draft_len))
    poisoned = poison(inputs, batch)
    poisoned["ssm"] = poisoned["ssm"].at[0].set(jnp.nan)
    got_o, got_states = map(np.asarray, run_kernel(**poisoned, batch=device_batch(batch), draft_len=draft_len,
                                                   block_v=16))
    valid = np.asarray(batch.token_valid)
    assert got_o.dtype == dtype and got_states.shape == (valid.shape[0], 4, 16, 32) and got_states.dtype == np.float32
    assert np.isfinite(got_o[valid].astype(np.float32)).all() and np.isfinite(got_states[valid]).all()
    assert rel_err(got_o[valid], want_o[valid]) < RTOL[dtype]
    assert rel_err(got_states[valid], want_states[valid]) < RTOL[dtype]
    assert not got_o[~valid].astype(np.float32).any()


def decode_steps(inputs: dict, batch, draft_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The decode kernel over each row's tokens, one launch a token on the row's slot: (each token's output and its
    slot's state after it, [T, ...]; untouched tokens 0)."""
    real = np.flatnonzero(np.asarray(batch.query_len) > 0)
    tokens = batch.token_valid.shape[0]
    outs = np.zeros(inputs["v"].shape, np.float32)
    states = np.zeros((tokens, *inputs["ssm"].shape[1:]), np.float32)
    ssm = inputs["ssm"]
    run = jax.jit(functools.partial(decode, block_v=16))
    for i in range(draft_len + 1):
        at = np.asarray(batch.query_start)[real] + i
        starts = np.asarray(batch.context_len - batch.query_len)[real] + i
        slots = np.asarray(batch.state_slot)[real]
        step = ragged(starts.tolist(), [1] * len(real), slots.tolist(), [[]] * len(real), len(real), len(real), 1)
        step_inputs = {n: inputs[n][at] for n in "qkvab"}
        out, ssm = run(**step_inputs, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], ssm=ssm,
                       batch=device_batch(step), out=jnp.zeros(step_inputs["v"].shape, step_inputs["v"].dtype))
        outs[at], states[at] = np.asarray(out, np.float32), np.asarray(ssm)[slots]
    return outs, states


@pytest.mark.parametrize("draft_len", [1, 3])
def test_verify_kernel_states_are_bitwise_those_of_decode_launches(draft_len):
    """The two kernels share their token math: a verify row's per-token states equal, bit for bit, those of
    draft_len + 1 decode launches, so a committed state is the one plain decoding would hold. The outputs agree to
    RTOL only here: XLA:CPU, compiling the interpreted kernels, fuses the output's reduction differently in the two
    (it contracts multiply-adds within a fusion)."""
    batch = verify_batch(draft_len, [4, 1, 6], [3, 0, 12], seed=7)
    inputs = make_inputs(11, batch.token_valid.shape[0], 2, 4, 16, 32, 8)
    got_o, got_states = map(np.asarray, run_kernel(**inputs, batch=device_batch(batch), draft_len=draft_len,
                                                   block_v=16))
    want_o, want_states = decode_steps(inputs, batch, draft_len)
    valid = np.asarray(batch.token_valid)
    np.testing.assert_array_equal(got_states[valid], want_states[valid])
    assert rel_err(got_o[valid], want_o[valid]) < RTOL[jnp.float32]


def test_verify_rejects_bad_arguments():
    inputs = make_inputs(0, 4, 2, 4, 16, 16, 3)
    batch = device_batch(ragged([3, 5], [2, 2], [1, 2], [[0], [0]], 4, 2, 1))
    with pytest.raises(ValueError, match="draft_len 0"):
        verify(**inputs, batch=batch, draft_len=0, out=jnp.zeros((4, 4, 16)))
    with pytest.raises(ValueError, match="block_v 12"):
        verify(**inputs, batch=batch, draft_len=1, out=jnp.zeros((4, 4, 16)), block_v=12)


def test_verify_lowers_to_one_triton_call_for_cuda():
    """Lowered (not compiled) for CUDA on this CPU machine at the 35B-A3B shapes, 64 rows of 4 tokens: one Triton call
    over (request, value head, value block), out (operand 12) updated in place, ssm (operand 11) only read."""
    s = jax.ShapeDtypeStruct
    rows, draft_len, nk, nv, dk, dv = 64, 3, 16, 32, 128, 128
    tokens = rows * (draft_len + 1)
    args = (s((tokens, nk, dk), jnp.bfloat16), s((tokens, nk, dk), jnp.bfloat16), s((tokens, nv, dv), jnp.bfloat16),
            s((tokens, nv), jnp.bfloat16), s((tokens, nv), jnp.bfloat16), s((nv,), jnp.float32),
            s((nv,), jnp.float32), s((rows + 1, nv, dk, dv), jnp.float32))
    batch = jax.tree.map(lambda x: s(x.shape, x.dtype), ragged([5] * rows, [draft_len + 1] * rows,
                                                               list(range(1, rows + 1)), [[0]] * rows, tokens, rows, 1))
    fn = jax.jit(lambda *x: verify(*x, draft_len=draft_len, out=jnp.zeros((tokens, nv, dv), jnp.bfloat16),
                                   block_v=32, num_warps=4, interpret=False))
    text = cuda_mlir(fn, *args, batch)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert "grid_x = 64 : i32, grid_y = 32 : i32, grid_z = 4 : i32" in text
    assert ("output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [0], operand_index = 12, "
            "operand_tuple_indices = []>]") in text


def test_verify_layer_on_the_gpu_ops_matches_the_reference_ops():
    """gdn_layer_verify through ops_for("gpu") (this kernel; the conv's reference where jax-triton cannot run) against
    ops_for("reference"): the same outputs and pending states to RTOL, the same conv inputs."""
    cfg = from_hf_dict({"model_type": "qwen3_5", "text_config": {
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
        "rms_norm_eps": 1e-6, "dtype": "float32", "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}})
    p = random_params(cfg, seed=1, scale=0.3)["layers"][0]["mixer"]
    cache = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape, x.dtype),
                         init_cache(cfg, 1, 1, 8)["layers"][0])
    batch = device_batch(verify_batch(2, [4, 1, 6], [3, 0, 12], seed=3))
    x = jax.random.normal(jax.random.key(4), (batch.token_valid.shape[0], 32), jnp.float32)

    def layer(kernels):
        ops = ops_for(kernels)
        return jax.jit(lambda x, p, c, b: gdn_layer_verify(x, p, c, b, cfg, 2, ops.verify_delta_rule, ops.dense,
                                                            ops.verify_conv))(x, p, cache, batch)

    (got, got_pending), (want, want_pending) = layer("gpu"), layer("reference")
    valid = np.asarray(batch.token_valid)
    assert rel_err(np.asarray(got)[valid], np.asarray(want)[valid]) < RTOL[jnp.float32]
    assert rel_err(np.asarray(got_pending["ssm"])[valid], np.asarray(want_pending["ssm"])[valid]) < RTOL[jnp.float32]
    for name in ("conv_q", "conv_k", "conv_v"):
        np.testing.assert_array_equal(np.asarray(got_pending[name]), np.asarray(want_pending[name]))
