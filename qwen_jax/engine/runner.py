"""ModelRunner: one replica's device state (params, cache, snapshots, penalty counts, the last sampled tokens) and the
turning of a scheduled step into device work: the step's host data (an op list of numpy arrays), then the programs
of engine/step.py issued without waiting for them.

It never decides who runs (the scheduler does) and never blocks on the device except in `fetch`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qwen_jax.config import ModelConfig
from qwen_jax.engine import buckets, grammar, step
from qwen_jax.engine.compilation import Compiler
from qwen_jax.engine.sampler import SampleOutput, SamplingTensors, cut_path
from qwen_jax.engine.scheduler import Row
from qwen_jax.engine.speculative import VerifyOutput
from qwen_jax.layers.batch import ragged
from qwen_jax.sampling_params import SamplingParams
from sharding import rules
from sharding.mesh import make_mesh

log = logging.getLogger("qwen_jax")

# Every step with a row asking for logprobs computes the API maximum of top-n (one compiled width, not 21).
TOP_LOGPROBS_WIDTH = SamplingParams.MAX_LOGPROBS
_GREEDY = SamplingParams(temperature=0.0)


# A verify program of a few rows runs this many rounds per decode step a decode program runs: a program's ~6 ms of
# host time is shared by more tokens. Rows that end inside a program compute the rest of its rounds for nothing.
VERIFY_ROUNDS_PER_DECODE_STEP = 2


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict | None, num_blocks: int, block_size: int, num_slots: int,
                 num_snapshots: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: list[int], seed: int = 0, mesh: Mesh | None = None, decode_steps: int = 1,
                 decode_steps_max_rows: int = 0, kernels: str = "reference", num_speculative_tokens: int = 0,
                 drafts_at: Callable[[int], int] | None = None, lazy: bool = False):
        """`params` must already be laid out over `mesh` (default: the first device) by sharding.rules. None: the
        mesh is on other hosts (a data-parallel replica there); this runner only writes its steps down, and its
        executor sends them where they run (engine/multihost.py). `kernels`: the hot ops' implementation
        (qwen_jax/layers/hot_ops.py). A model that speculates: the MTP head proposes num_speculative_tokens drafts a
        row, and a verify step of r rows verifies drafts_at(r) of them (0: such a step does not verify; the verify
        programs compiled ahead are those). `lazy`: the device state beside the params is allocated at the warm-up
        once the programs are compiled (compile workers need the device memory meanwhile) or at the first step."""
        self.cfg = cfg
        self.kernels = kernels
        self.params = params
        self.mesh = mesh if mesh is not None else make_mesh(1)
        # Only the common samplers are compiled into the several-step decode and verify programs ahead on an
        # accelerator (on the CPU every variant is jitted when first needed)
        self.on_accelerator = self.mesh.devices.flat[0].platform != "cpu"
        self.block_size = block_size
        self.table_width = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.num_slots = num_slots
        # Decode steps of up to decode_steps_max_rows requests run decode_steps at a time in one program.
        self.num_speculative_tokens = num_speculative_tokens  # drafts the head proposes a row (0: no speculation)
        self.drafts_at = drafts_at or (lambda rows: num_speculative_tokens)
        self.decode_steps = decode_steps
        self.decode_steps_max_rows = decode_steps_max_rows if decode_steps > 1 else 0
        self.max_verify_rounds = VERIFY_ROUNDS_PER_DECODE_STEP * decode_steps if self.decode_steps_max_rows else 1
        self.decode_buckets = [size for size in buckets.token_buckets(max_num_batched_tokens, max_num_seqs)
                               if size <= self.decode_steps_max_rows]
        self.token_buckets = buckets.token_buckets(max_num_batched_tokens, max_num_seqs)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.step_seed = seed * 1_000_003
        self.has_snapshots = bool(num_snapshots and cfg.is_hybrid)
        self.cache = self.snapshots = self.penalty_counts = self.last_tokens = self.drafts = self.emitted = None
        # abstract params (jax.ShapeDtypeStruct): a runner that only compiles (a compile worker), nothing allocated,
        # or one whose weights are still being read (place_params)
        self.abstract = params is not None and isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct)
        self.lazy = lazy
        # what a compile worker needs to build this runner's twin (engine/compilation.py)
        self.spec = dict(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                         num_snapshots=num_snapshots, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, eos_token_ids=list(eos_token_ids), seed=seed,
                         decode_steps=decode_steps, decode_steps_max_rows=decode_steps_max_rows, kernels=kernels,
                         num_speculative_tokens=num_speculative_tokens, drafts_at=drafts_at)
        self.allocated = False
        if params is not None:
            self._make_state(abstract=True)
            if not self.abstract and not lazy:
                self.allocate()
        # The compiled programs, filled ahead by the compiler (engine/compilation.py) or, for what it did not
        # compile (a minimal warm-up, rare sampling layouts), jitted when a step first needs them.
        self.forwards: dict[int, jax.stages.Compiled] = {}  # token bucket -> its forward
        # several decode steps a program (decode_steps), each with the sampling layout it was compiled for
        self.decoders: dict[int, tuple[step.Layout, jax.stages.Compiled]] = {}
        # speculative decoding: the MTP head's program after a plain step of each bucket, and the verify steps of
        # each (bucket, drafts a row, rounds)
        self.drafters: dict[int, tuple[step.Layout, jax.stages.Compiled]] = {}
        self.verifiers: dict[tuple[int, int, int], tuple[step.Layout, jax.stages.Compiled]] = {}
        self.stagers: dict[int, jax.stages.Compiled] = {}  # packed-input size -> its stage_inputs program
        # (inputs layout, sampling layout) -> its stage_behind program, compiled ahead for the common sampling layout
        self.behind_stagers: dict[tuple[step.Layout, step.Layout], jax.stages.Compiled] = {}
        self.samplers: dict[tuple, jax.stages.Compiled] = {}  # (layout, path, top) -> sample_step
        # ("restore" | "save" | "penalties", rows) -> the snapshot copies or penalty resets of that many sequences
        self.row_programs: dict[tuple[str, int], jax.stages.Compiled] = {}
        self._inputs: dict[int, jax.Array] = {}  # packed-input size -> the device buffer a step's inputs go to
        self.top_logprobs_width = TOP_LOGPROBS_WIDTH
        self.compiler = Compiler(self)
        # What runs a step's op list (see prepare): `execute` here; a multi-host leader's engine puts the broadcast to
        # the other hosts in front of it (engine/multihost.py).
        self.executor: Callable[[list], SampleOutput | None] = self.execute
        # Time spent blocked on the devices' sampled tokens; the rest of a step is host work (engine stats).
        self.device_wait_seconds = 0.0

    def _make_state(self, abstract: bool) -> None:
        """The device state beside the params: the cache, the snapshots, the penalty counts, the last sampled tokens,
        the drafts (`abstract`: their shapes only)."""
        cfg, spec = self.cfg, self.spec
        replicated = step.replicated(self.mesh)
        put = (lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)) if abstract else self.put
        self.cache = rules.init_cache(cfg, self.mesh, spec["num_blocks"], spec["block_size"], spec["num_slots"],
                                      abstract=abstract)
        self.penalty_counts = put(np.zeros((spec["num_slots"], cfg.vocab_size), np.int32))
        self.last_tokens = put(np.zeros(spec["max_num_seqs"], np.int32))
        # speculative decoding: the drafts proposed for each row of the last step (row r: sample row r's)
        self.drafts = put(np.zeros((spec["max_num_seqs"], spec["num_speculative_tokens"]), np.int32))
        # each row's tokens emitted by the last verify program (the next step's catch-up: step.stage_behind)
        self.emitted = put(np.zeros(spec["max_num_seqs"], np.int32))
        if self.has_snapshots:  # GDN state only (+ the sink at 0), split like the cache
            snapshot_cache = rules.init_cache(cfg, self.mesh, 1, spec["block_size"], spec["num_snapshots"] + 1,
                                              abstract=abstract)["layers"]
            self.snapshots = [snapshot_cache[i] for i in step.gdn_indices(cfg)]

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
            self._make_state(abstract=False)
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
        padded = buckets.bucket_for(max(num_tokens, 1), self.token_buckets)
        num_requests = buckets.request_bucket(padded, self.max_num_seqs)
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
                       [r.seq.block_table for r in rows], padded, num_requests, self.table_width)
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
        snapshot restores and penalty resets of the rows entering the batch, then the forward (with the MTP head
        when `head`: StepPlan.head), several decode steps, or verify rounds, then snapshot saves. `behind`: some
        row catches up on the verify program `in_flight` (step.stage_behind). Also records, for each sampling row,
        where its token will be (seq.sample_row)."""
        verifying = self._verifying(in_flight)
        buffer, layout = self.step_inputs(rows, verifying)
        behind = any(id(r.seq) in verifying for r in rows)
        num_requests = step.layout_shape(layout, "query_len")[0]
        sampling = [r.seq.params if r.samples else _GREEDY for r in rows]
        steps = rows[0].steps if rows else 1
        # the tokens a row had before this step's first: its planned samples are already counted as pending
        constrained = [i for i, r in enumerate(rows) if r.samples and r.seq.grammar is not None]
        tensors = SamplingTensors.build_host(
            sampling, [r.seq.num_requested - r.steps if r.samples else 0 for r in rows], [r.seq.slot for r in rows],
            vocab_size=self.vocab_size, batch_size=num_requests, eos_token_ids=self.eos_token_ids,
            step_seed=self.step_seed + 1, num_penalty_rows=self.num_slots, constrained_rows=constrained,
            token_masks=self._token_masks([rows[i] for i in constrained]) if constrained else None)
        # an unseeded row's key advances once per token a row may emit (a verify row: rounds x (its drafts + 1))
        self.step_seed += steps * (rows[0].drafts + 1) if rows else 1
        sampling_buffer, sampling_layout = step.pack(tensors._asdict())
        top = TOP_LOGPROBS_WIDTH if any(p.logprobs is not None for p in sampling) else 0
        ops = []
        restore = [(r.restore_snapshot, r.seq.slot) for r in rows if r.restore_snapshot is not None]
        if restore and self.has_snapshots:
            ops.append(step.RestoreSnapshots(*self.pairs(restore)))
        entering = [r.seq for r in rows if r.admitted and r.seq.params.has_penalties]
        if entering:
            ops.append(step.ResetPenalties(*self._penalty_rows(entering)))
        batch = (buffer, layout, sampling_buffer, sampling_layout, cut_path(sampling, self.vocab_size), top)
        if rows and rows[0].drafts:  # verify rows only (Scheduler._speculate): no penalties, admissions, snapshots
            return [step.Verify(*batch, draft_len=rows[0].drafts, rounds=steps, behind=behind)]
        if steps > 1:  # decoding rows only (Scheduler._multi_step): no penalties, admissions or snapshots
            ops.append(step.DecodeSteps(*batch, steps=steps, behind=behind))
            return ops
        ops.append(step.Forward(*batch, head=head and bool(self.num_speculative_tokens), behind=behind))
        save = [(r.seq.slot, r.save_snapshot) for r in rows if r.save_snapshot is not None]
        if save and self.has_snapshots:
            ops.append(step.SaveSnapshots(*self.pairs(save)))
        return ops

    def _token_masks(self, rows: list[Row]) -> np.ndarray:
        """The grammar masks of constrained sampling rows [len(rows), W]: each from its matcher, which has seen
        every output token before this step's (the core reads a constrained request's last step back before it
        plans the next)."""
        masks = np.zeros((len(rows), grammar.mask_words(self.vocab_size)), np.int32)
        for i, row in enumerate(rows):
            if row.seq.num_pending != row.steps:
                raise RuntimeError(f"request {row.seq.request_id}: its grammar mask needs its last token, which "
                                   "is still on the device")
            row.seq.grammar.fill_mask(masks, i)
        return masks

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
        count, longest = buckets.bucket(len(seqs)), self.table_width * self.block_size
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
        """Issue one step's ops (see prepare) in order, without waiting for them: the step's SampleOutput, on the
        devices, its copy to the host started. The only place a step touches the devices; on several hosts every
        host runs the same list."""
        self.allocate()
        out = None
        for op in ops:
            match op:
                case step.RestoreSnapshots():
                    program = self._row_program(op.KIND, len(op.src))
                    self.cache = program(self.cache, self.snapshots, *self.put((op.src, op.dst)))
                case step.SaveSnapshots():
                    program = self._row_program(op.KIND, len(op.src))
                    self.snapshots = program(self.cache, self.snapshots, *self.put((op.src, op.dst)))
                case step.ResetPenalties():
                    program = self._row_program(op.KIND, len(op.rows))
                    self.penalty_counts = program(self.penalty_counts,
                                                  *self.put((op.rows, op.ids, op.num_prompt, op.num_tokens)))
                case step.Forward():
                    forward = self._forward(op.layout)
                    sample = self._sampler(op.sampling_layout, op.path, op.top)
                    inputs, sampling = self._stage(op.layout, op.inputs, op.sampling, op.sampling_layout, op.behind)
                    logits, self.cache, *head_inputs = forward(self.params, self.cache, self.last_tokens, inputs)
                    out, self.last_tokens, self.penalty_counts = sample(logits, sampling, self.last_tokens,
                                                                        self.penalty_counts)
                    if op.head:  # a model that speculates: the MTP head's pages and first drafts
                        self.cache, self.drafts = self._drafter(op.layout)(self.params, self.cache, *head_inputs,
                                                                           self.last_tokens, self.drafts, inputs)
                case step.DecodeSteps():
                    program = self._decode_program(op.layout, op.sampling_layout, op.path, op.top, op.steps)
                    inputs, sampling = self._stage(op.layout, op.inputs, op.sampling, op.sampling_layout, op.behind)
                    out, self.cache, self.last_tokens = program(self.params, self.cache, self.last_tokens, inputs,
                                                                sampling)
                case step.Verify():
                    inputs, sampling = self._stage(op.layout, op.inputs, op.sampling, op.sampling_layout, op.behind)
                    program = self._verifier(op.layout, op.sampling_layout, op.path, op.top, op.draft_len,
                                             op.rounds)
                    out, self.cache, self.last_tokens, self.drafts, self.emitted = program(
                        self.params, self.cache, self.last_tokens, self.drafts, self.emitted, inputs, sampling)
                case step.CompileBuckets():
                    self.compiler.compile(op.sizes)
                case _:
                    raise ValueError(f"unknown step op {op!r}")
        if out is not None:
            for array in out:
                array.copy_to_host_async()
        return out

    def _stage(self, layout: step.Layout, buffer, sampling, sampling_layout: step.Layout,
               behind: bool) -> tuple[jax.Array, jax.Array]:
        """A step's packed inputs on the devices: the forward's copied into its bucket's input buffer (in place),
        the sampler's as they come; `behind`: both caught up on the verify program before (step.stage_behind)."""
        buffer, sampling = self.put((np.asarray(buffer), np.asarray(sampling)))
        inputs = self._input_buffer(layout.size)
        if behind:
            self._inputs[layout.size], sampling = self._behind_stager(layout, sampling_layout)(
                inputs, buffer, sampling, self.emitted)
        else:
            self._inputs[layout.size] = self._stager(layout.size)(inputs, buffer)
        return self._inputs[layout.size], sampling

    def _behind_stager(self, layout: step.Layout, sampling_layout: step.Layout):
        """The stage_behind program of these layouts: compiled ahead for the common sampling layout, jitted on first
        use for the others."""
        program = self.behind_stagers.get((layout, sampling_layout))
        if program is None:
            return functools.partial(step.stage_behind, layout=layout, sampling_layout=sampling_layout)
        return program

    def _stager(self, size: int) -> jax.stages.Compiled:
        """The program that copies packed inputs of `size` into their input buffer (compiled with its bucket)."""
        return self.compiler.stager(size)

    # ---- compiled programs -----------------------------------------------------------------------------------
    @property
    def num_forwards(self) -> int:
        """Forwards compiled so far (one per token bucket)."""
        return len(self.forwards)

    @property
    def num_stagers(self) -> int:
        """Input-staging programs compiled so far (one per token bucket)."""
        return len(self.stagers)

    def _forward(self, layout: step.Layout) -> jax.stages.Compiled:
        size = step.layout_shape(layout, "tokens")[0]
        if size not in self.forwards:  # not compiled ahead (a minimal warm-up)
            self.compiler.forward(size)
        return self.forwards[size]

    def max_decode_steps(self, seqs: list) -> int:
        """Decode steps the running sequences `seqs` may run in one program: decode_steps when they are few enough,
        else 1. On a GPU only the greedy / temperature-only sampler without logprobs is compiled into it ahead: other
        samplers take single steps rather than compile a whole forward on a request's path."""
        if not 0 < len(seqs) <= self.decode_steps_max_rows:
            return 1
        if self.on_accelerator and any(
                s.params.logprobs is not None or s.params.logit_bias or cut_path([s.params], self.vocab_size)
                for s in seqs):
            return 1
        return self.decode_steps

    def _decode_program(self, layout: step.Layout, sampling_layout: step.Layout, path: int, top: int, steps: int):
        size = step.layout_shape(layout, "tokens")[0]
        compiled = self.decoders.get(size)
        if compiled is not None and (sampling_layout, path, top, steps) == (compiled[0], 0, 0, self.decode_steps):
            return compiled[1]
        return functools.partial(step.decode_steps, layout=layout, sampling_layout=sampling_layout, cfg=self.cfg,
                                 mesh=self.mesh, kernels=self.kernels, steps=steps, num_top_logprobs=top, path=path)

    # ---- speculative decoding's programs --------------------------------------------------------------------
    def verify_rounds(self, rows: list[Row], k: int) -> int:
        """The most rounds one verify program runs for `rows` of k drafts (max_verify_rounds where decode steps run
        several a program); 0: these rows do not verify. On a GPU only greedy and temperature-only sampling without
        logprobs is compiled into the verify programs ahead: rows that sample otherwise decode plainly rather than
        compile a verify program on a request's path."""
        if self.on_accelerator and any(
                r.seq.params.logprobs is not None or cut_path([r.seq.params], self.vocab_size) for r in rows):
            return 0
        return self.max_verify_rounds if 0 < len(rows) <= self.decode_steps_max_rows else 1

    def _drafter(self, layout: step.Layout):
        size = step.layout_shape(layout, "tokens")[0]
        compiled = self.drafters.get(size)
        if compiled is not None and compiled[0] == layout:
            return compiled[1]
        return functools.partial(step.draft_step, layout=layout, cfg=self.cfg, mesh=self.mesh, kernels=self.kernels,
                                 draft_len=self.num_speculative_tokens)

    def _verifier(self, layout: step.Layout, sampling_layout: step.Layout, path: int, top: int, draft_len: int,
                  rounds: int):
        size = step.layout_shape(layout, "tokens")[0]
        compiled = self.verifiers.get((size, draft_len, rounds))
        if compiled is not None and (sampling_layout, path, top) == (compiled[0], 0, 0):
            return compiled[1]
        return functools.partial(step.verify_step, layout=layout, sampling_layout=sampling_layout, cfg=self.cfg,
                                 mesh=self.mesh, kernels=self.kernels, draft_len=draft_len, rounds=rounds,
                                 num_top_logprobs=top, path=path)

    def _input_buffer(self, size: int) -> jax.Array:
        buffer = self._inputs.get(size)
        if buffer is None:
            buffer = self._inputs[size] = self.put(np.zeros(size, np.int32))
        return buffer

    def _row_program(self, kind: str, rows: int) -> Callable:
        """The snapshot copy or penalty reset (op KIND) of `rows` entries: compiled ahead (row_programs), else jitted
        (a warm-up that is not full)."""
        compiled = self.row_programs.get((kind, rows))
        if compiled is not None:
            return compiled
        if kind == step.ResetPenalties.KIND:
            return step.init_penalties
        program = step.restore_snapshots if kind == step.RestoreSnapshots.KIND else step.save_snapshots
        return functools.partial(program, cfg=self.cfg, mesh=self.mesh)

    def _sampler(self, layout: step.Layout, path: int, top: int):
        """The sampler program of a batch: compiled ahead for the common sampling layout (no logit_bias, bans or grammar
        masks), jitted on first use for the others. It always reads and updates the penalty counts: a row without
        penalties names no row of them, which leaves its logits and the counts exactly as they were, so one program
        serves batches with and without penalties."""
        program = self.samplers.get((layout, path, top))
        if program is not None:
            return program
        return lambda logits, sampling, last_tokens, counts: step.sample_step(
            logits, sampling, last_tokens, counts, layout=layout, num_top_logprobs=top, path=path)

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
