"""The sharded forward step: decoder.forward with the hot ops partitioned for the mesh (sharding/ops.py), wrapped in a
shard_map over the data axis when there are several replicas, and jitted with the rules' shardings.

Each data replica reads and writes only its own cache shard: its rows' block tables and state slots are indices
into that replica's shard (replica-local ids, each replica with its own sink block 0 and sink slot 0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen_jax.config import ModelConfig
from qwen_jax.models import decoder
from sharding import rules
from sharding.mesh import DATA
from sharding.ops import ops_for_mesh

BATCH_KEYS = ("tokens", "positions", "seq_lens", "state_slots", "block_tables", "context_lens")


def sharded_forward(cfg: ModelConfig, mesh: Mesh, all_logits: bool = False) -> Callable:
    """forward(params, cache, batch) -> (logits, cache) for `mesh` (not jitted; see `jit_forward`)."""
    step = functools.partial(decoder.forward, cfg=cfg, all_logits=all_logits, ops=ops_for_mesh(cfg, mesh))
    if mesh.shape[DATA] == 1:
        return step
    # Manual over data only: inside, each replica's rows and cache shard are auto-partitioned over the model axes.
    # check_vma off: a pallas_call's outputs carry no record of which axes they vary over (kernels="gpu").
    return jax.shard_map(step, mesh=mesh, in_specs=(P(), P(DATA), P(DATA)), out_specs=(P(DATA), P(DATA)),
                         axis_names={DATA}, check_vma=False)


def jit_forward(cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, num_slots: int,
                all_logits: bool = False, donate_cache: bool = True) -> Callable:
    """The jitted step with explicit in/out shardings; the cache is donated and comes back in the same shards.
    `batch` must be a dict with BATCH_KEYS (decoder.make_batch's), each with the batch rows first."""
    cache_sh = rules.cache_shardings(cfg, mesh, num_blocks, block_size, num_slots)
    batch_sh = dict.fromkeys(BATCH_KEYS, rules.batch_sharding(mesh))
    return jax.jit(sharded_forward(cfg, mesh, all_logits),
                   in_shardings=(rules.param_shardings(cfg, mesh), cache_sh, batch_sh),
                   out_shardings=(rules.batch_sharding(mesh), cache_sh),
                   donate_argnums=(1,) if donate_cache else ())


def _trimmed(spec: P) -> P:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def init_cache(cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, num_slots: int) -> dict:
    """Zeroed cache made directly in its shards (num_blocks and num_slots count all replicas together).
    Specs without trailing Nones, as compiled programs return them: a donated cache keeps one jit signature."""
    shardings = jax.tree.map(lambda sh: NamedSharding(mesh, _trimmed(sh.spec)),
                             rules.cache_shardings(cfg, mesh, num_blocks, block_size, num_slots))
    return jax.jit(lambda: decoder.init_cache(cfg, num_blocks, block_size, num_slots), out_shardings=shardings)()
