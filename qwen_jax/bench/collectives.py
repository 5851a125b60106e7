"""Collectives per decode step of the served program: lower and compile engine/step.py's forward for one replica's
mesh on abstract shapes (nothing allocated) and count all-reduce / all-gather / all-to-all / reduce-scatter /
collective-permute in the compiled HLO.

`python -m qwen_jax.bench.collectives` prints the table in sharding/README.md (run with 8 or more host devices).
Layouts are one replica's mesh: data-parallel replicas each run their own program on their own devices and add no
collective, so a layout names no data-parallel size.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import jax
import numpy as np
from jax.sharding import Mesh

from qwen_jax.config import ModelConfig, load_config
from qwen_jax.engine import step
from qwen_jax.layers.batch import ragged
from qwen_jax.models import decoder
from sharding import rules
from sharding.mesh import describe, make_mesh

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_OP = re.compile(r"=\s*[^=]*?\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Number of each collective op in an HLO module's text (async pairs counted once, by their -start)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match:
            counts[match.group(1)] += 1
    return counts


def decode_layout(batch_size: int, context: int, block_size: int, table_width: int) -> step.Layout:
    """The packed-input layout of a decode step of `batch_size` requests, one token each at position `context`
    (the layout fixes only shapes: the values are never read)."""
    blocks = -(-(context + 1) // block_size)
    batch = ragged([context] * batch_size, [1] * batch_size, list(range(1, batch_size + 1)),
                   [list(range(1 + r * blocks, 1 + (r + 1) * blocks)) for r in range(batch_size)],
                   batch_size, batch_size, table_width)
    return step.pack_inputs(np.zeros(batch_size, np.int32), batch, np.zeros(batch_size, np.int32))[1]


def step_collectives(cfg: ModelConfig, mesh: Mesh, batch_size: int = 8, num_blocks: int = 64, block_size: int = 16,
                     num_slots: int = 16, table_width: int = 4) -> dict[str, int]:
    """Collective counts of the compiled step.forward of a decode step of `batch_size` requests on `mesh`, with
    abstract params, cache and inputs in the shardings the engine gives them."""
    replicated = step.replicated(mesh)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          decoder.param_shapes(cfg), rules.param_shardings(cfg, mesh))
    cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         decoder.cache_shapes(cfg, num_blocks, block_size, num_slots),
                         rules.cache_shardings(cfg, mesh, num_blocks, block_size, num_slots))
    layout = decode_layout(batch_size, table_width * block_size // 2, block_size, table_width)
    last_tokens = jax.ShapeDtypeStruct((batch_size,), np.int32, sharding=replicated)
    buffer = jax.ShapeDtypeStruct((layout.size,), np.int32, sharding=replicated)
    lowered = step.forward.lower(params, cache, last_tokens, buffer, layout=layout, cfg=cfg, mesh=mesh,
                                 kernels="reference")
    return count_collectives(lowered.compile().as_text())


def mesh_for(layout: str) -> Mesh:
    """One replica's mesh: 'tp8' -> TP 8; 'ep8' -> TP 8 with expert parallelism (over the first devices)."""
    kind, size = layout[:2], int(layout[2:])
    if kind not in ("tp", "ep"):
        raise ValueError(f"layout {layout!r}: tpN or epN (data-parallel replicas run a program each, the same as "
                         f"one replica's)")
    return make_mesh(size, 1, kind == "ep")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="config.json of the model (its shapes are used; nothing is allocated)")
    parser.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    parser.add_argument("--layouts", default="tp8,ep8", help="comma list of tpN, epN")
    parser.add_argument("--batch", type=int, default=8, help="requests in the decode step")
    args = parser.parse_args()
    cfg = load_config(args.config)
    if args.layers:
        n = args.layers
        cfg = dataclasses.replace(cfg, num_layers=n, layer_types=cfg.layer_types[:n],
                                  moe_layers=tuple(i for i in cfg.moe_layers if i < n))
    for layout in args.layouts.split(","):
        m = mesh_for(layout)
        print(f"{describe(m)}: {step_collectives(cfg, m, batch_size=args.batch)}", flush=True)


if __name__ == "__main__":
    main()
