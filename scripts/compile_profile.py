"""Where the compile time of a decode step goes: lower + compile time of the whole model and of one layer of each
kind, on abstract inputs (nothing is allocated). Prints one JSON line per measurement.
"""

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.config import load_config
from qwen_jax.layers.attention import attention_layer
from qwen_jax.layers.gated_deltanet import gdn_layer
from qwen_jax.layers.mlp import sparse_moe
from qwen_jax.models.decoder import cache_shapes, forward, param_shapes


def compile_seconds(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return round(time.perf_counter() - t0, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    cfg = load_config(args.config)
    b, width, bs = args.batch, 64, 16
    sds = jax.ShapeDtypeStruct
    batch = {"tokens": sds((b, 1), jnp.int32), "positions": sds((b, 1), jnp.int32), "seq_lens": sds((b,), jnp.int32),
             "state_slots": sds((b,), jnp.int32), "block_tables": sds((b, width), jnp.int32),
             "context_lens": sds((b,), jnp.int32)}
    for layers in (40, 8, 4):
        small = dataclasses.replace(cfg, num_layers=layers, layer_types=cfg.layer_types[:layers],
                                    moe_layers=tuple(i for i in cfg.moe_layers if i < layers))
        p, c = param_shapes(small), cache_shapes(small, b * width + 1, bs, b + 1)
        print(json.dumps({"what": f"forward_{layers}_layers", "batch": b,
                          "compile_s": compile_seconds(lambda p, c, x, m=small: forward(p, c, x, m), p, c, batch)}),
              flush=True)
    p, c = param_shapes(cfg), cache_shapes(cfg, b * width + 1, bs, b + 1)
    lb = dict(batch, valid=sds((b, 1), jnp.bool_))
    x = sds((b, 1, cfg.hidden_size), cfg.jnp_dtype)
    inv = np.asarray(cfg.rope_inv_freq())
    a, g = cfg.attention_layers[0], cfg.linear_layers[0]
    for name, fn, fargs in (
        ("attention_layer", lambda x, p, c, bt: attention_layer(x, p, c, bt, cfg, jnp.asarray(inv)),
         (x, p["layers"][a]["mixer"], c["layers"][a], lb)),
        ("gdn_layer", lambda x, p, c, bt: gdn_layer(x, p, c, bt, cfg),
         (x, p["layers"][g]["mixer"], c["layers"][g], lb)),
        ("moe_layer", lambda x, p: sparse_moe(x, p, cfg.num_experts_per_tok, cfg.norm_topk_prob),
         (sds((b, cfg.hidden_size), cfg.jnp_dtype), p["layers"][0]["mlp"])),
    ):
        print(json.dumps({"what": name, "batch": b, "compile_s": compile_seconds(fn, *fargs)}), flush=True)


if __name__ == "__main__":
    main()
