"""ModelRunner: turns a StepPlan into padded device batches, runs the jitted forward + sampler with the cache
donated, and moves recurrent-state snapshots for the prefix cache.

Owns the device arrays (params, cache, snapshots), laid out over a device mesh by sharding/ (one device is a
1x1x1 mesh). Shapes are bucketed to powers of two so that steady serving reuses a few compiled programs; it never
decides who runs (the scheduler does).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from qwen_jax.config import FULL_ATTENTION, ModelConfig
from qwen_jax.engine.sampler import SampleOutput, SamplingTensors, sample
from qwen_jax.engine.scheduler import Row
from qwen_jax.models.decoder import decoder_layer, logits_head, make_batch, prepare_batch
from qwen_jax.sampling_params import SamplingParams
from sharding import rules, step
from sharding.mesh import make_mesh
from sharding.ops import ops_for_mesh

# Every step with a row asking for logprobs computes the API maximum of top-n (one compiled width, not 21).
TOP_LOGPROBS_WIDTH = SamplingParams.MAX_LOGPROBS


def bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def batch_buckets(most: int) -> list[int]:
    """The padded sizes bucket() gives to 1..most rows: 1, 2, 4, ... up to bucket(most)."""
    return sorted({bucket(n) for n in range(1, most + 1)})


def coarse_bucket(n: int, minimum: int) -> int:
    """The smallest minimum * 4^k >= n: prefill shapes step by 4x, so a full warm-up has few of them to compile."""
    size = minimum
    while size < n:
        size *= 4
    return size


def prefill_len(num_tokens: int, max_batched_tokens: int) -> int:
    """The padded length of a prefill row of num_tokens tokens: 16, 64, 256, 1,024, ... up to the token budget."""
    return min(coarse_bucket(num_tokens, 16), bucket(max_batched_tokens, 16))


def prefill_rows(seq_len: int, max_batched_tokens: int) -> int:
    """Rows per prefill program of padded length seq_len."""
    return max(1, max_batched_tokens // seq_len)


def prefill_batch(num_rows: int, seq_len: int, max_batched_tokens: int) -> int:
    """The padded row count of a prefill program: 1, 4, 16, 64, ... up to what the token budget allows."""
    return min(coarse_bucket(num_rows, 1), bucket(prefill_rows(seq_len, max_batched_tokens)))


def step_groups(decode: list[Row], prefill: list[Row], max_batched_tokens: int
                ) -> list[tuple[list[Row], int, int]]:
    """A step's rows as programs: (rows, padded length, padded row count) each. Decode rows are one program
    (padded to a power of two: decode shapes are the ones every running request waits on); prefill rows are grouped
    by padded length (a 16-token tail never pads to 1,024) and split to fit the token budget."""
    groups = [(decode, 1, bucket(len(decode)))] if decode else []
    by_len: dict[int, list[Row]] = {}
    for r in prefill:
        by_len.setdefault(prefill_len(r.num_tokens, max_batched_tokens), []).append(r)
    for seq_len, rows in sorted(by_len.items()):
        per_call = prefill_rows(seq_len, max_batched_tokens)
        for i in range(0, len(rows), per_call):
            chunk = rows[i:i + per_call]
            groups.append((chunk, seq_len, prefill_batch(len(chunk), seq_len, max_batched_tokens)))
    return groups


def step_shapes(max_num_seqs: int, max_batched_tokens: int, max_model_len: int) -> list[tuple[int, int]]:
    """Every padded (rows, length) a step can run (step_groups of any plan the scheduler makes): decode [B, 1] for
    B up to max_num_seqs, and prefill [R, L] for every length up to the longest chunk, R up to what fits the token
    budget. Compiling them all before serving keeps compile stalls out of requests (AsyncLLM's full warm-up)."""
    shapes = [(b, 1) for b in batch_buckets(max_num_seqs)]
    longest = min(max_batched_tokens, max_model_len)
    for seq_len in sorted({prefill_len(n, max_batched_tokens) for n in range(2, longest + 1)}):
        most = min(max_num_seqs, prefill_rows(seq_len, max_batched_tokens))
        shapes += sorted({(prefill_batch(n, seq_len, max_batched_tokens), seq_len) for n in range(1, most + 1)})
    return shapes


# A step runs as separately compiled programs, embed -> one per group of consecutive layers -> head + sampler,
# dispatched from Python. Groups of the same layer kinds share one compiled program per shape bucket, so compile
# time grows with the group size, not the depth (40 layers compiled as one program took 27 s on an H200; one layer
# about 0.6 s), while each program costs a dispatch and breaks XLA's CUDA graph (layers_per_program trades the two;
# 0 runs every layer in one program). Dispatch is asynchronous: a program's launch overlaps the work before it.
# Sharded: params and cache arrive committed to their rules' shardings (inputs follow them), the hot ops are split
# over the mesh's heads and experts (sharding/ops.py), and outputs are pinned (activations whole on every device,
# cache in its own shards).
# A small decode step is bound by the host launching its ~1,300 kernels: with all layers in one program XLA runs
# them as CUDA graphs (its command buffers; a program called once per layer with each layer's weights gained
# little from them: 22.2 vs 23.3 ms with them off at B=1 on a slow host). H200, step_profile, 35B-A3B, ctx 2,048,
# ms per step with one program per layer / one program: B=1 7.7-12.0 / 7.8-8.5, B=2 16.5-16.9 / 7.5-7.7, B=4
# 12.5-14.7 / 8.8-9.1, B=8 14.3-15.3 / 11.3-11.7, B=16 13.2-15.1 / 13.9-15.4, B=32 18.0-18.7 / 18.5-23.9
# (BENCH_H200.md, ninth session): up to 8 rows, one program.
CUDA_GRAPH_MAX_BATCH = 8
# Excess precision off: every rounding to bf16 that the layers write (where HF rounds) really happens.
EXACT = {"xla_allow_excess_precision": False}


@functools.partial(jax.jit, static_argnames=("mesh",), compiler_options=EXACT)
def _embed(embed, batch, mesh):
    return jax.lax.with_sharding_constraint(embed[batch["tokens"]], rules.batch_sharding(mesh))


@functools.partial(jax.jit, static_argnames=("cfg", "kinds", "mesh"), donate_argnums=(2,), compiler_options=EXACT)
def _layers(x, ps, cs, batch, cfg, kinds, mesh):
    """Consecutive layers whose kinds (see _layer_index) are `kinds`: (x, their updated caches)."""
    ops = ops_for_mesh(cfg, mesh)
    new = []
    for p, c, index in zip(ps, cs, kinds, strict=True):
        x, c = decoder_layer(x, p, c, batch, cfg, index, ops)
        x = jax.lax.with_sharding_constraint(x, rules.batch_sharding(mesh))
        new.append(rules.constrain_cache_layer(cfg, mesh, index, c))
    return x, new


@functools.partial(jax.jit, static_argnames=("cfg", "num_top_logprobs"), compiler_options=EXACT)
def _head_sample(x, head_params, batch, tensors, cfg, num_top_logprobs):
    return sample(logits_head(x, head_params, batch, cfg), tensors, num_top_logprobs)


def layer_groups(cfg: ModelConfig, layers_per_program: int) -> list[range]:
    """The layers each program runs: consecutive runs of `layers_per_program` (0: all layers in one)."""
    size = cfg.num_layers if layers_per_program <= 0 else layers_per_program
    return [range(i, min(i + size, cfg.num_layers)) for i in range(0, cfg.num_layers, size)]


def run_layers(params: dict, cache: dict, batch: dict, cfg: ModelConfig, mesh: Mesh,
               layers_per_program: int = 1) -> tuple[jax.Array, dict]:
    """Embedding and every layer for a batch already on the devices (from prepare_batch): (hidden [B, S, H], cache).
    The cache's per-layer buffers are donated group by group."""
    x = _embed(params["embed"], batch, mesh=mesh)
    layers = []
    for group in layer_groups(cfg, layers_per_program):
        x, cs = _layers(x, [params["layers"][i] for i in group], [cache["layers"][i] for i in group], batch,
                        cfg=cfg, kinds=tuple(_layer_index(cfg, i) for i in group), mesh=mesh)
        layers += cs
    return x, {"layers": layers}


def head_params(params: dict) -> dict:
    return {k: params[k] for k in ("embed", "final_norm", "lm_head") if k in params}


@functools.cache
def _put_program(sharding) -> Callable:
    """A jitted identity: host arrays cross to the devices as its arguments, in one call of jit's C++ path. A step's
    ~17 small arrays took 1.2-1.3 ms through jax.device_put and 0.2 ms this way on the CPU; on an H200 host the
    sampling tensors' transfer stayed ~0.7 ms, while the batch with its host-formed mask went 1.1-1.4 -> 0.55-0.73
    ms (BENCH_H200.md, tenth session)."""
    return jax.jit(lambda tree: tree, in_shardings=sharding, out_shardings=sharding)


def put_batch(tree, mesh: Mesh):
    """Host arrays -> the mesh's batch sharding. One host: one call of a jitted identity. Several: every host gives
    the same numbers and copies only its own devices' slices (rules.put)."""
    sharding = rules.batch_sharding(mesh)
    if sharding.is_fully_addressable:
        return _put_program(sharding)(tree)
    return jax.tree.map(lambda a: rules.put(a, sharding), tree)


def run_step(params: dict, cache: dict, batch: dict, tensors: SamplingTensors, cfg: ModelConfig,
             num_top_logprobs: int, mesh: Mesh, layers_per_program: int = 1) -> tuple[SampleOutput, dict]:
    """forward + sample for one padded host batch."""
    batch = put_batch(prepare_batch(batch), mesh)  # the mask formed on the host: no eager device ops
    x, cache = run_layers(params, cache, batch, cfg, mesh, layers_per_program)
    return _head_sample(x, head_params(params), batch, tensors, cfg=cfg, num_top_logprobs=num_top_logprobs), cache


def _layer_index(cfg: ModelConfig, i: int) -> int:
    """The first layer with the same kind (mixer type, MoE or dense) as layer i: layers of one kind compile once."""
    kind = (cfg.layer_types[i], cfg.is_moe_layer(i))
    return next(j for j in range(cfg.num_layers) if (cfg.layer_types[j], cfg.is_moe_layer(j)) == kind)


def _gdn_layers(tree: dict, cfg: ModelConfig) -> list[dict]:
    return [c for c, kind in zip(tree["layers"], cfg.layer_types) if kind != FULL_ATTENTION]


def _gdn_indices(cfg: ModelConfig) -> list[int]:
    return [i for i, kind in enumerate(cfg.layer_types) if kind != FULL_ATTENTION]


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), donate_argnums=(0,))
def _restore_snapshots(cache, snapshots, src, dst, cfg, mesh):
    """cache slots[dst] <- snapshots[src] for every recurrent layer (padding pairs write slot 0, the sink)."""
    layers = list(cache["layers"])
    for i, snap in zip(_gdn_indices(cfg), snapshots):
        layers[i] = rules.constrain_cache_layer(
            cfg, mesh, i, {k: v.at[dst].set(snap[k][src]) for k, v in layers[i].items()})
    return {"layers": layers}


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), donate_argnums=(1,))
def _save_snapshots(cache, snapshots, src, dst, cfg, mesh):
    """snapshots[dst] <- cache slots[src] (padding pairs write snapshot 0, the sink)."""
    return [rules.constrain_cache_layer(cfg, mesh, i, {k: v.at[dst].set(cache["layers"][i][k][src])
                                                       for k, v in snap.items()})
            for i, snap in zip(_gdn_indices(cfg), snapshots)]


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict, num_blocks: int, block_size: int, num_slots: int,
                 num_snapshots: int, max_model_len: int, vocab_size: int,
                 eos_token_ids: list[int], seed: int = 0, mesh: Mesh | None = None, layers_per_program: int = 1,
                 cuda_graph_max_batch: int | None = None):
        """`params` must already be laid out over `mesh` (default: the first device) by sharding.rules. None: the
        mesh is on other hosts (a data-parallel replica there); this runner only writes its steps down, and its
        executor must send them where they run (engine/multihost.py). cuda_graph_max_batch: decode batches of up to
        this many rows run all layers as one program (None: CUDA_GRAPH_MAX_BATCH on a GPU, 0 elsewhere)."""
        self.cfg = cfg
        self.layers_per_program = layers_per_program
        if cuda_graph_max_batch is None:
            cuda_graph_max_batch = CUDA_GRAPH_MAX_BATCH if jax.default_backend() == "gpu" else 0
        self.cuda_graph_max_batch = cuda_graph_max_batch
        self.params = params
        self.mesh = mesh if mesh is not None else make_mesh(1)
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.step_seed = seed * 1_000_003
        self.has_snapshots = bool(num_snapshots and cfg.is_hybrid)
        self.cache = self.snapshots = None
        if params is not None:
            self.cache = step.init_cache(cfg, self.mesh, num_blocks, block_size, num_slots)
        if params is not None and self.has_snapshots:  # GDN state only (+ the sink at 0), split like the cache
            self.snapshots = _gdn_layers(step.init_cache(cfg, self.mesh, 1, block_size, num_snapshots + 1), cfg)
        # What runs a step's op list (see run): `execute` here; a multi-host leader's engine puts the broadcast to
        # the other hosts in front of it (engine/multihost.py).
        self.executor: Callable[[list], list[SampleOutput]] = self.execute
        # Time spent blocked on the devices' sampled tokens; the rest of a step is host work (engine.stats()).
        self.device_wait_seconds = 0.0

    # ---- batches -------------------------------------------------------------------------------------------
    def _table_width(self, rows: list[Row]) -> int:
        """Block-table columns of a batch. The paged attention kernel (kernels="gpu") reads only a row's real
        context, so its tables are always full width: one compiled program per (rows, length) instead of one per
        width too. The reference gathers every column, so it gets the narrowest power-of-two bucket."""
        if self.cfg.kernels == "gpu":
            return self.max_blocks_per_seq
        needed = max((len(r.seq.block_table) for r in rows), default=1)
        return min(self.max_blocks_per_seq, bucket(needed, max(1, self.max_blocks_per_seq // 8)))

    def _batch(self, rows: list[Row], batch_size: int, seq_len: int) -> dict:
        tokens = np.zeros((batch_size, seq_len), np.int32)
        starts = np.zeros(batch_size, np.int32)
        lens = np.zeros(batch_size, np.int32)
        slots = np.zeros(batch_size, np.int32)
        tables = np.zeros((batch_size, self._table_width(rows)), np.int32)
        for i, r in enumerate(rows):
            ids = r.seq.token_ids(r.start, r.start + r.num_tokens)
            tokens[i, :len(ids)] = ids
            starts[i], lens[i] = r.start, r.num_tokens
            slots[i] = r.seq.slot or 0
            tables[i, :len(r.seq.block_table)] = r.seq.block_table
        return make_batch(tokens, starts, lens, slots, tables)

    def _sampling(self, rows: list[Row], batch_size: int, histories: dict) -> SamplingTensors:
        self.step_seed += 1
        return SamplingTensors.build_host(
            [r.seq.params for r in rows], [len(r.seq.output_token_ids) for r in rows],
            [histories.get(r.seq.request_id) for r in rows], vocab_size=self.vocab_size, batch_size=batch_size,
            eos_token_ids=self.eos_token_ids, step_seed=self.step_seed)

    # ---- execution -------------------------------------------------------------------------------------------
    def run(self, decode: list[Row], prefill: list[Row], histories: dict, max_batched_tokens: int
            ) -> list[tuple[Row, SampleOutput, int]]:
        """Run one step. Returns (row, its group's SampleOutput on the host, index of the row in it) per row.

        The step's device work is first written down as host data, a list of ops run in order by the executor:
        ("restore", src, dst) copies snapshots into state slots, ("forward", batch, sampling tensors, number of top
        logprobs) runs one padded group of rows, ("save", src, dst) copies state slots into snapshots (numpy arrays
        and ints only, so that a multi-host leader can send the same list to the other hosts)."""
        groups = step_groups(decode, prefill, max_batched_tokens)
        ops = []
        restore = [(r.restore_snapshot, r.seq.slot) for r in decode + prefill if r.restore_snapshot is not None]
        if restore and self.has_snapshots:
            ops.append(("restore", *self._pairs(restore)))
        for rows, seq_len, batch_size in groups:
            top = max((r.seq.params.logprobs or 0) for r in rows)
            ops.append(("forward", self._batch(rows, batch_size, seq_len), self._sampling(rows, batch_size, histories),
                        0 if top == 0 else TOP_LOGPROBS_WIDTH))
        save = [(r.seq.slot, r.save_snapshot) for r in decode + prefill if r.save_snapshot is not None]
        if save and self.has_snapshots:
            ops.append(("save", *self._pairs(save)))
        results = []
        for (rows, _, _), out in zip(groups, self.executor(ops), strict=True):
            waited = time.perf_counter()
            host = SampleOutput(*jax.device_get(tuple(out)))
            self.device_wait_seconds += time.perf_counter() - waited
            results += [(r, host, i) for i, r in enumerate(rows)]
        return results

    def warmup(self, shapes: list[tuple[int, int]], max_pairs: int) -> None:
        """Compile the programs of every padded (rows, length) in `shapes` and the snapshot copies of up to
        `max_pairs` pairs, by running them on padding rows only (length 0, slot 0, block 0): they write nothing but
        the sinks (KV block 0, state slot 0, snapshot 0). Through the executor, so other hosts compile them too."""
        width = self._table_width([])
        for rows, seq_len in shapes:
            zeros = np.zeros(rows, np.int32)
            batch = make_batch(np.zeros((rows, seq_len), np.int32), zeros, zeros, zeros,
                               np.zeros((rows, width), np.int32))
            tensors = SamplingTensors.build_host([], [], [], vocab_size=self.vocab_size, batch_size=rows)
            jax.block_until_ready(self.executor([("forward", batch, tensors, 0)]))
        if self.has_snapshots:
            for n in batch_buckets(max_pairs):
                self.executor([("restore", *self._pairs([(0, 0)] * n)), ("save", *self._pairs([(0, 0)] * n))])
        jax.block_until_ready(self.cache)

    def execute(self, ops: list) -> list[SampleOutput]:
        """Issue the device work of one step's ops (see run), in order: the forward ops' SampleOutputs, on the
        devices. The only place a step touches the devices; on several hosts every host runs the same list."""
        outs = []
        for kind, *args in ops:
            if kind == "restore":
                self.cache = _restore_snapshots(self.cache, self.snapshots, *put_batch(args, self.mesh),
                                                cfg=self.cfg, mesh=self.mesh)
            elif kind == "save":
                self.snapshots = _save_snapshots(self.cache, self.snapshots, *put_batch(args, self.mesh),
                                                 cfg=self.cfg, mesh=self.mesh)
            elif kind == "forward":
                batch, tensors, num_top = args
                tensors = SamplingTensors(*put_batch(tuple(tensors), self.mesh))
                rows, seq_len = batch["tokens"].shape
                whole = seq_len == 1 and rows <= self.cuda_graph_max_batch
                out, self.cache = run_step(self.params, self.cache, batch, tensors, self.cfg, num_top, self.mesh,
                                           0 if whole else self.layers_per_program)
                outs.append(out)
            else:
                raise ValueError(f"unknown step op {kind!r}")
        return outs

    @staticmethod
    def _pairs(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) index arrays padded to a bucket with (0, 0): padding copies into the sink entry."""
        src, dst = np.zeros((2, bucket(len(pairs))), np.int32)
        for i, (a, b) in enumerate(pairs):
            src[i], dst[i] = a, b
        return src, dst
