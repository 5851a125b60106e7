"""Partitioning rules, declared once: param/cache leaf -> logical axes -> mesh axes -> PartitionSpec/NamedSharding,
and `place`, which puts a host tensor straight into its shards.

This is the only module that maps tensor dimensions to mesh axes; model code never names a mesh axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_jax.config import FULL_ATTENTION, ModelConfig
from qwen_jax.models import decoder
from sharding.mesh import DATA, EXPERT, MODEL_AXES, TENSOR

# Logical axis -> mesh axes. A dimension that the product of its mesh axes does not divide is replicated (e.g.
# 2 KV heads on 8 devices: every device computes and caches both, as vLLM does), except the data axes below.
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "vocab": MODEL_AXES,
    "heads": MODEL_AXES,
    "kv_heads": MODEL_AXES,
    "gdn_key_heads": MODEL_AXES,
    "gdn_value_heads": MODEL_AXES,
    "mlp": MODEL_AXES,  # dense MLP and shared-expert columns
    "experts": (EXPERT,),
    "expert_mlp": (TENSOR,),  # columns of each routed expert
    "cache_blocks": (DATA,),
    "cache_slots": (DATA,),
}
DATA_LOGICAL = ("cache_blocks", "cache_slots")  # must divide: each replica of a data axis owns its pages and slots

# Leaf name -> logical axis per dimension (None: replicated), by where the leaf sits in the tree.
_NORM = ("hidden",)
TOP_LEVEL = {"embed": ("vocab", "hidden"), "lm_head": ("hidden", "vocab"), "final_norm": _NORM}
LAYER = {"input_norm": _NORM, "post_norm": _NORM}
ATTENTION = {
    "q": ("hidden", "heads", None), "gate": ("hidden", "heads", None), "k": ("hidden", "kv_heads", None),
    "v": ("hidden", "kv_heads", None), "o": ("heads", None, "hidden"), "q_norm": (None,), "k_norm": (None,),
    "q_bias": ("heads", None), "k_bias": ("kv_heads", None), "v_bias": ("kv_heads", None), "o_bias": _NORM,
}
GDN = {
    "q": ("hidden", "gdn_key_heads", None), "k": ("hidden", "gdn_key_heads", None),
    "v": ("hidden", "gdn_value_heads", None), "z": ("hidden", "gdn_value_heads", None),
    "b": ("hidden", "gdn_value_heads"), "a": ("hidden", "gdn_value_heads"),
    "conv_q": (None, "gdn_key_heads", None), "conv_k": (None, "gdn_key_heads", None),
    "conv_v": (None, "gdn_value_heads", None), "A_log": ("gdn_value_heads",), "dt_bias": ("gdn_value_heads",),
    "norm": (None,), "out": ("gdn_value_heads", None, "hidden"),
}
DENSE_MLP = {"w_gate": ("hidden", "mlp"), "w_up": ("hidden", "mlp"), "w_down": ("mlp", "hidden")}
MOE = {
    "router": ("hidden", None),
    "w_gate": ("experts", "hidden", "expert_mlp"), "w_up": ("experts", "hidden", "expert_mlp"),
    "w_down": ("experts", "expert_mlp", "hidden"),
    "shared_gate": ("hidden", "mlp"), "shared_up": ("hidden", "mlp"), "shared_down": ("mlp", "hidden"),
    "shared_expert_gate": ("hidden", None),
}
ATTENTION_CACHE = {"k": ("cache_blocks", None, "kv_heads", None), "v": ("cache_blocks", None, "kv_heads", None)}
GDN_CACHE = {
    "conv_q": ("cache_slots", None, "gdn_key_heads", None), "conv_k": ("cache_slots", None, "gdn_key_heads", None),
    "conv_v": ("cache_slots", None, "gdn_value_heads", None),
    "ssm": ("cache_slots", "gdn_value_heads", None, None),
}


# The MTP head's own leaves (its layer is a full-attention layer, under the LAYER/ATTENTION/MLP rules above); fc
# [2H, H] is small (16 MB at 35B-A3B) and stays whole on every device.
MTP = {"fc": (None, "hidden"), "pre_fc_norm_embedding": _NORM, "pre_fc_norm_hidden": _NORM, "final_norm": _NORM}


def _key(entry) -> str | int:
    return getattr(entry, "key", getattr(entry, "idx", entry))


def _layer_logical_axes(mixer: str, moe: bool, path: tuple) -> tuple[str | None, ...]:
    """A decoder layer's param at `path` (its keys below the layer, e.g. ("mixer", "q"))."""
    if path[0] in LAYER:
        return LAYER[path[0]]
    if path[0] == "mixer":
        return (ATTENTION if mixer == FULL_ATTENTION else GDN)[path[1]]
    return (MOE if moe else DENSE_MLP)[path[1]]


def param_logical_axes(cfg: ModelConfig, path: tuple) -> tuple[str | None, ...]:
    """Logical axes of the param at `path` (keys as in decoder.param_shapes, e.g. ("layers", 3, "mixer", "q"))."""
    path = tuple(_key(k) for k in path)
    if path[0] == "layers":
        return _layer_logical_axes(cfg.layer_types[path[1]], cfg.is_moe_layer(path[1]), path[2:])
    if path[0] == "mtp":
        return _layer_logical_axes(FULL_ATTENTION, cfg.mtp_is_moe, path[2:]) if path[1] == "layer" else MTP[path[1]]
    return TOP_LEVEL[path[0]]


def cache_logical_axes(cfg: ModelConfig, path: tuple) -> tuple[str | None, ...]:
    """Logical axes of the cache leaf at `path`: ("layers", i, name) or ("mtp", name), the head's KV pages."""
    path = tuple(_key(k) for k in path)
    if path[0] == "mtp":
        return ATTENTION_CACHE[path[1]]
    return (ATTENTION_CACHE if cfg.layer_types[path[1]] == FULL_ATTENTION else GDN_CACHE)[path[2]]


def logical_to_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """PartitionSpec for one array; size-1 mesh axes are left out, non-dividing model axes replicate."""
    entries = []
    for name, dim in zip(logical, shape, strict=True):
        axes = tuple(a for a in LOGICAL_RULES.get(name, ()) if a in mesh.shape and mesh.shape[a] > 1)
        size = int(np.prod([mesh.shape[a] for a in axes]))
        if axes and dim % size:
            if name in DATA_LOGICAL:
                raise ValueError(f"{name} dimension {dim} is not divisible by the data-parallel size {size}")
            axes = ()
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)


def param_specs(cfg: ModelConfig, mesh: Mesh) -> dict:
    """Pytree of PartitionSpec matching decoder.param_shapes(cfg)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s: logical_to_spec(param_logical_axes(cfg, path), s.shape, mesh), decoder.param_shapes(cfg))


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict:
    """Pytree of NamedSharding matching decoder.param_shapes(cfg)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(cfg, mesh))


def abstract_params(cfg: ModelConfig, mesh: Mesh) -> dict:
    """The params' shapes laid out over `mesh` (jax.ShapeDtypeStruct with their shardings): what programs compile
    against before (or without) the weights being read."""
    return jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
                        decoder.param_shapes(cfg), param_shardings(cfg, mesh))


def shard_bytes(tree: dict) -> int:
    """Bytes one device holds of a pytree of laid-out shapes (jax.ShapeDtypeStruct with shardings; every device
    holds one shard of each leaf)."""
    return sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


def cache_specs(cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, num_slots: int) -> dict:
    """Pytree of PartitionSpec matching decoder.cache_shapes: pages/slots over data, heads over the model axes
    (a GDN layer's conv inputs and float32 recurrent state split with its heads)."""
    shapes = decoder.cache_shapes(cfg, num_blocks, block_size, num_slots)
    return jax.tree_util.tree_map_with_path(
        lambda path, s: logical_to_spec(cache_logical_axes(cfg, path), s.shape, mesh), shapes)


def cache_shardings(cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, num_slots: int) -> dict:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_specs(cfg, mesh, num_blocks, block_size,
                                                                            num_slots))


def _trimmed(spec: P) -> P:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def init_cache(cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, num_slots: int,
               abstract: bool = False) -> dict:
    """Zeroed cache made directly in its shards (num_blocks and num_slots count all replicas together).
    Specs without trailing Nones, as compiled programs return them: a donated cache keeps one jit signature.
    `abstract`: its shapes, dtypes and shardings only (jax.ShapeDtypeStruct), nothing allocated."""
    shardings = jax.tree.map(lambda sh: NamedSharding(mesh, _trimmed(sh.spec)),
                             cache_shardings(cfg, mesh, num_blocks, block_size, num_slots))
    make = jax.jit(lambda: decoder.init_cache(cfg, num_blocks, block_size, num_slots), out_shardings=shardings)
    if abstract:
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), jax.eval_shape(make),
                            shardings)
    return make()


def _constrained(cfg: ModelConfig, mesh: Mesh, path: tuple, value: jax.Array) -> jax.Array:
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, logical_to_spec(
        cache_logical_axes(cfg, path), value.shape, mesh)))


def constrain_cache_layer(cfg: ModelConfig, mesh: Mesh, index: int, layer: dict) -> dict:
    """Inside a jitted program: pin layer `index`'s cache entries (KV pages or GDN state, any number of pages or
    slots, e.g. prefix-cache snapshots) to their rules' shardings, so a donated cache comes back in its own shards."""
    return {name: _constrained(cfg, mesh, ("layers", index, name), v) for name, v in layer.items()}


def constrain_cache(cfg: ModelConfig, mesh: Mesh, cache: dict) -> dict:
    """`constrain_cache_layer` over a whole cache (every layer, and the MTP head's pages when it has them)."""
    return jax.tree_util.tree_map_with_path(lambda path, v: _constrained(cfg, mesh, path, v), cache)


def cache_bytes_per_device(cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, num_slots: int) -> int:
    """Bytes of a cache of this geometry on each device (its shard of every leaf; replicated leaves whole)."""
    return shard_bytes(jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                    decoder.cache_shapes(cfg, num_blocks, block_size, num_slots),
                                    cache_shardings(cfg, mesh, num_blocks, block_size, num_slots)))


def put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global jax.Array from a host array: each addressable device receives only its own slice (multi-host safe:
    a host copies only the slices of its own devices)."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def put_tree(tree: dict, shardings: dict) -> dict:
    return jax.tree.map(put, tree, shardings)


def make_place(cfg: ModelConfig, mesh: Mesh) -> Callable[[tuple, np.ndarray], jax.Array]:
    """`place(path, host_array)` for weights.load_params: the tensor goes straight into its shards."""

    def place(path: tuple, array: np.ndarray) -> jax.Array:
        shape = tuple(np.shape(array))
        return put(array, NamedSharding(mesh, logical_to_spec(param_logical_axes(cfg, path), shape, mesh)))

    return place


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name, or a tuple of them)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def num_shards(spec: P, mesh: Mesh) -> int:
    """Into how many pieces `spec` cuts an array on `mesh` (1: replicated)."""
    return int(np.prod([mesh.shape[a] for entry in spec for a in entry_axes(entry)]))


def bytes_per_device(tree: dict) -> dict[jax.Device, int]:
    """Bytes each device holds of a pytree of jax.Arrays (its addressable shards)."""
    totals: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals
