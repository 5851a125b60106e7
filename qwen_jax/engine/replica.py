"""Replica: one model replica on its own devices, with its cache memory sized from those devices and its own block
pool, slot pool, prefix cache, scheduler and runner. The engine core (engine/core.py) owns one per data-parallel
replica.

A replica only ever sees its own sequences and never waits for the device itself: the core issues its steps and
reads them back.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh

from qwen_jax.config import ModelConfig
from qwen_jax.engine import buckets
from qwen_jax.engine.compilation import AUTOTUNE_ROOM, Compiler, measure_working, uses_workers
from qwen_jax.engine.memory import BlockPool, SlotPool
from qwen_jax.engine.memory_plan import MAX_NUM_SEQS_CAP, Footprint, MemoryPlanError, engine_share, plan_memory
from qwen_jax.engine.prefix_cache import PrefixCache
from qwen_jax.engine.programs import Shapes
from qwen_jax.engine.runner import ModelRunner
from qwen_jax.engine.sampler import table_bytes_per_slot
from qwen_jax.engine.scheduler import Scheduler
from qwen_jax.engine.sequence import Sequence
from qwen_jax.engine.speculative import DraftPolicy, parse_speculative_config
from sharding import rules
from sharding.mesh import AXES, EXPERT, TENSOR, model_parallel_size
from sharding.mesh import describe as describe_mesh

log = logging.getLogger("qwen_jax")

# Decode steps of at most DECODE_STEPS_MAX_ROWS requests run DECODE_STEPS at a time in one program (on a GPU; the
# engine argument num_scheduler_steps overrides the count): issuing a step costs the host more than the GPU takes to
# run a small batch (H200, 35B-A3B, one request: 5.4 ms of host time for 2.45 ms of GPU time; at 8 requests the GPU
# takes about 7 ms), and one program for several steps is issued once.
DECODE_STEPS = 4
DECODE_STEPS_MAX_ROWS = 8
# The default token budget of a step (engine argument max_num_batched_tokens; core.py says why).
GPU_BATCHED_TOKENS = 8192
BATCHED_TOKENS = 2048
# Where the caches (planned without the programs' working memory) leave this much of the engine's share, the largest
# forward's working memory is not measured before planning (its compile costs a start 15-25 s for 35B-A3B): it changes
# nothing there, and check_memory checks every compiled program's against what the caches leave. 35B-A3B's largest,
# forward[8192], needs 2.22 GiB (H100).
UNMEASURED_ROOM = 8 * 2**30
# A verify step keeps every GDN layer's state after each of its tokens until its commit (a slot's worth a token): its
# working memory is those states and this much more (verify[32, k=3] of 35B-A3B on an H100: 2.10 GiB for 1.91 GiB
# of states).
VERIFY_WORKING_PER_STATE = 1.1
# The rows whose verify states are held free beside the caches: the most sequences first (max_num_seqs not given:
# room for the few rows where speculation pays most), or up to the rows speculation runs at (given). Where that does
# not fit, the few, then one row, then none: speculation then takes what the caches leave.
SPECULATING_ROWS = (8, 64)


class Replica:
    def __init__(self, index: int, cfg: ModelConfig, params: dict | None, mesh: Mesh, args: dict, max_model_len: int,
                 eos_token_ids: list[int], seed: int):
        """Replica `index` over `mesh`, serving `params` (already laid out over `mesh`, or their shapes,
        rules.abstract_params, placed later with runner.place_params); `args` are the engine's."""
        self.index = index
        self.cfg = cfg
        self.mesh = mesh
        self.max_model_len = max_model_len
        budget = args["max_num_batched_tokens"]
        if budget is None:
            budget = GPU_BATCHED_TOKENS if jax.default_backend() == "gpu" else BATCHED_TOKENS
        self.max_num_batched_tokens = int(budget)
        self.block_size = int(args["block_size"])
        spec = parse_speculative_config(args["speculative_config"], cfg.has_mtp)
        self._size_memory(args, spec, params)
        self.blocks = BlockPool(self.num_blocks, self.block_size)
        self.slots = SlotPool(self.max_num_seqs + 1)
        self.prefix_cache = (PrefixCache(self.blocks, self.num_snapshots, cfg.is_hybrid)
                             if args["enable_prefix_caching"] else None)
        policy = DraftPolicy(spec, self.max_verify_tokens) if spec.num_drafts else None
        steps = args["num_scheduler_steps"]
        if steps is None:
            steps = DECODE_STEPS if jax.default_backend() == "gpu" else 1
        self.shapes = self._shapes(
            args, spec, num_blocks=self.num_blocks, num_slots=self.max_num_seqs + 1,
            num_snapshots=self.num_snapshots if self.prefix_cache else 0, max_num_seqs=self.max_num_seqs,
            decode_steps=int(steps), decode_steps_max_rows=DECODE_STEPS_MAX_ROWS,
            drafts_at=tuple(policy.drafts_at(rows) for rows in range(1, self.max_num_seqs + 1)) if policy else ())
        self.scheduler = Scheduler(self.blocks, self.slots, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.prefix_cache, max_model_len, policy, self.shapes, eos_token_ids)
        self.runner = ModelRunner(self.shapes, params, eos_token_ids, seed=seed, mesh=mesh, lazy=uses_workers(mesh))
        self.compiler = Compiler(self.runner)
        self.runner.compile_buckets = self.compiler.compile

    # ---- memory sizing ---------------------------------------------------------------------------------------
    def _size_memory(self, args: dict, spec, params: dict | None) -> None:
        """Cache sizes from the tightest device of this replica (memory_plan.plan_memory): the share of it this
        engine may take (gpu_memory_utilization of the device), less the weights (`params`' leaves that are only
        shapes yet count as placed) and the working memory held free for the programs: the larger of the largest
        forward's, measured (compilation.measure_working) where the caches would leave less than UNMEASURED_ROOM,
        and the states a verify step of the rows speculation is given room for keeps (SPECULATING_ROWS). What the
        caches leave (`held_back`) is the programs': a verify step takes the largest token bucket whose states fit
        there. A configuration that does not fit is refused here, before any program compiles (but that forward).
        Also decides `compile_before_weights`: the weights would leave the compile workers' autotuning too little
        of the device (AUTOTUNE_ROOM)."""
        cfg, block_size = self.cfg, self.block_size
        fixed_drafts = spec.num_drafts if spec.fixed else 0
        self.compile_before_weights = False
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        stats = [d.memory_stats() or {} for d in local]
        reported = bool(local) and all("bytes_limit" in s for s in stats)  # memory statistics
        if not local:  # a replica on other hosts: theirs decide (the allgather below)
            capacity, weights = float("inf"), 0.0
        elif reported:
            unplaced = rules.shard_bytes([leaf for leaf in jax.tree.leaves(params or {})
                                          if isinstance(leaf, jax.ShapeDtypeStruct)])
            share = float(args["gpu_memory_utilization"])
            capacity, weights = min(((engine_share(s, share), s["bytes_in_use"] + unplaced) for s in stats),
                                    key=lambda device: device[0] - device[1])
            # what the weights leave of the tightest device for the compile workers' autotuning
            self.compile_before_weights = min(s["bytes_limit"] - s["bytes_in_use"] for s in stats) - unplaced \
                < AUTOTUNE_ROOM
        else:  # no memory statistics (the CPU): a fixed cache budget, the weights not counted
            capacity, weights = float(args["cpu_cache_budget_gib"]) * 2**30, 0.0
        if jax.process_count() > 1:  # every host must build the same cache shapes and verify programs
            hosts = multihost_utils.process_allgather(np.array([capacity, weights, reported], np.float64))
            capacity, weights = (float(v) for v in hosts[np.argmin(hosts[:, 0] - hosts[:, 1]), :2])
            reported = reported or bool(hosts[:, 2].max())
        max_num_seqs = args["max_num_seqs"]
        if max_num_seqs is None and not reported:  # no device reports its memory: the cap, as before
            max_num_seqs = MAX_NUM_SEQS_CAP
        footprint = self._footprint(self.mesh, weights)
        per_token = VERIFY_WORKING_PER_STATE * footprint.per_slot  # a verify token's working memory
        drafts = spec.num_drafts

        def plan_for(rows: int, working: float):  # (working memory held free, plan) with verify room for `rows`
            reserve = max(working, per_token * rows * (drafts + 1)) if drafts and reported else working
            return reserve, plan_memory(
                capacity, footprint, block_size=block_size, max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs, keeps_snapshots=cfg.is_hybrid and bool(args["enable_prefix_caching"]),
                num_snapshots=args["num_snapshots"], num_kv_blocks=args["num_kv_blocks"], working=reserve,
                wider=self._wider_footprints)

        # what cannot fit even without the programs is refused before anything compiles; where the caches leave
        # UNMEASURED_ROOM, measuring the working memory would change nothing (check_memory checks every program's).
        # Every host plans alike: capacity and weights are the hosts' tightest.
        working = 0.0
        if reported and plan_for(0, 0.0)[1].spare < UNMEASURED_ROOM:
            # the largest forward: the caches' sizes do not change its working memory, so the smallest stand in
            working = float(measure_working(self._shapes(args, spec, num_blocks=2, num_slots=2, num_snapshots=0,
                                                         max_num_seqs=args["max_num_seqs"] or MAX_NUM_SEQS_CAP),
                                            self.mesh))
        if jax.process_count() > 1:
            working = float(multihost_utils.process_allgather(np.array(working, np.float64)).max())
        few, many = SPECULATING_ROWS
        # verify room for the rows speculation runs at, else for fewer; the last refusal (no verify room) stands
        for rows in dict.fromkeys((min(max_num_seqs, many) if max_num_seqs else few, min(max_num_seqs or few, few),
                                   1, 0)):
            try:
                reserve, plan = plan_for(rows, working)
                break
            except MemoryPlanError as exc:
                refused = exc
        else:
            raise refused
        if args["max_num_seqs"] is None:
            log.info("replica %d: max_num_seqs %d (the most, up to %d, that fit with KV for each at max_model_len "
                     "%d; --max-num-seqs sets it)", self.index, plan.max_num_seqs, MAX_NUM_SEQS_CAP,
                     self.max_model_len)
        self.max_num_seqs, self.num_blocks, self.num_snapshots = plan.max_num_seqs, plan.num_blocks, plan.num_snapshots
        self.held_back = reserve + plan.spare if reported else None  # the programs' memory beside the caches
        self.max_verify_tokens = None  # the most tokens a verify step takes (None: no cap known)
        if footprint.per_slot and self.held_back is not None:  # the largest token bucket that fits (a step pads to one)
            sizes = buckets.token_buckets(self.max_num_batched_tokens, self.max_num_seqs)
            self.max_verify_tokens = max((size for size in sizes if size * per_token <= self.held_back), default=0)
            log.info("replica %d: the caches leave %.2f GiB for the programs' working memory (the largest forward's: "
                     "%s); a verify step takes at most %d tokens", self.index, self.held_back / 2**30,
                     f"{working / 2**30:.2f} GiB" if working else "not measured, the caches leave enough",
                     self.max_verify_tokens)
        if fixed_drafts and self.max_verify_tokens is not None and self.max_verify_tokens < fixed_drafts + 1:
            need = (fixed_drafts + 1) * per_token / 2**30
            raise ValueError(f"a verify step of one request with {fixed_drafts} drafts keeps {fixed_drafts + 1} "
                             f"tokens' recurrent states ({need:.2f} GiB), more than the {self.held_back / 2**30:.2f} "
                             f"GiB the caches leave: lower num_speculative_tokens or --max-num-seqs, or raise "
                             f"--gpu-memory-utilization")

    def _shapes(self, args: dict, spec, **sizes) -> Shapes:
        """This replica's Shapes with the cache and batch `sizes` given (Shapes' fields)."""
        return Shapes(cfg=self.cfg, kernels=args["kernels"], tensor_parallel_size=int(np.prod(self.mesh.devices.shape)),
                      enable_expert_parallel=self.mesh.shape.get("expert", 1) > 1, block_size=self.block_size,
                      max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                      num_speculative_tokens=spec.num_drafts, **sizes)

    def _footprint(self, mesh: Mesh | AbstractMesh, weights: float) -> Footprint:
        """This model's bytes on one device of `mesh`: `weights`, and its shard of a slot and of a KV block."""
        return Footprint(weights=weights, per_slot=rules.cache_bytes_per_device(self.cfg, mesh, 0, self.block_size, 1),
                         per_counts=table_bytes_per_slot(self.cfg.vocab_size),
                         per_block=rules.cache_bytes_per_device(self.cfg, mesh, 1, self.block_size, 0))

    def _wider_footprints(self) -> list[tuple[int, Footprint]]:
        """(tensor-parallel size, footprint there) at 2, 4 and 8 times this replica's devices, split the same way
        (experts on their own axis or not): what a refusal offers as the smallest -tp that fits."""
        size = model_parallel_size(self.mesh)
        axis = EXPERT if self.mesh.shape[EXPERT] > 1 else TENSOR
        wider = []
        for tp in (2 * size, 4 * size, 8 * size):
            mesh = AbstractMesh(tuple(tp if a == axis else 1 for a in AXES), AXES)
            wider.append((tp, self._footprint(mesh, rules.shard_bytes(rules.abstract_params(self.cfg, mesh)))))
        return wider

    @property
    def num_tokens(self) -> int:
        """KV cache capacity in tokens (the padding sink block not counted)."""
        return self.blocks.num_usable * self.block_size

    def describe(self) -> str:
        return (f"replica {self.index} on {describe_mesh(self.mesh)} "
                f"(devices {','.join(str(d.id) for d in self.mesh.devices.flat)}): KV cache {self.blocks.num_usable} "
                f"blocks x {self.block_size} tokens ({self.num_tokens} tokens), {self.max_num_seqs} sequences at "
                f"once, {self.num_snapshots} state snapshots")

    # ---- requests --------------------------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def warmup(self, full: bool, part: tuple[int, int] = (0, 1)) -> None:
        """Compile this replica's step programs and run each once before it serves (Compiler.warm_up), checking
        them against the memory plan. Full: every program serving can run; else the smallest and the largest token
        bucket's. `part`: this core's share of a compile shared with the other cores of one host. Runs padding only:
        no request, block or counter is touched."""
        self.compiler.held_back = self.held_back
        self.compiler.warm_up(full, part=part)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish (or abort) one of this replica's sequences: its blocks and slot are free at once (a step still in
        flight that writes them runs before any later step that reuses them)."""
        self.scheduler.finish(seq, reason, stop_reason)

    # ---- introspection ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        s, slots, cache = self.scheduler, self.slots, self.prefix_cache
        return {
            "num_running": len(s.running), "num_waiting": len(s.waiting),
            "kv_blocks_used": self.blocks.num_usable - self.blocks.num_free, "kv_blocks_total": self.blocks.num_usable,
            "state_slots_used": slots.num_slots - 1 - slots.num_free, "state_slots_total": slots.num_slots - 1,
            "prefix_cache_queries": cache.queries if cache else 0, "prefix_cache_hits": cache.hits if cache else 0,
            "step_device_wait_seconds_total": self.runner.device_wait_seconds,
            "program_fallbacks_total": self.runner.programs.misses,
            "num_preemptions_total": s.num_preemptions, "generation_tokens_total": s.num_generated_tokens,
            "spec_verified_rows_total": s.spec_rows, "spec_drafted_tokens_total": s.spec_drafted,
            "spec_accepted_tokens_total": s.spec_accepted,
            "spec_accepted_tokens_per_position": list(s.spec_accepted_at),
        }
