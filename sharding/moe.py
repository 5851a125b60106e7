"""Expert-parallel MoE with shard_map: tokens stay replicated over the model axes, each device runs its own experts
(and its own expert columns) with ragged_dot on local group sizes, and one psum combines routed + shared partials.

Same signature and math as qwen_jax.layers.mlp.sparse_moe (the reference); only the summation order differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from qwen_jax.config import ModelConfig
from qwen_jax.layers.mlp import drop_padding, linear, route
from sharding.mesh import MODEL_AXES
from sharding.rules import entry_axes, param_specs


def expert_parallel_moe(cfg: ModelConfig, mesh: Mesh, routed: Callable) -> Callable:
    """sparse_moe(x [T, H], p, top_k, renormalize, valid) with the experts split over the mesh as sharding/rules.py
    says; `routed`: the routed experts op of the layers' bundle (layers/hot_ops.py's `experts`), run on each device's
    experts."""
    specs = param_specs(cfg, mesh)["layers"][cfg.moe_layers[0]]["mlp"]  # every MoE layer has the same specs
    expert_axes = entry_axes(specs["w_gate"][0])
    routed_axes = expert_axes + entry_axes(specs["w_gate"][2])
    shared_axes = entry_axes(specs["shared_gate"][1]) if "shared_gate" in specs else ()
    local_experts = cfg.num_experts // math.prod(mesh.shape[a] for a in expert_axes)

    def body(x: jax.Array, p: dict, valid: jax.Array | None, top_k: int, renormalize: bool) -> jax.Array:
        weights, ids = route(x, p["router"], top_k, renormalize)
        ids = drop_padding(ids, valid)
        first = jax.lax.axis_index(expert_axes) * local_experts if expert_axes else 0
        partials = {routed_axes: routed(x, weights, ids, p["w_gate"], p["w_up"], p["w_down"], first)}
        if "shared_gate" in p:
            hidden = jax.nn.silu(linear(x, p["shared_gate"])) * linear(x, p["shared_up"])
            shared = jnp.matmul(hidden, p["shared_down"], preferred_element_type=jnp.float32)
            scale = jax.nn.sigmoid(linear(x, p["shared_expert_gate"]).astype(jnp.float32))
            partials[shared_axes] = partials.get(shared_axes, 0.0) + scale * shared
        out = sum(jax.lax.psum(v, axes) if axes else v for axes, v in partials.items())
        return out.astype(x.dtype)

    def moe(x: jax.Array, p: dict, top_k: int, renormalize: bool, valid: jax.Array | None = None) -> jax.Array:
        fn = jax.shard_map(
            lambda x, p, valid: body(x, p, valid, top_k, renormalize), mesh=mesh,
            in_specs=(P(), {k: specs[k] for k in p}, P()), out_specs=P(), axis_names=set(MODEL_AXES),
            check_vma=False)
        return fn(x, p, valid)

    return moe
