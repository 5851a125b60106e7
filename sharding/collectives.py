"""Collectives per decode step: lower and compile the sharded forward on abstract shapes (nothing allocated) and
count all-reduce / all-gather / all-to-all / reduce-scatter / collective-permute in the compiled HLO.

`python -m sharding.collectives` prints the table in sharding/README.md (run with 8 or more host devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from qwen_jax.config import ModelConfig, load_config
from qwen_jax.models import decoder
from sharding import rules
from sharding.mesh import describe, make_mesh
from sharding.step import BATCH_KEYS, jit_forward

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


def abstract_batch(mesh: Mesh, batch_size: int, seq_len: int, max_blocks: int) -> dict:
    sharding = rules.batch_sharding(mesh)
    shapes = {"tokens": (batch_size, seq_len), "positions": (batch_size, seq_len), "seq_lens": (batch_size,),
              "state_slots": (batch_size,), "block_tables": (batch_size, max_blocks), "context_lens": (batch_size,)}
    return {k: jax.ShapeDtypeStruct(shapes[k], jnp.int32, sharding=sharding) for k in BATCH_KEYS}


def step_collectives(cfg: ModelConfig, mesh: Mesh, batch_size: int = 8, seq_len: int = 1, num_blocks: int = 64,
                     block_size: int = 16, num_slots: int = 16, max_blocks: int = 4) -> dict[str, int]:
    """Collective counts of one compiled forward step (decode when seq_len == 1) on abstract arrays."""
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          decoder.param_shapes(cfg), rules.param_shardings(cfg, mesh))
    cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         decoder.cache_shapes(cfg, num_blocks, block_size, num_slots),
                         rules.cache_shardings(cfg, mesh, num_blocks, block_size, num_slots))
    step = jit_forward(cfg, mesh, num_blocks, block_size, num_slots)
    batch = abstract_batch(mesh, batch_size, seq_len, max_blocks)
    return count_collectives(step.lower(params, cache, batch).compile().as_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="config.json of the model (its shapes are used; nothing is allocated)")
    parser.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    parser.add_argument("--layouts", default="tp8,ep8", help="comma list of tpN, epN, dpMxtpN")
    args = parser.parse_args()
    cfg = load_config(args.config)
    if args.layers:
        n = args.layers
        cfg = dataclasses.replace(cfg, num_layers=n, layer_types=cfg.layer_types[:n],
                                  moe_layers=tuple(i for i in cfg.moe_layers if i < n))
    for layout in args.layouts.split(","):
        print(f"{describe(mesh_for(layout))}: {step_collectives(cfg, mesh_for(layout))}", flush=True)


def mesh_for(layout: str) -> Mesh:
    """'tp8' -> TP 8; 'ep8' -> TP 8 with expert parallelism; 'dp2xtp4' -> 2 replicas of TP 4."""
    dp, tp, ep = 1, 1, False
    for part in layout.split("x"):
        kind, size = part[:2], int(part[2:])
        if kind == "dp":
            dp = size
        else:
            tp, ep = size, kind == "ep"
    return make_mesh(tp, dp, ep)


if __name__ == "__main__":
    main()
