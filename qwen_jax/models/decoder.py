"""The decoder of every supported architecture (Qwen3.5 hybrid MoE/dense, Qwen3, Qwen3-MoE, LLaMA) as pure
functions over an explicit params pytree and cache pytree.

A step's tokens lie on one flat token axis (qwen_jax.layers.batch.Ragged: decode rows and prefill chunks alike).
Layout of `params` (JAX convention, weights are [in, out]):
    embed [V, H], final_norm [H], lm_head [H, V] (absent when tied),
    layers[i] = {input_norm [H], post_norm [H], mixer: attention or gdn dict, mlp: dense or moe dict},
    mtp (when cfg.has_mtp) = {fc [2H, H], pre_fc_norm_embedding [H], pre_fc_norm_hidden [H], final_norm [H],
                              layer: a full-attention layer with the model's MLP kind} (models/mtp.py runs it).
`param_shapes` is the single source of truth for names and shapes: loaders, random init and sharding rules
all follow it. This module never touches devices or files.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen_jax.config import FULL_ATTENTION, ModelConfig
from qwen_jax.layers.attention import attention_layer
from qwen_jax.layers.batch import Ragged
from qwen_jax.layers.gated_deltanet import gdn_layer, gdn_layer_verify
from qwen_jax.layers.hot_ops import Ops
from qwen_jax.layers.mlp import swiglu_mlp
from qwen_jax.layers.norms import rms_norm

F32 = jnp.float32


def _attention_shapes(cfg: ModelConfig) -> dict:
    h, n, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {"q": (h, n, d), "k": (h, kv, d), "v": (h, kv, d), "o": (n, d, h)}
    if cfg.attn_output_gate:
        shapes["gate"] = (h, n, d)
    if cfg.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    if cfg.attention_bias:
        shapes.update(q_bias=(n, d), k_bias=(kv, d), v_bias=(kv, d), o_bias=(h,))
    return shapes


def _gdn_shapes(cfg: ModelConfig) -> dict:
    h, nk, nv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kern = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    return {
        "q": (h, nk, dk), "k": (h, nk, dk), "v": (h, nv, dv), "z": (h, nv, dv), "b": (h, nv), "a": (h, nv),
        "conv_q": (kern, nk, dk), "conv_k": (kern, nk, dk), "conv_v": (kern, nv, dv),
        "A_log": (nv,), "dt_bias": (nv,), "norm": (dv,), "out": (nv, dv, h),
    }


def _mlp_shapes(cfg: ModelConfig, moe: bool) -> dict:
    h = cfg.hidden_size
    if not moe:
        i = cfg.intermediate_size
        return {"w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    shapes = {"router": (h, e), "w_gate": (e, h, i), "w_up": (e, h, i), "w_down": (e, i, h)}
    if cfg.shared_expert_intermediate_size:
        s = cfg.shared_expert_intermediate_size
        shapes.update(shared_gate=(h, s), shared_up=(h, s), shared_down=(s, h), shared_expert_gate=(h, 1))
    return shapes


# Parameters kept in float32 whatever the model dtype (HF computes with them in float32).
FLOAT32_PARAMS = ("A_log", "dt_bias")
# The leaves whose outputs are added to the residual stream (decoder_layer's two `x + h`): attention's output
# projection and its bias, Gated DeltaNet's output projection, the dense MLP's and every expert's down projection, the
# shared expert's down projection.
RESIDUAL_WRITERS = ("o", "o_bias", "out", "w_down", "shared_down")


def param_shapes(cfg: ModelConfig) -> dict:
    """Pytree of jax.ShapeDtypeStruct with exactly the leaves `forward` reads."""
    dtype = cfg.jnp_dtype

    def spec(tree):
        return {k: jax.ShapeDtypeStruct(v, F32 if k in FLOAT32_PARAMS else dtype) for k, v in tree.items()}

    h = cfg.hidden_size
    norm = jax.ShapeDtypeStruct((h,), dtype)

    def layer(mixer: str, moe: bool) -> dict:
        shapes = _attention_shapes(cfg) if mixer == FULL_ATTENTION else _gdn_shapes(cfg)
        return {"input_norm": norm, "post_norm": norm, "mixer": spec(shapes), "mlp": spec(_mlp_shapes(cfg, moe))}

    tree = {
        "embed": jax.ShapeDtypeStruct((cfg.vocab_size, h), dtype),
        "final_norm": norm,
        "layers": [layer(kind, cfg.is_moe_layer(i)) for i, kind in enumerate(cfg.layer_types)],
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = jax.ShapeDtypeStruct((h, cfg.vocab_size), dtype)
    if cfg.has_mtp:
        tree["mtp"] = {"fc": jax.ShapeDtypeStruct((2 * h, h), dtype), "pre_fc_norm_embedding": norm,
                       "pre_fc_norm_hidden": norm, "final_norm": norm, "layer": layer(FULL_ATTENTION, cfg.mtp_is_moe)}
    return tree


def cache_shapes(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int) -> dict:
    """KV pages for attention layers (block 0 is a write sink for padding) and recurrent-state slots for
    Gated DeltaNet layers (slot 0 likewise): conv inputs in the model dtype, the delta-rule state in float32.
    A model with an MTP head has KV pages of its own for the head's attention layer (`mtp`), paged by the same block
    tables as the main model's."""
    dtype = cfg.jnp_dtype
    kv = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    k1 = cfg.linear_conv_kernel_dim - 1
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    pages = {"k": jax.ShapeDtypeStruct(kv, dtype), "v": jax.ShapeDtypeStruct(kv, dtype)}
    layers = []
    for kind in cfg.layer_types:
        if kind == FULL_ATTENTION:
            layers.append(dict(pages))
        else:
            layers.append({
                "conv_q": jax.ShapeDtypeStruct((num_slots, k1, nk, dk), dtype),
                "conv_k": jax.ShapeDtypeStruct((num_slots, k1, nk, dk), dtype),
                "conv_v": jax.ShapeDtypeStruct((num_slots, k1, nv, dv), dtype),
                "ssm": jax.ShapeDtypeStruct((num_slots, nv, dk, dv), F32),
            })
    return {"layers": layers, "mtp": dict(pages)} if cfg.has_mtp else {"layers": layers}


def init_cache(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int) -> dict:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, num_blocks, block_size, num_slots))


def _draw(key: jax.Array, shape: tuple, dtype, kind: str, scale: float) -> jax.Array:
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "A_log":  # -exp(A_log) in [-16, -1]: decays like trained models have
        return jnp.log(jax.random.uniform(key, shape, F32, 1.0, 16.0)).astype(dtype)
    return (jax.random.normal(key, shape, F32) * scale).astype(dtype)


def param_names(cfg: ModelConfig) -> set[str]:
    """The names of the model's parameter leaves (the last key of each path): what random_params' `scales` takes."""
    return {str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(param_shapes(cfg))[0]}


def random_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.02, shardings: dict | None = None,
                  scales: dict[str, float] | None = None) -> dict:
    """Random weights with the real shapes, drawn on the devices (no host copy): the `dummy` load format.
    Norm weights start at their identity value; GDN gates get values in the range trained models have.
    Other leaves are normal with std `scale`, or `scales[name]` for the leaves of that name (e.g. "embed", "o").
    One small program per leaf (shared by leaves of one shape): with `shardings` (a pytree like param_shapes)
    each device draws only its own shards, and compile time stays seconds even for 40 layers."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    unknown = set(scales or ()) - param_names(cfg)
    if unknown:
        raise ValueError(f"random_params: no leaf of this model is named {sorted(unknown)}")
    placement = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)
    key = jax.random.key(seed)
    out = []
    for idx, ((path, s), sharding) in enumerate(zip(leaves, placement)):
        name = str(path[-1].key)
        if name in ("input_norm", "post_norm", "final_norm", "q_norm", "k_norm", "pre_fc_norm_embedding",
                    "pre_fc_norm_hidden"):
            kind = "zeros" if cfg.norm_plus_one else "ones"
        elif name in ("norm", "dt_bias"):
            kind = "ones"
        else:
            kind = "A_log" if name == "A_log" else "normal"
        draw = jax.jit(_draw, static_argnums=(1, 2, 3, 4), out_shardings=sharding)
        std = (scales or {}).get(name, scale)
        out.append(draw(jax.random.fold_in(key, idx), tuple(s.shape), s.dtype, kind, std))
    return jax.tree_util.tree_unflatten(treedef, out)


def decoder_layer(x: jax.Array, p: dict, c: dict, batch: Ragged, cfg: ModelConfig, mixer: str, moe: bool, ops: Ops,
                  draft_len: int = 0, moe_rows: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """One layer: token mixer (`mixer`: attention or Gated DeltaNet) and MLP (`moe`: the sparse MoE, else the dense
    SwiGLU), each pre-normed with a residual. x: [T, H] on the batch's token axis. Returns (x, the layer's updated
    cache). draft_len > 0: the batch is speculative verify rows (each request its last token and draft_len drafts,
    or none); a Gated DeltaNet layer then leaves its slots alone and returns, instead of its cache, what
    commit_verified needs (an attention layer writes its KV pages as usual: a rejected position's are overwritten
    later, and takes its kernel's short-query launch). moe_rows [T] bool: the only tokens whose output is read (the
    sparse MoE routes no other; their outputs are not the layer's), None: all."""
    h = ops.norm(x, p["input_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    if mixer == FULL_ATTENTION:
        h, c = attention_layer(h, p["mixer"], c, batch, cfg, jnp.asarray(cfg.rope_inv_freq()), ops.attention,
                               ops.dense, max_query_len=draft_len + 1 if draft_len else None)
    elif draft_len:
        h, c = gdn_layer_verify(h, p["mixer"], c, batch, cfg, draft_len, ops.verify_delta_rule, ops.dense,
                                ops.verify_conv)
    else:
        h, c = gdn_layer(h, p["mixer"], c, batch, cfg, ops.delta_rule, ops.dense, ops.conv)
    x = x + h
    h = ops.norm(x, p["post_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    if moe:
        h = ops.moe(h, p["mlp"], cfg.num_experts_per_tok, cfg.norm_topk_prob,
                    batch.token_valid if moe_rows is None else moe_rows)
    else:
        h = swiglu_mlp(h, p["mlp"]["w_gate"], p["mlp"]["w_up"], p["mlp"]["w_down"], ops.dense)
    return x + h, c


# Each layer as a call of one jitted function per layer kind (mixer, MLP): a forward of 40 layers traces and lowers
# two or three layers, not 40 (XLA inlines the calls; the program it compiles is the same). Lowering was most of a
# step's compile time, and the part that holds the GIL.
layer_call = jax.jit(decoder_layer, static_argnames=("cfg", "mixer", "moe", "ops", "draft_len"))


def lm_head(x: jax.Array, params: dict, cfg: ModelConfig) -> jax.Array:
    """The LM head alone (input already normed): x [N, H] -> float32 logits [N, V]."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.matmul(x, head, preferred_element_type=F32)


def logits_head(x: jax.Array, params: dict, cfg: ModelConfig) -> jax.Array:
    """Final norm and LM head: x [N, H] -> float32 logits [N, V]."""
    return lm_head(rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_plus_one), params, cfg)


def forward(params: dict, cache: dict, tokens: jax.Array, batch: Ragged, cfg: ModelConfig, ops: Ops,
            sample_index: jax.Array | None = None, return_hidden: bool = False, draft_len: int = 0) -> tuple:
    """Run a step's new tokens [T] (the flat ragged batch `batch`) through the model, reading and updating the
    cache entries of its requests. Returns (float32 logits of the tokens `sample_index` [N] -> [N, V], or of every
    token [T, V] when None; the new cache), and with `return_hidden` also every token's hidden state after the final
    norm [T, H] (what the LM head reads, and the MTP head's input: models/mtp.py). `ops`: the hot ops
    (layers/hot_ops.py; sharding/partitioned_ops.py partitions them for a mesh). The engine's step program
    (engine/step.py) is this, jitted. The MTP head's cache entry, if any, passes through untouched.
    draft_len > 0: speculative verify rows (each request its last token and draft_len drafts, or none), whose
    recurrent slots stay untouched; also returns each layer's pending (None for attention layers), from which
    `commit_verified_layers` writes the recurrent states once the accepted counts are known."""
    x = params["embed"][tokens]
    layers, pending = [], []
    for i, (p, c) in enumerate(zip(params["layers"], cache["layers"], strict=True)):
        x, out = layer_call(x, p, c, batch, cfg=cfg, mixer=cfg.layer_types[i], moe=cfg.is_moe_layer(i), ops=ops,
                            draft_len=draft_len)
        recurrent_pending = draft_len and cfg.layer_types[i] != FULL_ATTENTION
        layers.append(c if recurrent_pending else out)
        pending.append(out if recurrent_pending else None)
    cache = {**cache, "layers": layers}
    if not return_hidden:
        return logits_head(x if sample_index is None else x[sample_index], params, cfg), cache
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    logits = lm_head(hidden if sample_index is None else hidden[sample_index], params, cfg)
    return (logits, cache, hidden, pending) if draft_len else (logits, cache, hidden)


# ---- speculative verification ----------------------------------------------------------------------------------------
def commit_verified_layers(cache: dict, pending: list, batch: Ragged, num_accepted: jax.Array, ops: Ops) -> dict:
    """Each verify row's recurrent state (every GDN layer) set to the one after its num_accepted [R] first tokens
    (`ops.commit_verified`: one kernel launch a layer on a GPU); attention layers (and the MTP head's pages) as they
    are."""
    return {**cache, "layers": [c if p is None else ops.commit_verified(c, p, batch, num_accepted)
                                for c, p in zip(cache["layers"], pending, strict=True)]}
