"""ModelRunner: one replica's device state (params, cache, snapshots, sampling tables, the last sampled tokens) and
the turning of a scheduled step into device work: the step's host data (an op list of numpy arrays), then its
programs, each looked up by its key in the replica's program table (engine/programs.py), issued without waiting.

It never decides who runs (the scheduler does) and never blocks on the device except in `fetch`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qwen_jax.config import ModelConfig
from qwen_jax.engine import buckets, grammar, step
from qwen_jax.engine.programs import (
    MODEL_SAMPLER_VARIANTS,
    SAMPLER_VARIANTS,
    WRITTEN_TABLES,
    ProgramKey,
    ProgramTable,
    Shapes,
    sampler_variant,
)
from qwen_jax.engine.sampler import SampleOutput, SamplingTables, SamplingTensors, banned_row, bans, bias_row
from qwen_jax.engine.scheduler import Row
from qwen_jax.engine.speculative import VerifyOutput
from qwen_jax.layers.batch import ragged
from qwen_jax.sampling_params import SamplingParams
from sharding import rules
from sharding.mesh import make_mesh

log = logging.getLogger("qwen_jax")

_GREEDY = SamplingParams(temperature=0.0)


class ModelRunner:
    def __init__(self, shapes: Shapes, params: dict | None, eos_token_ids: list[int], seed: int = 0,
                 mesh: Mesh | None = None, lazy: bool = False):
        """A runner of the programs of `shapes` (engine/programs.py) over `mesh` (default: the first device).
        `params` must already be laid out over the mesh by sharding.rules, or be their shapes (rules.abstract_params:
        place_params gives the weights later). None: the mesh is on other hosts (a data-parallel replica there);
        this runner only writes its steps down, and its executor sends them where they run (engine/multihost.py).
        `lazy`: the device state beside the params is allocated at the warm-up once the programs are compiled
        (compile workers need the device memory meanwhile) or at the first step."""
        self.shapes = shapes
        self.cfg: ModelConfig = shapes.cfg
        self.params = params
        self.mesh = mesh if mesh is not None else make_mesh(1)
        self.programs = ProgramTable(shapes, self.mesh)
        self.vocab_size = self.cfg.vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.step_seed = seed * 1_000_003
        self.cache = self.snapshots = self.tables = self.last_tokens = self.drafts = self.emitted = None
        # abstract params (jax.ShapeDtypeStruct): weights still being read (place_params)
        self.abstract = params is not None and isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct)
        self.lazy = lazy
        self.allocated = False
        if params is not None and not self.abstract and not lazy:
            self.allocate()
        self._inputs: dict[int, jax.Array] = {}  # packed-input size -> the device buffer a step's inputs go to
        # What runs a step's op list (see prepare): `execute` here; a multi-host leader's engine puts the broadcast to
        # the other hosts in front of it (engine/multihost.py).
        self.executor: Callable[[list], SampleOutput | None] = self.execute
        # What compiles the programs of some token buckets when host 0 says so (a CompileBuckets op on a follower):
        # the replica's compiler (engine/compilation.py).
        self.compile_buckets: Callable[[list[int]], None] | None = None
        # Time spent blocked on the devices' sampled tokens; the rest of a step is host work (engine stats).
        self.device_wait_seconds = 0.0

    @property
    def num_speculative_tokens(self) -> int:
        return self.shapes.num_speculative_tokens

    @property
    def num_slots(self) -> int:
        return self.shapes.num_slots

    def _make_state(self) -> None:
        """The device state beside the params: the cache, the snapshots, the sampling tables, the last sampled
        tokens, the drafts, each made in the shards programs.abstract_state gives it."""
        state = self.programs.state
        self.cache = rules.init_cache(self.cfg, self.mesh, self.shapes.num_blocks, self.shapes.block_size,
                                      self.shapes.num_slots)
        zeros = lambda a: self.put(np.zeros(a.shape, a.dtype))  # noqa: E731
        self.tables = SamplingTables(*map(zeros, state["tables"]))
        self.last_tokens, self.drafts, self.emitted = (zeros(state[name]) for name in ("last_tokens", "drafts",
                                                                                         "emitted"))
        if self.shapes.has_snapshots:  # GDN state only (+ the sink at 0), split like the cache
            snapshot_cache = rules.init_cache(self.cfg, self.mesh, 1, self.shapes.block_size,
                                              self.shapes.num_snapshots + 1)["layers"]
            self.snapshots = [snapshot_cache[i] for i in step.gdn_indices(self.cfg)]

    def place_params(self, params: dict) -> None:
        """The weights of a runner built on their shapes (rules.abstract_params: its programs compile while the
        weights are read), laid out the same way."""
        self.params = params
        self.abstract = False
        if not self.lazy:
            self.allocate()

    def allocate(self, reserve: int = 0) -> None:
        """Allocate the device state (a lazy runner's, at its warm-up once the compile workers are done, or at its
        first step); a no-op once done. `reserve`: bytes a device first takes, and gives back once the state is in
        place, so that they stay one free region for the program with the most working memory (run next)."""
        if not self.allocated and not self.abstract and self.params is not None:
            held = [jnp.zeros(reserve, jnp.uint8, device=d) for d in self.mesh.devices.flat
                    if d.process_index == jax.process_index()] if reserve else []
            self._make_state()
            jax.block_until_ready((held, self.cache))
            del held
            self.allocated = True

    def put(self, tree):
        """Host arrays -> replicated on the mesh (several hosts: each copies only its own devices' part)."""
        sharding = step.replicated(self.mesh)
        if sharding.is_fully_addressable:
            return jax.device_put(tree, sharding)
        return jax.tree.map(lambda a: rules.put(a, sharding), tree)

    # ---- a step's host data ----------------------------------------------------------------------------------
    def step_inputs(self, rows: list[Row], verifying: dict | None = None) -> tuple[np.ndarray, step.Layout]:
        """The forward's packed inputs for `rows` (padded to a token bucket and its request count); also records,
        for each sampling row, where its token will be (seq.sample_row). `verifying`: the rows of the verify
        program issued before this step and not read back yet, by sequence (`_verifying`; their counts are ahead:
        step.Behind)."""
        num_tokens = sum(r.num_tokens for r in rows)
        padded = buckets.bucket_for(max(num_tokens, 1), self.shapes.token_buckets)
        num_requests = self.shapes.requests(padded)
        tokens = np.zeros(padded, np.int32)
        source = np.full(padded, -1, np.int32)
        at = 0
        for r in rows:
            seq, end = r.seq, r.start + r.num_tokens
            known = min(end, seq.num_known_tokens)
            ids = seq.token_ids(r.start, known)
            tokens[at:at + len(ids)] = ids
            # A token the previous step sampled is still on the device: a row's last (a verify row's first, its
            # drafts following it come from the device in the program).
            if end > known and not r.drafts:
                source[at + r.num_tokens - 1] = seq.sample_row
            elif end > known and known <= r.start:
                source[at] = seq.sample_row
            at += r.num_tokens
        batch = ragged([r.start for r in rows], [r.num_tokens for r in rows], [r.seq.slot for r in rows],
                       [r.seq.block_table for r in rows], padded, num_requests, self.shapes.table_width)
        draft_source = np.zeros(num_requests, np.int32)
        draft_source[:len(rows)] = [r.seq.sample_row for r in rows]  # where the last step left each one's drafts
        for i, r in enumerate(rows):
            if r.samples:
                r.seq.sample_row = i
        behind = self._behind(rows, verifying or {}, num_requests) if self.num_speculative_tokens else None
        if rows and rows[0].drafts:
            return step.pack_inputs(tokens, batch, source, draft_source=draft_source, behind=behind)
        return step.pack_inputs(tokens, batch, source, self.following(rows, num_requests), behind=behind)

    @staticmethod
    def _verifying(in_flight: list[Row]) -> dict[int, tuple[int, Row]]:
        """The rows of a verify program in flight by sequence (id): (the row's index in that program, the row)."""
        return {id(row.seq): (j, row) for j, row in enumerate(in_flight)}

    @staticmethod
    def _behind(rows: list[Row], verifying: dict[int, tuple[int, Row]], num_requests: int) -> step.Behind:
        """How far each row's counts run ahead of the truth while the verify program of `verifying` runs (which
        booked every draft as computed and one sample a round: Scheduler._book)."""
        behind = step.Behind.none(num_requests)
        for i, r in enumerate(rows):
            if id(r.seq) in verifying:
                j, earlier = verifying[id(r.seq)]
                behind.row[i], behind.counted[i] = j, earlier.steps
                behind.booked[i] = earlier.steps * (earlier.drafts + 1)
        return behind

    def following(self, rows: list[Row], num_requests: int) -> np.ndarray | None:
        """A model that speculates: each row's token after its last (the prompt's next one after a chunk that ends
        inside it; -1 after a sampled one, which the device has), for the MTP head (step.draft_step); else None."""
        if not self.num_speculative_tokens:
            return None
        following = np.full(num_requests, -1, np.int32)
        for i, r in enumerate(rows):
            if not r.samples:
                end = r.start + r.num_tokens
                following[i] = r.seq.token_ids(end, end + 1)[0]
        return following

    def prepare(self, rows: list[Row], head: bool = False, in_flight: list[Row] = ()) -> list[step.Op]:
        """The device work of one planned step as host data, the step's ops (step.Op) run in order by the executor:
        snapshot restores, penalty resets and sampling-table rows of the requests entering the batch, grammar masks
        of the constrained ones, then the forward (with the MTP head when `head`: StepPlan.head), several decode
        steps, or verify rounds, then snapshot saves. Some row may catch up on the verify program `in_flight`
        (step.stage_behind). Also records, for each sampling row, where its token will be (seq.sample_row)."""
        verifying = self._verifying(in_flight)
        buffer, layout = self.step_inputs(rows, verifying)
        behind = any(id(r.seq) in verifying for r in rows)
        num_requests = step.layout_shape(layout, "query_len")[0]
        sampling = [r.seq.params if r.samples else _GREEDY for r in rows]
        steps = rows[0].steps if rows else 1
        several = steps > 1 or bool(rows and rows[0].drafts)
        # the tokens a row had before this step's first: its planned samples are already counted as pending
        constrained = [i for i, r in enumerate(rows) if r.samples and r.seq.grammar is not None]
        tensors = SamplingTensors.build_host(
            sampling, [r.seq.num_requested - r.steps if r.samples else 0 for r in rows], [r.seq.slot for r in rows],
            vocab_size=self.vocab_size, batch_size=num_requests, num_slots=self.num_slots,
            eos_token_ids=self.eos_token_ids, step_seed=self.step_seed + 1, constrained_rows=constrained)
        # an unseeded row's key advances once per token a row may emit (a verify row: rounds x (its drafts + 1))
        self.step_seed += steps * (rows[0].drafts + 1) if rows else 1
        sampling_buffer, sampling_layout = step.pack(tensors._asdict())
        path, top = sampler_variant(sampling, self.vocab_size, MODEL_SAMPLER_VARIANTS if several else SAMPLER_VARIANTS)
        ops = self._entering(rows)
        if constrained:
            ops.append(self._masks([rows[i] for i in constrained]))
        batch = (buffer, layout, sampling_buffer, sampling_layout, path, top)
        if rows and rows[0].drafts:  # verify rows only (Scheduler._speculate): decoding rows, no snapshots
            return [*ops, step.Verify(*batch, draft_len=rows[0].drafts, rounds=steps, behind=behind)]
        if steps > 1:  # decoding rows only (Scheduler._multi_step): no snapshots
            return [*ops, step.DecodeSteps(*batch, steps=steps, behind=behind)]
        ops.append(step.Forward(*batch, head=head and bool(self.num_speculative_tokens), behind=behind))
        save = [(r.seq.slot, r.save_snapshot) for r in rows if r.save_snapshot is not None]
        if save and self.shapes.has_snapshots:
            ops.append(step.SaveSnapshots(*self.pairs(save)))
        return ops

    def _entering(self, rows: list[Row]) -> list[step.Op]:
        """The ops of the requests entering the batch: their prefix-cache snapshots restored, and the rows of the
        sampling tables their settings read (penalty counts from their tokens so far, logit bias, the tokens banned
        before min_tokens)."""
        ops = []
        restore = [(r.restore_snapshot, r.seq.slot) for r in rows if r.restore_snapshot is not None]
        if restore and self.shapes.has_snapshots:
            ops.append(step.RestoreSnapshots(*self.pairs(restore)))
        entering = [r.seq for r in rows if r.admitted]
        penalised = [s for s in entering if s.params.has_penalties]
        if penalised:
            ops.append(step.ResetPenalties(*self._penalty_rows(penalised)))
        biased = [s for s in entering if s.params.logit_bias]
        if biased:
            ops.append(self._table_rows("bias", [(s.slot, bias_row(s.params, self.vocab_size)) for s in biased]))
        banning = [s for s in entering if bans(s.params, self.eos_token_ids)]
        if banning:
            ops.append(self._table_rows("banned", [(s.slot, banned_row(s.params, self.eos_token_ids, self.vocab_size))
                                                   for s in banning]))
        return ops

    def _masks(self, rows: list[Row]) -> step.WriteRows:
        """The grammar masks of constrained sampling rows, into their rows of the masks table: each from its
        matcher, which has seen every output token before this step's (the core reads a constrained request's last
        step back before it plans the next)."""
        masks = np.zeros((len(rows), grammar.mask_words(self.vocab_size)), np.int32)
        for i, row in enumerate(rows):
            if row.seq.num_pending != row.steps:
                raise RuntimeError(f"request {row.seq.request_id}: its grammar mask needs its last token, which "
                                   "is still on the device")
            row.seq.grammar.fill_mask(masks, i)
        return self._table_rows("masks", [(row.seq.slot, mask) for row, mask in zip(rows, masks, strict=True)])

    def _table_rows(self, table: str, rows: list[tuple[int, np.ndarray]]) -> step.WriteRows:
        """A WriteRows op of (slot, row) pairs, padded to a power of two with rows that name no slot."""
        count = buckets.bucket(len(rows))
        slots = np.full(count, self.num_slots, np.int32)
        values = np.zeros((count, *rows[0][1].shape), rows[0][1].dtype)
        for i, (slot, value) in enumerate(rows):
            slots[i], values[i] = slot, value
        return step.WriteRows(table, slots, values)

    def failing_rows(self, rows: list[Row], in_flight: list[Row] = ()) -> list[tuple[Row, Exception]]:
        """The rows whose step cannot be built even alone, each with its error (after `prepare` of them all
        raised). Nothing is issued and no counter moves: the engine fails those requests and builds the step
        again without them."""
        seed, sample_rows = self.step_seed, [r.seq.sample_row for r in rows]
        failing = []
        for row in rows:
            try:
                self.prepare([row], in_flight=in_flight)
            except Exception as exc:
                failing.append((row, exc))
            self.step_seed = seed
        for row, sample_row in zip(rows, sample_rows, strict=True):
            row.seq.sample_row = sample_row
        return failing

    def _penalty_rows(self, seqs: list) -> tuple[np.ndarray, ...]:
        """The penalty-count rows of sequences entering the batch, from their prompt and output so far (padding
        entries name row num_slots, dropped), each padded to the longest sequence the engine runs: one program per
        count of rows, all compiled ahead."""
        count, longest = buckets.bucket(len(seqs)), self.shapes.table_width * self.shapes.block_size
        rows = np.full(count, self.num_slots, np.int32)
        ids = np.zeros((count, longest), np.int32)
        num_prompt, num_tokens = np.zeros(count, np.int32), np.zeros(count, np.int32)
        for i, s in enumerate(seqs):
            known = s.token_ids(0, s.num_known_tokens)
            rows[i], ids[i, :len(known)] = s.slot, known
            num_prompt[i], num_tokens[i] = len(s.prompt_token_ids), len(known)
        return rows, ids, num_prompt, num_tokens

    @staticmethod
    def pairs(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) index arrays padded to a power of two with (0, 0): padding copies into the sink entry."""
        src, dst = np.zeros((2, buckets.bucket(len(pairs))), np.int32)
        for i, (a, b) in enumerate(pairs):
            src[i], dst[i] = a, b
        return src, dst

    # ---- device work -----------------------------------------------------------------------------------------
    def execute(self, ops: list[step.Op]) -> SampleOutput:
        """Issue one step's ops (see prepare) in order, each by its program's key, without waiting for them: the
        step's SampleOutput, on the devices, its copy to the host started. The only place a step touches the
        devices; on several hosts every host runs the same list."""
        self.allocate()
        get = self.programs.get
        out = None
        for op in ops:
            match op:
                case step.RestoreSnapshots():
                    program = get(ProgramKey(op.KIND, len(op.src)))
                    self.cache = program(self.cache, self.snapshots, *self.put((op.src, op.dst)))
                case step.SaveSnapshots():
                    program = get(ProgramKey(op.KIND, len(op.src)))
                    self.snapshots = program(self.cache, self.snapshots, *self.put((op.src, op.dst)))
                case step.ResetPenalties():
                    program = get(ProgramKey(op.KIND, len(op.rows)))
                    self.tables = program(self.tables, *self.put((op.rows, op.ids, op.num_prompt, op.num_tokens)))
                case step.WriteRows():
                    if op.table not in WRITTEN_TABLES:
                        raise ValueError(f"unknown sampling table {op.table!r}")
                    program = get(ProgramKey(op.KIND, len(op.rows), table=op.table))
                    self.tables = program(self.tables, *self.put((op.rows, op.values)))
                case step.Forward():
                    size = self._size(op)
                    inputs, sampling = self._stage(op, size)
                    logits, self.cache, *head_inputs = get(ProgramKey("forward", size))(
                        self.params, self.cache, self.last_tokens, inputs)
                    sample = get(ProgramKey("sampler", self.shapes.requests(size), path=op.path, top=op.top))
                    out, self.last_tokens, self.tables = sample(logits, sampling, self.last_tokens, self.tables)
                    if op.head:  # a model that speculates: the MTP head's pages and first drafts
                        self.cache, self.drafts = get(ProgramKey("draft", size))(
                            self.params, self.cache, *head_inputs, self.last_tokens, self.drafts, inputs)
                case step.DecodeSteps():
                    size = self._size(op)
                    inputs, sampling = self._stage(op, size)
                    program = get(ProgramKey("decode_steps", size, op.steps, path=op.path, top=op.top))
                    out, self.cache, self.last_tokens, self.tables = program(
                        self.params, self.cache, self.last_tokens, self.tables, inputs, sampling)
                case step.Verify():
                    size = self._size(op)
                    inputs, sampling = self._stage(op, size)
                    program = get(ProgramKey("verify", size, op.rounds, op.draft_len, path=op.path, top=op.top))
                    out, self.cache, self.last_tokens, self.drafts, self.emitted, self.tables = program(
                        self.params, self.cache, self.last_tokens, self.drafts, self.emitted, self.tables, inputs,
                        sampling)
                case step.CompileBuckets():
                    self.compile_buckets(op.sizes)
                case _:
                    raise ValueError(f"unknown step op {op!r}")
        if out is not None:
            for array in out:
                array.copy_to_host_async()
        return out

    @staticmethod
    def _size(op: step.Forward | step.DecodeSteps | step.Verify) -> int:
        """The token bucket of a model op."""
        return step.layout_shape(op.layout, "tokens")[0]

    def _stage(self, op: step.Forward | step.DecodeSteps | step.Verify, size: int) -> tuple[jax.Array, jax.Array]:
        """A step's packed inputs on the devices: the forward's copied into its bucket's input buffer (in place),
        the sampler's as they come; `behind`: both caught up on the verify program before (step.stage_behind)."""
        buffer, sampling = self.put((np.asarray(op.inputs), np.asarray(op.sampling)))
        inputs = self._input_buffer(op.layout.size)
        verifies = int(isinstance(op, step.Verify))
        if op.behind:
            program = self.programs.get(ProgramKey("stage_behind", size, draft_len=verifies))
            self._inputs[op.layout.size], sampling = program(inputs, buffer, sampling, self.emitted)
        else:
            self._inputs[op.layout.size] = self.programs.get(ProgramKey("stage", size, draft_len=verifies))(inputs,
                                                                                                            buffer)
        return self._inputs[op.layout.size], sampling

    def _input_buffer(self, size: int) -> jax.Array:
        buffer = self._inputs.get(size)
        if buffer is None:
            buffer = self._inputs[size] = self.put(np.zeros(size, np.int32))
        return buffer

    def fetch(self, out: SampleOutput) -> SampleOutput:
        """A step's sampled tokens and logprobs on the host: the one place the engine waits for the device."""
        waited = time.perf_counter()
        values = jax.device_get(tuple(out))
        # a replica on other hosts sends a plain list back: its length tells a verify step's output from a step's
        kind = type(out) if hasattr(out, "_fields") else (
            VerifyOutput if len(values) == len(VerifyOutput._fields) else SampleOutput)
        host = kind(*values)
        self.device_wait_seconds += time.perf_counter() - waited
        return host
