"""The compiled programs of one replica: a key for each (ProgramKey), the one table that serves them (ProgramTable:
compiled ahead, else jitted on the spot and counted as a miss), the catalog of what is compiled ahead, and the one
rule for which sampler variant a batch runs.

Never runs a program (the runner does) and never compiles ahead (engine/compilation.py fills the table); everything
here follows from a plain description of the replica's shapes (`Shapes`), so a compile worker builds the same
programs without any device state.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from qwen_jax.config import ModelConfig
from qwen_jax.engine import buckets, step
from qwen_jax.engine.sampler import SamplingTensors, cut_path, table_shapes
from qwen_jax.layers.batch import ragged
from qwen_jax.sampling_params import SamplingParams
from sharding import rules

log = logging.getLogger("qwen_jax")

# Every step with a row asking for logprobs computes the API maximum of top-n (one compiled width, not 21).
TOP = SamplingParams.MAX_LOGPROBS
# The sampler variants (cut path, top logprobs) compiled ahead, cheapest first. A variant serves a batch when its path
# and top are at least the batch's (a higher path draws the same tokens: sampler._truncate; a wider top holds the
# narrower). The single-step sampler is a small program: every variant. The several-step decode and verify programs
# are whole forwards: the common one (temperature, top-k up to sampler.TOP_K_FAST_MAX with top-p: the path of a
# checkpoint's generation_config) and one that serves anything (the full sort, top logprobs).
SAMPLER_VARIANTS = tuple((path, top) for top in (0, TOP) for path in (0, 1, 2))
MODEL_SAMPLER_VARIANTS = ((1, 0), (2, TOP))
# A verify program of a few rows runs this many rounds per decode step a decode program runs: a program's ~6 ms of
# host time is shared by more tokens. Rows that end inside a program compute the rest of its rounds for nothing.
VERIFY_ROUNDS_PER_DECODE_STEP = 2
# The sampling tables a WriteRows op may write, and the kinds of the programs of sequences entering a batch.
WRITTEN_TABLES = ("bias", "banned", "masks")


def sampler_variant(params: Sequence[SamplingParams], vocab_size: int,
                    variants: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The one rule: the first of `variants` (cheapest first) that serves a batch of these rows' sampling, as (cut
    path, top logprobs). Every setting has one: the last variant of each catalog serves anything."""
    need_path = cut_path(params, vocab_size)
    need_top = TOP if any(p.logprobs is not None for p in params) else 0
    return next(v for v in variants if v[0] >= need_path and v[1] >= need_top)


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """One compiled program. kind: "forward", "sampler", "decode_steps", "draft", "verify", "stage" (a step's inputs
    into their buffer), "stage_behind" (the same, caught up on a verify program in flight), "restore" / "save"
    (prefix-cache snapshots), "penalties" (penalty counts reset), "table" (a sampling table's rows written). size: the
    token bucket, or the rows of a sampler or of the programs of sequences entering a batch. steps: decode steps or
    verify rounds; draft_len: drafts a verify row holds (a verify layout's stage programs: > 0); path, top: the
    sampler variant; table: the table a "table" program writes."""

    kind: str
    size: int
    steps: int = 0
    draft_len: int = 0
    path: int = 0
    top: int = 0
    table: str = ""

    @property
    def name(self) -> str:
        extra = [f"{name}={value}" for name, value in (("steps", self.steps), ("drafts", self.draft_len),
                                                       ("path", self.path), ("top", self.top), ("table", self.table))
                 if value]
        return f"{self.kind}[{', '.join([str(self.size), *extra])}]"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Everything a replica's programs depend on, as plain values: the model, the kernels, the mesh's sizes, the
    cache's and the batch's sizes, the speculation. Picklable (compile workers get it)."""

    cfg: ModelConfig
    kernels: str
    tensor_parallel_size: int
    enable_expert_parallel: bool
    num_blocks: int
    block_size: int
    num_slots: int
    num_snapshots: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_steps: int = 1  # decode steps a program for batches of up to decode_steps_max_rows rows
    decode_steps_max_rows: int = 0
    num_speculative_tokens: int = 0  # drafts the MTP head proposes a row (0: no speculation)
    drafts_at: tuple[int, ...] = ()  # the drafts a verify step of r rows verifies: drafts_at[r - 1] (0: none)

    @property
    def table_width(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def token_buckets(self) -> list[int]:
        return buckets.token_buckets(self.max_num_batched_tokens, self.max_num_seqs)

    @property
    def several_steps_rows(self) -> int:
        """The most rows that run several decode steps (or verify rounds) a program; 0: none do."""
        return self.decode_steps_max_rows if self.decode_steps > 1 else 0

    @property
    def max_verify_rounds(self) -> int:
        return VERIFY_ROUNDS_PER_DECODE_STEP * self.decode_steps if self.several_steps_rows else 1

    @property
    def has_snapshots(self) -> bool:
        return bool(self.num_snapshots and self.cfg.is_hybrid)

    def requests(self, size: int) -> int:
        """The request count of a step of token bucket `size`."""
        return buckets.request_bucket(size, self.max_num_seqs)

    def decode_steps_for(self, rows: int) -> int:
        """Decode steps a program of `rows` decoding rows runs."""
        return self.decode_steps if 0 < rows <= self.several_steps_rows else 1

    def verify_rounds_for(self, rows: int) -> int:
        """The most verify rounds a program of `rows` rows runs."""
        return self.max_verify_rounds if 0 < rows <= self.several_steps_rows else 1

    def verify_variants(self, size: int) -> list[tuple[int, int]]:
        """The verify programs of token bucket `size`: (drafts a row, rounds) of every row count whose verify step
        pads to that bucket; several rounds where decode steps run several a program."""
        variants = set()
        largest = self.token_buckets[-1]
        for rows, k in enumerate(self.drafts_at, 1):
            if not k or rows * (k + 1) > largest or buckets.bucket_for(rows * (k + 1), self.token_buckets) != size:
                continue
            variants.add((k, 1))
            if rows <= self.several_steps_rows:
                variants.add((k, self.max_verify_rounds))
        return sorted(variants)

    def row_counts(self, full: bool = True) -> list[int]:
        """The padded counts of sequences that enter a batch at once (snapshot copies, penalty resets, table rows):
        every power of two up to max_num_seqs (`full`), else one."""
        return sorted({buckets.bucket(k) for k in range(1, (self.max_num_seqs if full else 1) + 1)})

    # ---- the packed inputs of each kind of step --------------------------------------------------------------
    def step_inputs(self, size: int) -> tuple[np.ndarray, step.Layout]:
        """The packed inputs of a plain step of `size` padding tokens (no request: every write goes to the sinks)."""
        requests = self.requests(size)
        batch = ragged([], [], [], [], size, requests, self.table_width)
        following = np.full(requests, -1, np.int32) if self.num_speculative_tokens else None
        return step.pack_inputs(np.zeros(size, np.int32), batch, following=following)

    def verify_inputs(self, size: int) -> tuple[np.ndarray, step.Layout]:
        """The packed inputs of a verify step of `size` padding tokens."""
        requests = self.requests(size)
        batch = ragged([], [], [], [], size, requests, self.table_width)
        return step.pack_inputs(np.zeros(size, np.int32), batch, draft_source=np.zeros(requests, np.int32))

    def padding_sampling(self, requests: int) -> tuple[np.ndarray, step.Layout]:
        """The packed sampling tensors of `requests` padding rows (every row greedy). Every batch of that many
        requests has this layout."""
        tensors = SamplingTensors.build_host([], [], vocab_size=self.cfg.vocab_size, batch_size=requests,
                                             num_slots=self.num_slots)
        return step.pack(tensors._asdict())

    def inputs_layout(self, key: ProgramKey) -> step.Layout:
        return (self.verify_inputs if key.draft_len else self.step_inputs)(key.size)[1]

    # ---- the catalog -----------------------------------------------------------------------------------------
    def catalog(self, sizes: Sequence[int], full: bool = True) -> list[ProgramKey]:
        """Every program steps of the token buckets `sizes` can run, largest buckets first (they take longest to
        compile): per bucket its forward and input staging, several-step decode (each model sampler variant), the
        MTP head's program, verify steps; per request count its samplers; per count of sequences entering a batch
        at once their snapshot copies, penalty resets and table writes. `full`: every sampler variant and row count,
        else the cheapest model variant and samplers without top logprobs, and one row."""
        keys = []
        model_variants = MODEL_SAMPLER_VARIANTS if full else MODEL_SAMPLER_VARIANTS[:1]
        for size in sorted(sizes, reverse=True):
            keys += [ProgramKey("forward", size), ProgramKey("stage", size)]
            if size <= self.several_steps_rows:
                keys += [ProgramKey("decode_steps", size, self.decode_steps, path=path, top=top)
                         for path, top in model_variants]
            if self.num_speculative_tokens:
                keys += [ProgramKey("draft", size), ProgramKey("stage_behind", size)]
                for k, rounds in self.verify_variants(size):
                    keys += [ProgramKey("verify", size, rounds, k, path=path, top=top) for path, top in model_variants]
                if self.verify_variants(size):
                    keys += [ProgramKey("stage", size, draft_len=1), ProgramKey("stage_behind", size, draft_len=1)]
        for requests in sorted({self.requests(size) for size in sizes}):
            keys += [ProgramKey("sampler", requests, path=path, top=top) for path, top in SAMPLER_VARIANTS
                     if full or not top]
        for rows in self.row_counts(full):
            kinds = (step.RestoreSnapshots.KIND, step.SaveSnapshots.KIND) if self.has_snapshots else ()
            keys += [ProgramKey(kind, rows) for kind in (*kinds, step.ResetPenalties.KIND)]
            keys += [ProgramKey(step.WriteRows.KIND, rows, table=table) for table in WRITTEN_TABLES]
        return keys


def program(key: ProgramKey, shapes: Shapes, mesh: Mesh, state: dict) -> tuple[Callable, tuple, dict]:
    """The jitted function of `key`, its arguments' shapes (from `state`: the device state's abstract shapes,
    `abstract_state`) and its static arguments: what lowering it (fn.lower(*args, **static)) and its jitted fallback
    (functools.partial(fn, **static)) take. The runner calls each program with its arguments in this order."""
    cfg = shapes.cfg
    replicated = step.replicated(mesh)

    def packed(size: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((size,), np.int32, sharding=replicated)

    model = dict(cfg=cfg, mesh=mesh, kernels=shapes.kernels)

    def sampling_layout() -> step.Layout:  # the sampling tensors' layout of a step of this bucket
        return shapes.padding_sampling(shapes.requests(key.size))[1]

    match key.kind:
        case "forward":
            layout = shapes.step_inputs(key.size)[1]
            return step.forward, (state["params"], state["cache"], state["last_tokens"], packed(layout.size)), dict(
                layout=layout, with_hidden=bool(shapes.num_speculative_tokens), **model)
        case "sampler":
            layout = shapes.padding_sampling(key.size)[1]
            logits = jax.ShapeDtypeStruct((key.size, cfg.vocab_size), np.float32, sharding=replicated)
            return step.sample_step, (logits, packed(layout.size), state["last_tokens"], state["tables"]), dict(
                layout=layout, num_top_logprobs=key.top, path=key.path)
        case "decode_steps":
            layout, sampling = shapes.step_inputs(key.size)[1], sampling_layout()
            return step.decode_steps, (state["params"], state["cache"], state["last_tokens"], state["tables"],
                                       packed(layout.size), packed(sampling.size)), dict(
                layout=layout, sampling_layout=sampling, steps=key.steps, num_top_logprobs=key.top,
                path=key.path, **model)
        case "draft":
            layout = shapes.step_inputs(key.size)[1]
            hidden = jax.ShapeDtypeStruct((key.size, cfg.hidden_size), cfg.jnp_dtype, sharding=replicated)
            tokens = jax.ShapeDtypeStruct((key.size,), np.int32, sharding=replicated)
            return step.draft_step, (state["params"], state["cache"], hidden, tokens, state["last_tokens"],
                                     state["drafts"], packed(layout.size)), dict(
                layout=layout, draft_len=shapes.num_speculative_tokens, **model)
        case "verify":
            layout, sampling = shapes.verify_inputs(key.size)[1], sampling_layout()
            return step.verify_step, (state["params"], state["cache"], state["last_tokens"], state["drafts"],
                                      state["emitted"], state["tables"], packed(layout.size),
                                      packed(sampling.size)), dict(
                layout=layout, sampling_layout=sampling, draft_len=key.draft_len, rounds=key.steps,
                num_top_logprobs=key.top, path=key.path, **model)
        case "stage":
            buffer = packed(shapes.inputs_layout(key).size)
            return step.stage_inputs, (buffer, buffer), {}
        case "stage_behind":
            layout, sampling = shapes.inputs_layout(key), sampling_layout()
            buffer = packed(layout.size)
            return step.stage_behind, (buffer, buffer, packed(sampling.size), state["emitted"]), dict(
                layout=layout, sampling_layout=sampling)
        case "restore" | "save":
            index = packed(key.size)
            fn = step.restore_snapshots if key.kind == "restore" else step.save_snapshots
            return fn, (state["cache"], state["snapshots"], index, index), dict(cfg=cfg, mesh=mesh)
        case "penalties":
            index = packed(key.size)
            ids = jax.ShapeDtypeStruct((key.size, shapes.table_width * shapes.block_size), np.int32,
                                       sharding=replicated)
            return step.reset_penalties, (state["tables"], index, ids, index, index), {}
        case "table":
            table = getattr(state["tables"], key.table)
            values = jax.ShapeDtypeStruct((key.size, *table.shape[1:]), table.dtype, sharding=replicated)
            return step.write_table, (state["tables"], packed(key.size), values), dict(table=key.table)
    raise ValueError(f"unknown program kind {key.kind!r}")


def abstract_state(shapes: Shapes, mesh: Mesh) -> dict:
    """The shapes (jax.ShapeDtypeStruct, laid out over `mesh`) of a replica's device state: its params, cache,
    last sampled tokens, drafts, tokens emitted by the last verify program, sampling tables and prefix-cache
    snapshots. Lowering needs nothing else."""
    replicated = step.replicated(mesh)

    def spec(shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    cfg = shapes.cfg
    state = dict(
        params=rules.abstract_params(cfg, mesh),
        cache=rules.init_cache(cfg, mesh, shapes.num_blocks, shapes.block_size, shapes.num_slots, abstract=True),
        last_tokens=spec((shapes.max_num_seqs,), np.int32),
        drafts=spec((shapes.max_num_seqs, shapes.num_speculative_tokens), np.int32),
        emitted=spec((shapes.max_num_seqs,), np.int32),
        tables=jax.tree.map(lambda a: spec(a.shape, a.dtype), table_shapes(shapes.num_slots, cfg.vocab_size)),
        snapshots=None)
    if shapes.has_snapshots:
        snapshot_cache = rules.init_cache(cfg, mesh, 1, shapes.block_size, shapes.num_snapshots + 1,
                                          abstract=True)["layers"]
        state["snapshots"] = [snapshot_cache[i] for i in step.gdn_indices(cfg)]
    return state


class ProgramTable:
    """The programs of one replica by key: the compiled one (filled ahead by engine/compilation.py), else the jitted
    function, compiled on its first call, each such use counted as a miss and the first of each key logged (a
    warning once `complete`: after a full warm-up a miss is a bug)."""

    def __init__(self, shapes: Shapes, mesh: Mesh):
        self.shapes = shapes
        self.mesh = mesh
        self.compiled: dict[ProgramKey, jax.stages.Compiled] = {}
        self.complete = False  # every program of the catalog is compiled (a full warm-up is done)
        self.misses = 0
        self._fallbacks: dict[ProgramKey, Callable] = {}
        self._state: dict | None = None

    @property
    def state(self) -> dict:
        """The device state's abstract shapes (built once)."""
        if self._state is None:
            self._state = abstract_state(self.shapes, self.mesh)
        return self._state

    def get(self, key: ProgramKey) -> Callable:
        compiled = self.compiled.get(key)
        if compiled is not None:
            return compiled
        self.misses += 1
        fallback = self._fallbacks.get(key)
        if fallback is None:
            log.log(logging.WARNING if self.complete else logging.INFO,
                    "program %s is not compiled: jitted now (%d miss(es) so far)", key.name, self.misses)
            fn, _, static = program(key, self.shapes, self.mesh, self.state)
            fallback = self._fallbacks[key] = functools.partial(fn, **static)
        return fallback

    def lower(self, key: ProgramKey) -> jax.stages.Lowered:
        fn, args, static = program(key, self.shapes, self.mesh, self.state)
        return fn.lower(*args, **static)

    def missing(self, keys: Sequence[ProgramKey]) -> list[ProgramKey]:
        return [key for key in keys if key not in self.compiled]
