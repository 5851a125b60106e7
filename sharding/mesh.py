"""The device mesh: vLLM-style parallel sizes (tensor, data, expert on/off) turned into one named 3-axis Mesh.

Only devices and axis sizes live here; which tensor dimension goes on which axis is decided in sharding/rules.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DATA, EXPERT, TENSOR = "data", "expert", "tensor"
AXES = (DATA, EXPERT, TENSOR)
# The model-parallel group: attention/GDN heads, dense MLP columns and the vocabulary split over both axes, so
# the devices that hold different experts also split attention (no replicated attention weights or KV cache).
MODEL_AXES = (EXPERT, TENSOR)


def make_mesh(tensor_parallel_size: int | None = None, data_parallel_size: int = 1,
              enable_expert_parallel: bool = False, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh over the first dp x tp of `devices` (default: every device of every host), axes (data, expert, tensor).

    data   = data_parallel_size: independent replicas (the engine cuts them apart with replica_meshes and runs a
    program per replica; none runs over this axis).
    Inside a replica the tensor_parallel_size devices split attention heads, GDN heads, dense MLPs and the vocab.
    enable_expert_parallel decides how those devices split the routed experts: True puts them on the expert axis
    (mesh (dp, tp, 1): each device holds E/tp whole experts), False on the tensor axis (mesh (dp, 1, tp): every
    device holds a 1/tp column slice of every expert), as vLLM's flag of the same name does inside a DP replica.
    """
    # Host-major order: the model-parallel group of a replica stays on one host when it fits there.
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    dp = int(data_parallel_size)
    tp = int(tensor_parallel_size) if tensor_parallel_size else len(devices) // max(dp, 1)
    if dp < 1 or tp < 1 or dp * tp > len(devices):
        raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs more than the {len(devices)} "
                         f"devices given")
    shape = (dp, tp, 1) if enable_expert_parallel else (dp, 1, tp)
    return Mesh(np.array(devices[:dp * tp], dtype=object).reshape(shape), AXES)


def replica_meshes(tensor_parallel_size: int | None = None, data_parallel_size: int = 1,
                   enable_expert_parallel: bool = False, devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """One mesh per data-parallel replica, for an engine that runs each replica as its own model: replica i gets
    the i-th row of make_mesh's (data, ...) device grid, i.e. devices [i*tp, (i+1)*tp) in host-major order, as a
    (1, expert, tensor) mesh of its own."""
    whole = make_mesh(tensor_parallel_size, data_parallel_size, enable_expert_parallel, devices)
    return [make_mesh(model_parallel_size(whole), 1, enable_expert_parallel, devices=list(row.flat))
            for row in whole.devices]


def model_parallel_size(mesh: Mesh) -> int:
    """How many devices split one replica's weights (expert x tensor)."""
    return int(np.prod([mesh.shape[a] for a in MODEL_AXES]))


def describe(mesh: Mesh) -> str:
    return " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
